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
