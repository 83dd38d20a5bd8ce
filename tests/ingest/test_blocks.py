"""File ingest by blocks: JSON Lines cut into byte ranges, written as data files, committed.

``ingest_paths`` cuts JSON Lines files into blocks (``factory.ingest.files.line_blocks``), each
block is normalized and written as Parquet data files (``factory.ingest.workers.ingest_block``),
and the main process dedupes across blocks (rewriting a block's files without repeated ids) and
commits the files raw_traces first. These tests force many tiny blocks (``_BLOCK_BYTES``) and
check what a user relies on: the first copy of a record wins and nothing is lost or doubled,
line numbers in rejection reasons stay right across blocks, a compressed file gives the same
tables as a plain one, a crash or failure leaves the lake consistent (and no data file nobody
references), the files are Snappy-compressed and their lineage leads from samples back to
raw_traces.

Tests marked ``xfail(strict=True)`` pin bugs found in review (see each reason): they fail once
the bug is fixed, and the marker must then go.
"""

from __future__ import annotations

import gzip
import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pyarrow.parquet as pq
import pytest

import factory.ingest.files
import factory.ingest.pipeline
import factory.ingest.tables
import factory.ingest.workers
from factory.datafiles import FileTarget
from factory.ingest import IngestSummary, ingest_paths
from factory.lake import Lake, walk_lineage
from factory.tables import NAMESPACE, schema_of
from tests.ingest.test_pipeline import dying_after_raw_commit

TABLES = ("raw_traces", "samples", "rejected_traces")

# Every line of the layout files is WIDTH bytes with its newline, and a block is BLOCK bytes:
# exactly four lines per block, so which record lands in which block is known.
WIDTH = 100
BLOCK = 4 * WIDTH


def _chat(i: int, pad: int = 0) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": f"q{i}" + "x" * pad},
                         {"role": "assistant", "content": "a"}]}


def _fixed(record: dict[str, Any], spelling: int = 0) -> bytes:
    """``record`` as a WIDTH-byte line; ``spelling`` 1 is the same record spaced differently
    (same raw_trace_id, different stored payload), padded with spaces inside the object."""
    body = json.dumps(record, separators=(",", ":"))
    if spelling:
        body = body.replace(",", ", ")
    assert len(body) < WIDTH - 1
    return (body[:-1] + " " * (WIDTH - 1 - len(body)) + "}\n").encode()


def _line(i: int, spelling: int = 0) -> bytes:
    """Chat record ``i`` as a WIDTH-byte line."""
    return _fixed(_chat(i), spelling)


BAD = b"{oops" + b"x" * (WIDTH - 6) + b"\n"  # not JSON; WIDTH bytes too
NO_FORMAT = {"weather": "sunny", "temp": 21}  # JSON that no normalizer takes: rejected


def _layout() -> tuple[list[bytes], dict[str, Any]]:
    """Five blocks with repeats one block later (written by the block, then dropped from its
    files), a block made only of repeats, and repeats four blocks later; returns the lines and
    what to expect."""
    rej, rej_again = _fixed(NO_FORMAT), _fixed(NO_FORMAT, 1)
    blocks = [
        [_line(0), BAD, _line(1), rej],
        [_line(2), _line(1, 1), rej_again, BAD],
        [_line(0, 1), _line(2, 1), rej_again, _line(1, 1)],  # nothing new
        [_line(3), _line(4), _line(5), _line(6)],
        [_line(7), _line(0, 1), BAD, _line(8)],
    ]
    lines = [line for block in blocks for line in block]
    assert all(len(line) == WIDTH for line in lines)
    expect = {"read": 20, "ingested": 9, "rejected": 2, "duplicates": 9,
              # the first spelling of every record, as stored (stripped)
              "payloads": {_line(i).strip().decode() for i in range(9)}
              | {BAD.strip().decode(), rej.strip().decode()},
              "bad_lineno": 2}
    return lines, expect


@pytest.fixture()
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> int:
    """Blocks of BLOCK bytes (the cap too: a file's blocks otherwise grow with its size)."""
    monkeypatch.setattr(factory.ingest.files, "_BLOCK_BYTES", BLOCK)
    monkeypatch.setattr(factory.ingest.files, "_MAX_BLOCK_BYTES", BLOCK)
    return BLOCK


def _check_counts(summary: IngestSummary) -> None:
    assert summary.read == summary.ingested + summary.rejected + summary.duplicates


def _ids(lake: Lake, name: str) -> list[str]:
    return lake.read(name, columns=["raw_trace_id"]).column(0).to_pylist()


def _assert_consistent(lake: Lake) -> None:
    """No id twice in a table, and every raw row has exactly one outcome (each test record has
    one conversation, so one sample)."""
    raw, samples, rejected = (_ids(lake, name) for name in TABLES)
    for name, ids in zip(TABLES, (raw, samples, rejected), strict=True):
        repeated = [i for i, n in Counter(ids).items() if n > 1]
        assert not repeated, f"{name} holds {len(repeated)} id(s) twice"
    assert not set(samples) & set(rejected)
    assert set(samples) | set(rejected) == set(raw)


def _committed_files(lake: Lake, name: str) -> list[Path]:
    """The data files the table's current snapshot references."""
    tbl = lake.table(name)
    if tbl.current_snapshot() is None:
        return []
    return [Path(urlparse(task.file.file_path).path) for task in tbl.scan().plan_files()]


def _unreferenced(lake: Lake) -> dict[str, set[str]]:
    """The .parquet files in each table's data folder that no snapshot references (tables here
    are append-only: the current snapshot holds every file ever committed)."""
    out = {}
    for name in TABLES:
        folder = Path(urlparse(lake.table(name).metadata.location).path) / "data"
        on_disk = {p.name for p in folder.glob("*.parquet")} if folder.exists() else set()
        out[name] = on_disk - {p.name for p in _committed_files(lake, name)}
    return out


def _no_garbage(lake: Lake) -> None:
    left = _unreferenced(lake)
    assert left == {name: set() for name in TABLES}, left


def _snapshots(lake: Lake) -> dict[str, int | None]:
    return {name: lake.snapshot_id(name) for name in TABLES}


def _tables(lake: Lake, rename: Callable[[str], str] = str) -> dict[str, list[tuple[str, ...]]]:
    """Every table's rows, sorted, without the receive time (and samples' created_at, which
    defaults to it); ``rename`` applied to rejection reasons (they name the file)."""
    out = {}
    for name in TABLES:
        rows = []
        for row in lake.read(name).to_pylist():
            if "reason" in row:
                row["reason"] = rename(row["reason"])
            rows.append(tuple(f"{k}={v}" for k, v in sorted(row.items())
                              if k not in ("received_at", "created_at")))
        out[name] = sorted(rows)
    return out


def _write_layout(path: Path) -> dict[str, Any]:
    lines, expect = _layout()
    data = b"".join(lines)
    path.write_bytes(gzip.compress(data) if path.name.endswith(".gz") else data)
    return expect


def _as_dict(expect: dict[str, Any]) -> dict[str, int]:
    return {k: expect[k] for k in ("read", "ingested", "rejected", "duplicates")}


def _assert_layout_tables(lake: Lake, expect: dict[str, Any], name: str = "a.jsonl") -> None:
    _assert_consistent(lake)
    assert lake.read("samples").num_rows == expect["ingested"]
    # The first copy of each record is the one stored, whichever block its repeats fell in.
    assert set(lake.read("raw_traces").column("payload").to_pylist()) == expect["payloads"]
    reasons = sorted(lake.read("rejected_traces").column("reason").to_pylist())
    assert len(reasons) == 2
    assert reasons[0].startswith(f"{name}:{expect['bad_lineno']}: invalid JSON"), reasons
    assert "no format recognizes it" in reasons[1], reasons


# -- 1. repeats across blocks ----------------------------------------------------------------
@pytest.mark.parametrize("workers", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_repeats_across_blocks_keep_the_first_copy_and_leave_no_file_behind(
        factory_home: Path, tmp_path: Path, small_blocks: int,
        monkeypatch: pytest.MonkeyPatch, workers: int) -> None:
    path = tmp_path / "a.jsonl"
    expect = _write_layout(path)
    deleted: list[tuple[str, str]] = []
    real_delete = Lake.delete_files

    def spy(self: Lake, name: str, locations: Any) -> None:
        deleted.extend((name, loc) for loc in locations)
        real_delete(self, name, locations)

    monkeypatch.setattr(Lake, "delete_files", spy)
    lake = Lake()
    summary = ingest_paths(lake, [path], workers=workers)
    assert summary.as_dict() == _as_dict(expect)
    _check_counts(summary)
    assert summary.num_samples == expect["ingested"]
    _assert_layout_tables(lake, expect)
    # Repeats one block later were written by their block and dropped from its files: the
    # replaced files are gone, and nothing in the data folders is left unreferenced.
    assert {name for name, _ in deleted} == set(TABLES), "the layout no longer tests the drop"
    assert not [loc for _, loc in deleted if Path(urlparse(loc).path).exists()]
    _no_garbage(lake)


def test_repeats_across_blocks_in_a_table_made_by_an_older_declaration(
        factory_home: Path, tmp_path: Path, small_blocks: int) -> None:
    import pyarrow as pa

    catalog = Lake().catalog
    for name in TABLES:  # as before ``source`` was declared: Lake.table adds it at the end
        older = pa.schema([f for f in schema_of(name) if f.name != "source"])
        catalog.create_table((NAMESPACE, name), schema=older)
    path = tmp_path / "a.jsonl"
    expect = _write_layout(path)
    lake = Lake()
    summary = ingest_paths(lake, [path], workers=1)
    assert summary.as_dict() == _as_dict(expect)
    _assert_layout_tables(lake, expect)
    assert set(lake.read("raw_traces").column("source").to_pylist()) == {"upload"}


# -- 2. block edges --------------------------------------------------------------------------
LONG = json.dumps(_chat(1, pad=1500)).encode()  # longer than three blocks
EDGE_LINES: list[tuple[bytes, bytes]] = [
    (json.dumps(_chat(0)).encode(), b"\r\n"),  # 1
    (b"", b"\r\n"),  # 2: blank, CRLF
    (LONG, b"\n"),  # 3
    (b"{broken", b"\n"),  # 4: not JSON
    (json.dumps(_chat(2)).encode(), b"\r\n"),  # 5
    (b"  \t", b"\n"),  # 6: only whitespace
    (b'{"messages": "caf\xe9"}', b"\n"),  # 7: not UTF-8 (latin-1)
    *[(json.dumps(_chat(i)).encode(), b"\n") for i in range(3, 13)],  # 8-17
    (b"[1, 2", b"\r\n"),  # 18: not JSON
    (LONG, b"\n"),  # 19: a repeat of line 3
    (json.dumps(_chat(13)).encode(), b""),  # 20: no newline at the end of the file
]
EDGE_BYTES = b"".join(line + end for line, end in EDGE_LINES)


@pytest.mark.parametrize("name", ["a.jsonl", "a.jsonl.gz"])
def test_long_lines_crlf_blank_lines_bad_utf8_and_no_final_newline(
        factory_home: Path, tmp_path: Path, small_blocks: int, name: str) -> None:
    assert len(LONG) > 3 * small_blocks
    path = tmp_path / name
    path.write_bytes(gzip.compress(EDGE_BYTES) if name.endswith(".gz") else EDGE_BYTES)
    lake = Lake()
    summary = ingest_paths(lake, [path], workers=1)
    assert summary.as_dict() == {"read": 18, "ingested": 14, "rejected": 3, "duplicates": 1}
    _assert_consistent(lake)
    rejected = {r["reason"].split(" (")[0]: r["payload"]
                for r in lake.read("rejected_traces").to_pylist()}
    # Line numbers count every line (blank ones too) across blocks, CRLF or not.
    assert rejected == {f"{name}:4: invalid JSON": "{broken",
                        f"{name}:7: invalid JSON": '{"messages": "caf\ufffd"}',
                        f"{name}:18: invalid JSON": "[1, 2"}
    # Every record stored as its line: whole (the long one), without the CR.
    stored = set(lake.read("raw_traces").column("payload").to_pylist())
    assert stored == {line.decode("utf-8", "replace") for line, _ in EDGE_LINES
                      if line.strip()}
    assert LONG.decode() in stored


PADDED_LINES = [
    b"  " + json.dumps(_chat(20)).encode(),  # leading spaces
    b"\t" + json.dumps(_chat(21)).encode() + b" \r",  # a tab before, space and CR after
    json.dumps(_chat(22)).encode() + b" " * 9,  # more trailing whitespace than is trimmed
    b"\x0b\x0c" + json.dumps(_chat(23)).encode() + b"\r",  # vertical tab, form feed
    b"{}", b" [] ", b'"x"',  # short records (held in the view itself), rejected
    b'{"a": 1234}', b'{"ab": 1234}', b'{"abc": 1234}',  # 11, 12 and 13 bytes
    json.dumps({"messages": [{"role": "user", "content": "caf\u00e9 \u2603"},
                             {"role": "assistant", "content": "\u00e0 toi"}]},
               ensure_ascii=False).encode(),  # not ASCII
]


@pytest.mark.parametrize("buffer_per_line", [False, True])
def test_each_payload_is_its_line_stripped_as_it_was_parsed(
        factory_home: Path, tmp_path: Path, small_blocks: int, buffer_per_line: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Payloads are cut out of the block as Arrow views: every kind of whitespace at either
    end is off, records of 12 bytes or less (stored in the view itself) and over, and a block
    too large for one view buffer (a line of gigabytes; here the limit is lowered) gets one
    buffer per line."""
    if buffer_per_line:
        monkeypatch.setattr(factory.ingest.tables, "_VIEW_BUFFER_BYTES", 1)
    path = tmp_path / "padded.jsonl"
    path.write_bytes(b"\n".join(PADDED_LINES * 3) + b"\n")  # three copies: duplicates
    lake = Lake()
    summary = ingest_paths(lake, [path], workers=1)
    assert summary.as_dict() == {"read": 33, "ingested": 5, "rejected": 6, "duplicates": 22}
    want = {line.strip().decode() for line in PADDED_LINES}
    assert len(want) == 11
    assert set(lake.read("raw_traces").column("payload").to_pylist()) == want
    rejected = lake.read("rejected_traces")
    assert set(rejected.column("payload").to_pylist()) == {
        "{}", "[]", '"x"', '{"a": 1234}', '{"ab": 1234}', '{"abc": 1234}'}


def test_lines_that_are_not_json_go_with_each_commit_not_all_at_the_end(
        factory_home: Path, tmp_path: Path, small_blocks: int) -> None:
    """The main process rejects the lines that are not JSON (it alone knows their numbers):
    they are written with every commit, so a long file does not hold them all until its end."""
    path = tmp_path / "broken.jsonl"
    lines = [_line(i) if i % 4 else b"{not json %d\n" % i for i in range(40)]
    path.write_bytes(b"".join(lines))
    lake = Lake()
    summary = ingest_paths(lake, [path], workers=1, batch_rows=8)
    assert summary.rejected == 10 and summary.ingested == 30
    commits = [int(snap.summary["added-records"])
               for snap in lake.table("rejected_traces").snapshots()]
    assert len(commits) >= 3 and sum(commits) == 10, commits
    _assert_consistent(lake)


def test_a_record_too_long_for_a_view_is_a_clear_error() -> None:
    """A payload's length is 32-bit in Arrow (and in the view that cuts it out of its block):
    a record of 2 GiB or more is refused with its size, not wrapped to a negative length."""
    import numpy as np

    block = b"x" * 64
    with pytest.raises(ValueError, match="2147483648 bytes"):
        factory.ingest.tables._views(block, np.frombuffer(block, dtype=np.uint8),
                                     np.array([0]), np.array([2**31]))


@pytest.mark.parametrize("workers", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_line_numbers_count_across_blocks_and_restart_in_each_file(
        factory_home: Path, tmp_path: Path, small_blocks: int, workers: int) -> None:
    def bad(tag: str) -> bytes:
        return (b"{" + tag.encode()).ljust(WIDTH - 1, b"x") + b"\n"

    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_bytes(b"".join([*map(_line, range(6)), bad("a7"), *map(_line, range(6, 9)),
                                bad("a11"), _line(9)]))  # three blocks
    second.write_bytes(b"".join([*map(_line, range(10, 15)), bad("b6"), *map(_line, (15, 16))]))
    lake = Lake()
    summary = ingest_paths(lake, [first, second], workers=workers)
    assert summary.as_dict() == {"read": 20, "ingested": 17, "rejected": 3, "duplicates": 0}
    reasons = sorted(r.split(" (")[0] for r in
                     lake.read("rejected_traces").column("reason").to_pylist())
    assert reasons == ["a.jsonl:11: invalid JSON", "a.jsonl:7: invalid JSON",
                       "b.jsonl:6: invalid JSON"]


# -- 3. compressed = plain -------------------------------------------------------------------
def test_a_gz_file_of_several_blocks_gives_the_same_tables_as_the_plain_file(
        tmp_path: Path, small_blocks: int, monkeypatch: pytest.MonkeyPatch) -> None:
    lines, _ = _layout()
    data = b"".join(lines) + EDGE_BYTES
    got = {}
    for name in ("a.jsonl", "a.jsonl.gz"):
        monkeypatch.setenv("FACTORY_HOME", str(tmp_path / f"home-{name}"))
        path = tmp_path / name
        path.write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
        lake = Lake()
        summary = ingest_paths(lake, [path], workers=1)
        _check_counts(summary)
        got[name] = (summary.as_dict(), _tables(lake, lambda r: r.replace("a.jsonl.gz:",
                                                                          "a.jsonl:")))
        _no_garbage(lake)
    assert got["a.jsonl"] == got["a.jsonl.gz"]
    assert got["a.jsonl"][0]["read"] == 20 + 18


# -- 4. a .json and a .jsonl file ------------------------------------------------------------
@pytest.mark.parametrize(("json_first", "batch_rows"),
                         [(True, 1_000_000), (True, 1), (False, 1_000_000)])
def test_the_same_record_in_a_json_and_a_jsonl_file_is_one_raw_row(
        factory_home: Path, tmp_path: Path, small_blocks: int, json_first: bool,
        batch_rows: int) -> None:
    one = tmp_path / "one.json"
    one.write_text(json.dumps(_chat(5), indent=2))
    lines = tmp_path / "many.jsonl"
    lines.write_bytes(b"".join(_line(i) for i in range(12)))  # three blocks; record 5 in the 2nd
    lake = Lake()
    summary = ingest_paths(lake, [one, lines] if json_first else [lines, one], workers=1,
                           batch_rows=batch_rows)
    assert summary.as_dict() == {"read": 13, "ingested": 12, "rejected": 0, "duplicates": 1}
    _assert_consistent(lake)
    assert lake.read("raw_traces").num_rows == 12
    [payload] = [p for p in lake.read("raw_traces").column("payload").to_pylist()
                 if json.loads(p) == _chat(5)]
    assert payload == (one.read_text() if json_first else _line(5).strip().decode())
    _no_garbage(lake)


# -- 5. re-ingest, crash and replay ----------------------------------------------------------
def test_reingest_commits_nothing_and_counts_every_record_as_a_duplicate(
        factory_home: Path, tmp_path: Path, small_blocks: int) -> None:
    path = tmp_path / "a.jsonl"
    expect = _write_layout(path)
    lake = Lake()
    ingest_paths(lake, [path], workers=1, batch_rows=4)
    before = _snapshots(lake)
    again = ingest_paths(lake, [path], workers=1, batch_rows=4)
    assert again.as_dict() == {"read": expect["read"], "ingested": 0, "rejected": 0,
                               "duplicates": expect["read"]}
    assert again.snapshots == {}
    assert _snapshots(lake) == before
    _no_garbage(lake)  # nor any file written and left uncommitted


@pytest.mark.parametrize("batch_rows", [1_000_000, 4])
def test_a_crash_after_the_raw_commit_is_healed_on_replay(
        factory_home: Path, tmp_path: Path, small_blocks: int,
        monkeypatch: pytest.MonkeyPatch, batch_rows: int) -> None:
    path = tmp_path / "a.jsonl"
    expect = _write_layout(path)
    lake = Lake()
    with dying_after_raw_commit(monkeypatch), pytest.raises(OSError, match="process died"):
        ingest_paths(lake, [path], workers=1, batch_rows=batch_rows)
    assert lake.read("raw_traces").num_rows > 0
    assert (lake.snapshot_id("samples"), lake.snapshot_id("rejected_traces")) == (None, None)

    replay = ingest_paths(lake, [path], workers=1, batch_rows=batch_rows)
    assert replay.as_dict() == _as_dict(expect)
    _assert_layout_tables(lake, expect)  # raw rows not written twice, each with its outcome
    before = _snapshots(lake)
    again = ingest_paths(lake, [path], workers=1)
    assert again.duplicates == expect["read"] and _snapshots(lake) == before


# -- 6. failures -----------------------------------------------------------------------------
@pytest.mark.parametrize(("fail_at", "batch_rows"), [(3, 4), (5, 4), (5, 1_000_000)])
def test_a_failure_mid_file_reaches_the_caller_and_leaves_the_lake_consistent(
        factory_home: Path, tmp_path: Path, small_blocks: int,
        monkeypatch: pytest.MonkeyPatch, fail_at: int, batch_rows: int) -> None:
    """The 3rd or 5th block fails: the blocks before it are committed (batch_rows 4) or were
    written and never committed (1_000_000)."""
    path = tmp_path / "a.jsonl"
    expect = _write_layout(path)
    real = factory.ingest.workers.process_lines
    calls: list[int] = []

    def failing(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == fail_at:
            raise RuntimeError("normalizer blew up")
        return real(*args, **kwargs)

    monkeypatch.setattr(factory.ingest.workers, "process_lines", failing)
    lake = Lake()
    with pytest.raises(RuntimeError, match="normalizer blew up"):
        ingest_paths(lake, [path], workers=1, batch_rows=batch_rows)
    committed = set(_ids(lake, "raw_traces"))
    if (fail_at, batch_rows) == (5, 4):  # the blocks before the failure were committed
        assert committed
    _assert_consistent(lake)  # committed blocks whole: raw rows each with their outcome
    _no_garbage(lake)  # the files of blocks done but not committed are removed

    monkeypatch.setattr(factory.ingest.workers, "process_lines", real)
    replay = ingest_paths(lake, [path], workers=1, batch_rows=4)
    _check_counts(replay)
    assert replay.read == expect["read"]
    assert replay.ingested + replay.rejected == len(expect["payloads"]) - len(committed)
    _assert_layout_tables(lake, expect)
    _no_garbage(lake)


@pytest.mark.parametrize("workers", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_a_file_cut_short_while_ingested_fails_in_the_block_that_reads_it(
        factory_home: Path, tmp_path: Path, small_blocks: int,
        monkeypatch: pytest.MonkeyPatch, workers: int) -> None:
    """A block reads its own byte range (in a worker process with workers=2): the file cut
    short after three blocks were handed out makes the 4th fail, and that error reaches the
    caller with nothing committed and no file left behind."""
    path = tmp_path / "a.jsonl"
    _write_layout(path)
    real = factory.ingest.pipeline.line_blocks

    def cut_after_three(*args: Any, **kwargs: Any) -> Any:
        for num, task in enumerate(real(*args, **kwargs), start=1):
            if num == 4:
                with open(path, "r+b") as fh:
                    fh.truncate(task.start)
            yield task

    monkeypatch.setattr(factory.ingest.pipeline, "line_blocks", cut_after_three)
    lake = Lake()
    with pytest.raises(OSError, match="shrank"):
        ingest_paths(lake, [path], workers=workers)
    assert _snapshots(lake) == {name: None for name in TABLES}
    _no_garbage(lake)


def test_a_write_failing_inside_a_block_leaves_no_data_file(
        factory_home: Path, tmp_path: Path, small_blocks: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "a.jsonl"
    _write_layout(path)
    real = FileTarget.write
    calls: list[str] = []

    def failing(self: FileTarget, rows: Any, location: str) -> str:
        if self.table == "samples":
            calls.append(location)
            if len(calls) == 3:  # the 3rd block's samples, after its raw_traces file
                raise OSError("disk full")
        return real(self, rows, location)

    monkeypatch.setattr(FileTarget, "write", failing)
    lake = Lake()
    with pytest.raises(OSError, match="disk full"):
        ingest_paths(lake, [path], workers=1, batch_rows=4)
    _assert_consistent(lake)
    _no_garbage(lake)


def test_a_failed_commit_removes_the_files_it_did_not_commit(
        factory_home: Path, tmp_path: Path, small_blocks: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "a.jsonl"
    _write_layout(path)
    lake = Lake()
    with dying_after_raw_commit(monkeypatch), pytest.raises(OSError, match="process died"):
        ingest_paths(lake, [path], workers=1)
    assert lake.read("raw_traces").num_rows > 0
    _no_garbage(lake)


# -- 7. the files and their lineage ----------------------------------------------------------
def test_committed_files_are_snappy_readable_by_duckdb_and_samples_read_their_raw_snapshot(
        factory_home: Path, tmp_path: Path, small_blocks: int) -> None:
    import duckdb

    path = tmp_path / "a.jsonl"
    expect = _write_layout(path)
    extra = tmp_path / "b.json"  # committed by the in-process writer (Lake.append)
    extra.write_text(json.dumps([_chat(100), {"weather": "sunny"}]))
    lake = Lake()
    summary = ingest_paths(lake, [path, extra], workers=1, batch_rows=4)
    assert (summary.ingested, summary.rejected) == (expect["ingested"] + 1,
                                                    expect["rejected"] + 1)
    for name in TABLES:
        files = _committed_files(lake, name)
        assert files
        for file in files:
            meta = pq.ParquetFile(file).metadata
            codecs = {meta.row_group(g).column(c).compression
                      for g in range(meta.num_row_groups) for c in range(meta.num_columns)}
            assert codecs == {"SNAPPY"}, (name, file.name, codecs)
        [(num,)] = duckdb.read_parquet([str(f) for f in files]).aggregate("count(*)").fetchall()
        assert num == lake.read(name).num_rows
    joined = lake.sql("select count(*) from samples join raw_traces using (raw_trace_id)")
    assert joined.column(0).to_pylist() == [expect["ingested"] + 1]

    # Every samples / rejected_traces snapshot names the raw_traces snapshot it was made from,
    # and that snapshot holds the raw row of each of its rows.
    for name in ("samples", "rejected_traces"):
        snaps = lake.table(name).snapshots()
        assert len(snaps) > 1  # several commit rounds
        for snap in snaps:
            raw_snap = lake.snapshot_info(name, snap.snapshot_id)["reads"]["raw_traces"]
            ids = set(lake.read(name, snapshot_id=snap.snapshot_id,
                                columns=["raw_trace_id"]).column(0).to_pylist())
            raw = set(lake.read("raw_traces", snapshot_id=raw_snap,
                                columns=["raw_trace_id"]).column(0).to_pylist())
            assert ids <= raw, (name, snap.snapshot_id)
    tree = walk_lineage(lake, "samples")
    assert [u["table"] for u in tree["upstream"]] == ["raw_traces"]


def test_samples_healed_after_a_crash_lead_back_to_raw_traces(
        factory_home: Path, tmp_path: Path, small_blocks: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "a.jsonl"
    _write_layout(path)
    lake = Lake()
    with dying_after_raw_commit(monkeypatch), pytest.raises(OSError, match="process died"):
        ingest_paths(lake, [path], workers=1)
    ingest_paths(lake, [path], workers=1)
    tree = walk_lineage(lake, "samples")
    assert [(u["table"], u["snapshot_id"]) for u in tree["upstream"]] == [
        ("raw_traces", lake.snapshot_id("raw_traces"))]


# -- 8. the codec property on older tables -----------------------------------------------------
def test_tables_made_without_the_codec_get_it_once_and_a_chosen_codec_is_kept(
        factory_home: Path, tmp_path: Path) -> None:
    codec = "write.parquet.compression-codec"
    catalog = Lake().catalog
    # As older code made them: no property, or a codec an operator chose.
    catalog.create_table((NAMESPACE, "raw_traces"), schema=schema_of("raw_traces"))
    catalog.create_table((NAMESPACE, "rejected_traces"), schema=schema_of("rejected_traces"))
    catalog.create_table((NAMESPACE, "samples"), schema=schema_of("samples"),
                         properties={codec: "zstd"})
    lake = Lake()
    assert lake.table("raw_traces").properties[codec] == "snappy"
    assert lake.table("rejected_traces").properties[codec] == "snappy"
    assert lake.table("samples").properties[codec] == "zstd"
    locations = {n: lake.table(n).metadata_location for n in TABLES}
    again = Lake()  # a new process: nothing left to add, no new metadata version
    assert {n: again.table(n).metadata_location for n in TABLES} == locations

    path = tmp_path / "a.jsonl"
    path.write_bytes(b"".join(_line(i) for i in range(3)) + BAD)
    ingest_paths(again, [path], workers=1)
    for name, want in (("raw_traces", "SNAPPY"), ("samples", "ZSTD"),
                       ("rejected_traces", "SNAPPY")):
        files = _committed_files(again, name)
        assert files
        assert {pq.ParquetFile(f).metadata.row_group(0).column(0).compression
                for f in files} == {want}, name


# -- a byte order mark -----------------------------------------------------------------------
BOM = b"\xef\xbb\xbf"


def test_a_bom_before_the_first_line_is_not_a_rejection(
        factory_home: Path, tmp_path: Path) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_bytes(BOM + _line(0) + _line(1))
    plain = tmp_path / "plain.jsonl"
    plain.write_bytes(_line(0))
    lake = Lake()
    assert ingest_paths(lake, [path], workers=1).as_dict() == {
        "read": 2, "ingested": 2, "rejected": 0, "duplicates": 0}
    # The same record without the mark is the same record.
    assert ingest_paths(lake, [plain], workers=1).duplicates == 1


def test_a_bom_is_not_stored_in_the_payload(factory_home: Path, tmp_path: Path) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_bytes(BOM + _line(0))
    lake = Lake()
    ingest_paths(lake, [path], workers=1)
    [payload] = lake.read("raw_traces").column("payload").to_pylist()
    assert payload == _line(0).strip().decode()


def test_a_json_file_with_a_bom_is_accepted(factory_home: Path, tmp_path: Path) -> None:
    path = tmp_path / "bom.json"
    path.write_bytes(BOM + json.dumps([_chat(0), _chat(1)]).encode())
    summary = ingest_paths(Lake(), [path], workers=1)
    assert (summary.ingested, summary.rejected) == (2, 0)


def test_a_crash_is_healed_when_the_file_starts_with_a_bom(
        factory_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_bytes(BOM + _line(0) + _line(1))
    lake = Lake()
    with dying_after_raw_commit(monkeypatch), pytest.raises(OSError, match="process died"):
        ingest_paths(lake, [path], workers=1)
    replay = ingest_paths(lake, [path], workers=1)
    assert (replay.ingested, replay.duplicates) == (2, 0)
    _assert_consistent(lake)


# -- a lone surrogate ------------------------------------------------------------------------
def test_a_lone_surrogate_escape_does_not_stop_the_file(
        factory_home: Path, tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"messages": [{"role": "user", "content": "\\ud800"}, '
                     b'{"role": "assistant", "content": "x"}]}\n' + _line(0))
    lake = Lake()
    summary = ingest_paths(lake, [path], workers=1)
    assert summary.as_dict() == {"read": 2, "ingested": 2, "rejected": 0, "duplicates": 0}
    _assert_consistent(lake)
    # Stored escaped, as it came: read back, the content is the same lone surrogate.
    contents = [json.loads(m)[0]["content"] for m in lake.read("samples").column(
        "messages").to_pylist()]
    assert "\ud800" in contents or [{"type": "text", "text": "\ud800"}] in contents
