"""The loop from the Dagster UI: ``factory ui`` (``dagster dev`` on the factory's code
location) started by the test, driven only through its GraphQL API (``launchRun`` on
``__ASSET_JOB`` with an asset selection and a partition), exactly what the UI's Materialize
button sends: dataset -> plan -> deployment.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.deploy.conftest import ROOT, wait_until
from tests.inference.conftest import make_adapter

pytestmark = pytest.mark.slow

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
EXPERIMENT = """name: tiny
data: {where: "tags['project'] = 'demo'", eval_fraction: 0.2, max_tokens: 512}
recipe: smollm2-135m-lora
overrides: {num_steps: 2, checkpoint_every_steps: 2}
eval: {judge: embedded, rubric: auto, max_samples: 4}
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _gql(url: str, query: str, variables: dict[str, Any] | None = None) -> dict[str, Any]:
    r = httpx.post(url, json={"query": query, "variables": variables or {}}, timeout=30)
    r.raise_for_status()
    body: dict[str, Any] = r.json()
    assert "errors" not in body, body["errors"]
    return body["data"]


def _materialize(url: str, location: str, repo: str, assets: list[str], partition: str,
                 run_config: dict[str, Any] | None = None, timeout_s: float = 240) -> str:
    params = {"selector": {"repositoryLocationName": location, "repositoryName": repo,
                           "jobName": "__ASSET_JOB",
                           "assetSelection": [{"path": [a]} for a in assets]},
              "runConfigData": run_config or {},
              "executionMetadata": {"tags": [{"key": "dagster/partition", "value": partition}]}}
    launched = _gql(url, LAUNCH, {"p": params})["launchRun"]
    assert launched["__typename"] == "LaunchRunSuccess", launched
    run_id: str = launched["run"]["runId"]

    def finished() -> str | None:
        status = _gql(url, STATUS, {"id": run_id})["runOrError"]["status"]
        return status if status in ("SUCCESS", "FAILURE", "CANCELED") else None

    status = wait_until(finished, timeout_s, what=f"run of {assets}")
    assert status == "SUCCESS", f"{assets} run {run_id} ended {status}"
    return run_id


@pytest.fixture()
def tiny_as_smollm2(factory_home: Path, tmp_path: Path, tiny_model_dir: Path,
                    monkeypatch: pytest.MonkeyPatch) -> Path:
    """Experiments dir with a tiny experiment; the recipe's base model is the tiny model."""
    models = tmp_path / "models"
    models.mkdir()
    (models / "smollm2-135m-instruct").symlink_to(tiny_model_dir)
    monkeypatch.setenv("FACTORY_MODELS_DIR", str(models))
    experiments = tmp_path / "experiments"
    experiments.mkdir()
    (experiments / "tiny.yaml").write_text(EXPERIMENT)
    monkeypatch.setenv("FACTORY_EXPERIMENTS_DIR", str(experiments))
    return experiments


def test_dataset_plan_and_deployment_through_graphql(
        factory_home: Path, tiny_as_smollm2: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    import dagster as dg

    from factory.deploy import DeployConfig, Deployer
    from factory.gateway import load_routes
    from factory.ingest import RawRecord, ingest_records
    from factory.lake import Lake
    from factory.tasks import generate_records

    now = datetime.now(UTC)
    ingest_records(Lake(), [RawRecord(payload=r, source="upload", received_at=now,
                                      tags={"project": "demo"})
                            for r in generate_records(30, 0)])
    instance = dg.DagsterInstance.get()
    instance.add_dynamic_partitions("experiments", ["tiny"])
    instance.add_dynamic_partitions("runs", ["tiny"])
    adapter = make_adapter(tiny_model_dir, tmp_path / "adapter", seed=3)

    port = _free_port()
    url = f"http://127.0.0.1:{port}/graphql"
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "factory"), "ui", "--port", str(port)], cwd=ROOT,
        env=dict(os.environ), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)
    try:
        def loaded() -> tuple[str, str] | None:
            try:
                entries = _gql(url, LOCATIONS)["workspaceOrError"]["locationEntries"]
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                return None
            for entry in entries:
                loc = entry["locationOrLoadError"]
                if loc and loc["__typename"] == "RepositoryLocation":
                    return entry["name"], loc["repositories"][0]["name"]
                assert not loc or loc["__typename"] != "PythonError", loc
            return None

        location, repo = wait_until(loaded, 180, what="the code location in the UI")
        _materialize(url, location, repo, ["dataset", "dataset_profile"], "tiny")
        _materialize(url, location, repo, ["training_plan"], "tiny")
        _materialize(url, location, repo, ["deployment"], "tiny",
                     {"ops": {"deployment": {"config": {"checkpoint": str(adapter)}}}})
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    lake = Lake()
    assert lake.sql("SELECT count(*) AS n FROM dataset_eval WHERE experiment = 'tiny'"
                    ).column("n")[0].as_py() > 0
    assert lake.sql("SELECT count(*) AS n FROM training_plans WHERE run_key = 'tiny'"
                    ).column("n")[0].as_py() == 1
    deployer = Deployer()
    live = deployer.live("tiny")
    try:
        assert live is not None and live.checkpoint == str(adapter)
        assert load_routes(lake)["factory/tiny"].base_url == live.endpoint
        # The server the UI run started outlived the run (and the UI).
        answer = openai.OpenAI(base_url=live.endpoint, api_key="x", max_retries=0
                               ).chat.completions.create(
            model=live.adapter, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert answer.choices[0].message.content is not None
    finally:
        if live is not None:
            Deployer(config=DeployConfig(drain_s=0.0)).undeploy("tiny")
