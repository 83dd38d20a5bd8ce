"""Metrics trackers: one small interface, three backends.

- ``jsonl``: one JSON line per ``log_params``/``log_metrics`` call (default; the factory's lake
  table backend reads the events file instead, so nothing here imports the lake);
- ``mlflow``: MLflow, a local SQLite store beside the events file unless ``tracker.uri`` is set
  (needs ``mlflow-skinny``, the ``mlflow`` extra);
- ``neptune``: Neptune via ``neptune-scale``. Optional: the hosted Neptune service closed on
  2026-03-05, so this only helps self-hosted or offline-mode users; without the package it
  fails with a clear error at start, before training.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Protocol

from .config import TrackerConfig


class Tracker(Protocol):
    """Where a run's parameters and metrics go."""

    def log_params(self, params: dict[str, Any]) -> None: ...

    def log_metrics(self, metrics: dict[str, float], *, step: int) -> None: ...

    def close(self, status: str) -> None: ...


class NullTracker:
    def log_params(self, params: dict[str, Any]) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], *, step: int) -> None:
        pass

    def close(self, status: str) -> None:
        pass


class JsonlTracker:
    """Appends ``{"kind", "time", ...}`` lines to a local file."""

    def __init__(self, path: str | Path, *, run_id: str) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.run_id = run_id

    def _write(self, record: dict[str, Any]) -> None:
        record = {"run_id": self.run_id, "time": time.time(), **record}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, sort_keys=True, default=str) + "\n")

    def log_params(self, params: dict[str, Any]) -> None:
        self._write({"kind": "params", "params": params})

    def log_metrics(self, metrics: dict[str, float], *, step: int) -> None:
        self._write({"kind": "metrics", "step": step, "metrics": metrics})

    def close(self, status: str) -> None:
        self._write({"kind": "end", "status": status})


def _flat(params: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in params.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = json.dumps(v) if isinstance(v, list) else str(v)
    return out


class MlflowTracker:
    """One MLflow run per trainer run id (a resumed segment continues the same MLflow run)."""

    def __init__(self, *, uri: str, experiment: str, run_id: str) -> None:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise ValueError("tracker.backend: 'mlflow' needs mlflow-skinny "
                             "(pip install 'llm-factory[mlflow]')") from None
        self.client = MlflowClient(tracking_uri=uri)
        exp = self.client.get_experiment_by_name(experiment)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(experiment)
        found = self.client.search_runs([exp_id], f"tags.factory_run_id = '{run_id}'",
                                        max_results=1)
        if found:
            self.mlflow_run_id = found[0].info.run_id
            self.client.update_run(self.mlflow_run_id, status="RUNNING")
        else:
            run = self.client.create_run(exp_id, run_name=run_id,
                                         tags={"factory_run_id": run_id})
            self.mlflow_run_id = run.info.run_id

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        existing = self.client.get_run(self.mlflow_run_id).data.params
        new = [Param(k, v[:6000]) for k, v in _flat(params).items() if k not in existing]
        if new:
            self.client.log_batch(self.mlflow_run_id, params=new)

    def log_metrics(self, metrics: dict[str, float], *, step: int) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        self.client.log_batch(self.mlflow_run_id, metrics=[
            Metric(k, float(v), ts, step) for k, v in metrics.items() if v is not None])

    def close(self, status: str) -> None:
        mapped = {"finished": "FINISHED", "failed": "FAILED", "nan": "FAILED",
                  "preempted": "KILLED"}.get(status, "FINISHED")
        self.client.set_terminated(self.mlflow_run_id, status=mapped)


class NeptuneTracker:
    """Neptune through ``neptune-scale`` (optional; see the module docstring)."""

    def __init__(self, *, project: str, run_id: str, mode: str | None = None) -> None:
        try:
            from neptune_scale import Run
        except ImportError:
            raise ValueError("tracker.backend: 'neptune' needs the optional package "
                             "neptune-scale (the hosted service closed in March 2026; use it "
                             "only with a self-hosted or offline Neptune)") from None
        kwargs: dict[str, Any] = {"project": project, "run_id": run_id, "resume": True}
        if mode:
            kwargs["mode"] = mode
        self.run = Run(**kwargs)

    def log_params(self, params: dict[str, Any]) -> None:
        self.run.log_configs({k.replace(".", "/"): v for k, v in _flat(params).items()})

    def log_metrics(self, metrics: dict[str, float], *, step: int) -> None:
        self.run.log_metrics(data={k: float(v) for k, v in metrics.items() if v is not None},
                             step=step)

    def close(self, status: str) -> None:
        self.run.close()


def make_tracker(config: TrackerConfig, *, run_id: str, events_path: Path) -> Tracker:
    """The tracker a job asks for; ValueError (naming ``tracker.*``) if it cannot be made."""
    if config.backend == "none":
        return NullTracker()
    if config.backend == "jsonl":
        return JsonlTracker(config.path or events_path.with_name("metrics.jsonl"), run_id=run_id)
    if config.backend == "mlflow":
        uri = config.uri or f"sqlite:///{events_path.with_name('mlflow.db').resolve()}"
        return MlflowTracker(uri=uri, experiment=config.experiment, run_id=run_id)
    if config.backend == "neptune":
        assert config.project is not None
        return NeptuneTracker(project=config.project, run_id=run_id)
    raise AssertionError(config.backend)
