"""File ingest end to end on a real lake: raw first, rejects quarantined, re-ingest a no-op."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

import pytest

from factory.blobs import BlobStore
from factory.ingest import RawRecord, ingest_paths, ingest_records, read_file
from factory.lake import Lake, Lineage
from tests.ingest import conversations as conv

GOOD = [conv.openai_call(), conv.anthropic_call(), conv.gemini_snake_call(),
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
        {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}]

# (line, the words its rejection reason must contain)
BAD = [
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assis', "invalid JSON"),
    ('{"messages": "hello"}', "messages: expected an array"),
    ('{"messages": [{"role": "narrator", "content": "x"}, {"role": "assistant", "content": "y"}]}',
     "messages[0].role: unknown role 'narrator'"),
    (json.dumps({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@not-base64@@"}}]},
        {"role": "assistant", "content": "y"}]}),
     "messages[0].content[0].image_url.url: invalid base64"),
    (json.dumps({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{conv.JPEG_B64}"}}]},
        {"role": "assistant", "content": "y"}]}),
     "stated media type 'image/png' but the bytes are image/jpeg"),
    ('{"weather": "sunny", "temp": 21}', "no format recognizes it"),
    ('[1, 2, 3]', "expected a JSON object"),
    (json.dumps({**conv.openai_call(), "status": 429, "response": {"error": {"message": "rate"}}}),
     "status: the upstream call returned 429"),
    (json.dumps({"messages": [{"role": "user", "content": 42},
                              {"role": "assistant", "content": "y"}]}),
     "messages[0].content: expected an array, got a number"),
]


def _write_mixed(path: Path) -> None:
    lines = []
    for i in range(max(len(GOOD), len(BAD))):
        if i < len(GOOD):
            lines.append(json.dumps(GOOD[i], ensure_ascii=False))
        if i < len(BAD):
            lines.append(BAD[i][0])
    path.write_text("\n".join(lines) + "\n\n", encoding="utf-8")


def _snapshots(lake: Lake) -> dict[str, int | None]:
    return {t: lake.snapshot_id(t) for t in ("raw_traces", "samples", "rejected_traces")}


def test_mixed_file_ingests_every_good_line_and_quarantines_every_bad_one(
        factory_home: Path, tmp_path: Path) -> None:
    path = tmp_path / "mixed.jsonl"
    _write_mixed(path)
    lake = Lake()
    summary = ingest_paths(lake, [path], tags={"team": "search"})
    assert summary.as_dict() == {"read": len(GOOD) + len(BAD), "ingested": len(GOOD),
                                 "rejected": len(BAD), "duplicates": 0}
    raw = lake.read("raw_traces")
    assert raw.num_rows == len(GOOD) + len(BAD)
    samples = lake.read("samples").to_pylist()
    assert len(samples) == len(GOOD)
    rejected = lake.read("rejected_traces").to_pylist()
    reasons = sorted(r["reason"] for r in rejected)
    for _, words in BAD:
        assert sum(words in r for r in reasons) == 1, (words, reasons)
    assert {r["raw_trace_id"] for r in rejected} <= set(raw.column("raw_trace_id").to_pylist())
    payloads = {r["payload"] for r in rejected}
    assert {line for line, _ in BAD} == payloads  # each bad line kept exactly as it came
    one = next(s for s in samples if s["provider"] == "anthropic")
    assert json.loads(one["messages"]) == conv.CANONICAL_MESSAGES
    assert one["has_images"] and one["has_tool_calls"] and one["num_turns"] == 2
    assert dict(one["tags"]) == {"team": "search"}
    assert one["source"] == "upload"
    assert BlobStore().get(conv.PNG_SHA) == conv.PNG
    formats = sorted(raw.column("format").to_pylist())
    assert formats.count("unknown") == 3 and "sharegpt" in formats and "gemini" in formats


def test_reingesting_a_file_changes_no_table(factory_home: Path, tmp_path: Path) -> None:
    path = tmp_path / "mixed.jsonl"
    _write_mixed(path)
    lake = Lake()
    ingest_paths(lake, [path])
    before = _snapshots(lake)
    again = ingest_paths(lake, [path], batch_rows=3)
    assert again.as_dict() == {"read": len(GOOD) + len(BAD), "ingested": 0, "rejected": 0,
                               "duplicates": len(GOOD) + len(BAD)}
    assert _snapshots(lake) == before
    assert again.snapshots == {}


def test_same_record_twice_in_one_batch_is_one_raw_row(factory_home: Path) -> None:
    lake = Lake()
    now = datetime.now(tz=UTC)
    recs = [RawRecord(payload=conv.openai_call(), source="proxy", received_at=now, tags={})
            for _ in range(3)]
    summary = ingest_records(lake, recs,
                             lineages={"raw_traces": Lineage(run_id="r1", asset_key="gateway")})
    assert (summary.ingested, summary.duplicates) == (1, 2)
    assert lake.snapshot_info("raw_traces")["run_id"] == "r1"


def test_batches_commit_once_per_table_not_per_record(factory_home: Path) -> None:
    lake = Lake()
    now = datetime.now(tz=UTC)
    recs = [RawRecord(payload={"messages": [{"role": "user", "content": f"q{i}"},
                                            {"role": "assistant", "content": "a"}]},
                      source="upload", received_at=now, tags={}) for i in range(25)]
    ingest_records(lake, recs, batch_rows=10)
    info = lake.snapshot_info("samples")
    assert info["rows"] == 25 and info["earlier_snapshots"] == 2  # 3 commits for 25 records


def test_gateway_ids_and_errors_never_raise(factory_home: Path) -> None:
    lake = Lake()
    now = datetime.now(tz=UTC)
    recs = [RawRecord(payload=object(), source="proxy", received_at=now, tags={}),
            RawRecord(payload=conv.openai_call(), source="proxy", received_at=now, tags={},
                      raw_trace_id="capture-1", project="p")]
    summary = ingest_records(lake, recs)
    assert summary.as_dict() == {"read": 2, "ingested": 1, "rejected": 1, "duplicates": 0}
    assert lake.read("samples").column("raw_trace_id").to_pylist() == ["capture-1"]
    assert ingest_records(lake, recs[1:]).duplicates == 1


def test_new_ids_skip_the_lake_s_ids_and_still_dedupe_among_themselves(
        factory_home: Path) -> None:
    """``new_ids`` (the gateway's first attempt at its own captures) reads no raw_traces ids:
    a record already in the lake is not found (the caller vouches it cannot be), and a record
    twice among the new ones is still one row."""
    lake = Lake()
    now = datetime.now(tz=UTC)

    def rec(i: int) -> RawRecord:
        return RawRecord(payload=conv.openai_call(), source="proxy", received_at=now, tags={},
                         raw_trace_id=f"capture-{i}")

    assert ingest_records(lake, [rec(1)]).ingested == 1
    lineage = Lineage(run_id="r2", asset_key="gateway")
    summary = ingest_records(lake, [rec(2), rec(3), rec(3)], new_ids=True,
                             lineages={"raw_traces": lineage})
    assert (summary.ingested, summary.duplicates) == (2, 1)
    assert "raw_traces" not in lineage.reads
    assert ingest_records(lake, [rec(1)], new_ids=True).ingested == 1  # not looked up
    assert ingest_records(lake, [rec(1)]).duplicates == 1  # looked up


def test_json_array_gz_and_folders(factory_home: Path, tmp_path: Path) -> None:
    root = tmp_path / "drop"
    (root / "nested").mkdir(parents=True)
    (root / "array.json").write_text(json.dumps(GOOD[:3]))
    (root / "one.json").write_text(json.dumps(GOOD[3], indent=2))
    with gzip.open(root / "nested" / "lines.jsonl.gz", "wt") as fh:
        fh.write(json.dumps(GOOD[4]) + "\n" + json.dumps(conv.gemini_call()) + "\n")
    (root / "nested" / "otel.json").write_text(json.dumps(conv.otlp_export()))
    (root / "ignored.txt").write_text("not ingested")
    summary = ingest_paths(Lake(), [root])
    assert summary.as_dict() == {"read": 7, "ingested": 7, "rejected": 0, "duplicates": 0}


def test_json_array_streams_elements_across_buffer_edges(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import factory.ingest.files as files

    monkeypatch.setattr(files, "_CHUNK", 64)  # elements span many refills
    items = [{"messages": [{"role": "user", "content": "x" * i},
                           {"role": "assistant", "content": str(10 ** i)}]} for i in range(40)]
    path = tmp_path / "a.json"
    path.write_text(json.dumps(items))
    got = [r.payload for r in read_file(path)]
    assert got == items
    path.write_text(json.dumps(items)[:-40])
    recs = list(read_file(path))
    assert recs[-1].parse_error is not None and "invalid JSON" in recs[-1].parse_error


def test_cli_prints_one_json_line(factory_home: Path, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    from factory.app.cli import main

    path = tmp_path / "mixed.jsonl"
    _write_mixed(path)
    assert main(["ingest", str(path), "--tag", "src=test", "--format", "auto"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == {"read": 14, "ingested": 5, "rejected": 9, "duplicates": 0}
    assert main(["ingest", str(path), "--workers", "2"]) == 0  # a small file: in process
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["duplicates"] == 14
    assert main(["ingest", str(path), "--tag", "nope"]) == 2
    assert "KEY=VALUE" in capsys.readouterr().err
    assert main(["ingest", str(tmp_path / "missing.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err


@contextmanager
def dying_after_raw_commit(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Inside: every commit after the raw_traces one fails, as if the process died there."""
    # Rows are committed as Arrow tables (``append``) or as data files written by ingest
    # workers (``commit_files``): both die after raw_traces.
    real = {"append": Lake.append, "commit_files": Lake.commit_files}

    def dying(method: str) -> object:
        def commit(self: Lake, name: str, data: object, **kwargs: object) -> object:
            if name != "raw_traces":
                raise OSError("process died after the raw_traces commit")
            return real[method](self, name, data, **kwargs)  # type: ignore[operator]
        return commit

    for method in real:
        monkeypatch.setattr(Lake, method, dying(method))
    try:
        yield
    finally:
        for method, fn in real.items():
            monkeypatch.setattr(Lake, method, fn)


def test_crash_between_raw_and_samples_commits_is_healed_on_replay(
        factory_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "mixed.jsonl"
    _write_mixed(path)
    lake = Lake()
    with dying_after_raw_commit(monkeypatch), pytest.raises(OSError):
        ingest_paths(lake, [path])
    assert lake.read("raw_traces").num_rows == len(GOOD) + len(BAD)
    assert lake.snapshot_id("samples") is None

    replay = ingest_paths(lake, [path])
    assert replay.as_dict() == {"read": len(GOOD) + len(BAD), "ingested": len(GOOD),
                                "rejected": len(BAD), "duplicates": 0}
    assert lake.read("raw_traces").num_rows == len(GOOD) + len(BAD)  # raw rows not rewritten
    assert lake.read("rejected_traces").num_rows == len(BAD)
    assert sorted(lake.read("samples").column("raw_trace_id").to_pylist()) == sorted(
        lake.sql("select raw_trace_id from raw_traces where raw_trace_id not in "
                 "(select raw_trace_id from rejected_traces)").column(0).to_pylist())
    assert ingest_paths(lake, [path]).duplicates == len(GOOD) + len(BAD)


def _chat(i: int) -> RawRecord:
    return RawRecord(payload={"messages": [{"role": "user", "content": f"q{i}"},
                                           {"role": "assistant", "content": "a"}]},
                     source="upload", received_at=datetime.now(tz=UTC), tags={})


@pytest.mark.parametrize("background", [False, True])
def test_duplicates_across_chunks_and_uncommitted_batches(
        factory_home: Path, monkeypatch: pytest.MonkeyPatch, background: bool) -> None:
    import time

    import factory.ingest.records as records

    monkeypatch.setattr(records, "CHUNK_RECORDS", 2)
    real_append = Lake.append

    def slow_append(self: Lake, name: str, data: object, **kwargs: object) -> object:
        time.sleep(0.2)  # keep batches in flight while later ones are deduped
        return real_append(self, name, data, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Lake, "append", slow_append)
    lake = Lake()
    order = [*range(12), 0, 5, 11, 3]
    summary = ingest_records(lake, [_chat(i) for i in order], batch_rows=5,
                             background_writes=background)
    assert summary.as_dict() == {"read": 16, "ingested": 12, "rejected": 0, "duplicates": 4}
    assert summary.num_samples == 12
    info = lake.snapshot_info("raw_traces")
    assert info["rows"] == 12 and info["earlier_snapshots"] == 2  # the last batch is all dups
    assert lake.read("samples").num_rows == 12


@pytest.mark.parametrize("background", [False, True])
def test_a_failed_commit_stops_the_later_batches(
        factory_home: Path, monkeypatch: pytest.MonkeyPatch, background: bool) -> None:
    lake = Lake()
    real_append = Lake.append

    def failing_append(self: Lake, name: str, data: object, **kwargs: object) -> object:
        if name == "samples":
            raise OSError("disk full")
        return real_append(self, name, data, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Lake, "append", failing_append)
    with pytest.raises(OSError, match="disk full"):
        ingest_records(lake, [_chat(i) for i in range(6)], batch_rows=2,
                       background_writes=background)
    assert lake.read("raw_traces").num_rows == 2  # the first batch's raw rows, nothing after


def test_samples_lineage_reaches_the_raw_traces_they_came_from(factory_home: Path) -> None:
    from factory.lake import walk_lineage

    lake = Lake()
    now = datetime.now(tz=UTC)
    ingest_records(lake, [RawRecord(payload=conv.openai_call(), source="upload",
                                    received_at=now, tags={})],
                   lineages={"raw_traces": Lineage(run_id="r1", asset_key="traces")})
    tree = walk_lineage(lake, "samples")
    [up] = tree["upstream"]
    assert (up["table"], up["snapshot_id"]) == ("raw_traces", lake.snapshot_id("raw_traces"))
    assert lake.snapshot_info("raw_traces")["reads"] == {}  # raw rows have no table source


def test_ingest_without_a_lineage_still_leads_from_samples_to_raw_traces(
        factory_home: Path) -> None:
    """The gateway's flusher and `factory ingest` run outside Dagster and pass no lineage."""
    from factory.lake import walk_lineage

    lake = Lake()
    ingest_records(lake, [RawRecord(payload=conv.openai_call(), source="proxy",
                                    received_at=datetime.now(tz=UTC), tags={})])
    tree = walk_lineage(lake, "samples")
    assert [(u["table"], u["snapshot_id"]) for u in tree["upstream"]] == [
        ("raw_traces", lake.snapshot_id("raw_traces"))]
    assert tree["asset_key"] == "samples" and tree["run_id"].startswith("ingest-")
