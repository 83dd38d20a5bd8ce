"""``factory run`` and ``factory demo`` as clients of the Dagster instance.

They do what a click in the UI does: submit ``start_experiment_job`` for the experiment's
partition to the instance's run queue (``dagster job launch``, through the run launcher the
instance is configured with), and then only watch. The daemon launches the run; ``chain_sensor``
trains every sweep point, ``checkpoint_sensor`` evaluates each checkpoint while it trains, and
the best checkpoint is selected and deployed per the experiment's ``deploy`` policy. The client
follows the chain's runs (tag ``factory/chain``) with progress lines (each scored checkpoint with
its interval and sample count) and ends with the chain's outcome as ``chain_sensor`` recorded
it. With no daemon running it starts one for the duration
(``factory.app.instance.ensure_daemon``).

Ctrl-C cancels the chain's runs that have not ended through the instance's run coordinator
(a queued run is dropped; a running one is interrupted, and ``training_run`` then cancels its
trainer, which checkpoints first), waits for them to end and raises ``KeyboardInterrupt``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

from factory.app.instance import (
    CODE_LOCATION,
    DAEMON_STALE_S,
    daemon_running,
    dagster_home,
    instance,
)
from factory.dagster_runs import (
    CHAIN_TAG,
    FAILED,
    FINISHED,
    TRAINER_RUN_TAG,
    failure_message,
    materialized,
)
from factory.errors import FactoryError
from factory.evals.selection import StepScore, format_score
from factory.process import raise_pending

Progress = Callable[[str], None]
REQUEST_TAG = "factory/request"
CANCEL_WAIT_S = 120.0
"""How long cancelled runs get to end (the trainer's checkpoint on SIGTERM, the provider's
grace before SIGKILL) before the client gives up waiting."""


class ChainFailed(FactoryError):
    """The chain ended without reaching its goal; the message is why (from the failed run)."""


def submit(job: str, partition: str, tags: dict[str, str] | None = None) -> str:
    """Queue a run of ``job`` for ``partition`` on the instance; its Dagster run id."""
    import dagster as dg

    request = uuid.uuid4().hex
    all_tags = {"dagster/partition": partition, REQUEST_TAG: request, **(tags or {})}
    cmd = [sys.executable, "-m", "dagster", "job", "launch", "-m", CODE_LOCATION, "-j", job,
           "--tags", json.dumps(all_tags)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False,
                         env={**os.environ, "DAGSTER_HOME": str(dagster_home())})
    runs = instance().get_runs(filters=dg.RunsFilter(tags={REQUEST_TAG: request}), limit=1)
    if out.returncode != 0 or not runs:
        tail = (out.stderr or out.stdout).strip().splitlines()[-5:]
        raise FactoryError(f"could not submit {job} for {partition!r}: " + " | ".join(tail))
    return str(runs[0].run_id)


def loop_outcome(inst: Any, chain: str) -> str | None:
    """How ``chain_sensor`` recorded that chain ``chain`` ended, or None while it is active."""
    for state in inst.all_instigator_state():
        if state.name != "chain_sensor" or state.instigator_data is None:
            continue
        cursor = getattr(state.instigator_data, "cursor", None)
        if cursor:
            done = json.loads(cursor).get("done", {})
            if chain in done:
                return str(done[chain])
    return None


JOB_ASSETS = {"start_experiment_job": "synthetic_samples, dataset, dataset_profile, rubric",
              "train_run_job": "training_plan, training_run",
              "select_checkpoint_job": "final_evals, best_checkpoint",
              "deploy_model_job": "deployment"}
"""What each of the chain's jobs materializes, for progress lines."""


def _label(run: Any) -> str:
    part = run.tags.get("dagster/partition", "")
    what = JOB_ASSETS.get(run.job_name) or ", ".join(
        sorted(k.to_user_string() for k in run.asset_selection or [])) or run.job_name
    return f"{what} [{part}]" if part else what


def chain_runs(inst: Any, start_run: str) -> list[Any]:
    """Every run of the chain: its start, the runs tagged with it, and the checkpoint evals of
    the trainer runs it submitted (oldest first)."""
    import dagster as dg

    start = inst.get_run_record_by_id(start_run)
    records = [start] if start is not None else []
    tagged = list(inst.get_run_records(filters=dg.RunsFilter(tags={CHAIN_TAG: start_run})))
    records += tagged
    for record in tagged:
        trainer = record.dagster_run.tags.get(TRAINER_RUN_TAG)
        if trainer:
            records += inst.get_run_records(filters=dg.RunsFilter(
                tags={"factory/run-id": trainer}))
    records.sort(key=lambda r: (r.create_timestamp, r.dagster_run.run_id))
    return [r.dagster_run for r in records]


def eval_score(meta: dict[str, Any]) -> str | None:
    """A checkpoint eval's score from its materialization metadata as ``format_score`` prints
    it (``0.962 [0.921, 0.983] n=200 (Wilson)``); None when it was not scored."""
    if not all(isinstance(meta.get(k), int | float)
               for k in ("mean_score", "ci_low", "ci_high", "num_samples")):
        return None
    return format_score(StepScore.from_row(meta))


DAEMON_CHECK_S = 10.0
"""Seconds between checks, while a chain is followed, that a daemon still runs it."""


QUIET_POLL_S = 4.0
"""Longest wait between looks at a chain whose runs' statuses have not changed (a training run
of many minutes): each unchanged look waits 1.5 times the last, from ``poll_s``; a change goes
back to ``poll_s``. One look costs ~40 ms of CPU, taken from a trainer on the same cores."""


def follow(inst: Any, start_run: str, progress: Progress, *, poll_s: float = 1.0,
           quiet_poll_s: float = QUIET_POLL_S,
           sleep: Callable[[float], None] = time.sleep) -> str:
    """Wait for the chain started by ``start_run`` to end; its outcome (``deployed``, or the
    manual policy's stop after ``best_checkpoint``). Raises ChainFailed with the reason when
    the chain stops short (a failed run: its step's message), or when no daemon moves it on
    any more (``factory ui``'s, say, stopped: its heartbeats older than ``DAEMON_STALE_S``).

    Looks every ``poll_s`` seconds after a run's status changed and while every run of the
    chain has ended (the next step or the outcome is a sensor pass away), up to every
    ``quiet_poll_s`` while one runs and none changes (``sleep`` waits). ``chain_sensor``
    records the outcome once the chain's runs have ended, so its cursors are read then, and
    every ``DAEMON_CHECK_S`` while one still runs."""
    statuses: dict[str, str] = {}
    checked = outcome_checked = time.monotonic()
    wait = poll_s
    while True:
        start = inst.get_run_by_id(start_run)
        if start is None:
            raise ChainFailed(f"run {start_run} is not on the instance")
        if time.monotonic() - checked >= DAEMON_CHECK_S:
            checked = time.monotonic()
            if not daemon_running(inst):
                raise ChainFailed(f"no Dagster daemon runs the chain any more (no heartbeat "
                                  f"for {DAEMON_STALE_S:.0f} s): start `factory ui` or run "
                                  f"`factory run` again")
        runs = chain_runs(inst, start_run)
        changed = False
        for run in runs:
            status = run.status.value
            if statuses.get(run.run_id) == status:
                continue
            statuses[run.run_id] = status
            changed = True
            line = f"  {_label(run)}: {status.lower()}"
            if run.status.value == "SUCCESS" and run.tags.get("factory/step"):
                score = eval_score(materialized(inst, run.run_id, "checkpoint_evals"))
                if score:
                    line += f" (step {run.tags['factory/step']}: mean score {score})"
            elif run.status in FAILED:
                line += f": {failure_message(inst, run.run_id)}"
            progress(line)
        if start.status in FAILED:
            raise ChainFailed(f"{_label(start)} failed: {failure_message(inst, start_run)}")
        outcome = None
        ended = start.status.value == "SUCCESS" and all(r.status in FINISHED for r in runs)
        if ended or (start.status.value == "SUCCESS"
                     and time.monotonic() - outcome_checked >= DAEMON_CHECK_S):
            outcome_checked = time.monotonic()
            outcome = loop_outcome(inst, start_run)
        if outcome is not None:
            if outcome == "deployed" or outcome.startswith("best checkpoint selected"):
                return outcome
            raise ChainFailed(outcome)
        # Every run ended: chain_sensor's next pass starts the next one or records the outcome,
        # seconds away, so the looks keep the poll interval.
        wait = poll_s if changed or ended else min(wait * 1.5, max(quiet_poll_s, poll_s))
        sleep(wait)
        raise_pending()  # a SIGTERM whose exception a finalizer swallowed


def cancel_chain(inst: Any, start_run: str, progress: Progress, *,
                 wait_s: float = CANCEL_WAIT_S) -> list[str]:
    """Cancel the chain's runs that have not ended and wait for them; their run ids."""
    live = [r for r in chain_runs(inst, start_run) if r.status not in FINISHED]
    for run in live:
        progress(f"  cancelling {_label(run)} ({run.run_id[:8]})")
        inst.run_coordinator.cancel_run(run.run_id)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if all(inst.get_run_by_id(r.run_id).status in FINISHED for r in live):
            break
        time.sleep(0.5)
    return [r.run_id for r in live]
