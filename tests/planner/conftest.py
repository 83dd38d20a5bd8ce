"""Helpers for planner tests: experiments written to a tmp folder and synthetic profiles."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from factory.experiments import Experiment, parse_experiment
from factory.planner import DatasetProfile


def profile(**kw: Any) -> DatasetProfile:
    """A profile of 5,000 mixed-length text samples unless told otherwise."""
    base: dict[str, Any] = dict(
        num_samples=5000, prompt_tokens_p50=120, prompt_tokens_p95=600, prompt_tokens_p99=900,
        prompt_tokens_max=1200, completion_tokens_p50=60, completion_tokens_p95=200,
        completion_tokens_p99=300, completion_tokens_max=500)
    base.update(kw)
    return DatasetProfile(**base)


def experiment(recipe: str = "smollm2-135m-lora", **fields: Any) -> Experiment:
    raw: dict[str, Any] = {"name": "t", "recipe": recipe, **fields}
    return parse_experiment(yaml.safe_dump(raw), Path("t.yaml"))


@pytest.fixture()
def make_experiment() -> Any:
    return experiment
