"""``factory ui`` serves the Dagster web UI on 127.0.0.1 with the code location loaded."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

QUERY = """{ workspaceOrError { ... on Workspace { locationEntries { name
  locationOrLoadError { __typename ... on RepositoryLocation { repositories {
  assetNodes { assetKey { path } } } } } } } } }"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_ui_serves_the_code_location(factory_home: Path) -> None:
    port = _free_port()
    proc = subprocess.Popen([str(Path(sys.executable).parent / "factory"), "ui", "--port",
                             str(port)], env=dict(os.environ), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 150
        entries = None
        while time.monotonic() < deadline:
            try:
                r = httpx.post(f"http://127.0.0.1:{port}/graphql", json={"query": QUERY},
                               timeout=10)
                entries = r.json()["data"]["workspaceOrError"]["locationEntries"]
                if entries and entries[0]["locationOrLoadError"]:
                    break
            except (httpx.HTTPError, KeyError, TypeError, ValueError):
                pass
            time.sleep(1)
        assert entries, "the UI never answered"
        location = entries[0]["locationOrLoadError"]
        assert location["__typename"] == "RepositoryLocation", location
        keys = {tuple(n["assetKey"]["path"]) for repo in location["repositories"]
                for n in repo["assetNodes"]}
        assert ("base_model",) in keys
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert (factory_home / "dagster").is_dir()
