"""The receiver route under uvicorn: signed events stored, checkpoints rowed, forgeries 401."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette

from factory.control.receiver import trainer_events_route
from factory.gateway import ServerThread
from factory.lake import Lake
from factory.trainer.webhooks import sign

SECRET = b"s3cret"


@pytest.fixture()
def server(factory_home: Path):
    lake = Lake()
    app = Starlette(routes=[trainer_events_route(lake, {"k1": SECRET})])
    with ServerThread(app) as srv:  # started: uvicorn is listening
        yield f"{srv.url}/v1/trainer/events", lake


def _post(url: str, event: dict, *, secret: bytes = SECRET, ts: float | None = None,
          body: bytes | None = None, headers: dict | None = None) -> httpx.Response:
    raw = body if body is not None else json.dumps(event).encode()
    h = headers or sign(raw, "k1", secret, ts if ts is not None else time.time())
    return httpx.post(url, content=raw, headers=h)


def test_events_are_verified_stored_and_checkpoints_rowed(server, caplog) -> None:
    url, lake = server
    ok = {"event_id": "e1", "run_id": "r1", "type": "progress", "step": 3, "seq": 1,
          "segment": "x", "time": time.time(), "loss": 1.5}
    first_ts = time.time()
    assert _post(url + "?segment=r1-s000", ok, ts=first_ts).status_code == 200
    ck = {"event_id": "e2", "run_id": "r1", "type": "checkpoint", "step": 4, "seq": 2,
          "segment": "x", "time": time.time(), "location": "/nowhere/step-00000004",
          "manifest_sha256": "ab"}
    assert _post(url, ck).status_code == 200
    with caplog.at_level(logging.WARNING, logger="factory.control.receiver"):
        assert _post(url, ok, secret=b"wrong").status_code == 401           # forged
        assert _post(url, ok, ts=time.time() - 3600).status_code == 401     # stale
        raw = json.dumps(ok).encode()
        # Same body, signed at another second than the first post: a retry, not a replay.
        h = sign(raw, "k1", SECRET, first_ts - 1)
        assert _post(url, ok, body=raw, headers=h).status_code == 200       # duplicate body
        assert _post(url, ok, body=raw, headers=h).status_code == 401       # replay
    assert sum("rejected trainer event" in r.message for r in caplog.records) == 3
    events = lake.read("training_events").to_pylist()
    assert sorted(e["event_id"] for e in events) == ["e1", "e2"]
    assert next(e for e in events if e["event_id"] == "e1")["segment_id"] == "r1-s000"
    [row] = lake.read("checkpoints").to_pylist()
    assert row["step"] == 4 and row["path"] == "/nowhere/step-00000004"
    assert row["verified"] is False  # unreachable location never counts


def test_env_secrets(monkeypatch) -> None:
    from factory.control.receiver import env_secrets

    monkeypatch.delenv("FACTORY_WEBHOOK_SECRET", raising=False)
    assert env_secrets() == {}
    monkeypatch.setenv("FACTORY_WEBHOOK_SECRET", "abc")
    monkeypatch.setenv("FACTORY_WEBHOOK_KEY_ID", "k9")
    assert env_secrets() == {"k9": b"abc"}


def _tables(node: dict) -> set[str]:
    return {node["table"]}.union(*(_tables(up) for up in node["upstream"]))


def _find(node: dict, table: str) -> dict:
    if node["table"] == table:
        return node
    for up in node["upstream"]:
        try:
            return _find(up, table)
        except KeyError:
            pass
    raise KeyError(table)


def test_checkpoint_lineage_leads_to_the_run_its_plan_and_data(server, make_job,
                                                               capsys) -> None:
    """A checkpoint committed by the receiver reads the commit that submitted its run, which
    recorded the plan and dataset snapshots the run was built from (not whatever
    ``training_runs`` holds by the time the checkpoint arrives)."""
    from factory.app.cli import main
    from factory.control.plane import ControlPlane
    from factory.control.providers import LocalProvider
    from factory.lake import Lineage

    url, lake = server
    upstream = Lineage(run_id="plan-run", asset_key="training_plan")
    plan_snap = lake.append("training_plans", [{"run_key": "exp", "experiment": "exp"}],
                            lineage=upstream)
    train_snap = lake.append("dataset_train", [{"experiment": "exp", "sample_id": "a"}])
    eval_snap = lake.append("dataset_eval", [{"experiment": "exp", "sample_id": "b"}])
    plane = ControlPlane(lake, [LocalProvider()])
    session = lake.session(run_id="dagster-run-1", asset_key="training_run")
    for table in ("training_plans", "dataset_train", "dataset_eval"):
        session.read(table)
    plane.submit(make_job("r1"), experiment="exp", lineage=session.lineage)
    submit_snap = lake.snapshot_id("training_runs")
    # Later commits of training_runs (another run, a status change) carry no such reads.
    plane.submit(make_job("r2"), experiment="exp")
    lake.append("dataset_train", [{"experiment": "exp", "sample_id": "c"}])

    ck = {"event_id": "c1", "run_id": "r1", "type": "checkpoint", "step": 2, "seq": 1,
          "segment": "x", "time": time.time(), "location": "/nowhere/step-00000002",
          "manifest_sha256": "ab"}
    assert _post(url + "?segment=r1-s000", ck).status_code == 200
    assert main(["lineage", "checkpoints", "--format", "json"]) == 0
    tree = json.loads(capsys.readouterr().out)
    assert (tree["asset_key"], tree["run_id"]) == ("checkpoints", "dagster-run-1")
    [events] = tree["upstream"]
    assert events["table"] == "training_events"
    [run] = events["upstream"]
    assert (run["table"], run["snapshot_id"], run["run_id"]) == (
        "training_runs", submit_snap, "dagster-run-1")
    assert run["reads"] == {"training_plans": plan_snap, "dataset_train": train_snap,
                            "dataset_eval": eval_snap}
    assert _find(tree, "training_plans")["asset_key"] == "training_plan"
    assert _tables(tree) == {"checkpoints", "training_events", "training_runs",
                             "training_plans", "dataset_train", "dataset_eval"}
