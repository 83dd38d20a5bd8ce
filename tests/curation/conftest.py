"""Curation test helpers: the planted dataset, a token counter on SmolLM2's tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from factory.curation.config import CurationConfig
from factory.curation.synthetic import Planted, planted
from factory.curation.tokens import RenderCounter

# The first overwrite of an experiment's rows deletes nothing; pyiceberg warns about it.
pytestmark = pytest.mark.filterwarnings("ignore:Delete operation did not match any records")

# Tool-calling samples render to ~400-570 tokens (the tools block sits in the system turn).
CONFIG = CurationConfig(max_tokens=1024)


@pytest.fixture(scope="session")
def counter(smollm2_dir: Path) -> RenderCounter:
    return RenderCounter(smollm2_dir)


@pytest.fixture(scope="session")
def planted_data() -> Planted:
    return planted(200, config=CONFIG, seed=1)
