"""The receiver route under uvicorn: signed events stored, checkpoints rowed, forgeries 401."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette

from factory.control.receiver import trainer_events_route
from factory.lake import Lake
from trainer.webhooks import sign

SECRET = b"s3cret"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture()
def server(factory_home: Path):
    lake = Lake()
    app = Starlette(routes=[trainer_events_route(lake, {"k1": SECRET})])
    port = _port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    while not srv.started:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}/v1/trainer/events", lake
    srv.should_exit = True
    t.join(5)


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
