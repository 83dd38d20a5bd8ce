"""The loop under Dagster itself: a real ``factory ui`` (``dagster dev``: webserver and daemon)
started by the test on a small lake and the tiny model, and nothing else driving it.

(a) git path: an experiment file dropped into the experiments folder reaches a live
    deployment with no other command;
(b) UI path: one launch of ``start_experiment_job`` over GraphQL (the UI's Launch button)
    reaches a new live deployment; a Materialize of ``deployment`` with a chosen checkpoint (the
    UI's config editor) serves that checkpoint, and the server outlives the UI;
(c) schedule path: a sweep's cron tick trains both points, the comparison has their real
    scores, and the winner is promoted (``deploy: auto``).

First, the UI itself: the code location loaded, the instance queueing runs for the daemon.
Each path checks the order of the chain's runs: no ``best_checkpoint`` before the last checkpoint
of its runs is scored.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.deploy.dagster_ui import UI, factory_ui, gql
from tests.inference.conftest import make_adapter
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]  # under a second test worker

TINY = """name: tiny
data: {where: "tags['project'] = 'demo'", eval_fraction: 0.2, max_tokens: 512}
recipe: smollm2-135m-lora
overrides: {num_steps: 4, checkpoint_every_steps: 2}
eval: {judge: embedded, rubric: auto, max_samples: 3}
"""
SWEEP = """name: sweep
data: {where: "tags['project'] = 'demo'", eval_fraction: 0.2, max_tokens: 512}
recipe: smollm2-135m-lora
overrides: {num_steps: 2, checkpoint_every_steps: 2}
sweep: {learning_rate: [1.0e-3, 4.0e-3]}
eval: {judge: embedded, rubric: auto, max_samples: 3}
deploy: auto
schedule: "%s"
"""
CHAIN_S = 600


@pytest.fixture(scope="module")
def ui(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[UI]:
    """A factory with demo samples and an empty experiments folder, and its UI."""
    from factory.ingest import RawRecord, ingest_records
    from factory.lake import Lake
    from factory.tasks import generate_records
    from tests.deploy.conftest import _stop_leftovers

    root = tmp_path_factory.mktemp("ui-loop")
    home = root / "factory-home"
    (home / "dagster").mkdir(parents=True)
    models = root / "models"
    models.mkdir()
    (models / "smollm2-135m-instruct").symlink_to(tiny_model_dir)
    (root / "experiments").mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FACTORY_HOME", str(home))
        mp.setenv("FACTORY_MODELS_DIR", str(models))
        mp.setenv("FACTORY_EXPERIMENTS_DIR", str(root / "experiments"))
        mp.setenv("DAGSTER_HOME", str(home / "dagster"))
        now = datetime.now(UTC)
        ingest_records(Lake(), [RawRecord(payload=r, source="upload", received_at=now,
                                          tags={"project": "demo"})
                                for r in generate_records(30, 0)])
        try:
            with factory_ui(dict(os.environ)) as running:
                yield running
        finally:
            _stop_leftovers(home)


def _instance() -> Any:
    from factory.app.instance import instance

    return instance()


def _chain_outcome(start_run: str) -> str:
    """Wait for the chain that ``start_run`` began to end (as chain_sensor records it)."""
    from factory.app.client import loop_outcome

    inst = _instance()
    return str(wait_until(lambda: loop_outcome(inst, start_run), CHAIN_S,
                          what=f"the chain of {start_run}"))


def _assert_ordered(start_run: str) -> list[str]:
    """Every checkpoint of the chain's runs was scored, each evaluation ended before the
    best checkpoint was selected, and the deployment came after the selection. Returns the
    chain's trainer run ids."""
    import dagster as dg

    from factory.app.client import chain_runs
    from factory.lake import Lake

    inst = _instance()
    runs = chain_runs(inst, start_run)
    record = {r.run_id: inst.get_run_record_by_id(r.run_id) for r in runs}
    select = [r for r in runs if r.job_name == "select_checkpoint_job"]
    assert len(select) == 1 and select[0].status == dg.DagsterRunStatus.SUCCESS
    selected_at = record[select[0].run_id].start_time
    trainers = sorted({r.tags["factory/run-id"] for r in runs if "factory/run-id" in r.tags})
    evals = [r for r in runs if "factory/run-id" in r.tags]
    assert evals and all(record[r.run_id].end_time <= selected_at for r in evals)
    train_runs = [r for r in runs if r.job_name == "train_run_job"]
    assert train_runs and all(record[r.run_id].end_time <= selected_at for r in train_runs)
    lake = Lake()
    for trainer in trainers:
        steps = {r["step"] for r in lake.sql("SELECT step FROM checkpoints WHERE run_id = ? "
                                              "AND verified", [trainer]).to_pylist()}
        scored = {r["step"] for r in lake.sql(
            "SELECT DISTINCT step FROM eval_scores WHERE run_id = ? AND kind = 'checkpoint'",
            [trainer]).to_pylist()}
        assert steps and steps == scored, (trainer, steps, scored)
    deploys = [r for r in runs if r.job_name == "deploy_model_job"]
    if deploys:
        assert record[deploys[0].run_id].start_time >= record[select[0].run_id].end_time
    return trainers


def _starts(experiment: str) -> list[Any]:
    import dagster as dg

    return list(_instance().get_runs(filters=dg.RunsFilter(
        job_name="start_experiment_job", tags={"dagster/partition": experiment})))


def _ask(endpoint: str, model: str) -> str | None:
    answer = openai.OpenAI(base_url=endpoint, api_key="x", max_retries=0
                           ).chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    return answer.choices[0].message.content


QUERY = """{ workspaceOrError { ... on Workspace { locationEntries { name
  locationOrLoadError { __typename ... on RepositoryLocation { repositories {
  assetNodes { assetKey { path } } jobs { name } } } } } } } }"""


def test_ui_serves_the_code_location(ui: UI) -> None:
    entries = gql(ui.url, QUERY)["workspaceOrError"]["locationEntries"]
    [repo] = entries[0]["locationOrLoadError"]["repositories"]
    keys = {tuple(n["assetKey"]["path"]) for n in repo["assetNodes"]}
    assert {("base_model",), ("dataset",), ("training_run",), ("deployment",)} <= keys
    assert "start_experiment_job" in {j["name"] for j in repo["jobs"]}
    config = (Path(os.environ["DAGSTER_HOME"]) / "dagster.yaml").read_text()
    assert "QueuedRunCoordinator" in config and "factory/eval" in config


def test_a_dropped_experiment_file_reaches_a_live_endpoint(ui: UI) -> None:
    from factory.deploy import Deployer

    experiments = Path(os.environ["FACTORY_EXPERIMENTS_DIR"])
    (experiments / "tiny.yaml").write_text(TINY)
    [start] = wait_until(lambda: _starts("tiny"), 120, what="the experiments sensor's start")
    assert _chain_outcome(start.run_id) == "deployed"
    trainers = _assert_ordered(start.run_id)
    live = Deployer().live("tiny")
    assert live is not None and live.run_id in trainers
    assert _ask(live.endpoint, live.adapter) is not None


def test_one_launch_in_the_ui_reaches_a_new_deployment(ui: UI, tiny_model_dir: Path,
                                                       tmp_path: Path) -> None:
    from factory.deploy import DeployConfig, Deployer
    from factory.gateway import load_routes
    from factory.lake import Lake

    before = Deployer().live("tiny")
    start = ui.launch("start_experiment_job", "tiny")
    assert _chain_outcome(start) == "deployed"
    trainers = _assert_ordered(start)
    live = Deployer().live("tiny")
    assert live is not None and live.run_id in trainers
    assert before is None or live.version != before.version

    # Materialize with config, as the UI's launchpad sends it: a chosen checkpoint.
    adapter = make_adapter(tiny_model_dir, tmp_path / "adapter", seed=3)
    run_id = ui.launch("__ASSET_JOB", "tiny", assets=["deployment"], run_config={
        "ops": {"deployment": {"config": {"checkpoint": str(adapter)}}}})
    assert wait_until(lambda: ui.status(run_id) in ("SUCCESS", "FAILURE") and ui.status(run_id),
                      240, what="the deployment run") == "SUCCESS"
    chosen = Deployer().live("tiny")
    assert chosen is not None and chosen.checkpoint == str(adapter)
    assert load_routes(Lake())["factory/tiny"].base_url == chosen.endpoint
    assert _ask(chosen.endpoint, chosen.adapter) is not None
    Deployer(config=DeployConfig(drain_s=0.0)).undeploy("tiny")


def test_a_scheduled_sweep_trains_compares_and_promotes(ui: UI) -> None:
    from factory.deploy import Deployer
    from factory.experiments import load_experiment
    from factory.lake import Lake
    from factory.planner.service import sweep_comparison

    # The first minute boundary at least 30 s away: the sensor (every 15 s) first sees the
    # file and records the tick before it, then fires on this one. The file's own arrival
    # starts nothing: a scheduled experiment runs on its ticks.
    tick = (datetime.now(UTC) + timedelta(seconds=90)).replace(second=0, microsecond=0)
    experiments = Path(os.environ["FACTORY_EXPERIMENTS_DIR"])
    (experiments / "sweep.yaml").write_text(SWEEP % f"{tick.minute} {tick.hour} * * *")
    key = f"sweep@{tick.strftime('%Y%m%dT%H%M')}"

    def scheduled() -> Any:
        return next((r for r in _starts("sweep") if r.tags.get("dagster/run_key") == key), None)

    start = wait_until(scheduled, 300, what=f"the schedule tick's run {key}")
    assert start.tags["factory/reason"].startswith("schedule")
    assert len(_starts("sweep")) == 1
    assert _chain_outcome(start.run_id) == "deployed"
    trainers = _assert_ordered(start.run_id)
    assert len(trainers) == 2
    rows = sweep_comparison(Lake(), load_experiment("sweep"))
    scores = {r["run_id"]: r["best_eval_score"] for r in rows}
    assert set(scores) == set(trainers) and all(s is not None for s in scores.values())
    live = Deployer().live("sweep")
    best = Lake().sql("SELECT run_id, mean_score FROM best_checkpoints WHERE experiment = "
                      "'sweep' ORDER BY selected_at DESC LIMIT 1").to_pylist()[0]
    assert live is not None and live.run_id == best["run_id"]
    assert scores[best["run_id"]] == pytest.approx(max(scores.values()))
    # The base model and the references were judged once for both points: the later point's
    # first eval copied them from the earlier one.
    import dagster as dg

    reused = []
    for record in _instance().fetch_materializations(
            dg.AssetKey("checkpoint_evals"), limit=100).records:
        meta = record.asset_materialization.metadata if record.asset_materialization else {}
        source = meta.get("scores_reused_from")
        if meta["run_id"].value in trainers and source is not None and source.value:
            reused.append(source.value)
    assert len(reused) == 1 and set(reused[0]) == {"base", "reference"}
    assert set(reused[0].values()) < set(trainers)
