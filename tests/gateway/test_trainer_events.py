"""``factory serve`` receives the trainer's signed webhooks at ``POST /v1/trainer/events``."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from factory.gateway import gateway_in_thread
from factory.lake import Lake
from factory.trainer.webhooks import sign


def test_signed_events_land_and_forgeries_are_refused(factory_home: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FACTORY_WEBHOOK_KEY_ID", "k1")
    monkeypatch.setenv("FACTORY_WEBHOOK_SECRET", "s3cret")
    srv = gateway_in_thread()
    try:
        url = srv.url + "/v1/trainer/events"
        event = {"event_id": "e1", "run_id": "r1", "type": "checkpoint", "step": 4, "seq": 1,
                 "segment": "s", "time": time.time(), "location": "/nowhere/step-00000004",
                 "manifest_sha256": "ab"}
        raw = json.dumps(event).encode()
        forged = httpx.post(url, content=raw, headers=sign(raw, "k1", b"wrong", time.time()))
        assert forged.status_code == 401
        ok = httpx.post(url, content=raw, headers=sign(raw, "k1", b"s3cret", time.time()))
        assert ok.status_code == 200, ok.text
        [row] = Lake().read("checkpoints").to_pylist()
        assert (row["run_id"], row["step"]) == ("r1", 4)
    finally:
        srv.stop()


def test_webhooks_bypass_factory_keys(factory_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FACTORY_WEBHOOK_KEY_ID", "k1")
    monkeypatch.setenv("FACTORY_WEBHOOK_SECRET", "s3cret")
    from factory.app.cli import main

    assert main(["keys", "create", "--name", "ci"]) == 0
    srv = gateway_in_thread()
    try:
        raw = json.dumps({"event_id": "e9", "run_id": "r1", "type": "progress", "step": 1,
                          "seq": 1, "segment": "s", "time": time.time(), "loss": 1.0}).encode()
        r = httpx.post(srv.url + "/v1/trainer/events", content=raw,
                       headers=sign(raw, "k1", b"s3cret", time.time()))
        assert r.status_code == 200, r.text
        assert httpx.get(srv.url + "/v1/models").status_code == 401  # other routes need a key
    finally:
        srv.stop()
