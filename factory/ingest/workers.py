"""The worker processes of a file ingest: a block of JSON Lines in, Parquet data files out.

``factory.ingest.pipeline.ingest_paths`` cuts a JSON Lines file into blocks of whole lines
(``factory.ingest.files.line_blocks``) and hands each to ``ingest_block`` through
``BlockWorkers``, in a worker process (or in process for a small file). The worker reads its
block from the file itself, parses, hashes and normalizes every line
(``factory.ingest.rows.process_lines``), builds the block's rows of the three tables
(``factory.ingest.tables``) and writes them as Parquet data files. It commits nothing. The main
process gets back the data files, the ids they hold and per-record counts: it drops the rows
that repeat an earlier block (rare: the files are rewritten), and commits the files of many
blocks at once, ``raw_traces`` first.

So the main process handles a few kilobytes per block, and a file ingest scales with the
worker processes. This module imports neither the lake nor pyiceberg: a spawned worker starts
without them.
"""

from __future__ import annotations

import codecs
import concurrent.futures
import ctypes
import dataclasses
import gc
import multiprocessing.context
import multiprocessing.spawn
import sys
import threading
from collections import deque
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from factory.blobs import BlobStore
from factory.ingest.dedupe import known_mask
from factory.ingest.files import BlockTask
from factory.ingest.records import FileContext
from factory.ingest.rows import LineError, process_lines
from factory.ingest.tables import TABLE_NAMES, BlockRows

if TYPE_CHECKING:
    from factory.datafiles import FileTarget
    from factory.ingest.dedupe import KnownIds
    from factory.lake import Lake


@dataclass
class BlockResult:
    """What a block gave: data files not committed yet, and what the main process needs."""

    name: str = ""
    """The file's name."""
    start: int = 0
    """Where the block starts in the file (0: its first line is line 1)."""
    num_read: int = 0
    """Records read (an OTLP export line counts one per trace), including everything below."""
    num_duplicates: int = 0
    """Records that repeat an earlier record of the same block (nothing written for them)."""
    files: dict[str, list[str]] = field(default_factory=dict)
    """Data files per table (locations), written and not committed."""
    ids: list[str] = field(default_factory=list)
    """The raw_trace_id of each raw row written, in the files' order."""
    rejected: list[bool] = field(default_factory=list)
    """Per id: went to rejected_traces (else to samples)."""
    num_samples: list[int] = field(default_factory=list)
    """Per id: sample rows written."""
    held: list[tuple[str, str, tuple[int, int] | str, str | None]] = field(
        default_factory=list)
    """Records whose id the lake holds already, as (id, format, where, rejection reason if
    known): not written, the main process decides (a duplicate, or a raw row left without an
    outcome by a crash). ``where`` is the record's own text, or (offset, length) of its line
    in the block: a re-ingest sends back ids, not the file, and the main process reads the
    few lines it needs."""
    num_bytes: int = 0
    """Bytes of the block (for batching commits)."""
    plain: bool = True
    """Read from the file by the worker (its bytes are the file's, for progress)."""
    num_lines: int = 0
    """Newlines in the block (the main process numbers the lines of the next blocks)."""
    invalid: list[LineError] = field(default_factory=list)
    """Lines that are not JSON, not written: their rejection reason names the line number,
    which only the main process knows (it does not read the file)."""


# -- the worker process --------------------------------------------------------------------------
_WORKER: dict[str, Any] = {}

_SPAWNING = threading.Lock()
_SPAWNER: list[int] = []
"""The thread starting a worker, while it does (only its spawns are changed)."""


class _WorkerProcess(multiprocessing.context.SpawnProcess):
    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        # The preparation data a spawned child gets names its main module: this thread's
        # workers get factory.worker_env instead of the parent's (see there). Only for this
        # thread: another one spawning meanwhile gets the usual data.
        with _SPAWNING:
            prepare = multiprocessing.spawn.get_preparation_data

            def worker_preparation(name: str) -> dict[str, Any]:
                data: dict[str, Any] = prepare(name)
                if _SPAWNER and _SPAWNER[0] == threading.get_ident():
                    data.pop("init_main_from_path", None)
                    data["init_main_from_name"] = "factory.worker_env"
                return data

            _SPAWNER.append(threading.get_ident())
            multiprocessing.spawn.get_preparation_data = worker_preparation
            try:
                return multiprocessing.context.SpawnProcess._Popen(process_obj)
            finally:
                multiprocessing.spawn.get_preparation_data = prepare
                _SPAWNER.clear()


class WorkerContext(multiprocessing.context.SpawnContext):
    """The spawn start method, with ``factory.worker_env`` as the children's main module
    (not the parent's), which also sets their environment."""

    Process = _WorkerProcess


def worker_context(*, local_files: bool = True) -> multiprocessing.context.BaseContext:
    """How the workers start: forked on Linux when this process runs no Python thread but the
    main one and the data files are local (``local_files``), else spawned (``WorkerContext``).

    A forked worker has every module loaded already, where a spawned one imports numpy,
    pyarrow and the normalizers first (0.2 CPU-s each, a few percent of the bench's 200k
    records on two cores: measured 5.69-5.82 s forked, 5.96-6.02 s spawned). A fork copies
    the locks of every thread as they are at that moment, so a process with other Python
    threads (a Dagster run, the gateway, pyiceberg's reader pool after a scan) spawns its
    workers. Native threads are not seen here: those of numpy's OpenBLAS and of Arrow's pools,
    which this process may run, reset themselves in a forked child; an object store's client
    (S3 data files) is not known to, so its workers are spawned. Other systems than Linux
    spawn, as Python does by default there.

    A forked worker keeps the memory allocator settings of this process: ``WORKER_ENV``
    (``factory.worker_env``) applies to spawned workers only (measured: no difference in CPU
    for the forked ones, with glibc's or Arrow's system allocator instead).
    """
    if (local_files and sys.platform == "linux" and threading.active_count() == 1
            and "fork" in multiprocessing.get_all_start_methods()):
        return multiprocessing.get_context("fork")
    return WorkerContext()


def _keep_freed_memory() -> None:
    """glibc's malloc: serve every block's buffers from the heap and keep what is freed.

    By default a buffer over 128 KiB (a block's bytes, its lines) is mapped fresh and
    unmapped when freed, and the heap's top is given back: every block faulted in its memory
    again (-17% of a worker's CPU with this, measured on the bench's 30k records). A worker
    is short-lived, so holding its high-water mark costs nothing. No-op without glibc.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    mallopt(m_mmap_threshold, 256 << 20)
    mallopt(m_trim_threshold, 1 << 30)


def init_block_worker(known: list[bytes], settings: Any,
                      targets: dict[str, FileTarget]) -> None:
    """Set up a worker: the digests of the known ids, the blob store it writes images to, and
    how to write each table's files (no catalog, no pyiceberg: the worker starts faster)."""
    _keep_freed_memory()
    _WORKER["known"] = [np.frombuffer(b, dtype="S32") for b in known]
    _WORKER["blobs"] = BlobStore(settings)
    _WORKER["targets"] = targets
    # Everything alive now (modules, the known ids) stays for the worker's life: out of the
    # collector's sight, so a full collection walks only what blocks leave behind.
    gc.freeze()


def worker_block(task: BlockTask, ctx: FileContext) -> BlockResult:
    """``ingest_block`` in a worker process set up by ``init_block_worker``.

    The cyclic collector is off during a block and collects once after it: a block's parsed
    records are acyclic and freed by reference counting, and the collector only re-walked
    the thousands alive at a time (the rare cycle, an exception's traceback, waits until the
    block ends).
    """
    gc.disable()
    try:
        return ingest_block(task, ctx, targets=_WORKER["targets"], known=_WORKER["known"],
                            blobs=_WORKER["blobs"])
    finally:
        gc.enable()
        gc.collect()


# -- one block -----------------------------------------------------------------------------------
def ingest_block(task: BlockTask, ctx: FileContext, *, targets: dict[str, FileTarget],
                 known: list[np.ndarray], blobs: BlobStore) -> BlockResult:
    """Read, normalize and write one block (see the module docstring)."""
    block = task.read()
    skip = 0
    if task.start == 0 and block.startswith(codecs.BOM_UTF8):
        skip = len(codecs.BOM_UTF8)
        block = block[skip:]  # a byte order mark is not part of the record
    lines = block.split(b"\n")
    invalid: list[LineError] = []
    results = process_lines(lines, name=task.name, first_lineno=1, format_hint=ctx.format_hint,
                            known=known, blobs=blobs, line_errors=invalid)
    out = BlockResult(name=task.name, start=task.start, plain=task.data is None,
                      num_read=len(results) + len(invalid), num_bytes=task.end - task.start,
                      num_lines=len(lines) - 1, invalid=invalid)
    rows = BlockRows(block, lines)
    seen: set[str] = set()
    # Ids the lake may hold: records process_lines skipped, and rejections (a line that is not
    # JSON is rejected before any check) whose id is known.
    in_lake = (known_mask([r[1] for r in results], known) if any(len(a) for a in known)
               else None)
    for i, (index, rid, text, fmt, reason, sample_rows) in enumerate(results):
        if rid in seen:
            out.num_duplicates += 1
            continue
        seen.add(rid)
        if in_lake is not None and in_lake[i]:  # the main process decides what it is
            if text is not None:
                out.held.append((rid, fmt, text, reason))
                continue
            line = lines[index]
            lead = len(line) - len(line.lstrip())
            out.held.append((rid, fmt, (skip + int(rows.lines.offsets[index]) + lead,
                                        len(line.strip())), reason))
            continue
        rows.add(index, rid, text, fmt, reason, sample_rows)
    for name, table in rows.tables(ctx):
        if table.num_rows:
            out.files[name] = [targets[name].write(table, task.locations[name])]
    out.ids, out.rejected, out.num_samples = rows.per_id()
    return out


# -- the pool, in the main process ---------------------------------------------------------------
class BlockWorkers:
    """Blocks through ``ingest_block``, in worker processes or in process, results in order.

    At most ``2 * workers`` blocks are in flight. The worker processes start (forked when
    this process has no other thread, else spawned: ``worker_context``) at the first block
    when ``eager``, else when a second block arrives. Every block, in a worker or here, checks
    against the ids the lake held when the ingest started, so records already there are not
    normalized again (ids given by earlier blocks are the main process's to drop).

    A block that fails leaves no data file behind: the locations it was given are removed.
    """

    def __init__(self, workers: int, known: KnownIds, lake: Lake, ctx: FileContext,
                 targets: dict[str, FileTarget], *, eager: bool) -> None:
        self.workers = workers
        self.eager = eager
        self.known_at_start = list(known.arrays)
        self.lake = lake
        self.ctx = ctx
        self.blobs = BlobStore(lake.settings)
        self.targets = targets
        self._locations: dict[str, list[str]] = {name: [] for name in TABLE_NAMES}
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._pending: deque[tuple[BlockTask, Future[BlockResult] | BlockResult]] = deque()
        self._num_blocks = 0

    def _new_locations(self) -> dict[str, str]:
        """A fresh data file location per table (handed out in runs: each run loads the
        table once)."""
        for name, free in self._locations.items():
            if not free:
                free.extend(self.lake.new_data_locations(name, 64))
        return {name: free.pop() for name, free in self._locations.items()}

    def submit(self, task: BlockTask) -> Iterator[tuple[BlockTask, BlockResult]]:
        """Queue a block; yields the results that must be taken out first."""
        self._num_blocks += 1
        task = dataclasses.replace(task, locations=self._new_locations())
        if self.workers > 1 and self._pool is None and (self.eager or self._num_blocks == 2):
            # pyiceberg stays out of the spawned workers, which import this module
            from factory.lake import stop_idle_reader_pool  # (loaded: this process holds a lake)

            stop_idle_reader_pool()  # (the workers can then be forked)
            local = all(loc.startswith("file:") or "://" not in loc
                        for loc in task.locations.values())
            self._pool = concurrent.futures.ProcessPoolExecutor(
                max_workers=self.workers, mp_context=worker_context(local_files=local),
                initializer=init_block_worker,
                initargs=([a.tobytes() for a in self.known_at_start], self.lake.settings,
                          self.targets))
        result: Future[BlockResult] | BlockResult
        if self._pool is None:
            try:
                result = ingest_block(task, self.ctx, targets=self.targets,
                                      known=self.known_at_start, blobs=self.blobs)
            except BaseException:
                self._forget(task)
                raise
        else:
            result = self._pool.submit(worker_block, task, self.ctx)
        self._pending.append((task, result))
        while len(self._pending) > 2 * self.workers:
            yield self._take()

    def drain(self) -> Iterator[tuple[BlockTask, BlockResult]]:
        while self._pending:
            yield self._take()

    def _take(self) -> tuple[BlockTask, BlockResult]:
        task, result = self._pending.popleft()
        if isinstance(result, BlockResult):
            return task, result
        try:
            return task, result.result()
        except BaseException:  # a worker failed (or died) mid-block
            self._forget(task)
            raise

    def _forget(self, task: BlockTask) -> None:
        """Remove whatever a failed block may have written."""
        delete_files(self.lake, {name: [loc] for name, loc in task.locations.items()})

    def close(self) -> None:
        """Stop the workers; the data files of blocks never taken out are removed."""
        pending = list(self._pending)
        self._pending.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        for task, result in pending:
            if isinstance(result, Future) and (result.cancelled()
                                               or result.exception() is not None):
                self._forget(task)
                continue
            done = result if isinstance(result, BlockResult) else result.result()
            delete_files(self.lake, done.files)


def delete_files(lake: Lake, files: Mapping[str, list[str]]) -> None:
    for name, data_files in files.items():
        try:
            lake.delete_files(name, data_files)
        except OSError:  # garbage left behind is harmless: never referenced by a snapshot
            pass

