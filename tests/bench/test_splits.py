"""Dev and test splits of the benches, and the ledger of test scores."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import splits
from factory.tasks import ticket_triage


def test_dev_and_test_draw_different_requests_and_test_keeps_the_old_seed() -> None:
    assert splits.heldout_seed(1, "test") == 1
    assert splits.heldout_seed(1, "dev") == 1 + splits.DEV_OFFSET
    with pytest.raises(ValueError, match="split"):
        splits.heldout_seed(1, "train")
    test = {t["messages"][1]["content"]
            for t in ticket_triage.generate_heldout(200, splits.heldout_seed(1, "test"))}
    dev = {t["messages"][1]["content"]
           for t in ticket_triage.generate_heldout(200, splits.heldout_seed(1, "dev"))}
    # a short ticket of a frame without slots ("Could you update the company address that
    # appears on our invoices from July on?") comes out the same in both: 3 of 200 here
    assert len(test & dev) <= 5


def test_every_test_score_is_kept_and_summarized_over_seeds(tmp_path: Path) -> None:
    ledger = tmp_path / "ledger.jsonl"
    config = {"recipe": "r", "records": 500, "overrides": {}}
    for seed, dep in ((0, 0.84), (1, 0.88), (2, 0.86)):
        splits.record(bench="loop", task="triage", config=config, seed=seed, heldout="disjoint",
                      num=200, deployed=dep, base=0.0, ledger=ledger)
    splits.record(bench="loop", task="triage", config={**config, "overrides": {"lr": 1}},
                  seed=0, heldout="disjoint", num=200, deployed=0.9, base=0.0, ledger=ledger)
    entries = splits.read(ledger)
    assert len(entries) == 4 and all(e["commit"] for e in entries)
    rows = splits.render(entries).splitlines()[2:]
    assert len(rows) == 2
    assert "| 0, 1, 2 | 86.0% ± 2.0% (84.0%, 88.0%, 86.0%) | 0.0% ± 0.0% |" in rows[0]
    assert rows[1].endswith("| 0 | 90.0% (90.0%) | 0.0% |")
