"""Rubric inference recognizes what the references are, and the judge then ranks checkpoints
as the task's exact metric does: generated answers of known exact accuracy for each kind of
task (labels, JSON, tool calls, free text) must score in the exact metric's order."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from typing import Any

import pytest

from factory.evals import Answer, EmbeddedJudge, EvalItem, Rubric, answer_from_message
from factory.evals.rubric import check_answer, closed_labels, infer_rubric
from factory.tasks import agent_orders, support_extract

LEVELS = (0.0, 0.25, 0.5, 0.75, 1.0)
"""Exact accuracies of the generated checkpoints (0.0 is a base model that writes prose)."""


@pytest.fixture(scope="module")
def judge() -> EmbeddedJudge:
    return EmbeddedJudge()


def _items(prompts: Sequence[str], refs: Sequence[Answer],
           tools: list[dict[str, Any]] | None = None) -> list[EvalItem]:
    return [EvalItem(sample_id=f"s{i:03d}", messages=[{"role": "user", "content": p}],
                     tools=tools or [], reference=r)
            for i, (p, r) in enumerate(zip(prompts, refs, strict=True))]


def _right(n: int, level: float, seed: int) -> list[bool]:
    """Which of ``n`` answers are right: exactly ``round(level * n)``, in random places."""
    k = round(level * n)
    marks = [True] * k + [False] * (n - k)
    random.Random(seed).shuffle(marks)
    return marks


def _assert_ranks_like_exact(judge: EmbeddedJudge, rubric: Rubric, items: list[EvalItem],
                             checkpoints: list[list[Answer]], exacts: list[float]
                             ) -> list[float]:
    """The judge's mean score of each checkpoint, asserted to order them as ``exacts`` (each
    checkpoint's exact metric) does."""
    means = []
    for answers in checkpoints:
        rows = judge.score(rubric, items, answers)
        assert all(r.status == "ok" and r.score is not None for r in rows)
        means.append(sum(float(r.score or 0.0) for r in rows) / len(rows))
    assert len(set(exacts)) == len(exacts) and len(set(means)) == len(means)
    assert sorted(range(len(means)), key=lambda k: means[k]) == \
        sorted(range(len(exacts)), key=lambda k: exacts[k])
    return means


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def test_labels_are_checked_exactly_and_a_wrong_label_scores_zero(judge: EmbeddedJudge
                                                                   ) -> None:
    labels = support_extract.INTENTS[:5]  # a 5-way classification
    rng = random.Random(0)
    gold = [rng.choice(labels) for _ in range(40)]
    items = _items([f"Ticket {i}: classify it." for i in range(40)], [Answer(text=g) for g in gold])
    rubric = infer_rubric([i.reference for i in items])
    assert rubric.kind == "labels"
    assert [c.check for c in rubric.criteria] == ["label_match"]
    assert rubric.criteria[0].params["labels"] == sorted(labels)

    checkpoints = []
    for k, level in enumerate(LEVELS):
        answers = []
        for g, right in zip(gold, _right(len(gold), level, seed=k), strict=True):
            if level == 0.0:  # the base model answers in sentences
                answers.append(Answer(text=f"The customer is writing about {g.replace('_', ' ')}."))
            else:
                answers.append(Answer(text=g if right else next(x for x in labels if x != g)))
        checkpoints.append(answers)
    exacts = [_mean([float(a.text == g) for a, g in zip(c, gold, strict=True)])
              for c in checkpoints]
    assert exacts == list(LEVELS)
    means = _assert_ranks_like_exact(judge, rubric, items, checkpoints, exacts)
    assert means == pytest.approx(exacts)  # the score is the accuracy
    wrong = check_answer(rubric.criteria[0], Answer(text="refund"), Answer(text="bug_report"))
    assert wrong == (0.0, "answered 'refund', expected 'bug_report'")
    assert check_answer(rubric.criteria[0], Answer(text=" Refund."), Answer(text="refund"))[0] \
        == 1.0
    # without a reference (rejection sampling): one of the labels
    assert check_answer(rubric.criteria[0], Answer(text="refund"), None)[0] == 1.0
    assert check_answer(rubric.criteria[0], Answer(text="a refund please"), None)[0] == 0.0


def test_json_scores_the_field_accuracy(judge: EmbeddedJudge) -> None:
    convs = support_extract.generate_conversations(40, seed=3)
    prompts = [c["messages"][1]["content"] for c in convs]
    refs = [c["messages"][2]["content"] for c in convs]
    items = _items(prompts, [Answer(text=r) for r in refs])
    rubric = infer_rubric([i.reference for i in items])
    assert rubric.kind == "json" and [c.check for c in rubric.criteria] == ["json_match"]

    checkpoints = []
    for k, level in enumerate(LEVELS):
        rng = random.Random(k)
        answers = []
        for i, ref in enumerate(refs):
            if level == 0.0:
                answers.append(Answer(text="Here are the details you asked for: " + ref))
                continue
            value = json.loads(ref)
            # level * 4 fields right on average: each field wrong with probability 1 - level
            for field in support_extract.FIELDS:
                if rng.random() >= level:
                    value[field] = f"wrong-{field}-{i}"
            answers.append(Answer(text=json.dumps(value)))
        checkpoints.append(answers)
    exacts = [_mean([support_extract.field_accuracy(a.text, r)
                     for a, r in zip(c, refs, strict=True)]) for c in checkpoints]
    means = _assert_ranks_like_exact(judge, rubric, items, checkpoints, exacts)
    assert means == pytest.approx(exacts)


def test_tool_calls_are_checked_by_name_and_exact_arguments(judge: EmbeddedJudge) -> None:
    held = agent_orders.generate_heldout(60, seed=1)
    items, expected = [], []
    for i, h in enumerate(held):
        exp = h["expected"]
        ref = Answer(text="Happy to help with that.") if exp["name"] is None else Answer(
            text="", tool_calls=((exp["name"], json.dumps(exp["arguments"], sort_keys=True)),))
        items.append(EvalItem(sample_id=f"s{i:03d}", messages=h["messages"],
                              tools=agent_orders.TOOLS, reference=ref))
        expected.append(exp)
    rubric = infer_rubric([i.reference for i in items], tools=[i.tools for i in items])
    assert rubric.kind == "tool_calls" and [c.check for c in rubric.criteria] == [
        "tool_call_match"]

    def call(name: str, args: dict[str, Any]) -> dict[str, Any]:
        # keys in another order and spaced: the same arguments to an exact check
        text = json.dumps(dict(reversed(list(args.items()))), indent=1)
        return {"role": "assistant", "content": None,
                "tool_calls": [{"id": "c0", "type": "function",
                                "function": {"name": name, "arguments": text}}]}

    messages: list[list[dict[str, Any]]] = []
    for k, level in enumerate(LEVELS):
        out = []
        for exp, right in zip(expected, _right(len(expected), level, seed=k), strict=True):
            if level == 0.0:
                out.append({"role": "assistant", "content": "I will look into your order."})
            elif exp["name"] is None:
                out.append({"role": "assistant", "content": "You're welcome!"} if right else
                           call("get_order_status", {"order_id": "000000"}))
            elif right:
                out.append(call(exp["name"], exp["arguments"]))
            elif k % 2:  # the right tool with one argument off
                wrong = dict(exp["arguments"], order_id="999999")
                out.append(call(exp["name"], wrong))
            else:  # another tool
                other = next(t for t in agent_orders.TOOL_NAMES if t != exp["name"])
                out.append(call(other, exp["arguments"]))
        messages.append(out)
    checkpoints = [[answer_from_message(m) for m in c] for c in messages]
    exacts = [_mean([float(agent_orders.exact_tool_call(e, m))
                     for e, m in zip(expected, c, strict=True)]) for c in messages]
    means = _assert_ranks_like_exact(judge, rubric, items, checkpoints, exacts)
    assert means == pytest.approx(exacts)


def test_free_text_is_scored_by_similarity_in_the_exact_order(judge: EmbeddedJudge) -> None:
    convs = [c for c in agent_orders.generate_conversations(200, seed=2)
             if c["kind"] != "call"][:30]
    refs = [c["messages"][-1]["content"] for c in convs]
    intents = [c["intent"] for c in convs]
    items = _items([c["messages"][1]["content"] for c in convs], [Answer(text=r) for r in refs])
    rubric = infer_rubric([i.reference for i in items])
    assert rubric.kind == "free_text"
    assert "reference_similarity" in [c.check for c in rubric.criteria]

    checkpoints = []
    for k, level in enumerate((0.0, 0.5, 1.0)):
        answers = []
        for j, right in enumerate(_right(len(refs), level, seed=k)):
            # a wrong answer is a fluent answer to another request
            other = next(r for r, t in zip(refs, intents, strict=True) if t != intents[j])
            answers.append(Answer(text=refs[j] if right else other))
        checkpoints.append(answers)
    exacts = [_mean([float(a.text == r) for a, r in zip(c, refs, strict=True)])
              for c in checkpoints]
    _assert_ranks_like_exact(judge, rubric, items, checkpoints, exacts)


def test_label_detection_needs_a_closed_set() -> None:
    assert closed_labels(["spam", "ham", "Spam.", "ham", "spam", "ham"]) == ["ham", "spam"]
    # short answers that do not repeat are free text, not labels
    assert closed_labels(["Paris", "Berlin", "Tokyo", "Lima", "Oslo", "Rome"]) is None
    assert closed_labels(["The order ships on Monday, as the tracking page says.",
                          "ham", "ham"]) is None


def test_stored_rubrics_load_and_score_as_before() -> None:
    stored = {"version": "ignored", "source": "auto", "num_examples": 30, "criteria": [
        {"name": "json_valid", "check": "json_valid", "description": "d", "weight": 1.0,
         "params": {}},
        {"name": "json_fields_match", "check": "json_fields_match", "description": "d",
         "weight": 2.0, "params": {}},
        {"name": "single_line", "check": "single_line", "description": "d", "weight": 0.5,
         "params": {}}]}
    rubric = Rubric.from_dict(json.loads(json.dumps(stored)))
    assert rubric.kind == "json" and rubric.source == "auto"
    ref = Answer(text='{"a":"x","b":"y"}')
    half = Answer(text='{"a":"X ","b":"z"}')
    scores = [check_answer(c, half, ref)[0] for c in rubric.criteria]
    assert scores == [1.0, 0.5, 1.0]
