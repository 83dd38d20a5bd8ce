"""Experiment files: validation with file, line, field and what is allowed; sweeps; run keys."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from factory.experiments import (
    BalanceSpec,
    ExperimentError,
    cron_problem,
    last_cron_tick,
    list_experiments,
    load_experiment,
    run_id,
    run_keys,
    sweep_points,
)

GOOD = """\
name: support-extractor
data: {where: "tags['project'] = 'support'", eval_fraction: 0.1, max_tokens: 2048}
recipe: smollm2-135m-lora
overrides: {learning_rate: 2.0e-4}
eval: {every_steps: 20, judge: embedded, rubric: auto}
sweep: {lora_rank: [8, 16], lora_dropout: [0.0, 0.1, 0.2]}
schedule: "0 3 * * *"
"""


def _write(tmp_path: Path, text: str, name: str = "support-extractor.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_issue_example_loads(tmp_path: Path) -> None:
    e = load_experiment(_write(tmp_path, GOOD))
    assert e.name == "support-extractor" and e.recipe == "smollm2-135m-lora"
    assert e.data.where == "tags['project'] = 'support'" and e.data.max_tokens == 2048
    assert e.overrides == {"learning_rate": 2.0e-4}
    assert e.eval.every_steps == 20 and e.schedule == "0 3 * * *"
    assert len(sweep_points(e)) == 6


def test_eval_constrain_parses_and_defaults_to_auto(tmp_path: Path) -> None:
    assert load_experiment(_write(tmp_path, GOOD)).eval.constrain == "auto"
    on = GOOD.replace("judge: embedded", "judge: embedded, constrain: on")
    assert load_experiment(_write(tmp_path, on)).eval.constrain == "on"
    quoted = GOOD.replace("judge: embedded", "judge: embedded, constrain: 'off'")
    assert load_experiment(_write(tmp_path, quoted)).eval.constrain == "off"


def test_shadow_deploy_policy(tmp_path: Path) -> None:
    e = load_experiment(_write(tmp_path, GOOD + "deploy: {shadow: {route: gpt-4o-mini, "
                                                "share: 0.2, agreement: 0.95}}\n"))
    assert e.deploy == "shadow" and e.shadow is not None
    assert (e.shadow.route, e.shadow.share, e.shadow.agreement, e.shadow.min_pairs,
            e.shadow.pass_score) == ("gpt-4o-mini", 0.2, 0.95, 200, None)
    assert load_experiment(_write(tmp_path, GOOD)).shadow is None


def test_load_by_name_from_experiments_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FACTORY_EXPERIMENTS_DIR", str(tmp_path))
    _write(tmp_path, GOOD)
    assert load_experiment("support-extractor").path == tmp_path / "support-extractor.yaml"
    assert [e.name for e in list_experiments()] == ["support-extractor"]
    with pytest.raises(ExperimentError, match="no experiment 'nope'.*support-extractor"):
        load_experiment("nope")


@pytest.mark.parametrize(("bad", "expected"), [
    (GOOD.replace("eval_fraction", "eval_fracton"),
     r":2: data.eval_fracton: unknown key 'eval_fracton'; did you mean 'eval_fraction'\?"),
    (GOOD.replace("learning_rate: 2.0e-4", "learnig_rate: 2.0e-4"),
     r":4: overrides.learnig_rate: unknown key .*did you mean 'learning_rate'\?"),
    (GOOD.replace("recipe: smollm2-135m-lora", "recipe: smollm2-135m"),
     r":3: recipe: unknown recipe 'smollm2-135m'; did you mean 'smollm2-135m-lora'\?"),
    (GOOD.replace("lora_rank: [8, 16]", "lora_rank: [8, -1]"),
     r":6: sweep.lora_rank.1: got -1; allowed: a positive integer"),
    (GOOD.replace('"0 3 * * *"', '"0 25 * * *"'), r":7: schedule: hour 25 outside 0-23"),
    (GOOD.replace("eval_fraction: 0.1", "eval_fraction: 1.5"),
     r":2: data.eval_fraction: got 1.5; allowed: a number in \(0, 1\)"),
    (GOOD + "colour: blue\n", r":8: colour: unknown key 'colour'"),
    (GOOD.replace("eval_fraction: 0.1", "eval_fraction: 0.1, engine: duckdb"),
     r":2: data.engine: got 'duckdb'; allowed: embedded or spark"),
    (GOOD.replace("every_steps: 20", "every_steps: often"),
     r":5: eval.every_steps: got 'often'"),
    (GOOD.replace("overrides: {learning_rate: 2.0e-4}", "overrides: {lora_rank: 4}"),
     r"sweep.lora_rank: 'lora_rank' is both overridden and swept"),
    (GOOD + "deploy: {shadow: {share: 0.2}}\n",
     r":8: deploy.shadow.route: got None; allowed: the model name clients send"),
    (GOOD + "deploy: {shadow: {route: gpt-4o-mini, agreement: 95}}\n",
     r"deploy.shadow.agreement: got 95; allowed: a number in \[0, 1\]"),
    (GOOD + "deploy: {shadow: {route: gpt-4o-mini, min_pair: 20}}\n",
     r"deploy.shadow.min_pair: unknown key 'min_pair'; did you mean 'min_pairs'\?"),
    (GOOD + "deploy: sometimes\n", r"deploy: got 'sometimes'; allowed: auto"),
    (GOOD.replace("learning_rate: 2.0e-4", "parallelism: fsdp3"),
     r":4: overrides.parallelism: got 'fsdp3'; allowed: single or fsdp2$"),
    (GOOD.replace("learning_rate: 2.0e-4", "num_steps: 2.0"),
     r":4: overrides.num_steps: got 2.0; allowed: a positive integer \(optimizer steps\)$"),
    (GOOD.replace("lora_rank: [8, 16]", "lora_rank: 8"),
     r":6: sweep.lora_rank: got 8; allowed: a non-empty list of values$"),
    (GOOD.replace("max_tokens: 2048}", "max_tokens: 2048, drop: [refusl]}"),
     r":2: data.drop.0: unknown detector 'refusl'; did you mean 'refusal'\? allowed: refusal"),
    (GOOD.replace("judge: embedded", "judge: embedded, colour: 1"),
     r":5: eval.colour: unknown key 'colour'; allowed: every_steps, judge, rubric, max_samples, "
     r"constrain$"),
    (GOOD.replace("judge: embedded", "judge: embedded, constrain: sometimes"),
     r":5: eval.constrain: got 'sometimes'; allowed: auto, on \(answers of a closed task "
     r"constrained to its labels or JSON shape\) or off$"),
    (GOOD.replace("rubric: auto}", "rubric: auto,\n       constrain: onn}"),
     r":6: eval.constrain: got 'onn'; did you mean 'on'\? allowed: auto, on"),
    (GOOD + "deploy: {}\n", r":8: deploy.shadow: must be a mapping with at least 'route'"),
    (GOOD.replace("name: support-extractor", "name: Support!"),
     r":1: name: got 'Support!'; allowed: lowercase letters"),
    ("name: x\nrecipe: [unclosed\n", r"not valid YAML"),
    ("- a\n- b\n", r":1: \(top level\): an experiment file must be a mapping"),
])
def test_errors_name_file_line_field_and_allowed(tmp_path: Path, bad: str, expected: str) -> None:
    path = _write(tmp_path, bad)
    with pytest.raises(ExperimentError, match=expected) as info:
        load_experiment(path)
    assert str(info.value).startswith(str(path))


def test_run_keys_stable_and_order_independent(tmp_path: Path) -> None:
    a = load_experiment(_write(tmp_path, GOOD))
    swapped = GOOD.replace("sweep: {lora_rank: [8, 16], lora_dropout: [0.0, 0.1, 0.2]}",
                           "sweep: {lora_dropout: [0.0, 0.1, 0.2], lora_rank: [8, 16]}")
    b = load_experiment(_write(tmp_path, swapped, "other.yaml"))
    assert sorted(run_keys(a)) == sorted(run_keys(b))
    assert "support-extractor/lora_dropout=0.1/lora_rank=16" in run_keys(a)
    rid = run_id("support-extractor/lora_dropout=0.1/lora_rank=16")
    assert rid.startswith("support-extractor-lora_dropout-0.1-lora_rank-16-")
    assert rid != run_id("support-extractor/lora_dropout=0.1/lora_rank=8")


def test_cron() -> None:
    assert cron_problem("0 3 * * *") is None and cron_problem("*/15 9-17 * * 1-5") is None
    assert cron_problem("0 3 * *") == "expected 5 fields (minute hour day month weekday), got 4"
    assert cron_problem("0 0 * * * *") == ("expected 5 fields (minute hour day month weekday), "
                                           "got 6")  # croniter's seconds field is not ours
    assert cron_problem("*/0 * * * *") == "bad step '0' in the minute field"
    assert cron_problem("0 3 * * 8") == "day of week 8 outside 0-7"
    assert cron_problem("0 x * * *") == "bad hour 'x'"
    assert cron_problem("@daily") is None and cron_problem("0 3 * * mon-fri") is None


def test_last_cron_tick_is_the_latest_minute_at_or_before_now() -> None:
    now = datetime(2026, 12, 5, 3, 7, 30, tzinfo=UTC)  # a Saturday
    assert last_cron_tick("0 3 * * *", now) == datetime(2026, 12, 5, 3, 0, tzinfo=UTC)
    assert last_cron_tick("7 3 * * *", now) == datetime(2026, 12, 5, 3, 7, tzinfo=UTC)
    assert last_cron_tick("0 9 * * 7", now) == datetime(2026, 11, 29, 9, 0, tzinfo=UTC)
    assert last_cron_tick("0 3 29 2 *", now) is None  # beyond the 8-day lookback


def test_shipped_demo_experiment_is_valid() -> None:
    root = Path(__file__).resolve().parents[2]
    e = load_experiment(root / "experiments" / "demo-extract.yaml")
    assert e.recipe == "smollm2-135m-lora" and run_keys(e) == ["demo-extract"]


MIXED = """\
name: support-extractor
recipe: smollm2-135m-lora
data:
  mix:
    synthetic: 1
    traffic: 6
    "experiment:triage": 1
    "file:general/instructions.jsonl": 2
"""


def test_data_mix_names_sources_with_weights(tmp_path: Path) -> None:
    (tmp_path / "general").mkdir()
    general = tmp_path / "general" / "instructions.jsonl"
    general.write_text('{"messages": []}\n')
    e = load_experiment(_write(tmp_path, MIXED))
    # The primary source (traffic) first, the others as listed; file paths resolved.
    assert [(m.source, m.weight) for m in e.data.mix] == [
        ("traffic", 6.0), ("synthetic", 1.0), ("experiment:triage", 1.0),
        (f"file:{general.resolve()}", 2.0)]
    assert [(m.kind, m.target) for m in e.data.mix][2:] == [
        ("experiment", "triage"), ("file", str(general.resolve()))]
    assert load_experiment(_write(tmp_path, GOOD)).data.mix == ()


@pytest.mark.parametrize(("bad", "expected"), [
    (MIXED.replace("traffic: 6", "trafic: 6"),
     r":6: data.mix.trafic: unknown source 'trafic'; did you mean 'traffic'\? allowed: traffic, "
     r"synthetic, experiment:<name>, file:<path>"),
    (MIXED.replace("traffic: 6", "traffic: 0"),
     r":6: data.mix.traffic: got 0; allowed: a positive number"),
    (MIXED.replace("instructions.jsonl", "missing.jsonl"),
     r":8: data.mix.file:general/missing.jsonl: no such file .*general/missing.jsonl"),
    (MIXED.replace("experiment:triage", "experiment:Triage!"),
     r":7: data.mix.experiment:Triage!: 'Triage!' is not an experiment name"),
    (MIXED.replace("experiment:triage", "experiment:support-extractor"),
     r":7: data.mix.experiment:support-extractor: an experiment cannot mix in its own"),
    (MIXED.replace("""  mix:
    synthetic: 1
    traffic: 6
    "experiment:triage": 1
    "file:general/instructions.jsonl": 2
""", "  mix: [traffic]\n"), r":4: data.mix: got \['traffic'\]; allowed: a mapping of sources"),
])
def test_data_mix_errors_name_the_line(tmp_path: Path, bad: str, expected: str) -> None:
    (tmp_path / "general").mkdir()
    (tmp_path / "general" / "instructions.jsonl").write_text('{"messages": []}\n')
    with pytest.raises(ExperimentError, match=expected):
        load_experiment(_write(tmp_path, bad))


def test_data_balance_groups_the_traffic(tmp_path: Path) -> None:
    head = "name: multi\nrecipe: smollm2-135m-lora\ndata:\n"
    short = load_experiment(_write(tmp_path, head + "  balance: language\n"))
    assert short.data.balance == BalanceSpec(by="language", alpha=0.5)
    full = load_experiment(_write(tmp_path, head + "  balance: {by: language, alpha: 0.3}\n"))
    assert full.data.balance == BalanceSpec(by="language", alpha=0.3)
    # Left out: the planner's default (balanced where the languages are skewed); none: off.
    assert load_experiment(_write(tmp_path, GOOD)).data.balance == BalanceSpec(auto=True)
    assert load_experiment(_write(tmp_path, head + "  balance: none\n")).data.balance is None
    assert load_experiment(_write(tmp_path, head + "  balance: false\n")).data.balance is None


@pytest.mark.parametrize(("bad", "expected"), [
    ("  balance: {by: tool}\n", r":4: data.balance.by: got 'tool'; allowed: language"),
    ("  balance: {by: language, alpha: 2}\n", r":4: data.balance.alpha: got 2; allowed: a "
                                              r"number in \[0, 1\]"),
    ("  balance: {by: language, temprature: 2}\n", r"data.balance.temprature"),
    ("  balance: [language]\n", r":4: data.balance: got \['language'\]; allowed: a column"),
    ("  balance: never\n", r":4: data.balance: got 'never'; allowed: language, or none"),
    ("  balance: {by: language, auto: true}\n", r":4: data.balance.auto: got True"),
    ("  balance: language\n  mix: {synthetic: 1, \"experiment:other\": 1}\n",
     r"data.balance: balance splits the traffic into groups, and data.mix does not name"),
])
def test_data_balance_errors_name_the_line(tmp_path: Path, bad: str, expected: str) -> None:
    head = "name: multi\nrecipe: smollm2-135m-lora\ndata:\n"
    with pytest.raises(ExperimentError, match=expected):
        load_experiment(_write(tmp_path, head + bad))
