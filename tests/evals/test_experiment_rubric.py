"""An experiment's rubric made and recorded (``factory.evals.experiment_rubric``) on a real lake:
an inline rubric as written (no judge made for it), ``auto`` inferred from the eval set's
reference answers, and the errors that name the fix."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from factory.evals.experiment_rubric import experiment_rubric
from factory.evals.judges import EmbeddedJudge
from factory.evals.judging import EvalError
from factory.experiments import load_experiment
from factory.lake import Lake
from tests.evals.conftest import write_experiment

HEAD = 'name: support\ndata: {where: "true"}\nrecipe: smollm2-135m-lora\n'


def _session() -> Any:
    return Lake().session(run_id="test", asset_key="rubric")


def _no_judge() -> Any:
    raise AssertionError("an inline rubric needs no judge")


def test_an_inline_rubric_is_recorded_as_written(factory_home: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    write_experiment(factory_home, monkeypatch, HEAD + "eval: {rubric: {criteria: [{name: "
                     "label, description: the right label, check: label_match}]}}\n")
    rubric = experiment_rubric(_session(), load_experiment("support"), judge=_no_judge)
    assert rubric.source == "inline" and [c.name for c in rubric.criteria] == ["label"]
    [row] = Lake().read("rubrics").to_pylist()
    assert (row["experiment"], row["version"], row["source"]) == ("support", rubric.version,
                                                                  "inline")
    assert json.loads(row["rubric"]) == json.loads(rubric.to_json())


def test_auto_infers_the_rubric_from_the_eval_answers(factory_home: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    write_experiment(factory_home, monkeypatch, HEAD + "eval: {rubric: auto}\n")
    session = _session()
    msgs = [json.dumps([{"role": "user", "content": [{"type": "text", "text": f"q{i}"}]},
                        {"role": "assistant", "content": [{"type": "text", "text": label}]}])
            for i, label in enumerate(["yes", "no", "yes", "no"])]

    def eval_set(experiment: str) -> list[dict[str, Any]]:
        return [{"experiment": experiment, "sample_id": f"{experiment}-{i}", "messages": m,
                 "tools": "[]", "split": "eval", "split_group": f"s{i}"}
                for i, m in enumerate(msgs)]

    Lake().append("dataset_eval", eval_set("other"))
    with pytest.raises(EvalError, match="has no eval samples; materialize its dataset first"):
        experiment_rubric(session, load_experiment("support"), judge=EmbeddedJudge)
    Lake().append("dataset_eval", eval_set("support"))
    rubric = experiment_rubric(session, load_experiment("support"), judge=EmbeddedJudge)
    assert rubric.source != "inline" and rubric.num_examples == 4
    assert [r["version"] for r in Lake().read("rubrics").to_pylist()] == [rubric.version]


def test_a_named_rubric_is_refused_with_the_fix(factory_home: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    write_experiment(factory_home, monkeypatch, HEAD + "eval: {rubric: strict}\n")
    with pytest.raises(EvalError, match="eval.rubric 'strict': named rubrics are not supported; "
                                        "use 'auto' or an inline mapping"):
        experiment_rubric(_session(), load_experiment("support"), judge=_no_judge)
    assert not Lake().exists("rubrics")


def test_labels_that_repeat_only_across_the_training_set_are_labels(
        factory_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A phrasing split of a many-label task can hold each label once in the eval set
    (CLINC150 at 10 a intent); the training answers make them repeat, so the rubric checks the
    exact label, offers every one (also a label the eval set lacks) and constrains to them."""
    from factory.evals.rubric import structured_outputs

    write_experiment(factory_home, monkeypatch, HEAD + "eval: {rubric: auto}\n")
    labels = [f"intent_{i:02d}" for i in range(30)]

    def rows(table: str, answers: list[str]) -> list[dict[str, Any]]:
        return [{"experiment": "support", "sample_id": f"{table}-{i:03d}",
                 "messages": json.dumps([{"role": "user", "content": f"q{i}"},
                                         {"role": "assistant", "content": a}]),
                 "tools": "[]", "split": table, "split_group": f"{table}{i}"}
                for i, a in enumerate(answers)]

    Lake().append("dataset_eval", rows("eval", labels[:20]))  # once each, 10 labels missing
    alone = experiment_rubric(_session(), load_experiment("support"), judge=EmbeddedJudge)
    assert alone.kind == "free_text"  # what the eval set alone reads as
    Lake().append("dataset_train", rows("train", [label for label in labels for _ in range(9)]))
    rubric = experiment_rubric(_session(), load_experiment("support"), judge=EmbeddedJudge)
    assert rubric.kind == "labels" and rubric.num_examples == 20 + 270
    assert rubric.criteria[0].params["labels"] == labels
    constraint = structured_outputs(rubric)
    assert constraint is not None and "intent_29" in constraint["choice"]
