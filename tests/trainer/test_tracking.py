"""Trackers: the JSONL and MLflow backends record a run; Neptune fails clearly when absent."""

from __future__ import annotations

import builtins
import json
from pathlib import Path
from typing import Any

import pytest

from factory.trainer.config import TrackerConfig
from factory.trainer.tracking import JsonlTracker, make_tracker


def test_jsonl_tracker_records_params_metrics_and_end(tmp_path: Path) -> None:
    tracker = make_tracker(TrackerConfig(), run_id="r", events_path=tmp_path / "events.jsonl")
    assert isinstance(tracker, JsonlTracker)
    tracker.log_params({"plan": {"lora_rank": 8}})
    tracker.log_metrics({"loss": 1.5}, step=3)
    tracker.close("finished")
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["kind"] for x in lines] == ["params", "metrics", "end"]
    assert lines[1]["metrics"] == {"loss": 1.5} and lines[1]["step"] == 3


@pytest.mark.slow
# mlflow 3.17's SQL store uses SQLAlchemy's deprecated ``noload``: theirs to fix, named here.
@pytest.mark.filterwarnings("ignore:.*noload.*:DeprecationWarning")
def test_mlflow_tracker_writes_a_local_sqlite_store(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    events = tmp_path / "events.jsonl"
    for segment in range(2):  # a resumed segment continues the same MLflow run
        tracker = make_tracker(TrackerConfig(backend="mlflow"), run_id="run-1",
                               events_path=events)
        tracker.log_params({"lora_rank": 8, "target": ["q_proj"]})
        tracker.log_metrics({"loss": 2.0 - segment}, step=segment + 1)
        tracker.close("finished")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{(tmp_path / 'mlflow.db').resolve()}")
    experiment = client.get_experiment_by_name("factory")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    history = client.get_metric_history(run.info.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(1, 2.0), (2, 1.0)]
    assert run.data.params["lora_rank"] == "8" and run.info.status == "FINISHED"


def test_neptune_without_the_package_is_a_clear_error(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def no_neptune(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("neptune_scale"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_neptune)
    with pytest.raises(ValueError, match="neptune-scale.*closed in March 2026"):
        make_tracker(TrackerConfig(backend="neptune", project="ws/proj"), run_id="r",
                     events_path=tmp_path / "events.jsonl")
