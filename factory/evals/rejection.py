"""Rejection sampling for curation: an eval judge scoring training samples' own answers.

Curation (``factory.curation.decide``, step "judge") keeps a sample when its score is at least
``data.judge_threshold``. The score is the sample's last assistant turn judged against the
experiment's rubric reduced to the criteria that need no reference answer (the sample's answer
*is* the candidate reference): JSON validity and schema, tool calls against their declared
argument schemas, length band, language, single line, and, with an LLM judge, the task-specific
``llm`` criteria asked without a reference. The rubric is the experiment file's inline one, or
inferred (``build_rubric``) from the selected samples themselves: a property becomes a criterion
only when at least 80% of the answers share it, so the odd sample out scores low.

A sample the judge fails on (LLM judge out of retries) raises ``JudgeOutputError``: it is never
scored as a silent zero or kept unjudged.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from factory.evals.answers import (
    build_rubric,
    items_from_samples,
    to_openai_messages,
    to_openai_tools,
)
from factory.evals.judges import (
    REFERENCE_CHECKS,
    EmbeddedJudge,
    EvalItem,
    JudgeOutputError,
    answer_from_message,
)
from factory.evals.rubric import Answer, Rubric

MAX_RUBRIC_EXAMPLES = 200
"""Samples the rubric is inferred from (the first by sample_id): enough for 80% majorities."""


def _loads(v: Any) -> Any:
    return json.loads(v) if isinstance(v, str | bytes) else v


def reference_free(rubric: Rubric, *, llm: bool) -> Rubric:
    """``rubric`` without the criteria that compare with a reference (and without ``llm``
    criteria unless the judge is an LLM); ValueError when nothing is left."""
    kept = tuple(c for c in rubric.criteria
                 if c.check not in REFERENCE_CHECKS and (llm or c.check != "llm"))
    if not kept:
        raise ValueError("rejection sampling: the rubric has no criterion that can be checked "
                         "without a reference answer (" + ", ".join(
                             c.name for c in rubric.criteria) + ")")
    return Rubric(criteria=kept, source=rubric.source, num_examples=rubric.num_examples)


def to_item(sample: Mapping[str, Any]) -> tuple[EvalItem, Answer]:
    """A canonical sample (``sample_id``, ``messages``, ``tools``) as (prompt, its own answer)."""
    messages = _loads(sample["messages"]) or []
    last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
    if last is None:
        raise ValueError(f"sample {sample.get('sample_id')}: no assistant turn to judge")
    answer = answer_from_message(messages[last])
    item = EvalItem(sample_id=str(sample.get("sample_id")),
                    messages=to_openai_messages(messages[:last]),
                    tools=to_openai_tools(sample.get("tools")), reference=answer)
    return item, answer


class RejectionJudge:
    """Curation's ``Judge`` (``score(sample) -> float``, plus ``score_many``) over an eval
    judge (``EmbeddedJudge`` or ``LLMJudge``) and a reference-free rubric."""

    def __init__(self, judge: Any, rubric: Rubric) -> None:
        self.judge = judge
        self.rubric = reference_free(rubric, llm=not isinstance(judge, EmbeddedJudge))

    @property
    def name(self) -> str:
        return str(self.judge.name)

    def score(self, sample: Mapping[str, Any]) -> float:
        return self.score_many([sample])[0]

    def score_many(self, samples: Sequence[Mapping[str, Any]]) -> list[float]:
        """Scores (0..1) of the samples' own answers, in order."""
        if not samples:
            return []
        pairs = [to_item(s) for s in samples]
        rows = self.judge.score(self.rubric, [i for i, _ in pairs], [a for _, a in pairs],
                                with_reference=False)
        failed = [r for r in rows if r.score is None]
        if failed:
            raise JudgeOutputError(
                f"rejection sampling: the judge {self.name} failed on {len(failed)} of "
                f"{len(rows)} samples (first: {failed[0].sample_id}: {failed[0].error})")
        return [float(r.score) for r in rows]


def rejection_judge(judge: Any, samples: Iterable[Mapping[str, Any]], *,
                    rubric: Any = "auto", ordered: bool = False) -> RejectionJudge:
    """A ``RejectionJudge`` for ``samples`` (rows with ``sample_id``, ``messages``, ``tools``).

    ``rubric``: an inline rubric mapping (the experiment's ``eval.rubric``) or ``"auto"``:
    inferred from the first ``MAX_RUBRIC_EXAMPLES`` samples with an answer, in ``sample_id``
    order (an LLM judge adds its task-specific criteria). ``ordered``: ``samples`` already come
    in that order, and are read only as far as needed (the Spark engine streams them).
    """
    if isinstance(rubric, Mapping):
        return RejectionJudge(judge, Rubric.from_dict(dict(rubric), source="inline"))
    if rubric != "auto":
        raise ValueError(f"eval.rubric {rubric!r}: named rubrics are not supported; use 'auto' "
                         "or an inline mapping")
    usable = []
    for s in samples if ordered else sorted(samples, key=lambda s: str(s["sample_id"])):
        try:
            usable.extend(items_from_samples([dict(s)]))
        except ValueError:
            continue  # no answer to learn from: curation drops it as empty
        if len(usable) >= MAX_RUBRIC_EXAMPLES:
            break
    if not usable:
        raise ValueError("rejection sampling: no selected sample has an assistant answer to "
                         "infer a rubric from")
    return RejectionJudge(judge, build_rubric(usable, judge=judge))
