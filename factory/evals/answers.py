"""From eval samples to scored answers: prompts out of canonical samples, answers from a server,
scores from a judge. Used by the ``checkpoint_evals`` asset, the demo and the tests.

Answers of a closed task (labels, JSON) may be generated under a constraint to its answer set
(``eval_constraint``: the experiment's ``eval.constrain`` and the rubric's
``structured_outputs``), sent as the serving protocol's ``structured_outputs``, which the CPU
server and vLLM both enforce.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from factory.evals.judges import EvalItem, LLMJudge, ScoreRow, answer_from_message
from factory.evals.rubric import Answer, Criterion, Rubric, infer_rubric, structured_outputs
from factory.experiments import CONSTRAIN_AUTO


def eval_constraint(rubric: Rubric, mode: str, *,
                    auto: frozenset[str] = CONSTRAIN_AUTO) -> dict[str, Any] | None:
    """The ``structured_outputs`` eval answers are generated under: the rubric's closed answer
    set when ``mode`` (``eval.constrain``) is ``on``, or ``auto`` and the set is of a kind in
    ``auto`` (default ``factory.experiments.CONSTRAIN_AUTO``: what ``auto`` means now; a run
    planned earlier keeps the meaning its plan recorded); None when off or the task is not
    closed (tool calls, free text)."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"eval.constrain: must be auto, on or off, got {mode!r}")
    if mode == "off":
        return None
    out = structured_outputs(rubric)
    if mode == "auto" and (out is None or not set(out) <= auto):
        return None
    return out


def _loads(v: Any) -> Any:
    return json.loads(v) if isinstance(v, str | bytes) else v


def to_openai_messages(messages: Any) -> list[dict[str, Any]]:
    """Canonical messages to OpenAI chat format (tool calls nested under ``function``)."""
    out = []
    for m in _loads(messages):
        msg: dict[str, Any] = {"role": m["role"], "content": m.get("content")}
        if m.get("tool_calls"):
            msg["tool_calls"] = [
                c if "function" in c else
                {"id": c.get("id"), "type": "function",
                 "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in m["tool_calls"]]
        if m.get("tool_call_id"):
            msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
    return out


def to_openai_tools(tools: Any) -> list[dict[str, Any]]:
    return [t if "function" in t else {"type": "function", "function": t}
            for t in (_loads(tools) or [])]


def items_from_samples(rows: Sequence[dict[str, Any]]) -> list[EvalItem]:
    """Eval items from canonical sample rows (``sample_id``, ``messages``, ``tools``): the
    prompt is everything before the last assistant turn, the reference is that turn."""
    items = []
    for row in rows:
        messages = _loads(row["messages"])
        last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"),
                   default=None)
        if last is None or last == 0:
            raise ValueError(f"sample {row.get('sample_id')}: no assistant turn to compare with")
        items.append(EvalItem(sample_id=str(row["sample_id"]),
                              messages=to_openai_messages(messages[:last]),
                              tools=to_openai_tools(row.get("tools")),
                              reference=answer_from_message(messages[last])))
    return items


def build_rubric(items: Sequence[EvalItem], *, judge: Any = None,
                 max_examples: int = 200, references: Sequence[Answer] = ()) -> Rubric:
    """Code-checkable criteria inferred from the references (the first ``max_examples`` items'
    and ``references``, more answers of the task such as its training set's); for free text
    with an ``LLMJudge``, plus the task-specific criteria it writes from a handful of the
    items (labels, JSON and tool calls are checked exactly, and an opinion would only blur
    that)."""
    sample = list(items)[:max_examples]
    rubric = infer_rubric([*(i.reference for i in sample), *references],
                          tools=[i.tools for i in sample])
    if isinstance(judge, LLMJudge) and rubric.kind == "free_text":
        extra = judge.propose_criteria(sample)
        taken = {c.name for c in rubric.criteria}
        added = tuple(Criterion(name=c["name"], description=c["description"], check="llm",
                                weight=c["weight"]) for c in extra if c["name"] not in taken)
        rubric = Rubric(criteria=rubric.criteria + added, source="auto+llm",
                        num_examples=rubric.num_examples)
    return rubric


@dataclass(frozen=True, kw_only=True)
class Generated:
    """One model answer."""

    sample_id: str
    """Which sample."""
    text: str
    """The raw response text (content; tool calls rendered after it)."""
    answer: Answer
    """What the judge looks at."""
    finish_reason: str
    """``stop``, ``length`` or ``tool_calls``."""
    num_completion_tokens: int
    """Tokens generated."""


def generate_answers(client: Any, model: str, items: Sequence[EvalItem], *,
                     max_tokens: int = 256, concurrency: int = 8,
                     constraint: dict[str, Any] | None = None) -> list[Generated]:
    """Ask ``model`` on the server behind ``client`` (``InferenceClient``) for every item,
    ``concurrency`` at a time (the server batches them); ``constraint``: the requests'
    ``structured_outputs`` (``eval_constraint``), None for free answers."""
    extra = {"structured_outputs": constraint} if constraint is not None else {}

    def one(item: EvalItem) -> dict[str, Any]:
        response: dict[str, Any] = client.chat(model, item.messages, tools=item.tools or None,
                                               max_tokens=max_tokens, **extra)
        return response

    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        responses = list(pool.map(one, items))
    out = []
    for item, r in zip(items, responses, strict=True):
        choice = r["choices"][0]
        answer = answer_from_message(choice["message"])
        text = answer.text + "".join(f"\n{n}({a})" for n, a in answer.tool_calls)
        out.append(Generated(sample_id=item.sample_id, text=text, answer=answer,
                             finish_reason=choice.get("finish_reason") or "stop",
                             num_completion_tokens=int(r.get("usage", {})
                                                       .get("completion_tokens", 0))))
    return out


def score_reference(judge: Any, rubric: Rubric, items: Sequence[EvalItem]) -> list[ScoreRow]:
    """The reference answers judged against their own rubric: the bar a checkpoint must beat."""
    return list(judge.score(rubric, items, [i.reference for i in items]))


def answer_text(answer: Answer) -> str:
    """An answer as one line of text: its text, then each tool call as ``name(arguments)``."""
    calls = [f"{name}({args})" for name, args in answer.tool_calls]
    return " ".join(p for p in [answer.text.strip(), *calls] if p)


def _cell(text: str, limit: int = 160) -> str:
    """``text`` for a Markdown table cell: one line, pipes escaped, at most ``limit`` chars."""
    one = " ".join(text.split()).replace("|", "\\|")
    return one if len(one) <= limit else one[:limit - 1] + "…"


def _content_text(content: Any) -> str:
    """A message's content (a string, or canonical/OpenAI parts) as text."""
    if isinstance(content, list):
        return "\n".join(str(p.get("text") or "") for p in content if isinstance(p, dict))
    return str(content or "")


def worst_answers(items: Sequence[EvalItem], answers: Sequence[Answer],
                  scored: Sequence[ScoreRow], *, k: int = 5) -> str:
    """The ``k`` lowest-scored answers as a Markdown table (request, reference, the model's
    answer, score, the judge's assessment): what a person deciding on a checkpoint reads next
    to its score. Failed judgements (score None) come first: nobody knows how good they are."""
    rows = sorted(zip(items, answers, scored, strict=True),
                  key=lambda r: (r[2].score is not None, r[2].score or 0.0, r[0].sample_id))
    lines = ["| request | reference | answer | score | judge |", "|---|---|---|---|---|"]
    for item, answer, row in rows[:k]:
        request = next((_content_text(m.get("content")) for m in reversed(item.messages)
                        if m.get("role") == "user"), "")
        score = "failed" if row.score is None else f"{row.score:.2f}"
        lines.append(f"| {_cell(request)} | {_cell(answer_text(item.reference))} | "
                     f"{_cell(answer_text(answer))} | {score} | "
                     f"{_cell(row.error or row.assessment, 200)} |")
    return "\n".join(lines)
