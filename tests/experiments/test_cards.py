"""The experiment cards committed under docs/experiments/ are the files' current cards."""

from __future__ import annotations

import re
from pathlib import Path

from factory.planner.render import committed_cards, main

ROOT = Path(__file__).resolve().parents[2]


def test_every_committed_card_is_rendered_from_its_current_file() -> None:
    expected = committed_cards(ROOT / "experiments")
    committed = {p.name: p.read_text(encoding="utf-8")
                 for p in (ROOT / "docs" / "experiments").glob("*.md")}
    assert sorted(committed) == sorted(expected), "run `make cards`"
    for name, text in expected.items():
        assert committed[name] == text, f"docs/experiments/{name} is stale: run `make cards`"


def test_a_card_shows_what_the_file_changes(tmp_path: Path) -> None:
    exp_dir = tmp_path / "experiments"
    exp_dir.mkdir()
    source = (ROOT / "experiments" / "demo-extract.yaml").read_text(encoding="utf-8")
    changed = re.sub(r"num_steps: \d+", "num_steps: 11", source)
    assert changed != source
    (exp_dir / "demo-extract.yaml").write_text(changed, encoding="utf-8")
    assert main([str(exp_dir), str(tmp_path / "cards")]) == 0
    card = (tmp_path / "cards" / "demo-extract.md").read_text(encoding="utf-8")
    assert "- `num_steps`: 11" in card
    assert card != (ROOT / "docs" / "experiments" / "demo-extract.md").read_text(encoding="utf-8")
