"""``factory ui`` serves the Dagster web UI on 127.0.0.1 with the code location loaded, the
instance configured to queue runs for the daemon."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.deploy.dagster_ui import factory_ui, gql

QUERY = """{ workspaceOrError { ... on Workspace { locationEntries { name
  locationOrLoadError { __typename ... on RepositoryLocation { repositories {
  assetNodes { assetKey { path } } jobs { name } } } } } } } }"""


@pytest.mark.slow
def test_ui_serves_the_code_location(factory_home: Path) -> None:
    with factory_ui() as ui:
        entries = gql(ui.url, QUERY)["workspaceOrError"]["locationEntries"]
    [repo] = entries[0]["locationOrLoadError"]["repositories"]
    keys = {tuple(n["assetKey"]["path"]) for n in repo["assetNodes"]}
    assert {("base_model",), ("dataset",), ("training_run",), ("deployment",)} <= keys
    assert "start_experiment_job" in {j["name"] for j in repo["jobs"]}
    config = (factory_home / "dagster" / "dagster.yaml").read_text()
    assert "QueuedRunCoordinator" in config and "factory/eval" in config
