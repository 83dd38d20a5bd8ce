"""``chain_sensor``: each chain's next run request, from real runs on a Dagster instance and the
lake's checkpoints and scores; skip reasons say what a chain waits for."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from factory.dagster_runs import CHAIN_TAG, TRAINER_RUN_TAG
from factory.lake import Lake
from factory.sensors.chains import EVAL_TAG, evaluate

EXP = """\
name: sup
data: {where: "true"}
recipe: smollm2-135m-lora
sweep: {learning_rate: [1.0e-4, 2.0e-4]}
deploy: auto
"""
KEYS = ["sup/learning_rate=0.0001", "sup/learning_rate=0.0002"]
S = dg.DagsterRunStatus


@pytest.fixture()
def exp_dir(factory_home: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = factory_home / "experiments"
    d.mkdir()
    (d / "sup.yaml").write_text(EXP)
    monkeypatch.setenv("FACTORY_EXPERIMENTS_DIR", str(d))
    return d


def _run(instance: dg.DagsterInstance, job: str, status: dg.DagsterRunStatus,
         **tags: str) -> str:
    run = instance.add_run(dg.DagsterRun(job_name=job, status=status, tags=tags))
    return run.run_id


def _ckpt(run_id: str, step: int) -> dict[str, Any]:
    return {"run_id": run_id, "experiment": "sup", "step": step, "path": f"/c/{step}",
            "manifest_sha256": "0" * 64, "verified": True, "received_at": datetime.now(UTC),
            "event_id": f"{run_id}-{step}"}


def _score(run_id: str, step: int) -> dict[str, Any]:
    return {"run_id": run_id, "experiment": "sup", "step": step, "kind": "checkpoint",
            "score": 0.5, "status": "ok"}


def test_a_chain_goes_from_profile_to_deployment(exp_dir: Path) -> None:
    lake = Lake()
    with dg.instance_for_test() as instance:
        def tick(cursor: str | None) -> tuple[list[dg.RunRequest], list[str], dict, str]:
            return evaluate(instance, lake, cursor)

        assert tick(None)[0] == []  # no chain started
        start = _run(instance, "start_experiment_job", S.SUCCESS,
                     **{"dagster/partition": "sup"})
        chain = {CHAIN_TAG: start}
        # 1. every sweep point is planned and trained, its partition added first
        requests, partitions, report, cursor = tick(None)
        assert partitions == KEYS
        assert sorted(r.partition_key for r in requests) == KEYS
        assert all(r.job_name == "train_run_job" and r.tags[CHAIN_TAG] == start
                   for r in requests)
        assert requests[0].run_key == f"train:{start}:{KEYS[0]}"
        assert "profiled" in requests[0].tags["factory/reason"]
        # the same tick again asks for the same run keys (the daemon launches them once)
        assert [r.run_key for r in tick(cursor)[0]] == [r.run_key for r in requests]
        t1 = _run(instance, "train_run_job", S.SUCCESS,
                  **{**chain, "dagster/partition": KEYS[0], TRAINER_RUN_TAG: "run-a"})
        _run(instance, "train_run_job", S.STARTED,
             **{**chain, "dagster/partition": KEYS[1], TRAINER_RUN_TAG: "run-b"})
        requests, _, report, cursor = tick(cursor)
        assert requests == [] and list(report.values()) == [f"training {KEYS[1]}"]
        assert t1
        # 2. both trained; a checkpoint without scores holds the selection back
        _run(instance, "train_run_job", S.SUCCESS,
             **{**chain, "dagster/partition": KEYS[1], TRAINER_RUN_TAG: "run-b"})
        lake.append("checkpoints", [_ckpt("run-a", 2), _ckpt("run-a", 4), _ckpt("run-b", 2)])
        lake.append("eval_scores", [_score("run-a", 2), _score("run-a", 4)])
        requests, _, report, cursor = tick(cursor)
        assert requests == [] and "run-b:2" in next(iter(report.values()))
        # its evaluation ended without scores (e.g. refused by the equivalence check): done
        _run(instance, "__ASSET_JOB", S.FAILURE, **{"dagster/partition": "run-b:2"})
        requests, _, report, cursor = tick(cursor)
        [select] = requests
        assert select.job_name == "select_checkpoint_job" and select.partition_key == "sup"
        assert "scored (2)" in select.tags["factory/reason"]
        # final_evals and best_checkpoint choose among the chain's runs, in the evals' queue
        chosen = {"config": {"runs": ["run-a", "run-b"]}}
        assert select.run_config == {"ops": {"final_evals": chosen, "best_checkpoint": chosen}}
        assert select.tags[EVAL_TAG] == "1"
        # 3. selected: deploy: auto promotes it
        _run(instance, "select_checkpoint_job", S.SUCCESS, **chain)
        [deploy] = tick(cursor)[0]
        assert deploy.job_name == "deploy_model_job" and deploy.run_key == f"deploy:{start}"
        _run(instance, "deploy_model_job", S.SUCCESS, **chain)
        requests, _, report, cursor = tick(cursor)
        assert requests == [] and list(report.values()) == ["deployed"]
        assert json.loads(cursor)["done"][start] == "deployed"
        assert tick(cursor)[2] == {}  # an ended chain is not looked at again


def test_a_failed_training_run_stops_its_chain(exp_dir: Path) -> None:
    with dg.instance_for_test() as instance:
        start = _run(instance, "start_experiment_job", S.SUCCESS,
                     **{"dagster/partition": "sup"})
        for key, status in zip(KEYS, (S.FAILURE, S.SUCCESS), strict=True):
            _run(instance, "train_run_job", status,
                 **{CHAIN_TAG: start, "dagster/partition": key})
        requests, _, report, cursor = evaluate(instance, Lake(), None)
        assert requests == []
        assert list(report.values())[0].startswith(f"training of {KEYS[0]} failed")
        assert start in json.loads(cursor)["done"]


def test_manual_policy_stops_at_the_best_checkpoint(exp_dir: Path) -> None:
    (exp_dir / "sup.yaml").write_text(EXP.replace("deploy: auto\n", ""))  # a sweep: manual
    lake = Lake()
    lake.append("checkpoints", [_ckpt("run-a", 2)])
    lake.append("eval_scores", [_score("run-a", 2)])
    with dg.instance_for_test() as instance:
        start = _run(instance, "start_experiment_job", S.SUCCESS,
                     **{"dagster/partition": "sup"})
        for key in KEYS:
            _run(instance, "train_run_job", S.SUCCESS,
                 **{CHAIN_TAG: start, "dagster/partition": key, TRAINER_RUN_TAG: "run-a"})
        _run(instance, "select_checkpoint_job", S.SUCCESS, **{CHAIN_TAG: start})
        requests, _, report, _ = evaluate(instance, lake, None)
        assert requests == [] and "deploy: manual" in list(report.values())[0]


def test_an_edited_file_supersedes_the_chain_it_started(exp_dir: Path) -> None:
    from factory.experiments import experiment_sha, load_experiment

    with dg.instance_for_test() as instance:
        sha = experiment_sha(load_experiment("sup"))
        (exp_dir / "sup.yaml").write_text(EXP.replace("2.0e-4", "3.0e-4"))
        start = _run(instance, "start_experiment_job", S.SUCCESS,
                     **{"dagster/partition": "sup", "factory/experiment-sha": sha})
        requests, _, _, cursor = evaluate(instance, Lake(), None)
        assert requests == [] and json.loads(cursor)["done"][start].startswith("superseded")


def test_a_shadow_policy_deploys_a_candidate(exp_dir: Path) -> None:
    (exp_dir / "sup.yaml").write_text(EXP.replace(
        "deploy: auto", "deploy: {shadow: {route: gpt-4o-mini, agreement: 0.95}}"))
    lake = Lake()
    with dg.instance_for_test() as instance:
        def tick(cursor: str | None) -> tuple[list[dg.RunRequest], list[str], dict, str]:
            return evaluate(instance, lake, cursor)

        start = _run(instance, "start_experiment_job", S.SUCCESS,
                     **{"dagster/partition": "sup"})
        chain = {CHAIN_TAG: start}
        cursor = tick(None)[3]
        for key, run in zip(KEYS, ("run-a", "run-b"), strict=True):
            _run(instance, "train_run_job", S.SUCCESS,
                 **{**chain, "dagster/partition": key, TRAINER_RUN_TAG: run})
        lake.append("checkpoints", [_ckpt("run-a", 2), _ckpt("run-b", 2)])
        lake.append("eval_scores", [_score("run-a", 2), _score("run-b", 2)])
        [select] = tick(cursor)[0]
        _run(instance, "select_checkpoint_job", S.SUCCESS, **chain)
        [deploy] = tick(cursor)[0]
        assert deploy.job_name == "deploy_model_job"
        assert deploy.tags["factory/reason"].startswith("deploy: shadow")
        _run(instance, "deploy_model_job", S.SUCCESS, **chain)
        requests, _, report, cursor = tick(cursor)
        assert requests == [] and list(report.values()) == [
            "deployed as a candidate, shadowing live traffic"]


SELECTING = "judging the leading checkpoints on the whole eval set, then selecting the best"


@pytest.mark.parametrize(("evals", "select", "outcome"), [
    # every checkpoint scored: the selection is requested (final evals, then the choice)
    ({"run-a:2": "scored", "run-b:2": "scored"}, None, ("request", SELECTING)),
    # an evaluation still to come holds it back; one that ended without scores does not
    ({"run-a:2": "scored", "run-b:2": S.STARTED}, None,
     ("waiting", "1 checkpoint(s) not scored yet: run-b:2")),
    ({"run-a:2": "scored", "run-b:2": S.FAILURE}, None, ("request", SELECTING)),
    # nothing scored at all: nothing to select
    ({"run-a:2": S.FAILURE, "run-b:2": S.FAILURE}, None,
     ("ended", "no checkpoint of the chain's runs was scored: nothing to select")),
    # the selection's run starting (out of the evals' queue) or running: the chain waits
    ({"run-a:2": "scored", "run-b:2": "scored"}, S.STARTING, ("waiting", SELECTING)),
    ({"run-a:2": "scored", "run-b:2": "scored"}, S.STARTED, ("waiting", SELECTING)),
    # its final evals or the choice failed: the chain ends with the run's message
    ({"run-a:2": "scored", "run-b:2": "scored"}, S.FAILURE,
     ("ended", "the selection (final_evals, best_checkpoint) failed: run ")),
    # selected: deploy: auto deploys
    ({"run-a:2": "scored", "run-b:2": "scored"}, S.SUCCESS, ("deploy", "deploying")),
])
def test_the_selection_step_on_a_table_of_states(
        exp_dir: Path, evals: dict[str, Any], select: dg.DagsterRunStatus | None,
        outcome: tuple[str, str]) -> None:
    """The step between the scored checkpoints and the deployment, one tick per state: what
    the chain requests, waits for, or how it ends."""
    lake = Lake()
    lake.append("checkpoints", [_ckpt(key.split(":")[0], 2) for key in evals])
    scored = [_score(key.split(":")[0], 2) for key, state in evals.items() if state == "scored"]
    if scored:
        lake.append("eval_scores", scored)
    with dg.instance_for_test() as instance:
        start = _run(instance, "start_experiment_job", S.SUCCESS, **{"dagster/partition": "sup"})
        chain = {CHAIN_TAG: start}
        for key, run in zip(KEYS, ("run-a", "run-b"), strict=True):
            _run(instance, "train_run_job", S.SUCCESS,
                 **{**chain, "dagster/partition": key, TRAINER_RUN_TAG: run})
        for key, state in evals.items():
            if state != "scored":
                _run(instance, "__ASSET_JOB", state, **{"dagster/partition": key})
        if select is not None:
            _run(instance, "select_checkpoint_job", select, **chain)
        requests, _, report, cursor = evaluate(instance, lake, None)
        kind, text = outcome
        [said] = report.values()
        assert said.startswith(text), said
        ended = json.loads(cursor)["done"].get(start)
        assert (ended is not None) == (kind == "ended")
        jobs = [r.job_name for r in requests]
        assert jobs == {"request": ["select_checkpoint_job"],
                        "deploy": ["deploy_model_job"]}.get(kind, [])
        if kind == "request":
            assert requests[0].tags[EVAL_TAG] == "1"
            assert requests[0].run_key == f"select:{start}"
