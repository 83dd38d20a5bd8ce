"""The durable local spool between the gateway's hot path and the lake.

Append-only segment files under ``$FACTORY_HOME/spool``. Each capture is one framed record,
written with a single ``write(2)`` on the request path before the response completes (so a
process killed with SIGKILL right after a client got its 200 still has the capture in the page
cache), and made durable against power loss by a group-commit thread that fsyncs every
``group_commit_ms`` (one fsync for all captures of the window, off the request path).

The active segment is ``<ns>-<pid>-<seq>.open``; after ``segment_max_age_s`` or
``segment_max_bytes`` it is fsynced and renamed ``.seg`` (sealed), and only sealed segments are
read by the flusher, which deletes them after the lake commit succeeded. At start, ``.open``
segments whose writer is gone (a crash) are sealed and drained like any other: a writer holds
an ``flock`` on its active segment, which the kernel releases when the process dies.

Frame: ``b"FSP1"``, payload length (u32 LE), CRC-32 of the payload (u32 LE), payload. Payload:
a one-line JSON header, ``\\n``, then the raw bodies whose lengths the header gives. A torn or
corrupt tail stops the read of that segment; the segment is then kept as ``.corrupt`` instead of
deleted, so nothing is silently lost.
"""

from __future__ import annotations

import fcntl
import logging
import os
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

log = logging.getLogger("factory.gateway")

MAGIC = b"FSP1"
_FRAME = struct.Struct("<4sII")


def encode(header: dict[str, Any], *bodies: bytes) -> bytes:
    payload = b"".join((orjson.dumps(header), b"\n", *bodies))
    return _FRAME.pack(MAGIC, len(payload), zlib.crc32(payload)) + payload


@dataclass(frozen=True)
class SpoolEntry:
    """One decoded record: its header and the raw bytes after it."""

    header: dict[str, Any]
    body: bytes


def read_segment(path: Path) -> tuple[list[SpoolEntry], bool]:
    """All records of a segment, and whether the file was intact to its end."""
    data = path.read_bytes()
    entries: list[SpoolEntry] = []
    pos, end = 0, len(data)
    while pos < end:
        if end - pos < _FRAME.size:
            return entries, False
        magic, length, crc = _FRAME.unpack_from(data, pos)
        start = pos + _FRAME.size
        payload = data[start:start + length]
        if magic != MAGIC or len(payload) != length or zlib.crc32(payload) != crc:
            return entries, False
        newline = payload.index(b"\n")
        entries.append(SpoolEntry(orjson.loads(payload[:newline]), payload[newline + 1:]))
        pos = start + length
    return entries, True


def _writer_gone(path: Path) -> bool:
    """Whether no process appends to the active segment ``path`` any more.

    A writer holds an ``flock`` on its active segment until it is sealed; the kernel releases
    it when the process dies, SIGKILL included. So a lock taken here means the writer is gone,
    which a pid check cannot tell when the pid was reused or belongs to another container
    sharing the folder.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False  # sealed by its writer meanwhile
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # releases the lock taken, if any
    return True


class SpoolWriter:
    """Appends records to the active segment; a thread fsyncs in groups and seals segments."""

    def __init__(self, directory: Path, *, group_commit_ms: float = 2.0,
                 segment_max_age_s: float = 0.5, segment_max_bytes: int = 16 << 20) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.group_commit_s = group_commit_ms / 1000
        self.segment_max_age_s = segment_max_age_s
        self.segment_max_bytes = segment_max_bytes
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._seq = 0
        self._fd = -1
        self._path: Path | None = None
        self._opened_at = 0.0
        self._size = 0
        self._count = 0
        self._dirty = False
        self.num_written = 0
        """Records appended since start."""
        self.num_sealed_records = 0
        self._thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        self.recover()
        self._open_segment()
        self._thread = threading.Thread(target=self._run, name="gateway-spool", daemon=True)
        self._thread.start()

    def recover(self) -> list[Path]:
        """Seal ``.open`` segments left by writers that are gone (crash, kill -9)."""
        sealed = []
        for path in sorted(self.dir.glob("*.open")):
            if not _writer_gone(path):
                continue
            target = path.with_suffix(".seg")
            try:
                os.replace(path, target)
            except FileNotFoundError:
                continue  # another starting gateway recovered it first
            sealed.append(target)
        if sealed:
            self._fsync_dir()
            log.info("spool: recovered %d segment(s) from a previous run", len(sealed))
        return sealed

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        with self._lock:
            self._seal_locked()

    # -- hot path --------------------------------------------------------------------------------
    def append(self, frame: bytes) -> None:
        """Write one encoded record (raises OSError when the disk refuses it)."""
        with self._lock:
            written = os.write(self._fd, frame)
            if written != len(frame):  # a short write on a full disk: never leave half a frame
                os.ftruncate(self._fd, self._size)
                raise OSError(f"spool: short write ({written} of {len(frame)} bytes)")
            self._size += written
            self._count += 1
            self.num_written += 1
            if not self._dirty:
                self._dirty = True
                self._wake.set()

    # -- background --------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(timeout=self.segment_max_age_s / 2)
            if self._stop.is_set():
                break
            if self._wake.is_set():
                # Group window: let the captures arriving now share this fsync.
                time.sleep(self.group_commit_s)
                self._wake.clear()
            try:
                self._sync_and_maybe_seal()
            except OSError as exc:
                log.error("spool: fsync/seal failed: %s", exc)
                time.sleep(0.1)
            except Exception:
                # Anything else is a bug, but the thread must outlive it: were it to die,
                # captures would stop being sealed (and flushed) with nothing said.
                log.exception("spool: the seal thread hit an unexpected error; continuing")
                time.sleep(0.1)

    def _sync_and_maybe_seal(self) -> None:
        with self._lock:
            fd, path, count, dirty = self._fd, self._path, self._count, self._dirty
            self._dirty = False
            due = count > 0 and (
                time.monotonic() - self._opened_at >= self.segment_max_age_s
                or self._size >= self.segment_max_bytes)
            if due:
                # Swap in a fresh segment under the lock (an open(2)), and fsync/rename the full
                # one after releasing it: appends on the event loop never wait for the disk.
                self._open_segment()
        if not due:
            if dirty:
                os.fdatasync(fd)
            return
        assert path is not None
        self._seal(fd, path, count)

    def _seal(self, fd: int, path: Path, count: int) -> None:
        """Make a segment no one appends to any more durable and hand it to the flusher (the
        file is renamed before it is closed: until then its lock says its writer lives)."""
        os.fdatasync(fd)
        if count:
            os.replace(path, path.with_suffix(".seg"))
            self.num_sealed_records += count
        else:
            path.unlink(missing_ok=True)
        os.close(fd)
        self._fsync_dir()

    def _open_segment(self) -> None:
        self._seq += 1
        name = f"{time.time_ns():020d}-{os.getpid()}-{self._seq:06d}.open"
        self._path = self.dir / name
        self._fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX)  # held while this process may append (recover)
        self._opened_at = time.monotonic()
        self._size = 0
        self._count = 0

    def _seal_locked(self) -> None:
        """Seal the active segment at stop (no new one is opened)."""
        if self._fd < 0 or self._path is None:
            return
        fd, path, count = self._fd, self._path, self._count
        self._fd, self._path = -1, None
        self._seal(fd, path, count)

    def _fsync_dir(self) -> None:
        dfd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    # -- introspection -----------------------------------------------------------------------------
    def active_count(self) -> int:
        return self._count


def sealed_segments(directory: Path) -> list[Path]:
    """Sealed segments, oldest first (names start with the creation time)."""
    return sorted(directory.glob("*.seg"))


def pending_files(directory: Path) -> Iterator[Path]:
    yield from directory.glob("*.seg")
    yield from directory.glob("*.open")


def _size(path: Path) -> int:
    """``path``'s size; 0 once it is gone."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def oldest_pending_age_s(directory: Path) -> float:
    """Seconds since the oldest segment still holding uncommitted captures was opened. A
    segment the flusher commits and removes between the listing and its ``stat`` is not
    pending (the race once turned ``/metrics`` into a 500 in the shadow-queue test)."""
    names = [p.name for p in pending_files(directory) if _size(p) > 0]
    if not names:
        return 0.0
    oldest_ns = min(int(n.split("-")[0]) for n in names)
    return max(0.0, (time.time_ns() - oldest_ns) / 1e9)
