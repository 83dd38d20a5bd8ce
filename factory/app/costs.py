"""The cost model of the comparison page (``factory compare``): an editable price table kept in
``$FACTORY_HOME/compare-prices.json`` and the estimated USD per 1,000 requests of each side of a
shadow pair.

The frontier's cost comes from the pair's token counts and its model's price per million tokens,
the candidate's from its measured seconds per request and a price per machine hour.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from factory.lake import Lake

PRICES_FILE = "compare-prices.json"

DEFAULT_MODEL_PRICES: dict[str, tuple[float, float]] = {
    # USD per 1M input / output tokens, list prices as published by the providers in 2025.
    "gpt-4o-mini": (0.15, 0.60),
    "gpt-4o": (2.50, 10.00),
    "gpt-4.1-mini": (0.40, 1.60),
    "gpt-4.1": (2.00, 8.00),
    "claude-3-5-haiku": (0.80, 4.00),
    "claude-sonnet-4": (3.00, 15.00),
    "gemini-2.0-flash": (0.10, 0.40),
    "gemini-2.5-pro": (1.25, 10.00),
}
DEFAULT_MACHINE_PER_HOUR = 2.00
"""USD per hour of the machine serving the candidate: about one rented data-center GPU."""


@dataclass(frozen=True, kw_only=True)
class Prices:
    """The price table the cost estimates use (editable on ``/prices``)."""

    models: dict[str, tuple[float, float]] = field(
        default_factory=lambda: dict(DEFAULT_MODEL_PRICES))
    """Frontier model name -> (USD per 1M input tokens, USD per 1M output tokens)."""
    machine_per_hour: float = DEFAULT_MACHINE_PER_HOUR
    """USD per hour of the machine serving the candidate."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.machine_per_hour) and self.machine_per_hour >= 0):
            raise ValueError(f"machine_per_hour: must be a number >= 0, "
                             f"got {self.machine_per_hour!r}")
        for model, pair in self.models.items():
            if not model.strip():
                raise ValueError("models: a price row needs a model name")
            if not all(math.isfinite(p) and p >= 0 for p in pair):
                raise ValueError(f"models[{model!r}]: prices must be numbers >= 0, got {pair!r}")

    def of(self, model: str) -> tuple[str, tuple[float, float]] | None:
        """The price row for ``model``: its own, else the longest name it starts with (a dated
        release such as ``gpt-4o-mini-2024-07-18`` costs what ``gpt-4o-mini`` does)."""
        if model in self.models:
            return model, self.models[model]
        prefixes = [m for m in self.models if model.startswith(m)]
        if not prefixes:
            return None
        best = max(prefixes, key=len)
        return best, self.models[best]


def prices_path(lake: Lake) -> Path:
    return lake.settings.home / PRICES_FILE


def load_prices(path: Path) -> Prices:
    """The saved table, or the defaults before one was saved."""
    if not path.is_file():
        return Prices()
    try:
        data = json.loads(path.read_text())
        return Prices(models={str(m): (float(p["input"]), float(p["output"]))
                              for m, p in data["models"].items()},
                      machine_per_hour=float(data["machine_per_hour"]))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{path}: not a price table ({exc}); fix or delete it") from None


def save_prices(path: Path, prices: Prices) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"machine_per_hour": prices.machine_per_hour, "models": {
        m: {"input": i, "output": o} for m, (i, o) in sorted(prices.models.items())}}, indent=2))
    tmp.replace(path)


def parse_prices(form: Mapping[str, str]) -> Prices:
    """The table of the ``/prices`` form: rows ``model_i``, ``input_i``, ``output_i``; a row
    with an empty model name is dropped."""
    models: dict[str, tuple[float, float]] = {}
    i = 0
    while f"model_{i}" in form:
        name = form[f"model_{i}"].strip()
        if name:
            models[name] = (_number(form.get(f"input_{i}", ""), f"{name} input price"),
                            _number(form.get(f"output_{i}", ""), f"{name} output price"))
        i += 1
    return Prices(models=models,
                  machine_per_hour=_number(form.get("machine_per_hour", ""), "machine hour price"))


def _number(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{what}: {text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{what}: must be a number >= 0, got {text!r}")
    return value


@dataclass(frozen=True, kw_only=True)
class Costs:
    """Estimated USD per 1,000 requests and how each was computed."""

    frontier: float | None
    frontier_how: str
    candidate: float | None
    candidate_how: str


def costs(rows: list[dict[str, Any]], prices: Prices) -> Costs:
    """Cost per 1,000 requests of each side, from the pairs' token counts and latencies.

    ``rows`` are shadow pairs with ``route``, ``frontier_prompt_tokens``,
    ``frontier_completion_tokens``, ``candidate_latency_ms`` and ``answered`` (the candidate
    gave a message)."""
    per_request: list[float] = []
    unpriced: set[str] = set()
    matched: set[str] = set()
    for r in rows:
        found = prices.of(r["route"] or "")
        if found is None:
            unpriced.add(r["route"] or "?")
            continue
        pt, ct = r["frontier_prompt_tokens"], r["frontier_completion_tokens"]
        if pt is None or ct is None:
            continue
        name, (inp, out) = found
        matched.add(name)
        per_request.append((pt * inp + ct * out) / 1e6)
    frontier = 1000 * sum(per_request) / len(per_request) if per_request else None
    how = (f"mean over {len(per_request)} pairs of prompt tokens x input price + completion "
           f"tokens x output price ({', '.join(sorted(matched)) or 'no priced model'}), "
           f"x 1,000")
    if unpriced:
        how += f"; no price for {', '.join(sorted(unpriced))}: add it on the price table"
    seconds = [r["candidate_latency_ms"] / 1000 for r in rows
               if r["answered"] and r["candidate_latency_ms"] is not None]
    candidate = (1000 * sum(seconds) / len(seconds) * prices.machine_per_hour / 3600
                 if seconds else None)
    candidate_how = (f"mean measured seconds per answered request ({len(seconds)} pairs) x "
                     f"${prices.machine_per_hour:.2f} per machine hour / 3,600, x 1,000: one "
                     f"request at a time holding the machine, so batching only lowers it")
    return Costs(frontier=frontier, frontier_how=how, candidate=candidate,
                 candidate_how=candidate_how)
