"""A run's first eval reuses the base-model and reference scores of an earlier run of the same
experiment that judged the same eval samples under the same rubric (real lake)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from factory.evals.reuse import borrow_scores
from factory.lake import Lake, LakeSession, Lineage


def _rows(run_id: str, kind: str, samples: list[str], rubric: str = "v1",
          experiment: str = "support") -> list[dict[str, object]]:
    return [{"run_id": run_id, "experiment": experiment, "step": 0 if kind == "base" else None,
             "kind": kind, "rubric_version": rubric, "sample_id": s, "response": f"{kind} {s}",
             "score": 0.25 + i / 10, "status": "ok", "judge": "embedded",
             "evaluated_at": datetime.now(UTC)} for i, s in enumerate(samples)]


def _session(home: Path) -> LakeSession:
    return LakeSession(Lake(), Lineage(run_id="dagster-run", asset_key="checkpoint_evals"))


def test_the_second_run_copies_the_first_runs_base_and_reference_rows(factory_home: Path) -> None:
    session = _session(factory_home)
    samples = ["s1", "s2", "s3"]
    session.append("eval_scores", _rows("run-a", "base", samples) + _rows("run-a", "reference", samples))

    for kind in ("base", "reference"):
        assert borrow_scores(session, kind=kind, run_id="run-b", experiment="support",
                             rubric_version="v1", sample_ids=samples) == "run-a"
    got = session.sql("SELECT kind, sample_id, score, response FROM eval_scores "
                      "WHERE run_id = 'run-b' ORDER BY kind, sample_id").to_pylist()
    want = session.sql("SELECT kind, sample_id, score, response FROM eval_scores "
                       "WHERE run_id = 'run-a' ORDER BY kind, sample_id").to_pylist()
    assert got == want and len(got) == 6


def test_nothing_is_borrowed_from_another_eval_set_rubric_experiment_or_generation(
        factory_home: Path) -> None:
    session = _session(factory_home)
    session.append("eval_scores", _rows("run-a", "base", ["s1", "s2"]))

    def borrow(**kw: object) -> str | None:
        args = {"kind": "base", "run_id": "run-b", "experiment": "support",
                "rubric_version": "v1", "sample_ids": ["s1", "s2"], **kw}
        return borrow_scores(session, **args)  # type: ignore[arg-type]

    assert borrow(sample_ids=["s1", "s2", "s3"]) is None        # a new dataset snapshot
    assert borrow(rubric_version="v2") is None                  # another rubric
    assert borrow(experiment="other") is None
    assert borrow(same_generation=lambda run: run != "run-a") is None   # another base model
    assert borrow(run_id="run-a") is None                        # never from itself
    assert session.sql("SELECT count(*) AS n FROM eval_scores WHERE run_id = 'run-b'"
                       ).to_pylist() == [{"n": 0}]
    assert borrow() == "run-a"
