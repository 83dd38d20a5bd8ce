"""File ingest through worker processes gives the same tables as in process, loses nothing.

Also: the orjson fast path of canonical JSON is byte-identical to the reference encoder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from factory.ingest import ingest_paths
from factory.lake import Lake
from factory.normalize.canon import (
    NormalizeError,
    canon_json_text,
    canonical_json,
    canonical_json_fast,
)
from tests.ingest import conversations as conv
from tests.ingest.test_pipeline import BAD, GOOD, dying_after_raw_commit


def _write(path: Path) -> list[str]:
    """GOOD and BAD lines interleaved, a blank line, an OTLP export, and repeats of earlier
    lines further on (so duplicates span blocks); returns the lines."""
    lines: list[str] = []
    for i in range(max(len(GOOD), len(BAD))):
        if i < len(GOOD):
            lines.append(json.dumps(GOOD[i], ensure_ascii=False))
        if i < len(BAD):
            lines.append(BAD[i][0])
    lines += ["", json.dumps(conv.otlp_export()), lines[0], lines[3], lines[1]]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return lines


def _tables(lake: Lake) -> dict[str, list[tuple[Any, ...]]]:
    """Every table's rows without the receive time, sorted (order across blocks may differ)."""
    out = {}
    for name in ("raw_traces", "samples", "rejected_traces"):
        rows = lake.read(name).to_pylist()
        out[name] = sorted(tuple(str(v) for k, v in sorted(row.items()) if k != "received_at"
                                 and not (name == "samples" and k == "created_at"))
                           for row in rows)
    return out


def _snapshots(lake: Lake) -> dict[str, int | None]:
    return {t: lake.snapshot_id(t) for t in ("raw_traces", "samples", "rejected_traces")}


@pytest.mark.slow
def test_workers_give_the_same_tables_as_in_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import factory.ingest.files as files

    path = tmp_path / "mixed.jsonl"
    lines = _write(path)
    # Blocks of a few lines, so the pool starts and each worker gets several.
    monkeypatch.setattr(files, "_BLOCK_BYTES", 400)
    results = {}
    for workers in (1, 2):
        home = tmp_path / f"home-{workers}"
        monkeypatch.setenv("FACTORY_HOME", str(home))
        lake = Lake()
        summary = ingest_paths(lake, [path], workers=workers, batch_rows=7)
        num_records = len(GOOD) + len(BAD) + 1 + 3  # the export is one trace; 3 repeats
        assert summary.as_dict() == {"read": num_records, "ingested": len(GOOD) + 1,
                                     "rejected": len(BAD), "duplicates": 3}
        results[workers] = _tables(lake)
        reasons = lake.read("rejected_traces").column("reason").to_pylist()
        assert any(r.startswith("mixed.jsonl:2: invalid JSON") for r in reasons), reasons
        assert (home / "blobs" / conv.PNG_SHA[:2] / conv.PNG_SHA).read_bytes() == conv.PNG

        before = _snapshots(lake)
        again = ingest_paths(lake, [path], workers=workers)
        assert again.as_dict() == {"read": num_records, "ingested": 0, "rejected": 0,
                                   "duplicates": num_records}
        assert _snapshots(lake) == before
    assert results[1] == results[2]
    assert len(results[2]["raw_traces"]) == len(lines) - 1 - 3  # no blank, no repeats


@pytest.mark.slow
def test_workers_heal_a_crash_between_raw_and_samples(
        factory_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Records the workers skip as already known are normalized here when they have no
    outcome yet (raw rows committed, then the process died)."""
    import factory.ingest.files as files

    path = tmp_path / "mixed.jsonl"
    _write(path)
    monkeypatch.setattr(files, "_BLOCK_BYTES", 400)
    lake = Lake()
    with dying_after_raw_commit(monkeypatch), pytest.raises(OSError):
        ingest_paths(lake, [path], workers=1, batch_rows=1000)
    assert lake.snapshot_id("samples") is None

    replay = ingest_paths(lake, [path], workers=2)
    assert (replay.ingested, replay.rejected) == (len(GOOD) + 1, len(BAD))
    assert lake.read("samples").num_rows == len(GOOD) + 1
    assert lake.read("rejected_traces").num_rows == len(BAD)


def test_workers_must_be_positive(factory_home: Path, tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps(GOOD[0]) + "\n")
    with pytest.raises(ValueError, match="workers must be at least 1"):
        ingest_paths(Lake(), [path], workers=0)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(alphabet=st.characters(codec="utf-8") | st.sampled_from(
        ["\x00", "\x1f", "\x7f", "\u2028", "\b", "\f", "\n", "\r", "\t", '"', "\\", "é",
         "😀"]), max_size=10)
    | st.sampled_from(["1.5", "1e5", "null", "0.00001", "\ud800"]),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=5), children, max_size=4),
    max_leaves=25)


def _reference(value: Any) -> str | type[NormalizeError]:
    try:
        return canonical_json(value)
    except NormalizeError:
        return NormalizeError


def _fast(value: Any) -> str | type[NormalizeError]:
    try:
        return canonical_json_fast(value)
    except NormalizeError:
        return NormalizeError


def _reference_text(value: str) -> str:
    """``canon_json_text`` of a string as the json module alone computes it."""
    if value.lstrip()[:1] not in ("{", "["):
        return value
    try:
        parsed = json.loads(value)
    except (ValueError, RecursionError):
        return value
    if not isinstance(parsed, dict | list):
        return value
    try:
        return json.dumps(parsed, ensure_ascii=False, separators=(",", ":"), sort_keys=True,
                          allow_nan=False)
    except (TypeError, ValueError):
        return value


@settings(max_examples=int(__import__("os").environ.get("FUZZ_N", "300")), deadline=None)
@given(json_values)
def test_fast_canonical_json_is_byte_identical(value: Any) -> None:
    assert _fast(value) == _reference(value)
    text = json.dumps(value)  # floats and NaN as json writes them, big integers included
    assert canon_json_text(text) == _reference_text(text)
    assert canon_json_text(" " + text) == _reference_text(" " + text)


def test_fast_canonical_json_on_floats_that_print_differently() -> None:
    for value in ([1e16, 1e-05, 0.00001, 1.5e300, -0.0], {"a": [1e22]}, [float("nan")],
                  {"x": float("inf")}, [2**70]):
        assert _fast(value) == _reference(value)
    assert _fast({"b": 1, "a": ["é", "\u2028"]}) == '{"a":["é","\u2028"],"b":1}'


def test_id_digests_are_exact_per_spelling() -> None:
    import numpy as np

    from factory.ingest.dedupe import digests, known_mask

    hex_id = "ab" * 32
    ids = [hex_id, hex_id.upper(), "capture-1", "0" * 64, " " + hex_id[1:]]
    keys = digests(ids)
    assert len({bytes(k) for k in keys}) == len(ids)  # no two spellings share a digest
    assert bytes(keys[0]) == bytes.fromhex(hex_id)
    assert bytes(digests([hex_id])[0]) == bytes(keys[0])  # the all-hex fast path agrees
    assert bytes(digests(["0" * 64])[0]).ljust(32, b"\0") == bytes(32)
    known = [np.sort(digests(ids[:3]))]
    assert known_mask(ids, known).tolist() == [True, True, True, False, False]


def test_progress_counts_every_byte_of_the_files_once(
        factory_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The progress bar of `factory ingest` ends at the files' total size, block by block."""
    import factory.ingest.files as files

    path = tmp_path / "mixed.jsonl"
    _write(path)
    other = tmp_path / "one.json"
    other.write_text(json.dumps(GOOD[0]))
    monkeypatch.setattr(files, "_BLOCK_BYTES", 400)
    seen: list[int] = []
    ingest_paths(Lake(), [path, other], workers=1, on_bytes=seen.append)
    assert sum(seen) == path.stat().st_size + other.stat().st_size
    assert len(seen) > 3 and all(n > 0 for n in seen)


def test_a_file_given_twice_adds_nothing_the_second_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks that repeat earlier blocks of the same ingest are dropped whole: their data
    files are removed, never committed."""
    import factory.ingest.files as files

    path = tmp_path / "mixed.jsonl"
    _write(path)
    monkeypatch.setattr(files, "_BLOCK_BYTES", 400)
    monkeypatch.setenv("FACTORY_HOME", str(tmp_path / "home1"))
    once = ingest_paths(Lake(), [path], workers=1)
    home = tmp_path / "home2"
    monkeypatch.setenv("FACTORY_HOME", str(home))
    lake = Lake()
    twice = ingest_paths(lake, [path, path], workers=1)
    assert twice.as_dict() == {"read": 2 * once.read, "ingested": once.ingested,
                               "rejected": once.rejected,
                               "duplicates": once.duplicates + once.read}
    assert lake.read("raw_traces").num_rows == once.ingested + once.rejected
    on_disk = sorted(p.name for p in (home / "warehouse").rglob("data/*.parquet"))
    committed = sorted(Path(row["file_path"]).name
                       for name in ("raw_traces", "samples", "rejected_traces")
                       for row in lake.table(name).inspect.data_files().to_pylist())
    assert on_disk == committed  # nothing left behind by the dropped blocks


_SCRIPT_WITHOUT_MAIN_GUARD = """
import json, os, sys, threading, time
import factory.ingest.files as files
from factory.ingest import ingest_paths
from factory.ingest.workers import worker_context
from factory.lake import Lake

print("script body ran in", os.getpid(), flush=True)
if sys.argv[2] == "thread":  # another thread alive, as in a Dagster run
    threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
print("workers", worker_context().get_start_method(), flush=True)
files._BLOCK_BYTES = 400  # many blocks: the workers are used
summary = ingest_paths(Lake(), [sys.argv[1]], workers=2)
print(json.dumps(summary.as_dict()), flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize(("threads", "start"), [("main", "fork"), ("thread", "spawn")])
def test_a_script_without_a_main_guard_ingests_through_workers(
        factory_home: Path, tmp_path: Path, threads: str, start: str) -> None:
    """Workers do not run the caller's main module again (a script without an
    ``if __name__ == "__main__"`` guard would start an ingest in each worker): forked, as
    from a process with one thread, or spawned, as from one with more."""
    import os
    import subprocess
    import sys

    data = tmp_path / "mixed.jsonl"
    lines = _write(data)
    script = tmp_path / "ingest_script.py"
    script.write_text(_SCRIPT_WITHOUT_MAIN_GUARD)
    done = subprocess.run([sys.executable, str(script), str(data), threads],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ),
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout.splitlines()
    assert sum(1 for line in out if line.startswith("script body ran")) == 1
    assert f"workers {start}" in out
    summary = json.loads(out[-1])
    assert summary["ingested"] == len(GOOD) + 1  # and the OTLP export's one trace
    assert summary["rejected"] + summary["ingested"] + summary["duplicates"] == summary["read"]
    assert summary["read"] == len([line for line in lines if line])


def _worker_probe() -> tuple[dict[str, str | None], str]:
    import os
    import sys

    from factory.worker_env import WORKER_ENV

    main = sys.modules["__main__"]
    return ({k: os.environ.get(k) for k in WORKER_ENV},
            getattr(main.__spec__, "name", None) or getattr(main, "__file__", "?"))


def test_workers_get_their_environment_and_not_this_process_s_main_module(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import concurrent.futures
    import multiprocessing.spawn
    import os

    from factory.ingest.workers import WorkerContext
    from factory.worker_env import WORKER_ENV

    for name in WORKER_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "3")  # the user's setting wins
    prepare = multiprocessing.spawn.get_preparation_data
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=WorkerContext()) as pool:
        env, main = pool.submit(_worker_probe).result(timeout=120)
    assert env == {**WORKER_ENV, "OPENBLAS_NUM_THREADS": "3"}
    assert main == "factory.worker_env"
    # and this process is as it was
    assert multiprocessing.spawn.get_preparation_data is prepare
    assert "MIMALLOC_PURGE_DELAY" not in os.environ


def test_workers_are_spawned_from_a_process_with_other_threads() -> None:
    """A fork copies every lock as it is: with another thread alive (a Dagster run, the
    gateway) the workers are spawned instead (forked ones: the script test above)."""
    import threading

    from factory.ingest.workers import WorkerContext, worker_context

    stop = threading.Event()
    other = threading.Thread(target=stop.wait, daemon=True)
    other.start()
    try:
        context = worker_context()
        assert isinstance(context, WorkerContext)
        assert context.get_start_method() == "spawn"
    finally:
        stop.set()
        other.join()


def test_workers_writing_to_an_object_store_are_spawned() -> None:
    """An object store's client may hang in a forked child: its workers are spawned, whatever
    the threads."""
    from factory.ingest.workers import WorkerContext, worker_context

    assert isinstance(worker_context(local_files=False), WorkerContext)


def test_the_ids_seen_in_an_ingest_are_found_exactly_however_they_arrive(
        factory_home: Path) -> None:
    """Cross-block dedupe (the main process's ``KnownIds``): ids remembered in blocks of any
    size, merged as they pile up, are all found and nothing else is, including ids that share
    their first 8 bytes (searched by those first) and caller ids that are not hex digests."""
    import hashlib
    import random

    from factory.ingest.dedupe import KnownIds
    from factory.lake import Lake

    known = KnownIds(Lake(), None)
    rng = random.Random(7)
    seen: set[str] = set()
    twin_prefix = "ab" * 4
    for block in range(60):
        ids = [hashlib.sha256(f"{block}-{i}".encode()).hexdigest()
               for i in range(rng.choice([1, 3, 50, 400, 2300]))]
        ids += [twin_prefix + hashlib.sha256(f"t{block}".encode()).hexdigest()[8:],
                f"capture-{block}"]
        probe = ids + [hashlib.sha256(f"new-{block}-{i}".encode()).hexdigest()
                       for i in range(20)] + [twin_prefix + "0" * 56, f"capture-x{block}"]
        assert known.existing(probe) == seen & set(probe)
        known.remember(ids)
        seen.update(ids)
        assert known.existing(probe) == seen & set(probe)
        for arr, pre in zip(known.arrays, known.prefixes, strict=True):
            assert (arr[1:] >= arr[:-1]).all()
            assert (pre[1:] >= pre[:-1]).all()
        sizes = [len(a) for a in known.arrays]
        assert all(2 * b < a for a, b in zip(sizes, sizes[1:], strict=False)), sizes
    assert sum(len(a) for a in known.arrays) == len(seen)
