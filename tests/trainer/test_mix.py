"""The streamed mixture: sampled by weight, reproducible by seed, resumable from its position,
bounded in memory, and a single source batched as the whole-dataset stream batches it."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from factory.trainer.chat import install_chat_template, load_tokenizer
from factory.trainer.config import MixSource
from factory.trainer.data import MicroBatchStream, MixtureStream, SourceReader, tokenize
from tests.trainer.conftest import make_samples, write_parquet


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Any:
    return install_chat_template(load_tokenizer(str(tiny_model_dir)))


def _parquet(path: Path, samples: list[dict[str, Any]], row_group_size: int) -> Path:
    table = pa.table({
        "sample_id": [s["sample_id"] for s in samples],
        "messages": [json.dumps(s["messages"]) for s in samples],
        "tools": [json.dumps(s["tools"]) for s in samples]})
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def _stream(sources: list[MixSource], tok: Any, **kw: Any) -> MixtureStream:
    args: dict[str, Any] = {"max_seq_len": 320, "packing": True, "micro_batch_size": 2,
                            "seed": 7, "pad_id": tok.pad_token_id}
    args.update(kw)
    return MixtureStream(sources, tok, **args)


def _same(a: Any, b: Any) -> bool:
    return all(torch.equal(getattr(a, f), getattr(b, f))
               for f in ("input_ids", "position_ids", "labels"))


def test_one_source_gives_the_batches_of_the_whole_dataset_stream(tok, tmp_path: Path) -> None:
    samples = make_samples(40, seed=2)
    data = write_parquet(tmp_path / "d.parquet", samples)
    stream = _stream([MixSource(name="train", weight=1.0, data_files=[str(data)])], tok)
    examples, _ = tokenize(samples, tok, max_seq_len=320)
    whole = MicroBatchStream(examples, max_seq_len=320, packing=True, micro_batch_size=2,
                             seed=7, pad_id=tok.pad_token_id)
    assert stream.per_epoch == whole.per_epoch
    for k in range(whole.per_epoch * 3):  # three epochs, each reshuffled alike
        assert _same(stream.batch(k), whole.batch(k)), k
        assert stream.num_label_tokens(k) == whole.num_label_tokens(k)


def test_a_source_of_several_files_trains_them_mixed_not_one_after_the_other(
        tok, tmp_path: Path) -> None:
    # One source, two files (traffic and, say, synthetic samples written apart): the reader
    # visits one file's rows, then the other's; each step should hold both.
    a = write_parquet(tmp_path / "a.parquet", make_samples(40, seed=1))
    b = write_parquet(tmp_path / "b.parquet", make_samples(40, seed=2))
    source = [MixSource(name="train", weight=1.0, data_files=[str(a), str(b)])]
    stream = _stream(source, tok, packing=False, micro_batch_size=4)
    epoch = [stream.sample_ids(k) for k in range(stream.per_epoch)]
    assert sorted(i for ids in epoch for i in ids) == sorted(
        [f"s1-{i:04d}" for i in range(40)] + [f"s2-{i:04d}" for i in range(40)])
    first_half = [i for ids in epoch[:len(epoch) // 2] for i in ids]
    share_a = sum(i.startswith("s1-") for i in first_half) / len(first_half)
    assert 0.25 < share_a < 0.75, share_a
    # The order is the seed's: the same stream again, and another epoch differs.
    again = _stream(source, tok, packing=False, micro_batch_size=4)
    assert [again.sample_ids(k) for k in range(stream.per_epoch)] == epoch
    assert [stream.sample_ids(stream.per_epoch + k) for k in range(stream.per_epoch)] != epoch


def test_sources_are_drawn_by_weight_and_reproducibly(tok, tmp_path: Path) -> None:
    a = write_parquet(tmp_path / "a.parquet", make_samples(30, seed=1))
    b = _parquet(tmp_path / "b.parquet", make_samples(300, seed=9), row_group_size=50)
    mix = [MixSource(name="traffic", weight=3.0, data_files=[str(a)]),
           MixSource(name="general", weight=1.0, data_files=[str(b)])]
    one, two = _stream(mix, tok, window_samples=64), _stream(mix, tok, window_samples=64)
    ids = [one.batch(k).input_ids for k in range(60)]
    assert all(torch.equal(x, two.batch(k).input_ids) for k, x in enumerate(ids))
    drawn = Counter({n: s["drawn"] for n, s in one.summary().items()})
    share = drawn["general"] / (drawn["traffic"] + drawn["general"])
    # 1/4 in expectation; hundreds of draws keep it within a few points.
    assert 0.15 < share < 0.35, drawn
    other = _stream(mix, tok, window_samples=64, seed=8)
    assert not all(torch.equal(x, other.batch(k).input_ids) for k, x in enumerate(ids[:10]))


def test_a_seek_to_a_saved_position_gives_the_same_next_batches(tok, tmp_path: Path) -> None:
    a = write_parquet(tmp_path / "a.parquet", make_samples(30, seed=1))
    b = _parquet(tmp_path / "b.parquet", make_samples(200, seed=9), row_group_size=40)
    mix = [MixSource(name="traffic", weight=1.0, data_files=[str(a)]),
           MixSource(name="general", weight=1.0, data_files=[str(b)])]
    ref = _stream(mix, tok, window_samples=16)
    want = [ref.batch(k) for k in range(80)]
    for at in (0, 5, 17, 41):
        position = json.loads(json.dumps(ref.position(at)))  # as the checkpoint holds it
        resumed = _stream(mix, tok, window_samples=16)
        resumed.seek(position)
        assert all(_same(resumed.batch(k), want[k]) for k in range(at, 80)), at


def test_a_source_far_larger_than_the_window_is_never_held_whole(tok, tmp_path: Path) -> None:
    big = _parquet(tmp_path / "big.parquet", make_samples(600, seed=4), row_group_size=25)
    small = write_parquet(tmp_path / "small.parquet", make_samples(10, seed=5))
    mix = [MixSource(name="traffic", weight=1.0, data_files=[str(small)]),
           MixSource(name="general", weight=9.0, data_files=[str(big)])]
    stream = _stream(mix, tok, window_samples=12)
    for k in range(300):  # past one pass over the big source
        stream.release(k)
        stream.batch(k)
    assert stream.summary()["general"]["drawn"] > 600
    # A window's samples (two while a step spans a window's end), one row group of raw rows.
    assert stream.peak_examples_held <= 2 * 12
    assert stream.readers[1].peak_rows_held == 25


def test_jsonl_sources_read_a_block_at_a_time_in_a_seeded_order(tmp_path: Path) -> None:
    path = tmp_path / "general.jsonl"
    lines = [json.dumps({"messages": s["messages"]}) for s in make_samples(25, seed=6)]
    path.write_text("\n".join(lines[:10]) + "\n\n" + "\n".join(lines[10:]) + "\n")
    import factory.trainer.data as data

    old = data.BLOCK_LINES
    data.BLOCK_LINES = 4
    try:
        reader = SourceReader(MixSource(name="general", weight=1.0, payload_file=str(path)),
                              index=1, seed=3)
    finally:
        data.BLOCK_LINES = old
    assert reader.num_rows == 25 and len(reader.blocks) == 7
    epoch0 = [reader.row(0, i)["sample_id"] for i in range(25)]
    assert sorted(epoch0) == sorted(r["sample_id"] for r in reader.rows())
    assert "line-12" in epoch0 and "line-11" not in epoch0  # the blank line keeps its number
    assert epoch0 != [reader.row(1, i)["sample_id"] for i in range(25)]
    assert reader.peak_rows_held == 4


def test_the_pre_launch_check_covers_every_source_of_a_mix(tiny_model_dir: Path,
                                                          tmp_path: Path) -> None:
    from factory.trainer.config import TrainerJob
    from factory.trainer.data import check_job_data

    traffic = write_parquet(tmp_path / "t.parquet", make_samples(30, seed=1))
    long = [{"sample_id": f"long-{i}", "tools": [], "messages": [
        {"role": "user", "content": [{"type": "text", "text": "moon river " * 300}]},
        {"role": "assistant", "content": [{"type": "text", "text": "ok"}]}]} for i in range(2)]
    general = write_parquet(tmp_path / "g.parquet", make_samples(40, seed=2) + long)
    plan = {"base_model": str(tiny_model_dir), "max_seq_len": 320, "learning_rate": 1e-3,
            "num_steps": 1}

    def job(weight_files: list[tuple[str, Path]]) -> TrainerJob:
        return TrainerJob.from_dict({"run_id": "check", "output_dir": str(tmp_path / "out"),
                              "plan": plan, "mix": [
                                  {"name": n, "weight": 1.0, "data_files": [str(f)]}
                                  for n, f in weight_files]})

    stats = check_job_data(job([("traffic", traffic)]))
    assert stats.num_samples == 30 and stats.num_dropped == 0
    with pytest.raises(ValueError, match=r"would drop 2 of 42 file:general\.jsonl samples "
                                         r"\(4\.8%, over the 1% limit\): 2 too_long_for_plan"):
        check_job_data(job([("traffic", traffic), ("file:general.jsonl", general)]))


def test_a_resume_against_other_sources_or_weights_is_refused(make_job, tmp_path: Path) -> None:
    from factory.trainer.config import TrainerJob
    from factory.trainer.train import ExitCode, run_job
    from factory.trainer.webhooks import read_events

    traffic = write_parquet(tmp_path / "traffic.parquet", make_samples(24))
    general = write_parquet(tmp_path / "general.parquet", make_samples(40, seed=3))

    def mix(weight: float) -> list[dict[str, Any]]:
        return [{"name": "traffic", "weight": 1.0, "data_files": [str(traffic)]},
                {"name": "general", "weight": weight, "data_files": [str(general)]}]

    plan = {"num_steps": 2, "checkpoint_every_steps": 1}
    first = TrainerJob.from_json(make_job("mixed", plan=plan, data_files=[], mix=mix(1.0)))
    assert run_job(first) == ExitCode.FINISHED
    again = TrainerJob.from_json(make_job("mixed", plan={**plan, "num_steps": 3}, data_files=[],
                                   mix=mix(2.0), resume_from="latest"))
    assert run_job(again) == ExitCode.DATA_ERROR
    failed = [e for e in read_events(again.events_path) if e["type"] == "failed"]
    assert "was trained on different data" in failed[-1]["error"]
