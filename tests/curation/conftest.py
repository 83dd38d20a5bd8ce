"""Curation test helpers: the planted dataset, a token counter on SmolLM2's tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from factory.curation.config import CurationConfig
from factory.curation.tokens import RenderCounter
from factory.tasks.planted import Planted, planted

# The first overwrite of an experiment's rows deletes nothing; pyiceberg warns about it.
pytestmark = pytest.mark.filterwarnings("ignore:Delete operation did not match any records")

# Tool-calling samples render to ~400-570 tokens (the tools block sits in the system turn).
# The planted datasets put each contaminated copy in train and its source in eval by the split
# group's hash (``decide.split_side``): the phrasing split would hold the copy out with its
# source (same phrasing), leaving decontamination nothing to catch, so these tests of the
# cleaning steps hold out by split group; tests/curation/test_phrasing.py tests the phrasing
# split, and test_spark.py both.
CONFIG = CurationConfig(max_tokens=1024, phrasing_threshold=None)


@pytest.fixture(scope="session")
def counter(smollm2_dir: Path) -> RenderCounter:
    return RenderCounter(smollm2_dir)


@pytest.fixture(scope="session")
def planted_data() -> Planted:
    return planted(200, config=CONFIG, seed=1)
