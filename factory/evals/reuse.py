"""Base-model and reference scores judged once per experiment and eval set, not once per run.

The base model's answers (step 0) and the reference answers score the same under every run of
an experiment that judges the same eval samples with the same rubric version: sweep points,
reruns and retrains on an unchanged dataset. A run's first eval copies those rows from the
newest run that has all of them (the eval set's ``sample_id``s exactly, status ``ok`` or not),
instead of booting generation for the base model again. ``same_generation`` lets the caller
refuse a source run whose base answers were generated differently (another base model or
token budget); reference rows involve no generation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any


def borrow_scores(session: Any, *, kind: str, run_id: str, experiment: str,
                  rubric_version: str, sample_ids: Sequence[str],
                  same_generation: Callable[[str], bool] = lambda _run: True) -> str | None:
    """Copy another run's ``kind`` rows (``base`` or ``reference``) into ``run_id``; the source
    run's id, or None when no run qualifies (the caller then judges them itself)."""
    if not session.lake.exists("eval_scores") or not sample_ids:
        return None
    wanted = sorted(sample_ids)
    candidates = session.sql(
        "SELECT run_id, max(evaluated_at) AS newest FROM eval_scores WHERE experiment = ? "
        "AND kind = ? AND rubric_version = ? AND run_id <> ? GROUP BY run_id ORDER BY newest DESC",
        [experiment, kind, rubric_version, run_id]).to_pylist()
    for cand in candidates:
        rows = session.sql(
            "SELECT * FROM eval_scores WHERE run_id = ? AND kind = ? AND rubric_version = ? "
            "ORDER BY sample_id", [cand["run_id"], kind, rubric_version]).to_pylist()
        if sorted(r["sample_id"] for r in rows) != wanted:
            continue
        if kind == "base" and not same_generation(cand["run_id"]):
            continue
        now = datetime.now(UTC)
        session.append("eval_scores", [{**r, "run_id": run_id, "evaluated_at": now}
                                       for r in rows])
        return str(cand["run_id"])
    return None
