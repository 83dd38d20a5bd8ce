"""One declaration per training setting: a field added to the trainer's config is an override and
a sweep key, its bad values refused with file and line, and a plan key the planner must decide."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

import factory.planner.plan as plan_module
from factory.experiments import (
    PLAN_KEYS,
    ExperimentError,
    load_experiment,
    parse_experiment,
    train_keys,
    train_settings,
)
from factory.planner import PlanError, make_plan
from factory.planner.render import COMPARE_KEYS
from factory.trainer.config import PARALLELISMS, TrainConfig
from tests.planner.conftest import profile


@dataclass(frozen=True, kw_only=True)
class SmoothedConfig(TrainConfig):
    """The trainer's config with one setting more, as a change to ``TrainConfig`` would add it."""

    label_smoothing: float = field(default=0.0, metadata={"ge": 0, "lt": 1})
    """Share of the target probability spread evenly over the vocabulary."""


SMOOTHED = """\
name: smoothed
recipe: smollm2-135m-lora
overrides:
  label_smoothing: {value}
sweep: {{lora_rank: [8, 16]}}
"""


def test_the_trainer_config_declares_each_setting_once() -> None:
    settings = train_settings()
    assert tuple(settings) == train_keys() == plan_module.TRAIN_KEYS
    assert "base_model" not in settings and "parallelism" in settings
    assert settings["parallelism"].schema["enum"] == list(PARALLELISMS)
    assert settings["parallelism"].doc.startswith("``single`` (one device) or ``fsdp2``")
    assert settings["max_seq_len"].schema["x-allowed"] == "an integer >= 16 (tokens)"
    assert set(COMPARE_KEYS) <= set(PLAN_KEYS)  # the card's sweep columns are plan keys


def test_an_added_field_is_an_override_checked_with_file_and_line(tmp_path: Path) -> None:
    settings = train_settings(SmoothedConfig)
    assert list(settings)[-1] == "label_smoothing"
    assert settings["label_smoothing"].doc == ("Share of the target probability spread evenly "
                                               "over the vocabulary.")
    path = tmp_path / "smoothed.yaml"
    good = SMOOTHED.format(value=0.1)
    assert parse_experiment(good, path, config=SmoothedConfig).overrides == {
        "label_smoothing": 0.1}
    swept = good.replace("overrides:\n  label_smoothing: 0.1\n", "").replace(
        "lora_rank: [8, 16]", "label_smoothing: [0.0, 0.1]")
    assert parse_experiment(swept, path, config=SmoothedConfig).sweep == {
        "label_smoothing": [0.0, 0.1]}
    with pytest.raises(ExperimentError, match=(
            rf"^{path}:4: overrides.label_smoothing: got 1.5; allowed: a number in \[0, 1\)$")):
        parse_experiment(SMOOTHED.format(value=1.5), path, config=SmoothedConfig)
    with pytest.raises(ExperimentError, match=(
            rf"^{path}:4: overrides.label_smoothing: got 'a lot'; allowed: a number in")):
        parse_experiment(SMOOTHED.format(value="a lot"), path, config=SmoothedConfig)
    # The trainer's real config has no such field: the same file is refused, naming the key.
    path.write_text(good)
    with pytest.raises(ExperimentError, match=rf"^{path}:4: overrides.label_smoothing: "
                                              "unknown key 'label_smoothing'"):
        load_experiment(path)


def test_an_added_field_is_a_plan_key_once_a_planner_rule_decides_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    experiment = parse_experiment(SMOOTHED.format(value=0.1), tmp_path / "smoothed.yaml",
                                  config=SmoothedConfig)
    monkeypatch.setattr(plan_module, "TRAIN_KEYS", train_keys(SmoothedConfig))
    assert "label_smoothing" in plan_module.TRAIN_KEYS
    with pytest.raises(PlanError, match="no planner rule decides label_smoothing"):
        make_plan(experiment, profile())
    # The one planner edit: its rule (here a constant among the standing rules).
    monkeypatch.setattr(plan_module, "STANDING_RULES", (
        *plan_module.STANDING_RULES,
        ("label_smoothing", 0.0, "smoothing.none", "hard targets, as the data gives them")))
    plans = [make_plan(experiment, profile(), point=point) for point in ({"lora_rank": 8},
                                                                         {"lora_rank": 16})]
    for plan in plans:
        decision = plan.decisions["label_smoothing"]
        assert (decision.value, decision.overridden) == (0.1, True)
        assert "the planner would pick 0: hard targets" in decision.reason
        config = SmoothedConfig(**plan.train_config())
        config.validate()
        assert config.label_smoothing == 0.1
    plain = parse_experiment("name: plain\nrecipe: smollm2-135m-lora\n",
                             tmp_path / "plain.yaml", config=SmoothedConfig)
    decision = make_plan(plain, profile()).decisions["label_smoothing"]
    assert (decision.value, decision.rule) == (0.0, "smoothing.none")


def test_the_parallelism_rule_refuses_what_overrides_contradict() -> None:
    assert plan_module.parallelism_for(1) == "single" and plan_module.parallelism_for(4) == "fsdp2"
    assert plan_module.parallelism_problem("fsdp2", 4) is None
    assert "set parallelism: fsdp2 or num_devices: 1" in str(
        plan_module.parallelism_problem("single", 2))
    assert "set num_devices: 2 (or more) or parallelism: single" in str(
        plan_module.parallelism_problem("fsdp2", 1))
