"""The comparison page's cost model (factory.app.costs): the price table, its file and form,
and the estimated cost per 1,000 requests of each side."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from factory.app.costs import Prices, costs, load_prices, parse_prices, save_prices


def test_a_model_is_priced_by_its_own_row_or_the_longest_prefix() -> None:
    prices = Prices(models={"gpt-4o": (2.5, 10.0), "gpt-4o-mini": (0.15, 0.6)})
    assert prices.of("gpt-4o") == ("gpt-4o", (2.5, 10.0))
    assert prices.of("gpt-4o-mini-2024-07-18") == ("gpt-4o-mini", (0.15, 0.6))
    assert prices.of("llama-3") is None


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"machine_per_hour": -1.0}, "machine_per_hour: must be a number >= 0"),
    ({"machine_per_hour": math.nan}, "machine_per_hour"),
    ({"models": {" ": (1.0, 1.0)}}, "a price row needs a model name"),
    ({"models": {"m": (1.0, -2.0)}}, r"models\['m'\]: prices must be numbers >= 0"),
    ({"models": {"m": (math.inf, 1.0)}}, r"models\['m'\]"),
])
def test_a_bad_price_is_refused_by_name(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Prices(**kwargs)


def test_the_table_round_trips_through_its_file(tmp_path: Path) -> None:
    path = tmp_path / "home" / "compare-prices.json"
    assert load_prices(path) == Prices()  # nothing saved yet: the defaults
    table = Prices(models={"gpt-4o-mini": (1.0, 2.0), "mine": (0.0, 0.5)}, machine_per_hour=4.0)
    save_prices(path, table)
    assert load_prices(path) == table
    assert [p.name for p in path.parent.iterdir()] == ["compare-prices.json"]


@pytest.mark.parametrize("text", ["{not json", "[]", '{"models": {}}',
                                  '{"models": {"m": {"input": 1}}, "machine_per_hour": 1}',
                                  '{"models": {}, "machine_per_hour": -1}'])
def test_a_broken_file_is_named_with_the_fix(tmp_path: Path, text: str) -> None:
    path = tmp_path / "compare-prices.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=r"compare-prices.json: not a price table \(.*\); fix or "
                                         r"delete it"):
        load_prices(path)


def test_the_form_gives_the_table() -> None:
    form = {"model_0": " gpt-4o ", "input_0": "2.5", "output_0": "10", "model_1": "",
            "input_1": "", "output_1": "", "model_2": "mine", "input_2": "0", "output_2": "1e-1",
            "machine_per_hour": "3"}
    assert parse_prices(form) == Prices(models={"gpt-4o": (2.5, 10.0), "mine": (0.0, 0.1)},
                                        machine_per_hour=3.0)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("input_0", "abc", "m input price: 'abc' is not a number"),
    ("output_0", "-1", "m output price: must be a number >= 0, got '-1'"),
    ("output_0", "nan", "m output price: must be a number >= 0, got 'nan'"),
    ("machine_per_hour", "", "machine hour price: '' is not a number"),
])
def test_a_bad_form_field_is_named(field: str, value: str, message: str) -> None:
    form = {"model_0": "m", "input_0": "1", "output_0": "2", "machine_per_hour": "2",
            field: value}
    with pytest.raises(ValueError, match=message):
        parse_prices(form)


def _pair(route: str | None, prompt: int | None, completion: int | None,
          candidate_ms: float | None, answered: bool = True) -> dict[str, Any]:
    return {"route": route, "frontier_prompt_tokens": prompt,
            "frontier_completion_tokens": completion, "candidate_latency_ms": candidate_ms,
            "answered": answered}


def test_costs_per_thousand_requests() -> None:
    rows = [_pair("gpt-4o-mini-2024-07-18", 1000, 200, 100.0),
            _pair("gpt-4o-mini", 3000, 600, 300.0),
            _pair("gpt-4o-mini", None, 600, None),  # no token counts: not in the frontier mean
            _pair("gpt-4o-mini", 1000, 200, 9000.0, answered=False)]  # no answer: not timed
    estimate = costs(rows, Prices(machine_per_hour=3.6))
    # Frontier: mean of (1000 * 0.15 + 200 * 0.60) / 1e6 = 0.00027, 0.00081 and 0.00027, x 1000.
    assert estimate.frontier == pytest.approx(1000 * (0.00027 + 0.00081 + 0.00027) / 3)
    assert "mean over 3 pairs" in estimate.frontier_how and "(gpt-4o-mini)" in estimate.frontier_how
    # Candidate: mean 0.2 s per answered request at $3.60 per hour ($0.001 per second), x 1000.
    assert estimate.candidate == pytest.approx(0.2)
    assert "(2 pairs) x $3.60 per machine hour" in estimate.candidate_how


def test_an_unpriced_model_is_named_and_left_out() -> None:
    estimate = costs([_pair("llama-3", 1000, 200, None, answered=False), _pair(None, 1, 1, None)],
                     Prices())
    assert estimate.frontier is None and estimate.candidate is None
    assert "no priced model" in estimate.frontier_how
    assert estimate.frontier_how.endswith("; no price for ?, llama-3: add it on the price table")
