"""``factory run``'s wait on a chain (``factory.app.client.follow``) on a real Dagster instance:
how often it looks while nothing changes, and that it reads the sensors' cursors only once the
chain's runs have ended."""

from __future__ import annotations

from typing import Any

import dagster as dg
import pytest
from dagster._core.events import DagsterEvent, DagsterEventType
from dagster._core.test_utils import create_run_for_test

from factory.app import client
from factory.dagster_runs import CHAIN_TAG


def _succeed(inst: dg.DagsterInstance, run: dg.DagsterRun) -> None:
    inst.report_dagster_event(DagsterEvent(event_type_value=DagsterEventType.RUN_SUCCESS.value,
                                           job_name=run.job_name), run.run_id)


def _training_chain(inst: dg.DagsterInstance) -> tuple[dg.DagsterRun, dg.DagsterRun]:
    """A chain's start (done) and its training run (running), as ``chain_runs`` finds them."""
    start = create_run_for_test(inst, job_name="start_experiment_job",
                                status=dg.DagsterRunStatus.SUCCESS)
    train = create_run_for_test(inst, job_name="train_run_job",
                                status=dg.DagsterRunStatus.STARTED, tags={CHAIN_TAG: start.run_id})
    return start, train


def test_a_quiet_chain_is_looked_at_less_often_and_its_outcome_read_once_its_runs_ended(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with dg.DagsterInstance.ephemeral() as inst:
        start, train = _training_chain(inst)
        waits: list[float] = []
        outcome_reads: list[str] = []

        def sleep(seconds: float) -> None:
            waits.append(seconds)
            if len(waits) == 7:  # the training run ends after seven looks
                _succeed(inst, train)

        def loop_outcome(_inst: Any, chain: str) -> str | None:
            outcome_reads.append(inst.get_run_by_id(train.run_id).status.value)
            return "deployed" if outcome_reads[-1] == "SUCCESS" else None

        monkeypatch.setattr(client, "loop_outcome", loop_outcome)
        lines: list[str] = []
        assert client.follow(inst, start.run_id, lines.append, poll_s=1.0, quiet_poll_s=4.0,
                             sleep=sleep) == "deployed"
    # The first look saw both runs; each after it found nothing new: 1.5 times longer, up to 4 s.
    assert waits == [1.0, 1.5, 2.25, 3.375, 4.0, 4.0, 4.0]
    # The cursors were read once, when the training run had ended, not on every look.
    assert outcome_reads == ["SUCCESS"]
    assert any("training_plan, training_run: success" in line for line in lines)


def test_a_change_brings_the_looks_back_to_the_poll_interval(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with dg.DagsterInstance.ephemeral() as inst:
        start, train = _training_chain(inst)
        waits: list[float] = []
        state = {"deploy": None}

        def sleep(seconds: float) -> None:
            waits.append(seconds)
            if len(waits) == 3:
                _succeed(inst, train)
                state["deploy"] = create_run_for_test(
                    inst, job_name="deploy_model_job", status=dg.DagsterRunStatus.STARTED,
                    tags={CHAIN_TAG: start.run_id})
            elif len(waits) == 6:
                _succeed(inst, state["deploy"])

        monkeypatch.setattr(client, "loop_outcome", lambda _i, _c: (
            "deployed" if len(waits) >= 6 else None))
        assert client.follow(inst, start.run_id, lambda _line: None, poll_s=1.0,
                             quiet_poll_s=4.0, sleep=sleep) == "deployed"
    assert waits == [1.0, 1.5, 2.25, 1.0, 1.5, 2.25]


def test_once_every_run_ended_the_looks_keep_the_poll_interval(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The chain's runs all ended and chain_sensor has not recorded the outcome yet: it will
    within a pass, and each look waits ``poll_s``, not longer and longer."""
    with dg.DagsterInstance.ephemeral() as inst:
        start, train = _training_chain(inst)
        _succeed(inst, train)
        waits: list[float] = []
        monkeypatch.setattr(client, "loop_outcome", lambda _i, _c: (
            "deployed" if len(waits) >= 4 else None))
        assert client.follow(inst, start.run_id, lambda _line: None, poll_s=1.0,
                             quiet_poll_s=4.0, sleep=waits.append) == "deployed"
    assert waits == [1.0, 1.0, 1.0, 1.0]
