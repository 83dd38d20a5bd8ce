"""``factory demo --experiment``: the demo runs on either embedded base model, and refuses any
other recipe before any work."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from factory.app.cli import main
from factory.app.demo import demo_project
from factory.errors import FactoryError
from factory.experiments import load_experiment

ROOT = Path(__file__).resolve().parents[2]


def test_the_demo_experiments_are_the_same_task_on_each_embedded_base() -> None:
    smol = load_experiment(ROOT / "experiments" / "demo-extract.yaml")
    gemma = load_experiment(ROOT / "experiments" / "demo-extract-gemma.yaml")
    assert (smol.recipe, gemma.recipe) == ("smollm2-135m-lora", "gemma3-270m-lora")
    # The same task and cleaning on traffic of its own: a demo home of one finds no samples
    # for the other, whose training the experiments sensor would otherwise start beside it.
    assert (demo_project(smol), demo_project(gemma)) == ("demo", "demo-gemma")
    assert replace(smol.data, where="") == replace(gemma.data, where="")


def test_demo_refuses_a_recipe_without_embedded_weights(
        factory_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    experiments = tmp_path / "experiments"
    experiments.mkdir()
    spec = yaml.safe_load((ROOT / "experiments" / "demo-extract.yaml").read_text())
    (experiments / "demo-qwen.yaml").write_text(
        yaml.safe_dump({**spec, "name": "demo-qwen", "recipe": "qwen3-0.6b-lora"}))
    monkeypatch.setenv("FACTORY_EXPERIMENTS_DIR", str(experiments))
    assert main(["demo", "--experiment", "demo-qwen"]) != 0
    err = capsys.readouterr().err
    assert "demo-qwen's recipe qwen3-0.6b-lora is not one of the embedded base models" in err
    # Refused before any work: no traffic generated or captured.
    assert not any((factory_home / "uploads").glob("demo-traffic-*"))


def test_a_demo_experiment_selects_one_project_tag() -> None:
    smol = load_experiment(ROOT / "experiments" / "demo-extract.yaml")
    other = replace(smol, data=replace(smol.data, where="model = 'gpt-4o'"))
    with pytest.raises(FactoryError, match="must select its samples with data.where"):
        demo_project(other)


def test_a_fresh_answer_is_right_when_every_field_of_the_reference_is() -> None:
    from factory.app.demo import FRESH_SEED_OFFSET, same_answer
    from factory.tasks import generate_records

    record = generate_records(1, FRESH_SEED_OFFSET)[0]
    reference = json.loads(record["response"]["choices"][0]["message"]["content"])
    assert same_answer(json.dumps(reference), record)
    # Key order and spacing aside; a wrong value, a missing key, prose or no JSON: wrong.
    assert same_answer(" " + json.dumps(dict(reversed(list(reference.items()))), indent=1),
                       record)
    assert not same_answer(json.dumps({**reference, "intent": "refund_x"}), record)
    assert not same_answer(json.dumps({k: v for k, v in reference.items() if k != "email"}),
                           record)
    assert not same_answer("The sender is " + str(reference.get("name")), record)
