"""The background flusher: sealed spool segments -> ``raw_traces`` / ``samples`` in the lake.

Runs in its own thread so lake commits never touch the request path. A batch is whole segments
(up to ``flush_max_records`` captures), decoded into the capture records the ingest normalizers
accept and committed with ``factory.ingest.ingest_records``; the segments are deleted only after
that returned. Each capture's ``raw_trace_id`` is derived from its ``capture_id``, and ingest skips
ids already in ``raw_traces``, so a batch replayed after a crash between commit and delete is
captured exactly once. A replay is a segment older than this process's hold on the spool (an
earlier holder may have committed it) or one whose earlier attempt failed (it may have been
committed in part); any other batch is new to the lake, and ingest does not read
``raw_traces``' ids for it (a read that grows with the table, on every flush). While the lake
is unavailable (catalog locked, unreachable, any error on commit) the batch is retried with
back-off and the spool keeps growing; each failed attempt is logged with its traceback and
counted in ``/metrics``.

Only one process flushes a spool folder at a time (an ``flock`` on ``flush.lock``). Every
``expire_every_s`` it expires old snapshots of the tables it commits to (``CAPTURE_TABLES``,
``Lake.expire_snapshots``), so a gateway that commits every flush for days keeps its commits as
cheap as on the first day.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import orjson

from factory.gateway.captures import capture_payload, capture_raw_trace_id
from factory.gateway.shadow import SHADOW_KIND, commit_pairs
from factory.gateway.spool import SpoolEntry, read_segment, sealed_segments
from factory.normalize.otlp import merge_traces

log = logging.getLogger("factory.gateway")

CAPTURE_TABLES = ("raw_traces", "samples", "rejected_traces", "shadow_pairs")
"""The tables a flusher commits to."""

KEEP_LAST_SNAPSHOTS = 100
"""Snapshots of each capture table kept however old they are."""


class IngestFn(Protocol):
    """Commits capture records to the lake (``factory.ingest.ingest_records``); ``new_ids``:
    none of them can be there yet."""

    def __call__(self, lake: Any, records: list[Any], *, new_ids: bool) -> Any: ...


def to_raw_record(entry: SpoolEntry) -> Any:
    # ingest loads pyarrow.compute and its workers (0.3 s): the CLI imports the gateway for its keys
    from factory.ingest import RawRecord

    h = entry.header
    received = datetime.fromtimestamp(h["at"], tz=UTC)
    tags = dict(h.get("tags") or {})
    if h["k"] == "otel":
        return RawRecord(payload=orjson.loads(entry.body), source="otel", received_at=received,
                         tags=tags, project=h.get("project"), raw_trace_id=None,
                         format_hint="otlp")
    return RawRecord(payload=capture_payload(entry), source="proxy", received_at=received,
                     tags=tags, project=h.get("project"),
                     raw_trace_id=capture_raw_trace_id(h["id"]))


def merge_otel_records(records: list[Any]) -> list[Any]:
    """Merge the OTLP records of one trace that arrived in several exports of this batch.

    Exporters batch spans by time, not by trace, so one agent run often spans several
    ``POST /v1/traces``; merged, prefix-dropping sees the whole run and yields one sample.
    Spans of one trace that land in different flush batches are still ingested apart.
    """
    groups: dict[str, list[Any]] = {}
    out: list[Any] = []
    for rec in records:
        trace = rec.payload.get("otlp_trace") if rec.source == "otel" and isinstance(
            rec.payload, dict) else None
        if isinstance(trace, dict) and trace.get("trace_id"):
            group = groups.setdefault(str(trace["trace_id"]), [])
            if not group:
                out.append(group)
            group.append(rec)
        else:
            out.append(rec)
    merged: list[Any] = []
    for item in out:
        if not isinstance(item, list):
            merged.append(item)
        elif len(item) == 1:
            merged.append(item[0])
        else:
            first = item[0]
            payload = merge_traces([r.payload for r in item])[0]
            merged.append(replace(first, payload=payload,
                                  received_at=min(r.received_at for r in item)))
    return merged


def _default_ingest(lake: Any, records: list[Any], *, new_ids: bool) -> Any:
    # ingest loads pyarrow.compute and its workers (0.3 s): the CLI imports the gateway for its keys
    from factory.ingest import ingest_records

    return ingest_records(lake, records, new_ids=new_ids)


class Flusher:
    """Drains sealed segments into the lake; retries with back-off while the lake is down.

    Every failed attempt is logged with its traceback and counted (``num_failures``,
    ``last_error``, ``last_error_at``: the gateway's ``/metrics`` and ``/healthz``), so an
    outage shows while it lasts; the batch stays spooled and the next attempt comes after a
    back-off that doubles up to ``retry_max_s``.
    """

    def __init__(self, directory: Path, *, lake_factory: Callable[[], Any],
                 ingest: IngestFn | None = None, interval_s: float = 0.5,
                 max_records: int = 20_000, retry_max_s: float = 10.0,
                 expire_every_s: float = 0.0, retention_s: float = 600.0) -> None:
        self.dir = directory
        self.lake_factory = lake_factory
        self.ingest = ingest if ingest is not None else _default_ingest
        self.interval_s = interval_s
        self.max_records = max_records
        self.retry_max_s = retry_max_s
        self.expire_every_s = expire_every_s
        self.retention_s = retention_s
        self._last_expiry = time.monotonic()
        self.num_expired = 0
        """Snapshots this process expired from the capture tables."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock_fd = -1
        self._lock_wait_logged = False
        self._lake: Any = None
        self.num_committed = 0
        """Captures committed to the lake by this process (samples or rejected_traces)."""
        self.num_rejected = 0
        """Of those, captures ingest rejected (kept in ``rejected_traces`` with the reason)."""
        self.num_failures = 0
        """Flush attempts that raised (each logged with its traceback, its batch retried)."""
        self.num_corrupt_segments = 0
        self._locked_ns = 0
        """When this process took the flush lock: a segment created before it may have been
        committed by an earlier holder that stopped before deleting it (a replay)."""
        self._tried: set[str] = set()
        """Segments of a batch whose commit was attempted and failed: it may have been
        committed in part, so the next attempt is a replay."""
        self.num_pairs = 0
        """Shadow frames committed to ``shadow_pairs`` by this process (a replayed one counts
        again; the table keeps it once)."""
        self.last_success_at: float | None = None
        """Unix time of the last commit."""
        self.last_error: str | None = None
        """The last failure, one line; None once a commit succeeded after it."""
        self.last_error_at: float | None = None
        """Unix time of the last failure (kept after a later success)."""

    @property
    def running(self) -> bool:
        """Whether the flush thread is alive (False before ``start`` and once it ended)."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="gateway-flusher", daemon=True)
        self._thread.start()

    def stop(self, *, final_flush_s: float = 5.0) -> None:
        """Stop; one last drain attempt bounded by ``final_flush_s`` (what is left stays spooled
        for the next start)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=final_flush_s + 30)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def _acquire(self) -> bool:
        if self._lock_fd >= 0:
            return True
        fd = os.open(self.dir / "flush.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            if not self._lock_wait_logged:
                self._lock_wait_logged = True
                log.info("flusher: another process holds %s and drains this spool; this "
                            "one flushes once it is gone", self.dir / "flush.lock")
            return False
        self._lock_fd = fd
        self._locked_ns = time.time_ns()
        if self._lock_wait_logged:
            log.info("flusher: took over %s", self.dir / "flush.lock")
        return True

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # a bug: said loudly, never a thread gone without a word
            self._failed(exc)
            log.critical("flusher: stopped by an unexpected error; captures stay spooled until "
                         "the gateway restarts", exc_info=exc)

    def _loop(self) -> None:
        delay = self.interval_s
        while True:
            stopping = self._stop.is_set()  # once set: one last pass, then return
            try:
                committed = self.flush_once() if self._acquire() else 0
            except Exception as exc:
                delay = min(max(delay * 2, 0.2), self.retry_max_s)
                self._failed(exc)
                self._lake = None  # a fresh catalog connection on the next try
                log.error("flusher: committing captures to the lake failed (failure %d); they "
                          "stay spooled, next try in %.1f s", self.num_failures, delay,
                          exc_info=exc)
            else:
                delay = self.interval_s
                if committed and not stopping:
                    continue  # more may be waiting: drain without sleeping
            if stopping:
                return
            self._stop.wait(delay)

    def _failed(self, exc: BaseException) -> None:
        self.num_failures += 1
        self.last_error = traceback.format_exception_only(exc)[-1].strip()[:300]
        self.last_error_at = time.time()

    def flush_once(self) -> int | None:
        """Commit one batch of sealed segments; returns captures committed (0: nothing to do).

        Raises whatever the lake raised; the segments then stay for the next try.
        """
        segments = sealed_segments(self.dir)
        if not segments:
            return 0
        batch: list[SpoolEntry] = []
        used: list[Path] = []
        corrupt: list[Path] = []
        records: list[Any] = []
        pairs: list[SpoolEntry] = []
        for seg in segments:
            entries, intact = read_segment(seg)
            for entry in entries:
                if entry.header.get("k") == SHADOW_KIND:
                    pairs.append(entry)  # a candidate's answer: never a capture
                    continue
                try:
                    records.append(to_raw_record(entry))
                except (ValueError, KeyError, TypeError) as exc:
                    intact = False
                    log.error("spool: undecodable record in %s: %s", seg.name, exc)
            batch.extend(entries)
            (used if intact else corrupt).append(seg)
            if len(batch) >= self.max_records:
                break
        records = merge_otel_records(records)
        names = {seg.name for seg in used + corrupt}
        replay = any(int(seg.name.split("-")[0]) < self._locked_ns for seg in used + corrupt)
        new_ids = self._locked_ns > 0 and not replay and not names & self._tried
        self._tried |= names
        if records:
            if self._lake is None:
                self._lake = self.lake_factory()
            summary = self.ingest(self._lake, records, new_ids=new_ids)
            rejected = int(getattr(summary, "rejected", 0) or 0)
            if rejected:
                self.num_rejected += rejected
                log.info("flusher: %d of %d captures rejected by ingest; the reasons are in "
                         "rejected_traces", rejected, len(records))
        if pairs:
            if self._lake is None:
                self._lake = self.lake_factory()
            commit_pairs(self._lake, pairs, check_existing=not new_ids)
            self.num_pairs += len(pairs)
        for seg in used:
            seg.unlink()
        for seg in corrupt:
            self.num_corrupt_segments += 1
            os.replace(seg, seg.with_suffix(".corrupt"))
            log.error("spool: segment %s has a torn or corrupt record; its intact records were "
                      "committed, the file is kept as .corrupt", seg.name)
        self._tried -= names
        self.num_committed += len(records)
        self.last_success_at = time.time()
        self.last_error = None
        self._maybe_expire()
        return len(records)

    def _maybe_expire(self) -> None:
        """Expire old capture-table snapshots when ``expire_every_s`` has passed; a failure is
        logged and retried at the next period, never a failed flush (the rows are committed)."""
        if not self.expire_every_s or self._lake is None \
                or time.monotonic() - self._last_expiry < self.expire_every_s:
            return
        self._last_expiry = time.monotonic()
        try:
            expired = self._lake.expire_snapshots(CAPTURE_TABLES, retain_s=self.retention_s,
                                                  keep_last=KEEP_LAST_SNAPSHOTS)
        except Exception:
            log.exception("flusher: expiring old snapshots of %s failed; next try in %.0f s",
                          ", ".join(CAPTURE_TABLES), self.expire_every_s)
            return
        self.num_expired += sum(expired.values())
        if expired:
            log.info("flusher: expired %s old snapshot(s)",
                     ", ".join(f"{n} of {t}" for t, n in expired.items()))
