"""Which ``raw_trace_id``s the lake holds already: the dedupe of an ingest.

Ids are kept as their 32-byte digests (``digests``) in sorted numpy arrays, which worker
processes get a copy of (``known_mask``) and the main process extends as blocks come back
(``KnownIds``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # a worker process checks ids without the lake (and pyiceberg) loaded
    from factory.lake import Lake, Lineage


def digests(ids: Sequence[str]) -> np.ndarray:
    """Each id as 32 bytes (numpy ``S32``): a sha256 hex id is its digest, any other id (a
    caller's own, like a gateway capture id) the sha256 of its text."""
    joined = "".join(ids)
    # The usual case in one C call: every id 64 lower-case hex digits. (fromhex skips
    # whitespace, so 32 bytes per id also proves there was none.)
    if all(len(s) == 64 for s in ids) and not any(c in joined for c in "ABCDEF"):
        try:
            raw = bytes.fromhex(joined)
        except ValueError:
            raw = b""
        if len(raw) == 32 * len(ids):
            return np.frombuffer(raw, dtype="S32").copy()
    out = []
    for s in ids:
        try:
            one = bytes.fromhex(s)
        except ValueError:
            one = b""
        if len(one) != 32 or one.hex() != s:  # only the canonical spelling maps to its bytes
            one = hashlib.sha256(s.encode("utf-8", "surrogatepass")).digest()
        out.append(one)
    return np.array(out, dtype="S32")


def known_mask(ids: Sequence[str], known: Sequence[np.ndarray]) -> np.ndarray:
    """A bool per id: is it among ``known`` (sorted ``digests`` arrays)?"""
    found = np.zeros(len(ids), dtype=bool)
    if not ids:
        return found
    keys = digests(ids)
    for arr in known:
        if len(arr):
            # Binary search in the sorted digests: O(n log m), where isin would re-sort them.
            pos = np.minimum(np.searchsorted(arr, keys), len(arr) - 1)
            found |= arr[pos] == keys
    return found


class KnownIds:
    """Which raw_trace_ids the lake already holds, and which of them still lack an outcome.

    Read once per ingest: every id in raw_traces as its 32-byte digest (``digests``) in
    sorted numpy arrays, exact and a third of the memory of a set of strings; and, the first
    time a known id comes by, the "orphans": raw rows with no row in samples or
    rejected_traces (a crash between the raw and the derived commits), which are normalized
    again. Looking ids up is then a binary search in memory: scanning the tables per chunk to
    confirm candidates would make re-ingesting a file cost as much as ingesting it.

    With ``read=False`` the lake's ids are not read (records known to be new to it: the
    gateway's first attempt at its own captures); only ids seen in this ingest are known.
    """

    def __init__(self, lake: Lake, lineage: Lineage | None, *, read: bool = True) -> None:
        self.lake = lake
        self.arrays: list[np.ndarray] = []
        """Sorted digests of the ids (several arrays, merged now and then)."""
        self.prefixes: list[np.ndarray] = []
        """The first 8 bytes of each of ``arrays`` as big-endian integers: as sorted (8 bytes
        more per id, for a search 4x faster than in the digests)."""
        self._orphans: set[bytes] | None = None
        """Digests of ids in raw_traces without an outcome yet (read when first needed)."""
        self._snap = lake.snapshot_id("raw_traces") if read else None
        if lineage is not None and read:
            lineage.record_read("raw_traces", self._snap)
        self._add(self._ids("raw_traces", self._snap))
        self._num_initial = sum(len(a) for a in self.arrays)

    def _read_orphans(self) -> set[bytes]:
        """The raw rows (as of the start) that have no row in samples or rejected_traces."""
        if self._orphans is None:
            self._orphans = set()
            if self._num_initial:
                done = [i for name in ("samples", "rejected_traces")
                        for i in self._ids(name, self.lake.snapshot_id(name))]
                done_keys = np.unique(digests(done))
                raw = np.sort(digests(self._ids("raw_traces", self._snap)))
                if len(done_keys):
                    pos = np.minimum(np.searchsorted(done_keys, raw), len(done_keys) - 1)
                    raw = raw[done_keys[pos] != raw]
                self._orphans = {bytes(k).ljust(32, b"\0") for k in raw}
        return self._orphans

    def _ids(self, name: str, snap: int | None) -> list[str]:
        if snap is None:
            return []
        scan = self.lake.table(name).scan(snapshot_id=snap, selected_fields=("raw_trace_id",))
        return [s for s in scan.to_arrow().column(0).to_pylist() if s]

    def _add(self, ids: list[str]) -> None:
        if not ids:
            return
        self.arrays.append(np.sort(digests(ids)))
        self.prefixes.append(prefixes(self.arrays[-1]))
        # The arrays at least halve in size from first to last (a few dozen at most): the last
        # two are merged while the last is at least half the one before. Two sorted runs merge
        # in linear time (a stable sort finds them), so each id is merged about log2(n /
        # block) times, and a merge holds at most one more copy of the ids it merges.
        while len(self.arrays) > 1 and 2 * len(self.arrays[-1]) >= len(self.arrays[-2]):
            last = self.arrays.pop()
            merged = np.concatenate([self.arrays.pop(), last])
            del last
            self.prefixes[-2:] = []
            merged.sort(kind="stable")
            self.arrays.append(merged)
            self.prefixes.append(prefixes(merged))

    def existing(self, ids: list[str]) -> set[str]:
        """The subset of ``ids`` already in raw_traces (or in a batch handed to the writer)."""
        if not ids or not self.arrays:
            return set()
        keys = digests(ids)
        # In order: numpy's binary search starts each key where the one before ended.
        wanted = prefixes(keys)
        order = np.argsort(wanted)
        wanted = wanted[order]
        found = np.zeros(len(ids), dtype=bool)
        for arr, pre in zip(self.arrays, self.prefixes, strict=True):
            if not len(arr):
                continue
            # The 8-byte prefixes first (a search over integers, 4x faster than over 32-byte
            # strings), then the few ids whose prefix is there, in full.
            pos = np.minimum(np.searchsorted(pre, wanted), len(pre) - 1)
            maybe = order[pre[pos] == wanted]
            if len(maybe):
                found[maybe] |= known_mask([ids[i] for i in maybe.tolist()], [arr])
        return {i for i, f in zip(ids, found, strict=True) if f}

    def orphans_among(self, ids: set[str]) -> set[str]:
        """The subset of ``ids`` (known ones) whose raw row has no outcome yet."""
        if not ids:
            return set()
        orphans = self._read_orphans()
        if not orphans:
            return set()
        listed = list(ids)
        return {i for i, key in zip(listed, digests(listed), strict=True)
                if bytes(key).ljust(32, b"\0") in orphans}

    def healed(self, ids: set[str]) -> None:
        """These orphans get their outcome in this ingest: later copies are duplicates."""
        if ids and self._orphans:
            for key in digests(list(ids)):
                self._orphans.discard(bytes(key).ljust(32, b"\0"))

    def remember(self, ids: list[str]) -> None:
        self._add(ids)


def prefixes(keys: np.ndarray) -> np.ndarray:
    """The first 8 bytes of each 32-byte digest as a big-endian integer: ordered as the
    digests are (byte by byte)."""
    return keys.view(np.uint8).reshape(-1, 32)[:, :8].copy().view(">u8").ravel().astype(
        np.uint64)
