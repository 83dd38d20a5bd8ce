"""Every place that shows a person a score prints ``format_score``'s text (mean, 95% interval,
sample count, method): ``factory run``'s summary and progress lines, and ``make demo``'s
closing lines, read back from a real lake as ``best_checkpoint`` and ``checkpoint_evals``
leave it."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from factory.app.client import eval_score
from factory.app.loop import summary
from factory.evals.selection import summarize
from factory.lake import Lake

T0 = datetime(2026, 12, 1, tzinfo=UTC)


def _score(kind: str, step: int, sample: int, score: float) -> dict[str, Any]:
    return {"run_id": "r1", "experiment": "support", "step": step, "kind": kind,
            "rubric_version": "v1", "sample_id": f"s{sample:02d}", "score": score,
            "status": "ok", "judge": "code", "evaluated_at": T0}


def test_the_run_summary_prints_both_scores_with_their_intervals(factory_home: Path) -> None:
    lake = Lake()
    # 20 eval samples: the base model gets 2 right, the checkpoint at step 8 all 20.
    lake.append("eval_scores", [_score("base", 0, i, 1.0 if i < 2 else 0.0) for i in range(20)]
                + [_score("checkpoint", 8, i, 1.0) for i in range(20)])
    best = summarize(8, [1.0] * 20)
    lake.append("best_checkpoints", [{
        "experiment": "support", "run_id": "r1", "step": 8, "path": "/ckpt/r1/8",
        "rubric_version": "v1", "mean_score": best.mean, "ci_low": best.ci_low,
        "ci_high": best.ci_high, "ci_method": best.method, "num_samples": best.num_samples,
        "base_score": 0.1, "reference_score": 1.0, "selected_at": T0}])
    out = summary(lake, "support")
    assert (out["best_score"], out["best_step"]) == (1.0, 8)
    # Never a bare 1.000: the 20 samples behind it bound it at 0.839.
    assert out["best_score_interval"] == "1.000 [0.839, 1.000] n=20 (Wilson)"
    assert out["base_score_interval"] == "0.100 [0.028, 0.301] n=20 (Wilson)"
    assert out["eval_split"] is None  # no dataset profile: nothing to say
    # A dataset held out by split group only: the summary says its scores are recall only.
    reason = "recall only: 3 phrasing clusters of 40 samples, fewer than the 20 ..."
    lake.append("dataset_profile", [{"experiment": "support", "created_at": T0,
                                     "num_train": 36, "num_eval": 4, "eval_split": "recall only",
                                     "eval_split_reason": reason}])
    out = summary(lake, "support")
    assert (out["eval_split"], out["eval_split_reason"]) == ("recall only", reason)


def test_the_progress_line_score_comes_from_the_eval_metadata() -> None:
    meta = {"mean_score": 0.75, "ci_low": 0.5313, "ci_high": 0.8881, "num_samples": 20,
            "ci_method": "wilson", "num_failed": 2}
    assert eval_score(meta) == "0.750 [0.531, 0.888] n=20 +2 judge failures (Wilson)"
    # Not scored (the equivalence check failed): no score to print.
    assert eval_score({"scored": False}) is None
