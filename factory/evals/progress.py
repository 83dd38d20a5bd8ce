"""Which checkpoints still wait for their evaluation: the gate before the final choice
(``final_evals`` and ``best_checkpoint``), and which runs it waits for.

A checkpoint is done when ``eval_scores`` holds its scores, or when its ``checkpoint_evals``
run (partition ``<run_id>:<step>``) has ended without them (failed, cancelled, or refused by the
train/serve equivalence check): selection must not wait forever on an evaluation that will not
come, and must not run while one is still to come.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import dagster as dg

from factory.control import checkpoint_partition_key
from factory.dagster_runs import FINISHED


def unscored_checkpoints(instance: dg.DagsterInstance, lake: Any,
                         trainer_runs: list[str]) -> tuple[list[str], int]:
    """(``<run_id>:<step>`` keys of the verified checkpoints of ``trainer_runs`` whose
    evaluation has not ended, number of those checkpoints that are scored)."""
    if not trainer_runs or not lake.exists("checkpoints"):
        return [], 0
    marks = ", ".join("?" for _ in trainer_runs)
    ckpts = lake.sql(f"SELECT DISTINCT run_id, step FROM checkpoints WHERE verified "
                     f"AND run_id IN ({marks})", trainer_runs).to_pylist()
    scored: set[tuple[str, int]] = set()
    if lake.exists("eval_scores"):
        scored = {(r["run_id"], int(r["step"])) for r in lake.sql(
            f"SELECT DISTINCT run_id, step FROM eval_scores WHERE kind = 'checkpoint' "
            f"AND run_id IN ({marks})", trainer_runs).to_pylist()}
    pending = []
    for r in ckpts:
        if (r["run_id"], int(r["step"])) in scored:
            continue
        key = checkpoint_partition_key(r["run_id"], r["step"])
        ended = instance.get_runs(
            filters=dg.RunsFilter(tags={"dagster/partition": key}, statuses=list(FINISHED)), limit=1)
        if not ended:
            pending.append(key)
    return sorted(pending), len(scored)


def runs_to_wait_for(lake: Any, experiment: str, runs: Sequence[str]) -> list[str]:
    """The trainer runs whose checkpoints must all be scored before a choice: ``runs`` (a
    chain's, as ``chain_sensor`` passes them), else every finished run of ``experiment``."""
    if runs:
        return sorted(set(runs))
    if not lake.exists("training_runs"):
        return []
    return sorted({r["run_id"] for r in lake.sql(
        "SELECT run_id FROM training_runs WHERE experiment = ? AND status = 'finished'",
        [experiment]).to_pylist()})
