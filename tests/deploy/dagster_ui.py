"""A real ``factory ui`` (``dagster dev``: webserver and daemon) for tests, driven over GraphQL
as the UI's own buttons drive it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.deploy.conftest import ROOT
from tests.waiting import wait_until

LAUNCH = """mutation($p: ExecutionParams!) { launchRun(executionParams: $p) { __typename
  ... on LaunchRunSuccess { run { runId } }
  ... on PythonError { message }
  ... on RunConfigValidationInvalid { errors { message } }
  ... on InvalidSubsetError { message } } }"""
STATUS = """query($id: ID!) { runOrError(runId: $id) { __typename
  ... on Run { status } ... on PythonError { message } } }"""
LOCATIONS = """{ workspaceOrError { ... on Workspace { locationEntries { name
  locationOrLoadError { __typename ... on RepositoryLocation { repositories { name } }
  ... on PythonError { message } } } } } }"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def gql(url: str, query: str, variables: dict[str, Any] | None = None) -> dict[str, Any]:
    r = httpx.post(url, json={"query": query, "variables": variables or {}}, timeout=30)
    r.raise_for_status()
    body: dict[str, Any] = r.json()
    assert "errors" not in body, body["errors"]
    return body["data"]


@dataclass
class UI:
    """A running ``factory ui``: its GraphQL URL and the code location's names."""

    url: str
    location: str
    repo: str
    port: int

    def launch(self, job: str, partition: str, *, assets: list[str] | None = None,
               run_config: dict[str, Any] | None = None) -> str:
        """What a click on Launch / Materialize sends; the new run's id."""
        selector: dict[str, Any] = {"repositoryLocationName": self.location,
                                    "repositoryName": self.repo, "jobName": job}
        if assets is not None:
            selector["assetSelection"] = [{"path": [a]} for a in assets]
        params = {"selector": selector, "runConfigData": run_config or {},
                  "executionMetadata": {"tags": [{"key": "dagster/partition",
                                                  "value": partition}]}}
        launched = gql(self.url, LAUNCH, {"p": params})["launchRun"]
        assert launched["__typename"] == "LaunchRunSuccess", launched
        return str(launched["run"]["runId"])

    def status(self, run_id: str) -> str:
        return str(gql(self.url, STATUS, {"id": run_id})["runOrError"]["status"])


@contextmanager
def factory_ui(env: dict[str, str] | None = None) -> Iterator[UI]:
    """``factory ui`` on a free port until the block ends (stopped by SIGINT to its group)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/graphql"
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "factory"), "ui", "--port", str(port)], cwd=ROOT,
        env=dict(env or os.environ), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)
    try:
        def loaded() -> tuple[str, str] | None:
            try:
                entries = gql(url, LOCATIONS)["workspaceOrError"]["locationEntries"]
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                return None
            for entry in entries:
                loc = entry["locationOrLoadError"]
                if loc and loc["__typename"] == "RepositoryLocation":
                    return entry["name"], loc["repositories"][0]["name"]
                assert not loc or loc["__typename"] != "PythonError", loc
            return None

        location, repo = wait_until(loaded, 180, what="the code location in the UI")
        yield UI(url=url, location=location, repo=repo, port=port)
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
