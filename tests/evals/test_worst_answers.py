"""The lowest-scored answers shown beside a checkpoint's score."""

from __future__ import annotations

from factory.evals.answers import answer_text, worst_answers
from factory.evals.judges import EvalItem, ScoreRow
from factory.evals.rubric import Answer


def _row(sid: str, score: float | None, assessment: str = "ok") -> ScoreRow:
    return ScoreRow(sample_id=sid, score=score, status="ok" if score is not None else "failed",
                    judge="test", criteria={}, assessment=assessment,
                    error=None if score is not None else "timeout")


def test_lowest_first_failed_before_all_with_both_answers() -> None:
    items = [EvalItem(sample_id=f"s{i}",
                      messages=[{"role": "system", "content": "Route it."},
                                {"role": "user",
                                 "content": [{"type": "text", "text": f"ticket | {i}"}]}],
                      reference=Answer(text="billing")) for i in range(4)]
    answers = [Answer(text="billing"), Answer(text="bug"),
               Answer(text="", tool_calls=(("refund", '{"amount": 5}'),)), Answer(text="x")]
    scored = [_row("s0", 1.0), _row("s1", 0.0, "wrong label"), _row("s2", 0.5),
              _row("s3", None)]
    lines = worst_answers(items, answers, scored, k=3).splitlines()
    assert lines[2:] == [
        "| ticket \\| 3 | billing | x | failed | timeout |",
        "| ticket \\| 1 | billing | bug | 0.00 | wrong label |",
        '| ticket \\| 2 | billing | refund({"amount": 5}) | 0.50 | ok |',
    ]
    assert answer_text(Answer(text=" hi ", tool_calls=(("f", "{}"),))) == "hi f({})"
