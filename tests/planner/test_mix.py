"""A mixture in the plan: each source's share, rows drawn and effective epochs, in the plan
and its rendering; an epoch is a pass over the primary source."""

from __future__ import annotations

import pytest

from factory.planner import PlanError, make_plan
from factory.planner.render import plan_table
from tests.planner.conftest import experiment, profile

MIX = {"mix": {"traffic": 3, "synthetic": 1, "experiment:other": 1}}
ROWS = {"traffic": 4000, "synthetic": 100, "experiment:other": 20_000}


def test_the_plan_shows_the_effective_epochs_of_each_source() -> None:
    plain = make_plan(experiment(), profile())
    mixed = make_plan(experiment(data=MIX), profile(), source_rows=ROWS)
    assert plain.mix == [] and plain.to_dict()["mix"] == []
    by = {m["source"]: m for m in mixed.mix}
    assert mixed.mix[0]["source"] == "traffic"  # the primary source first
    assert set(by) == set(ROWS)
    assert (by["traffic"]["share"], by["synthetic"]["share"]) == (0.6, 0.2)
    # 5,000 samples: two passes over the primary source (traffic), its 4,000 rows at 60%.
    assert mixed["num_epochs"] == 2.0
    assert by["traffic"]["epochs"] == pytest.approx(2.0, rel=0.02)
    assert by["synthetic"]["epochs"] == pytest.approx(
        by["traffic"]["epochs"] * (1 / 3) * 4000 / 100, rel=1e-3)
    assert by["experiment:other"]["samples"] == pytest.approx(by["synthetic"]["samples"], abs=1)
    # A pass over 4,000 traffic rows at 60% draws ~6,667 samples: more steps than unmixed.
    assert mixed.estimates["steps"] > plain.estimates["steps"]
    assert "passes over traffic, the mix's primary source" in \
        mixed.decisions["num_epochs"].reason
    assert "repeats synthetic over 10 times" in " ".join(mixed.notes)
    table = plan_table(mixed)
    assert "| synthetic | 1 | 20.0% | 100 |" in table
    assert f"| {by['synthetic']['epochs']:.3g} |" in table
    assert mixed.to_dict()["mix"] == mixed.mix


def test_uncounted_sources_show_unknown_epochs_and_empty_ones_refuse_the_plan() -> None:
    unknown = make_plan(experiment(data=MIX), profile())
    assert [m["epochs"] for m in unknown.mix] == [None, None, None]  # rows not counted
    assert "| traffic | 3 | 60.0% | ? |" in plan_table(unknown)
    with pytest.raises(PlanError, match="data.mix source 'synthetic' has no samples; the "
                                        "dataset has no synthetic rows"):
        make_plan(experiment(data=MIX), profile(), source_rows={**ROWS, "synthetic": 0})


def test_balance_draws_the_traffic_s_languages_closer_to_even() -> None:
    rows = {"traffic[language=en]": 640, "traffic[language=fr]": 120,
            "traffic[language=de]": 120, "traffic[language=es]": 120, "traffic": 1000}
    half = make_plan(experiment(data={"balance": "language"}), profile(), source_rows=rows)
    by = {m["source"]: m for m in half.mix}
    assert half.mix[0]["source"] == "traffic[language=en]"  # the largest group is the primary
    assert "traffic" not in by
    # count ** 0.5: 640 -> 25.3, 120 -> 10.95 (x3): en 43.5%, each of the others 18.8%.
    assert by["traffic[language=en]"]["share"] == pytest.approx(0.435, abs=0.001)
    assert by["traffic[language=fr]"]["share"] == pytest.approx(0.188, abs=0.001)
    assert by["traffic[language=fr]"]["epochs"] > 2 * by["traffic[language=en]"]["epochs"]
    even = make_plan(experiment(data={"balance": {"by": "language", "alpha": 0.0}}), profile(),
                     source_rows=rows)
    assert {m["share"] for m in even.mix} == {0.25}
    same = make_plan(experiment(data={"balance": {"by": "language", "alpha": 1.0}}), profile(),
                     source_rows=rows)
    assert [m["share"] for m in same.mix] == [0.64, 0.12, 0.12, 0.12]
    # Beside another source, the groups share the traffic's weight.
    mixed = make_plan(experiment(data={"balance": "language",
                                       "mix": {"traffic": 3, "synthetic": 1}}), profile(),
                      source_rows={**rows, "synthetic": 50})
    shares = {m["source"]: m["share"] for m in mixed.mix}
    assert shares["synthetic"] == 0.25
    assert sum(v for k, v in shares.items() if k != "synthetic") == pytest.approx(0.75, abs=1e-3)
    # Without the groups' counts (a saved profile, no dataset yet) the traffic is as it is.
    unknown = make_plan(experiment(data={"balance": "language"}), profile())
    assert unknown.mix == []
    assert any("data.balance: no counts" in n for n in unknown.notes)


def test_balance_leaves_samples_of_no_known_language_at_their_share() -> None:
    rows = {"traffic[language=en]": 600, "traffic[language=fr]": 150,
            "traffic[language=und]": 50}
    plan = make_plan(experiment(data={"balance": {"by": "language", "alpha": 0.0}}), profile(),
                     source_rows=rows)
    shares = {m["source"]: m["share"] for m in plan.mix}
    # 50 of 800 rows stay 6.25% of the draws; the languages split the rest evenly.
    assert shares == {"traffic[language=en]": 0.4688, "traffic[language=fr]": 0.4688,
                      "traffic[language=und]": 0.0625}


AGENT_ROWS = {"traffic[language=en]": 384, "traffic[language=es]": 72,
              "traffic[language=de]": 72, "traffic[language=fr]": 72}
"""The agent task's training traffic: 64% English, 12% each Spanish, German and French."""


def test_the_planner_balances_skewed_languages_unless_the_file_says_none() -> None:
    auto = make_plan(experiment(), profile(), source_rows=AGENT_ROWS)
    explicit = make_plan(experiment(data={"balance": "language"}), profile(),
                         source_rows=AGENT_ROWS)
    shares = {m["source"]: m["share"] for m in auto.mix}
    assert shares == {m["source"]: m["share"] for m in explicit.mix}
    assert shares["traffic[language=en]"] == pytest.approx(0.435, abs=0.001)
    note = next(n for n in auto.notes if n.startswith("traffic balanced by language"))
    assert "en 384, de 72, es 72, fr 72 rows" in note and "data.balance: none" in note
    off = make_plan(experiment(data={"balance": "none"}), profile(), source_rows=AGENT_ROWS)
    assert off.mix == [] and not any("balanced" in n for n in off.notes)
    assert make_plan(experiment(data={"balance": False}), profile(),
                     source_rows=AGENT_ROWS).mix == []


@pytest.mark.parametrize("rows", [
    # English with a few queries guessed as other languages (CLINC150: 16 of 15,000 French).
    {"traffic[language=en]": 1450, "traffic[language=fr]": 30, "traffic[language=und]": 40},
    # Two languages, less than 2x apart.
    {"traffic[language=en]": 300, "traffic[language=fr]": 200},
    # One language; no counts at all (a plan before the dataset exists).
    {"traffic[language=en]": 500}, {}])
def test_the_planner_leaves_traffic_as_it_is_where_languages_are_not_skewed(
        rows: dict[str, int]) -> None:
    plan = make_plan(experiment(), profile(), source_rows=rows)
    assert plan.mix == [] and not any("balance" in n for n in plan.notes)


def test_the_default_balance_keeps_small_languages_at_their_share() -> None:
    rows = {**AGENT_ROWS, "traffic[language=nl]": 6, "traffic[language=und]": 20}
    shares = {m["source"]: m["share"]
              for m in make_plan(experiment(), profile(), source_rows=rows).mix}
    total = sum(rows.values())
    assert shares["traffic[language=nl]"] == pytest.approx(6 / total, abs=1e-4)
    assert shares["traffic[language=und]"] == pytest.approx(20 / total, abs=1e-4)
    assert shares["traffic[language=fr]"] == shares["traffic[language=de]"] > 0.17
