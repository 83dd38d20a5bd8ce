"""The loop through separate nodes on one machine: each process tree has a ``FACTORY_HOME`` of its
own, and they share one PostgreSQL (catalog and Dagster storage) and one warehouse folder (table
data, checkpoints, trainer job files, built models). A file ingest on one node writes the
traffic; ``factory daemon`` on another runs the chain an experiment file starts (dataset, a
training run on the tiny model, checkpoint evals on an inference server, selection, a
deployment); a gateway on a third routes ``factory/tiny`` to that deployment, and its traffic
is captured into the shared lake again."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest

from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

TINY = """name: tiny
data: {where: "tags['project'] = 'demo'", eval_fraction: 0.2, max_tokens: 512}
recipe: smollm2-135m-lora
overrides: {num_steps: 4, checkpoint_every_steps: 2}
eval: {judge: embedded, rubric: auto, max_samples: 3}
"""
CHAIN_S = 900


def _node(home: Path) -> dict[str, str]:
    return {**os.environ, "FACTORY_HOME": str(home), "DAGSTER_HOME": str(home / "dagster")}


@pytest.fixture()
def shared_loop(shared_factory: Path, tiny_model_dir: Path,
                monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Shared models (the tiny model as the recipe's base) and experiments folders."""
    models = shared_factory / "models"
    models.mkdir(parents=True)
    (models / "smollm2-135m-instruct").symlink_to(tiny_model_dir)
    monkeypatch.setenv("FACTORY_MODELS_DIR", str(models))
    monkeypatch.setenv("FACTORY_EXPERIMENTS_DIR", str(shared_factory / "experiments"))
    (shared_factory / "experiments").mkdir()
    yield shared_factory
    from factory.deploy import Deployer
    from factory.process import stop_group

    for dep in Deployer().versions():
        if dep.alive:
            stop_group(int(dep.pid or 0), timeout_s=10)


def test_the_loop_runs_through_nodes_sharing_one_database_and_warehouse(
        shared_loop: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import dagster as dg

    from factory.app.client import chain_runs, loop_outcome
    from factory.app.instance import instance
    from factory.dagster_runs import failure_message
    from factory.deploy import Deployer
    from factory.ingest import RawRecord, ingest_records
    from factory.lake import Lake
    from factory.tasks import generate_records

    # The ingest node writes the traffic.
    monkeypatch.setenv("FACTORY_HOME", str(tmp_path / "node-ingest"))
    now = datetime.now(UTC)
    ingest_records(Lake(), [RawRecord(payload=r, source="upload", received_at=now,
                                      tags={"project": "demo"})
                            for r in generate_records(30, 0)])

    gateway_home, daemon_home = tmp_path / "node-gateway", tmp_path / "node-daemon"
    gateway = subprocess.Popen([sys.executable, "-m", "factory.app.cli", "serve", "--port", "0"],
                               env=_node(gateway_home), stdout=subprocess.PIPE, text=True,
                               start_new_session=True)
    daemon = subprocess.Popen([sys.executable, "-m", "factory.app.cli", "daemon"],
                              env=_node(daemon_home), stdout=subprocess.DEVNULL,
                              start_new_session=True)
    try:
        assert gateway.stdout is not None
        match = re.search(r"http://[\d.]+:\d+", gateway.stdout.readline())
        assert match, "the gateway did not start"
        gateway_url = match.group(0)

        # The experiment file (in git for real nodes; a shared folder here) starts the chain
        # from the daemon's experiments sensor.
        (shared_loop / "experiments" / "tiny.yaml").write_text(TINY)
        monkeypatch.setenv("FACTORY_HOME", str(tmp_path / "node-client"))
        monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "node-client" / "dagster"))
        inst = instance()
        [start] = wait_until(lambda: list(inst.get_runs(filters=dg.RunsFilter(
            job_name="start_experiment_job", tags={"dagster/partition": "tiny"}))), 300,
            what="the experiments sensor's start")
        outcome = wait_until(lambda: loop_outcome(inst, start.run_id), CHAIN_S,
                             what="the chain to end")
        failed = [(r.job_name, failure_message(inst, r.run_id))
                  for r in chain_runs(inst, start.run_id)
                  if r.status == dg.DagsterRunStatus.FAILURE]
        assert outcome == "deployed", failed
        live = Deployer().live("tiny")
        assert live is not None
        # Trained on the daemon's node, into the shared checkpoints folder.
        assert Path(live.checkpoint).is_relative_to(shared_loop / "checkpoints")

        # The gateway node routes the experiment's model name to the deployment, and captures.
        def answered() -> httpx.Response | None:
            r = httpx.post(gateway_url + "/v1/chat/completions", timeout=120, json={
                "model": "factory/tiny", "max_tokens": 4,
                "messages": [{"role": "user", "content": "shared loop probe"}]})
            return r if r.status_code == 200 else None

        reply = wait_until(answered, 60, what="the gateway to route factory/tiny")
        assert reply.json()["choices"][0]["message"]["role"] == "assistant"
        wait_until(lambda: Lake().sql(
            "SELECT count(*) AS n FROM samples WHERE messages LIKE ?",
            ["%shared loop probe%"]).to_pylist()[0]["n"] == 1, 60, what="the capture")
    finally:
        for proc in (gateway, daemon):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(120)
        if gateway.stdout is not None:
            gateway.stdout.close()
