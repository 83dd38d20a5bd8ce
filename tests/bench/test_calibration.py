"""The calibration bench's pure parts (``bench/calibration.py``): experiment files with planner
defaults, test sets apart from the training data, accuracies with the evals' intervals, and the
tables' gap, interval check and goal on fixed rows. The runs themselves are the bench's."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from bench import calibration as cal
from bench import public_data as pd
from factory.experiments import parse_experiment


@pytest.mark.parametrize("task", list(cal.TASKS))
def test_experiment_file_has_planner_defaults_and_the_seed(task: str) -> None:
    spec = cal.TASKS[task]
    exp = parse_experiment(cal.experiment_yaml(spec, 2, {}), Path(f"{spec.experiment}.yaml"))
    assert exp.name == spec.experiment and exp.overrides == {} and exp.deploy == "auto"
    assert exp.data.seed == 2 and exp.data.where == f"tags['project'] = '{spec.project}'"
    assert exp.eval.every_steps is None and exp.eval.max_samples is None
    plumbing = parse_experiment(cal.experiment_yaml(spec, 0, cal.PLUMBING_OVERRIDES),
                                Path("p.yaml"))
    assert plumbing.overrides == cal.PLUMBING_OVERRIDES
    lever = parse_experiment(cal.experiment_yaml(spec, 1, {}, {"balance": "language"}),
                             Path("l.yaml"))
    assert lever.data.balance is not None and lever.data.balance.by == "language"
    assert lever.data.seed == 1 and lever.data.where == exp.data.where


def test_clinc_test_set_has_every_intent_and_no_training_query() -> None:
    training = cal.training_examples("clinc150", 0, 0, 10)
    assert len(training) == 1500
    test = cal.public_test("clinc150", 300, 1, training)
    by_label = Counter(r["label"] for r in test)
    assert len(test) == 300 and set(by_label) == set(pd.labels("clinc150"))
    assert set(by_label.values()) == {2}
    train_texts = {e["text"].lower() for e in training}
    assert not {r["messages"][-1]["content"].lower() for r in test} & train_texts
    assert test == cal.public_test("clinc150", 300, 1, training)
    assert test != cal.public_test("clinc150", 300, 2, training)
    assert len(cal.public_test("clinc150", 200, 1, training)) == 200
    # the whole official test split, less the two queries that are training texts here too
    whole = cal.public_test("clinc150", 4500, 1, cal.training_examples("clinc150", 0, 0, 0))
    assert len(whole) == 4498 and len(pd.load("clinc150", "test")) == 4500


def test_snips_trains_per_intent_and_tests_on_the_whole_official_split() -> None:
    training = cal.training_examples("snips", 0, 0, 10)
    assert len(training) == 70 and set(Counter(e["label"] for e in training).values()) == {10}
    assert len(cal.training_examples("snips", 0, 0, 0)) == 13084  # 0: the whole train split
    test = cal.test_sets("snips", cal.DEFAULT_TEST["snips"], 0, training)["test"]
    official = pd.load("snips", "test")
    assert [r["messages"][1]["content"] for r in test] == [e["text"] for e in official]
    assert test[0]["slots"] == official[0]["slots"] and test[0]["label"] == official[0]["label"]
    assert test[0]["messages"][0]["content"] == pd.system_prompt("snips")
    records = cal.training_records("snips", 0, 0, 10)
    assert len(records) == 70
    assert records[0]["response"]["choices"][0]["message"]["content"] == pd.gold_answer(
        "snips", training[0])


def test_snips_scores_exact_json_intent_and_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    requests = [{"messages": [], "label": "GetWeather", "slots": {"city": "paris"}},
                {"messages": [], "label": "PlayMusic", "slots": {"artist": "adele"}},
                {"messages": [], "label": "RateBook", "slots": {}}]
    answers = ['{"intent":"GetWeather","slots":{"city":"Paris"}}',   # right (case-blind)
               '{"intent":"PlayMusic","slots":{"artist":"adel"}}',   # intent right, slot wrong
               "RateBook"]                                            # does not parse
    monkeypatch.setattr(cal, "ask_all", lambda *a, **k: (answers, 1.0))
    got = cal.score_snips("http://x", "m", requests, 1)
    assert got["scores"] == [1.0, 0.0, 0.0] and got["exact"] == pytest.approx(1 / 3)
    assert got["intent_accuracy"] == pytest.approx(2 / 3)
    assert got["slot_f1"] == pytest.approx(2 * 1 / (2 * 1 + 1 + 1))  # tp 1, fp 1, fn 1
    acc = cal.accuracy(got)
    assert acc["intent_accuracy"] == got["intent_accuracy"] and acc["slot_f1"] == got["slot_f1"]
    note = cal.ledger_note("snips", {"deployed": acc, "base": acc})
    assert "deployed: intent accuracy 66.7, slot F1 50.0" in note


def test_keeps_each_answer_with_its_request_and_score(monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    requests = [{"messages": [], "label": "balance"}, {"messages": [], "label": "pto_used"}]
    monkeypatch.setattr(cal, "ask_all", lambda *a, **k: (["balance", "pto_balance"], 1.0))
    path = tmp_path / "answers-test-deployed.jsonl"
    got = cal.keep_answers(path, requests, cal.score_clinc("http://x", "m", requests, 1))
    assert got["exact"] == 0.5
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert [(r["label"], r["answer"], r["score"]) for r in rows] == [
        ("balance", "balance", 1.0), ("pto_used", "pto_balance", 0.0)]
    # bench/loop.py's triage scorer returns its answers' counts only: nothing is written
    other, counted = tmp_path / "none.jsonl", {"exact": 1.0, "num": 2, "answers": {"balance": 2}}
    assert cal.keep_answers(other, requests, counted) == counted
    assert not other.exists()


def test_fresh_extractions_are_unlike_every_training_message() -> None:
    training = cal.training_examples("extraction", 200, 0, 0)
    fresh = cal.fresh_extractions(50, 1, training)
    texts = [r["messages"][-1]["content"] for r in fresh]
    assert len(fresh) == 50 and len(set(texts)) == 50
    assert not set(texts) & {c["messages"][1]["content"] for c in training}
    assert fresh == cal.fresh_extractions(50, 1, training)
    assert all(r["messages"][0]["role"] == "system" and r["reference"].startswith("{")
               for r in fresh)


def test_test_sets_put_the_primary_first_and_draw_apart_from_training() -> None:
    training = cal.training_examples("triage", 40, 0, 0)
    sets = cal.test_sets("triage", 10, 0, training)
    assert list(sets)[0] == cal.PRIMARY["triage"] and set(sets) == {
        "disjoint", "unseen", "new-requests"}
    train_texts = {c["messages"][1]["content"] for c in training}
    assert all(r["messages"][1]["content"] not in train_texts for s in sets.values() for r in s)
    assert len(cal.training_records("triage", 40, 0, 0)) == 40


def test_accuracy_uses_the_evals_intervals() -> None:
    rate = cal.accuracy({"exact": 1.0, "num": 20})
    assert rate["mean"] == 1.0 and rate["high"] == pytest.approx(1.0)
    assert rate["low"] == pytest.approx(0.839, abs=1e-3)  # Wilson, 20 of 20
    graded = cal.accuracy({"exact": 0.5, "num": 4, "scores": [1.0, 1.0, 0.75, 0.5]})
    assert graded["mean"] == pytest.approx(0.8125) and graded["exact"] == 0.5
    assert graded["low"] < 0.8125 < graded["high"]


def _row(task: str, seed: int, eval_mean: float, low: float, high: float,
         test: float) -> dict[str, Any]:
    acc = {"mean": test, "low": test - 0.05, "high": test + 0.05, "num": 200, "exact": test}
    return {"task": task, "seed": seed, "ok": True, "commit": "abc1234", "run_s": 600.0,
            "loadavg_before": [1.0, 1.0, 1.0],
            "eval": {"mean": eval_mean, "low": low, "high": high, "num": 50, "step": 40,
                     "base": 0.1, "eval_split": "phrasing"},
            "test": {cal.PRIMARY[task]: {"deployed": acc, "base": {**acc, "mean": 0.1}}}}


def test_tables_give_gap_spread_and_goal() -> None:
    rows = [_row("triage", 0, 0.90, 0.80, 0.96, 0.88),
            _row("triage", 1, 0.92, 0.82, 0.97, 0.90),
            _row("agent", 0, 1.00, 0.93, 1.00, 0.80)]
    assert cal.gap(rows[0], "disjoint") == pytest.approx(0.02)
    assert cal.inside(rows[0], "disjoint") and not cal.inside(rows[2], "disjoint")
    lines, goals = cal.task_table(rows)
    assert goals == {"triage": True, "agent": False}
    triage = next(line for line in lines if line.startswith("| triage"))
    assert "| 91.0 ± 1.4 | 89.0 ± 1.4 | 10.0 ± 0.0 | 2.0 ± 0.0 | 2.0 |" in triage
    assert "2 of 2" in triage
    failed = {"task": "agent", "seed": 1, "ok": False, "error": "factory run failed (exit 1)"}
    assert any("FAILED" in line for line in cal.runs_table([*rows, failed]))


def test_dev_split_draws_other_requests_and_clinc_uses_its_validation_split() -> None:
    training = cal.training_examples("triage", 40, 0, 0)
    test = cal.test_sets("triage", 10, 0, training, "test")
    dev = cal.test_sets("triage", 10, 0, training, "dev")
    for kind in test:
        assert not ({r["messages"][1]["content"] for r in test[kind]}
                    & {r["messages"][1]["content"] for r in dev[kind]})
    clinc = cal.training_examples("clinc150", 0, 0, 1)
    dev_texts = {e["text"] for e in pd.load("clinc150", "dev")}
    assert all(r["messages"][1]["content"] in dev_texts
               for r in cal.test_sets("clinc150", 150, 0, clinc, "dev")["test"])


@pytest.mark.parametrize("argv", [["--plumbing", "--split", "test"],
                                  ["--overrides", '{"num_steps": 4}'],
                                  ["--overrides", '{"num_steps": 4}', "--split", "test"],
                                  ["--overrides", "[4]", "--split", "dev"],
                                  ["--data", '{"balance": "language"}'],
                                  ["--data", '{"seed": 3}', "--split", "dev"],
                                  ["--tasks", "triage,nope"],
                                  ["--sets", "disjoint,nope"]])
def test_refuses_a_plumbing_test_score_overrides_and_unknown_tasks_or_sets(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cal.main(argv)
    assert exc.value.code == 2
