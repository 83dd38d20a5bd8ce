"""Tokenizing for a plan: a sample longer than ``max_seq_len`` is dropped whole with its reason,
never cut; the pre-launch check refuses a plan that would drop more than 1% of the samples, with
the numbers, and accepts one that fits. All with the trainer's own tokenizer and rendering."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from factory.trainer.chat import encode
from factory.trainer.config import TrainerJob
from factory.trainer.data import (
    DROP_REASONS,
    MAX_DROP_FRACTION,
    check_job_data,
    check_plan_data,
    plan_tokenizer,
    read_rows,
    tokenize,
)
from tests.trainer.conftest import make_samples, write_parquet


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Any:
    return plan_tokenizer(str(tiny_model_dir))


def _long(i: int, words: int = 200) -> dict[str, Any]:
    """A sample whose rendering is several hundred tokens."""
    text = " ".join(["river stone moon"] * words)
    return {"sample_id": f"long-{i}", "tools": [], "messages": [
        {"role": "user", "content": [{"type": "text", "text": text}]},
        {"role": "assistant", "content": [{"type": "text", "text": "ok"}]}]}


def _lengths(rows: list[dict[str, Any]], tok: Any) -> list[int]:
    return [len(encode(r["messages"], r["tools"], tok)[0]) for r in rows]


def test_too_long_samples_are_dropped_whole_and_counted_by_reason(tok: Any) -> None:
    good = make_samples(20, seed=1)
    no_answer = {"sample_id": "no-answer", "tools": [], "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hello"}]}]}
    broken = {"sample_id": "broken", "tools": [], "messages": "not json"}
    rows = good + [_long(0), _long(1, words=300), no_answer, broken]
    lengths = _lengths(good + [_long(0), _long(1, words=300)], tok)
    max_seq_len = max(lengths[:20])

    examples, stats = tokenize(rows, tok, max_seq_len=max_seq_len)

    assert [e.sample_id for e in examples] == [r["sample_id"] for r in good]
    assert [len(e.input_ids) for e in examples] == lengths[:20]  # kept whole, none cut
    assert stats.num_dropped_by_reason == {"unrenderable": 1, "missing_image": 0,
                                           "too_long_for_plan": 2, "no_target": 1}
    assert set(stats.num_dropped_by_reason) == set(DROP_REASONS)
    assert (stats.num_samples, stats.num_examples, stats.num_dropped) == (24, 20, 4)
    assert stats.max_sample_tokens == max(lengths) > max_seq_len
    assert stats.num_tokens == sum(lengths[:20])
    assert stats.describe_drops() == (f"1 unrenderable, 2 too_long_for_plan (longest "
                                      f"{max(lengths)} tokens), 1 no_target")


def test_pre_launch_check_refuses_a_plan_that_drops_over_one_percent(tok: Any) -> None:
    good = make_samples(99, seed=2)
    rows = good[:97] + [_long(i) for i in range(3)]
    longest = max(_lengths(rows, tok))
    fits = max(_lengths(good, tok))
    with pytest.raises(ValueError) as err:
        check_plan_data(rows, tok, max_seq_len=fits)
    assert str(err.value) == (
        f"plan max_seq_len {fits} would drop 3 of 100 training samples (3.0%, over the 1% "
        f"limit): 3 too_long_for_plan (longest {longest} tokens)")

    # One long sample in 100 is within the limit: dropped, counted, and the plan accepted.
    stats = check_plan_data(good + [_long(0)], tok, max_seq_len=fits)
    assert stats.num_dropped / stats.num_samples == MAX_DROP_FRACTION
    assert stats.num_dropped_by_reason["too_long_for_plan"] == 1 and stats.num_examples == 99
    # A plan that covers them all drops none.
    assert check_plan_data(rows, tok, max_seq_len=longest).num_dropped == 0


def test_pre_launch_check_of_a_job_reads_its_files_and_its_base_model(
        tmp_path: Path, tiny_model_dir: Path, tok: Any) -> None:
    train = write_parquet(tmp_path / "train.parquet", make_samples(30, seed=3))
    held = write_parquet(tmp_path / "eval.parquet", [_long(i) for i in range(4)])
    lengths = _lengths(make_samples(30, seed=3), tok)
    job = TrainerJob.from_dict({"run_id": "j", "data_files": [str(train)],
                         "output_dir": str(tmp_path / "out"),
                         "plan": {"base_model": str(tiny_model_dir),
                                  "max_seq_len": max(lengths), "learning_rate": 1e-3,
                                  "num_steps": 2}})
    stats = check_job_data(job)
    assert (stats.num_samples, stats.num_examples) == (30, 30)

    too_short = replace(job, plan=replace(job.plan, max_seq_len=min(lengths)))
    with pytest.raises(ValueError, match=r"would drop \d+ of 30 training samples"):
        check_job_data(too_short)
    with_eval = replace(job, eval_data_files=[str(held)],
                        plan=replace(job.plan, eval_every_steps=1))
    with pytest.raises(ValueError, match="would keep none of the 4 held-out samples: "
                                         "4 too_long_for_plan"):
        check_job_data(with_eval)
    missing = replace(job, plan=replace(job.plan, base_model=str(tmp_path / "no-model")))
    with pytest.raises(ValueError, match="plan.base_model: no such directory"):
        check_job_data(missing)


def test_a_payload_without_usable_samples_is_refused(tmp_path: Path, tok: Any) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    rows = read_rows(payload_file=str(path))
    with pytest.raises(ValueError, match=r"would drop 1 of 1 training samples \(100.0%.*"
                                         r"1 no_target"):
        check_plan_data(rows, tok, max_seq_len=64)
    with pytest.raises(ValueError, match="no training samples"):
        check_plan_data([], tok, max_seq_len=64)
