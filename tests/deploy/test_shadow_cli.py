"""``factory shadow`` and ``factory promote``: a candidate shadows a model's calls, then takes
over ``factory/<experiment>``; bad input gets one clear error and changes nothing."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from factory.app.cli import main
from factory.deploy import Deployer
from factory.gateway.routes import load_routes
from factory.gateway.shadow import load_shadows
from factory.inference import free_port
from factory.lake import Lake


@pytest.fixture()
def server() -> Iterator[tuple[int, int]]:
    """A process whose argv carries ``--port``, as the deployer's servers do."""
    port = free_port("127.0.0.1")
    proc = subprocess.Popen([sys.executable, "-m", "factory.gateway.standin", "--port",
                             str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield port, proc.pid
    finally:
        proc.kill()
        proc.wait()


def _deployment(lake: Lake, version: str, status: str, port: int, pid: int) -> None:
    now = datetime.now(UTC)
    lake.append("deployments", [{
        "name": "triage", "version": version, "checkpoint": "/ckpt", "base_model": "base",
        "adapter": f"triage-{version}", "route_model": "factory/triage",
        "endpoint": f"http://127.0.0.1:{port}/v1", "backend": "transformers",
        "status": status, "pid": pid, "port": port, "log_path": "", "started_at": now,
        "updated_at": now}])


def test_bad_shadow_and_promote_input_changes_nothing(
        factory_home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["promote", "triage"]) == 2
    assert main(["shadow", "triage", "--route", "gpt-4o-mini"]) == 2
    assert main(["shadow", "triage"]) == 2
    err = capsys.readouterr().err
    assert "factory promote: error: 'triage' has no candidate" in err
    assert "'triage' has no candidate or live deployment to shadow with" in err
    assert "pass --route MODEL" in err
    assert load_shadows(Lake()) == {}


def test_shadow_then_promote(factory_home: Path, server: tuple[int, int],
                             capsys: pytest.CaptureFixture[str]) -> None:
    port, pid = server
    lake = Lake()
    _deployment(lake, "v1", "candidate", port, pid)
    assert main(["shadow", "triage", "--route", "gpt-4o-mini", "--share", "2"]) == 2
    assert "shadow share must be in (0, 1], got 2.0" in capsys.readouterr().err
    assert main(["shadow", "triage", "--route", "gpt-4o-mini", "--share", "0.25"]) == 0
    rule = load_shadows(lake)["gpt-4o-mini"]
    assert (rule.experiment, rule.version, rule.deployment, rule.share) == \
        ("triage", "v1", "triage-v1", 0.25)
    assert rule.base_url == f"http://127.0.0.1:{port}/v1"
    assert main(["shadow", "--list"]) == 0
    assert "gpt-4o-mini" in capsys.readouterr().out
    assert main(["promote", "triage", "--drain-s", "0"]) == 0
    live = Deployer(lake).live("triage")
    assert live is not None and live.version == "v1" and Deployer(lake).candidate("triage") is None
    assert load_routes(lake)["factory/triage"].deployment == "triage-v1"
    assert main(["shadow", "triage", "--route", "gpt-4o-mini", "--stop"]) == 0
    assert load_shadows(lake) == {}
