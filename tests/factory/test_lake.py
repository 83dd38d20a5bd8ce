"""The lake on the real SQLite catalog: create on first use, evolve, append safely, query."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pytest

from factory import tables
from factory.errors import QueryError, SnapshotNotFoundError, UnknownTableError
from factory.lake import ASSET_KEY, READS, RUN_ID, Lake, walk_lineage


def _trace(i: int) -> dict[str, object]:
    return {"raw_trace_id": f"id-{i}", "source": "upload", "format": "openai",
            "payload": json.dumps({"i": i}), "tags": {"project": "p"}}


def test_table_created_on_first_use_in_factory_namespace(factory_home: Path) -> None:
    lake = Lake()
    assert lake.existing_tables() == []
    lake.append("raw_traces", [_trace(1)])
    assert lake.existing_tables() == ["raw_traces"]
    assert lake.catalog.table_exists(("factory", "raw_traces"))
    assert (factory_home / "catalog.db").is_file()


def test_an_append_copies_the_table_metadata_a_few_times_not_once_per_read(
        factory_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """pyiceberg deep-copies the whole metadata (every snapshot) each time a transaction's
    ``table_metadata`` is read; the lake computes it once per transaction state, so a commit's
    cost does not grow ~18 copies of the table's history at a time."""
    import pyiceberg.table

    lake = Lake()
    for i in range(3):
        lake.append("raw_traces", [_trace(i)])
    real = pyiceberg.table.update_table_metadata
    calls = []

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(pyiceberg.table, "update_table_metadata", counted)
    lake.append("raw_traces", [_trace(9)])
    assert 0 < len(calls) <= 4
    tx = lake.table("raw_traces").transaction()
    first = tx.table_metadata
    assert tx.table_metadata is first  # same state: computed once
    tx.set_properties({"factory.test": "1"})
    assert tx.table_metadata is not first and tx.table_metadata.properties["factory.test"] == "1"


def test_expired_snapshots_keep_every_lineage_walk_whole(factory_home: Path) -> None:
    """Old snapshots of the capture tables go, except the newest, and those a kept snapshot of
    any table read (transitively): the walk from a dataset still reaches its raw traces."""
    from datetime import UTC, datetime

    from factory.ingest import RawRecord, ingest_records
    from factory.lake import Lineage

    lake = Lake()
    snaps = []
    for i in range(5):
        ingest_records(lake, [RawRecord(payload={"messages": [
            {"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]},
            source="upload", received_at=datetime.now(tz=UTC), tags={})])
        snaps.append((lake.snapshot_id("raw_traces"), lake.snapshot_id("samples")))
    raw_1, samples_1 = snaps[1]
    lake.append("dataset_drops", [{"experiment": "x", "sample_id": "s", "step": "empty"}],
                lineage=Lineage(run_id="r1", asset_key="dataset", reads={"samples": samples_1}))
    assert lake.snapshot_info("samples", samples_1)["reads"] == {"raw_traces": raw_1}

    expired = lake.expire_snapshots(["raw_traces", "samples", "rejected_traces"], retain_s=0,
                                    keep_last=1)
    assert expired == {"raw_traces": 3, "samples": 3}
    kept = {name: {s.snapshot_id for s in lake.table(name).snapshots()}
            for name in ("raw_traces", "samples")}
    assert kept == {"raw_traces": {raw_1, snaps[-1][0]}, "samples": {samples_1, snaps[-1][1]}}
    tree = walk_lineage(lake, "dataset_drops")
    [samples] = tree["upstream"]
    [raw] = samples["upstream"]
    assert (samples["snapshot_id"], raw["snapshot_id"]) == (samples_1, raw_1)
    assert "missing" not in samples and "missing" not in raw
    assert lake.read("samples").num_rows == 5  # rows are the current snapshot's: all there
    # a recent snapshot stays whatever keep_last says
    assert lake.expire_snapshots(["raw_traces", "samples"], retain_s=3600, keep_last=0) == {}


def test_unknown_table_is_a_clear_error(factory_home: Path) -> None:
    with pytest.raises(UnknownTableError, match="unknown table 'nope'.*raw_traces"):
        Lake().append("nope", [{"a": 1}])


def test_append_rejects_undeclared_columns(factory_home: Path) -> None:
    with pytest.raises(ValueError, match="no column"):
        Lake().append("raw_traces", pa.table({"raw_trace_id": ["a"], "bogus": [1]}))


def test_schema_evolution_adds_columns_and_keeps_rows(factory_home: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    lake = Lake()
    lake.append("raw_traces", [_trace(1)])
    grown = tables.TABLES["raw_traces"].append(pa.field("latency_ms", pa.float64()))
    monkeypatch.setitem(tables.TABLES, "raw_traces", grown)
    fresh = Lake()
    fresh.append("raw_traces", [{**_trace(2), "latency_ms": 12.5}])
    rows = sorted(fresh.read("raw_traces").to_pylist(), key=lambda r: r["raw_trace_id"])
    assert [r["raw_trace_id"] for r in rows] == ["id-1", "id-2"]
    assert [r["latency_ms"] for r in rows] == [None, 12.5]
    assert "latency_ms" in fresh.table("raw_traces").schema().column_names


def test_sql_sees_tables_by_bare_name_with_bind_parameters(factory_home: Path) -> None:
    lake = Lake()
    lake.append("raw_traces", [_trace(i) for i in range(5)])
    got = lake.sql("select count(*) as n from raw_traces where raw_trace_id <> ?", ["id-0"])
    assert got.to_pylist() == [{"n": 4}]
    assert lake.sql("select tags['project'] as p from raw_traces limit 1").to_pylist() == [
        {"p": "p"}]


def test_bad_sql_is_a_query_error(factory_home: Path) -> None:
    with pytest.raises(QueryError, match="SQL error"):
        Lake().sql("select * from nowhere_at_all")


def test_time_travel_and_missing_snapshot(factory_home: Path) -> None:
    lake = Lake()
    first = lake.append("raw_traces", [_trace(1)])
    lake.append("raw_traces", [_trace(2)])
    assert lake.read("raw_traces", snapshot_id=first).num_rows == 1
    assert lake.read("raw_traces").num_rows == 2
    with pytest.raises(SnapshotNotFoundError):
        lake.read("raw_traces", snapshot_id=12345)


def test_overwrite_replaces_only_matching_rows(factory_home: Path) -> None:
    lake = Lake()
    lake.append("raw_traces", [_trace(1), {**_trace(2), "source": "proxy"}])
    lake.overwrite("raw_traces", [{**_trace(3), "source": "proxy"}], where="source = 'proxy'")
    ids = sorted(r["raw_trace_id"] for r in lake.read("raw_traces").to_pylist())
    assert ids == ["id-1", "id-3"]


def test_writes_carry_lineage_in_snapshot_summary(factory_home: Path) -> None:
    lake = Lake()
    session = lake.session(run_id="run-a", asset_key="raw_traces")
    up = session.append("raw_traces", [_trace(1)])
    down = lake.session(run_id="run-b", asset_key="samples")
    down.read("raw_traces")
    snap = down.append("samples", [{"sample_id": "s1", "raw_trace_id": "id-1"}])
    props = lake.table("samples").snapshot_by_id(snap).summary.additional_properties
    assert props[RUN_ID] == "run-b"
    assert props[ASSET_KEY] == "samples"
    assert json.loads(props[READS]) == {"raw_traces": up}
    tree = walk_lineage(lake, "samples")
    assert tree["upstream"][0]["table"] == "raw_traces"
    assert tree["upstream"][0]["snapshot_id"] == up
    assert tree["upstream"][0]["run_id"] == "run-a"
    assert down.metadata()["read_snapshots"] == {"raw_traces": up}


def test_buffered_appender_batches_small_writes(factory_home: Path) -> None:
    lake = Lake()
    with lake.buffered("raw_traces", max_rows=10, max_delay_s=3600) as buf:
        for i in range(25):
            buf.add([_trace(i)])
    assert len(buf.snapshots) == 3  # 10 + 10 + the last 5 on close
    assert lake.read("raw_traces").num_rows == 25


_WRITER = textwrap.dedent("""
    import sys
    from factory.lake import Lake, Lineage
    who = sys.argv[1]
    lake = Lake()
    for b in range(50):
        rows = [{"raw_trace_id": f"{who}-{b}-{i}", "source": "upload"} for i in range(3)]
        lake.append("raw_traces", rows, lineage=Lineage(run_id=who, asset_key="raw_traces"))
""")


@pytest.mark.slow
def test_two_processes_appending_concurrently_lose_nothing(factory_home: Path) -> None:
    # No table yet: the writers also race to create the namespace and the table.
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, who]) for who in ("a", "b")]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    ids = Lake().read("raw_traces", columns=["raw_trace_id"]).column(0).to_pylist()
    assert len(ids) == 300
    assert set(ids) == {f"{w}-{b}-{i}" for w in "ab" for b in range(50) for i in range(3)}


def test_threads_opening_a_fresh_catalog_at_once_all_succeed(factory_home: Path) -> None:
    import threading

    errors: list[str] = []

    def open_catalog() -> None:
        try:
            Lake().append("raw_traces", [_trace(threading.get_ident())])
        except Exception as exc:  # collected: any failure is the finding
            errors.append(repr(exc))

    threads = [threading.Thread(target=open_catalog) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert Lake().read("raw_traces").num_rows == 8


def test_files_written_without_the_catalog_commit_once_through_a_conflict(
        factory_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two-stage writes: a FileTarget (picklable, pyarrow only) writes the data file; a commit
    that loses a race is retried with the same file, and a writer that committed in between
    loses nothing."""
    import pickle

    from pyiceberg.exceptions import CommitFailedException
    from pyiceberg.table import Transaction

    from factory.lake import Lineage

    lake = Lake()
    target = pickle.loads(pickle.dumps(lake.file_target("raw_traces")))
    location = target.write(pa.Table.from_pylist([_trace(1), _trace(2)],
                                                 schema=tables.TABLES["raw_traces"]),
                            lake.new_data_locations("raw_traces", 1)[0])
    lake.append("raw_traces", [_trace(3)])  # another writer commits first
    real = Transaction.commit_transaction
    attempts = {"n": 0}

    def conflicting_once(self: Transaction) -> object:
        attempts["n"] += 1
        if attempts["n"] == 1:
            raise CommitFailedException("the table moved on")
        return real(self)

    monkeypatch.setattr(Transaction, "commit_transaction", conflicting_once)
    snap = lake.commit_files("raw_traces", [location],
                             lineage=Lineage(run_id="r-1", asset_key="raw_traces"))
    assert attempts["n"] == 2
    ids = sorted(lake.read("raw_traces").column("raw_trace_id").to_pylist())
    assert ids == ["id-1", "id-2", "id-3"]
    info = lake.snapshot_info("raw_traces")
    assert info["snapshot_id"] == snap and info["run_id"] == "r-1" and info["rows"] == 3
    assert lake.commit_files("raw_traces", []) is None
    files = lake.table("raw_traces").inspect.data_files().to_pylist()
    assert sum(f["record_count"] for f in files) == 3 and len(files) == 2


def test_data_files_are_described_as_pyiceberg_describes_them(factory_home: Path) -> None:
    """commit_files describes its files once per schema (factory.lake.describe_data_files):
    the same DataFile, statistics included, as pyiceberg's own per-file function, and a file
    whose schema does not fit the table is still refused."""
    from pyiceberg.io.pyarrow import parquet_file_to_data_file

    from factory.lake import describe_data_files

    lake = Lake()
    target = lake.file_target("samples")
    rows = [{"sample_id": f"s{i}", "raw_trace_id": f"id-{i}", "messages": "[]", "tools": "[]",
             "num_turns": i, "has_images": i % 2 == 0, "source": "upload",
             "tags": {"k": str(i)}} for i in range(5)]
    locations = [target.write(pa.Table.from_pylist(rows[:n], schema=tables.TABLES["samples"]),
                              loc)
                 for n, loc in zip((2, 5), lake.new_data_locations("samples", 2), strict=True)]
    tbl = lake.table("samples")
    described = describe_data_files(tbl, locations)
    assert described == [parquet_file_to_data_file(tbl.io, tbl.metadata, loc)
                         for loc in locations]
    assert [f.record_count for f in described] == [2, 5]
    assert described[1].lower_bounds and described[1].null_value_counts

    # A column of another type than the table's: not this table's file.
    alien = pa.schema([f.with_type(pa.string()) if f.name == "num_turns" else f
                       for f in target.schema])
    bad = lake.new_data_locations("samples", 1)[0]
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{**r, "num_turns": "many"} for r in rows],
                                        schema=alien), bad.removeprefix("file://"))
    with pytest.raises(ValueError, match="num_turns"):
        parquet_file_to_data_file(tbl.io, tbl.metadata, bad)
    with pytest.raises(ValueError, match="num_turns"):
        describe_data_files(tbl, [locations[0], bad])


def test_files_described_ahead_are_described_again_after_the_table_changed(
        factory_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file ingest describes its files as they are written (Lake.describer) and commits
    later: a description is used as it is while the table stays as it was, and made again
    against the table the commit sees once a property (say, the metrics mode) changed."""
    from pyiceberg.io.pyarrow import parquet_file_to_data_file

    from factory.lake import FileDescriber

    lake = Lake()
    target = lake.file_target("raw_traces")
    locations = [target.write(pa.Table.from_pylist([_trace(i)], schema=tables.TABLES["raw_traces"]),
                              loc) for i, loc in enumerate(lake.new_data_locations("raw_traces", 3))]
    described: list[str] = []
    real = FileDescriber.describe

    def counting(self: FileDescriber, locs: list[str]) -> list[object]:
        described.extend(locs)
        return real(self, locs)

    monkeypatch.setattr(FileDescriber, "describe", counting)
    describer = lake.describer("raw_traces")
    describer.add(locations[:2])
    lake.commit_files("raw_traces", locations[:1], describer=describer)
    assert described == locations[:2]  # the first file was not read again

    with lake.catalog.load_table(("factory", "raw_traces")).transaction() as tx:
        tx.set_properties({"write.metadata.metrics.default": "counts"})
    lake.commit_files("raw_traces", locations[1:], describer=describer)
    assert described == [*locations[:2], *locations[1:]]
    tbl = lake.table("raw_traces")
    committed = {f.file_path: f for f in tbl.scan().plan_files() for f in [f.file]}
    for loc in locations[1:]:  # no bounds under "counts", as pyiceberg itself describes them
        assert committed[loc] == parquet_file_to_data_file(tbl.io, tbl.metadata, loc)
        assert not committed[loc].lower_bounds
    assert committed[locations[0]].lower_bounds
    assert sorted(lake.read("raw_traces").column("raw_trace_id").to_pylist()) == [
        "id-0", "id-1", "id-2"]


def test_pyiceberg_s_idle_reader_pool_is_stopped_only_when_its_threads_are_the_only_ones(
        factory_home: Path) -> None:
    """A file ingest forks its workers only from a process without other threads; pyiceberg's
    reader pool (left running by any read) is stopped for it when its threads are the only
    others, and reads still work after. Another thread alive: the pool is left alone. (In a
    process of its own: this one may hold other tests' threads.)"""
    script = textwrap.dedent("""
        import threading
        from pyiceberg.utils.concurrent import ExecutorFactory
        from factory.lake import Lake, stop_idle_reader_pool

        lake = Lake()
        lake.append("raw_traces", [{"raw_trace_id": "id-1", "source": "upload",
                                    "format": "openai", "payload": "{}"}])
        def ids():
            return lake.table("raw_traces").scan().to_arrow().column(
                "raw_trace_id").to_pylist()

        assert ids() == ["id-1"]
        pool = ExecutorFactory._instance
        assert pool is not None and threading.active_count() > 1
        stop_idle_reader_pool()
        assert threading.active_count() == 1 and ExecutorFactory._instance is None
        assert ids() == ["id-1"]  # on a new pool
        stop = threading.Event()
        other = threading.Thread(target=stop.wait, daemon=True)
        other.start()
        pool = ExecutorFactory._instance
        stop_idle_reader_pool()
        assert ExecutorFactory._instance is pool and pool is not None
        stop.set()
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok"


def test_log_rows_reads_only_what_appends_added_since_the_last_read(
        factory_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``Lake.log_rows`` keeps a table's rows per process: after appends only their new data
    files are read, after any other commit the whole table; either way the rows are the
    table's, as a full scan gives them."""
    lake = Lake()
    lake.append("raw_traces", [_trace(1), _trace(2)])
    assert sorted(r["raw_trace_id"] for r in lake.log_rows("raw_traces")) == ["id-1", "id-2"]
    read: list[list[str]] = []
    real = Lake.read_files

    def spy(self: Lake, name: str, locations: list[str]) -> pa.Table:
        read.append(list(locations))
        return real(self, name, locations)

    monkeypatch.setattr(Lake, "read_files", spy)
    assert lake.log_rows("raw_traces") is lake.log_rows("raw_traces")  # unchanged: no read
    assert read == []
    for i in (3, 4):
        lake.append("raw_traces", [_trace(i)])
    other = Lake()  # another Lake of the same process shares what was read
    rows = other.log_rows("raw_traces")
    assert len(read) == 1 and len(read[0]) == 2  # the two appended files, nothing else
    full = sorted(r["raw_trace_id"] for r in lake.read("raw_traces").to_pylist())
    assert sorted(r["raw_trace_id"] for r in rows) == full == ["id-1", "id-2", "id-3", "id-4"]
    lake.overwrite("raw_traces", [_trace(9)], where="raw_trace_id = 'id-1'")
    lake.append("raw_traces", [_trace(5)])
    rows = lake.log_rows("raw_traces")
    assert len(read) == 1  # not an append since: read whole, not by files
    assert sorted(r["raw_trace_id"] for r in rows) == sorted(
        r["raw_trace_id"] for r in lake.read("raw_traces").to_pylist())
    assert "id-1" not in {r["raw_trace_id"] for r in rows}
