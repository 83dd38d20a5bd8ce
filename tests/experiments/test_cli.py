"""``factory plan`` and ``factory sweep`` from the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from factory.app.cli import main

PROFILE = {"num_train": 300, "prompt_tokens_p50": 80, "prompt_tokens_p95": 200,
           "prompt_tokens_p99": 300, "prompt_tokens_max": 400, "completion_tokens_p50": 40,
           "completion_tokens_p95": 90, "completion_tokens_p99": 120,
           "completion_tokens_max": 150}


def test_plan_json_and_card(factory_home: Path, tmp_path: Path,
                            capsys: pytest.CaptureFixture[str]) -> None:
    exp = tmp_path / "e.yaml"
    exp.write_text("recipe: smollm2-135m-lora\nsweep: {lora_rank: [8, 16]}\n")
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps(PROFILE))
    cards = tmp_path / "cards"
    assert main(["plan", str(exp), "--profile", str(prof), "--json", "--card", str(cards)]) == 0
    plans = json.loads(capsys.readouterr().out)
    assert [p["run_key"] for p in plans] == ["e/lora_rank=8", "e/lora_rank=16"]
    assert plans[0]["reasons"]["lora_rank"]["overridden"] is True
    assert plans[0]["train_config"]["lora_rank"] == 8
    card = (cards / "e.md").read_text()
    assert "## Sweep (2 runs)" in card and "| learning_rate |" in card


def test_plan_errors_are_one_line(factory_home: Path, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    exp = tmp_path / "e.yaml"
    exp.write_text("recipe: smollm2-135m-lora\n")
    assert main(["plan", str(exp)]) == 2
    assert "no dataset_profile for experiment 'e'" in capsys.readouterr().err
    exp.write_text("recipe: smollm2-135m-lora\ndata: {max_tokens: 9000}\n")
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps(PROFILE))
    assert main(["plan", str(exp), "--profile", str(prof)]) == 2
    assert "set data.max_tokens to at most 8192" in capsys.readouterr().err


def test_sweep_compare_without_runs(factory_home: Path, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    exp = tmp_path / "e.yaml"
    exp.write_text("recipe: smollm2-135m-lora\nsweep: {lora_rank: [8, 16]}\n")
    assert main(["sweep", str(exp), "--compare", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["run_key"] for r in rows] == ["e/lora_rank=8", "e/lora_rank=16"]
    assert rows[0]["final_loss"] is None and rows[0]["run_id"] is None  # never planned
