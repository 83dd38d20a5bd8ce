"""Eval answers constrained to a closed task's answer set (``eval.constrain``).

The answer set comes from the rubric inferred from the references (labels, a JSON shape); the
answers come from the real CPU server on the random-init tiny model, whose free answers are
noise: with the constraint every triage answer is one of the labels.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from transformers import AutoTokenizer

from factory.evals.answers import (
    build_rubric,
    eval_constraint,
    generate_answers,
    items_from_samples,
)
from factory.evals.judging import answer_constraint
from factory.evals.rubric import (
    Answer,
    check_answer,
    infer_rubric,
    normalize_label,
    structured_outputs,
)
from factory.experiments import CONSTRAIN_AUTO
from factory.inference import InferenceServer
from factory.inference.constrain import build_constraint, parse_structured_outputs
from factory.tasks import generate_conversations, ticket_triage


def _rows(convs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"sample_id": f"s{i:03d}", "tools": "[]",
             "messages": json.dumps([{"role": m["role"],
                                      "content": [{"type": "text", "text": m["content"]}]}
                                     for m in c["messages"]])}
            for i, c in enumerate(convs)]


def test_a_label_task_is_closed_over_its_labels_in_every_casing() -> None:
    rubric = infer_rubric([Answer(text=x) for x in ["billing", "Bug", "shipping", "bug"] * 3])
    out = structured_outputs(rubric)
    assert out is not None
    assert {normalize_label(c) for c in out["choice"]} == {"billing", "bug", "shipping"}
    assert {"billing", "Billing", "BUG", "Bug"} <= set(out["choice"])
    assert eval_constraint(rubric, "on") == out
    assert eval_constraint(rubric, "off") is None
    assert "choice" in CONSTRAIN_AUTO and eval_constraint(rubric, "auto") == out  # measured
    with pytest.raises(ValueError, match="eval.constrain: must be auto, on or off"):
        eval_constraint(rubric, "yes")


def test_a_run_is_constrained_as_its_plan_recorded() -> None:
    rubric = infer_rubric([Answer(text=x) for x in ["billing", "bug", "shipping"] * 3])
    recorded = {"every_steps": None, "judge": "embedded", "rubric": "auto",
                "max_samples": None}
    assert answer_constraint(rubric, {"eval": {**recorded, "constrain": "on"}}, "x") == \
        structured_outputs(rubric)
    assert answer_constraint(rubric, {"eval": {**recorded, "constrain": "off"}}, "x") is None
    assert answer_constraint(rubric, {"eval": recorded}, "x") is None  # planned before the field
    # ``auto`` means what the plan recorded: on for labels now, off in a plan made before.
    assert answer_constraint(rubric, {"eval": {**recorded, "constrain": "auto",
                                               "constrain_auto": ["choice"]}}, "x") == \
        structured_outputs(rubric)
    assert answer_constraint(rubric, {"eval": {**recorded, "constrain": "auto"}}, "x") is None


def test_a_json_task_is_closed_over_its_keys_in_the_references_order(tiny_model_dir: Path
                                                                       ) -> None:
    refs = [json.dumps({"name": f"N{i}", "email": f"n{i}@x.io", "company": "Acme",
                        "intent": "refund"}, separators=(",", ":")) for i in range(10)]
    rubric = infer_rubric([Answer(text=r) for r in refs])
    assert rubric.criteria[0].params["required"] == ["name", "email", "company", "intent"]
    out = structured_outputs(rubric)
    assert out is not None
    schema = out["json"]
    assert list(schema["properties"]) == ["name", "email", "company", "intent"]
    jsonschema.validate(json.loads(refs[0]), schema)
    assert eval_constraint(rubric, "auto") is None  # JSON: not measured on a dev split, off
    assert eval_constraint(rubric, "on") == out
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**json.loads(refs[0]), "name": 3}, schema)  # the references' type
    # the grammar the server builds from it takes a reference, compact or spaced
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    spec = parse_structured_outputs(out)
    assert spec is not None
    for text in [refs[1], '{"name": "A", "email": "a@b.c", "company": "X", "intent": "bug"}']:
        assert _accepts(build_constraint(spec, tok, [tok.eos_token_id]), tok, text), text
    for bad in ['{"name":"A","email":"a@b.c","company":"X","intent":"bug","colour":"red"}',
                '{"name":"A"}', "refund"]:  # a key no reference has, a missing one, no JSON
        assert not _accepts(build_constraint(spec, tok, [tok.eos_token_id]), tok, bad), bad


def _accepts(constraint: Any, tok: Any, text: str) -> bool:
    """Whether ``constraint`` lets ``text``'s tokens through, then the end of the answer."""
    for t in tok(text, add_special_tokens=False)["input_ids"]:
        if not constraint.mask()[t]:
            return False
        constraint.advance(t)
    return bool(constraint.mask()[tok.eos_token_id])


def test_tool_call_and_free_text_tasks_are_not_constrained() -> None:
    calls = [Answer(text="", tool_calls=(("lookup", '{"id":1}'),))] * 3
    assert structured_outputs(infer_rubric(calls)) is None
    prose = [Answer(text=c["messages"][-1]["content"] + " and some more words to say here")
             for c in generate_conversations(6, seed=1)]
    assert structured_outputs(infer_rubric(prose)) is None


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[InferenceServer]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    with InferenceServer(tiny_model_dir, served_model_name="base", log_path=log,
                         startup_timeout_s=240, threads=1) as s:
        yield s


def test_constrained_triage_answers_are_always_labels(server: InferenceServer) -> None:
    items = items_from_samples(_rows(ticket_triage.generate_conversations(20, seed=3)))
    rubric = build_rubric(items)  # 5 labels: a label set needs twice as many references
    assert rubric.kind == "labels"
    items = items[:8]
    criterion = rubric.criteria[0]
    client = server.client()
    try:
        free = generate_answers(client, "base", items[:2], max_tokens=8, concurrency=2)
        answers = generate_answers(client, "base", items, max_tokens=16, concurrency=4,
                                   constraint=eval_constraint(rubric, "on"))
    finally:
        client.close()
    assert all(check_answer(criterion, a.answer, None)[0] == 0.0 for a in free)  # noise
    for a in answers:
        score, assessment = check_answer(criterion, a.answer, None)
        assert score == 1.0, assessment
        assert a.finish_reason == "stop"
