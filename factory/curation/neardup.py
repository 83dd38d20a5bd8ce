"""Word n-gram hashing, MinHash signatures, LSH band keys, exact Jaccard, connected components.

Hashes are stable 64-bit values (BLAKE2b of each word, combined with fixed odd multipliers), so
Spark workers and the in-process engine produce identical values. Signatures are computed for a
whole batch at once with numpy (one pass per permutation over the flat shingle array) instead of
one ``datasketch.MinHash`` object per sample, which measured ~20x slower here; the LSH banding
follows datasketch's scheme (b bands of r rows, a bucket per band key).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from itertools import chain, combinations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from factory.language import words

_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
# Position multipliers for combining word hashes into an n-gram hash (odd, fixed forever).
_POS = np.array([(0x9E3779B97F4A7C15 * (2 * i + 1)) & 0xFFFFFFFFFFFFFFFF for i in range(64)],
                dtype=np.uint64)

_word_cache: dict[str, int] = {}


def word_hash(word: str) -> int:
    h = _word_cache.get(word)
    if h is None:
        h = int.from_bytes(hashlib.blake2b(word.encode(), digest_size=8).digest(), "little")
        if len(_word_cache) < 2_000_000:
            _word_cache[word] = h
    return h


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer: spreads bits so that min/equality behave like a random hash."""
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint64(30))
        x = x * _M1
        x = x ^ (x >> np.uint64(27))
        x = x * _M2
        return x ^ (x >> np.uint64(31))


def flat_words(texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Word hashes of every text, flattened, and the offsets (len = len(texts) + 1).

    Each distinct word of the batch is hashed once (Arrow dictionary-encodes the flat word
    list in C), then the hashes are gathered: no Python work per word occurrence.
    """
    per_text = [words(t) for t in texts]
    lens = np.zeros(len(texts) + 1, dtype=np.int64)
    lens[1:] = [len(ws) for ws in per_text]
    offsets = np.cumsum(lens)
    if not offsets[-1]:
        return np.zeros(0, dtype=np.uint64), offsets
    encoded = pc.dictionary_encode(pa.array(list(chain.from_iterable(per_text)), pa.string()))
    distinct = np.array([word_hash(w) for w in encoded.dictionary.to_pylist()], dtype=np.uint64)
    return distinct[encoded.indices.to_numpy()], offsets


def ngram_hashes(flat: np.ndarray, offsets: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted unique hashes of the word n-grams of each text: (values, offsets)."""
    num = len(offsets) - 1
    total = len(flat)
    if total < n or n < 1:
        return np.zeros(0, dtype=np.uint64), np.zeros(num + 1, dtype=np.int64)
    width = total - n + 1
    with np.errstate(over="ignore"):
        acc = np.zeros(width, dtype=np.uint64)
        for k in range(n):
            acc += flat[k:k + width] * _POS[k % len(_POS)]
    acc = _mix(acc ^ np.uint64(n))
    starts = np.arange(width)
    owner = np.searchsorted(offsets, starts, side="right") - 1
    valid = starts + n <= offsets[owner + 1]
    acc, owner = acc[valid], owner[valid]
    order = np.lexsort((acc, owner))
    acc, owner = acc[order], owner[order]
    keep = np.ones(len(acc), dtype=bool)
    keep[1:] = (acc[1:] != acc[:-1]) | (owner[1:] != owner[:-1])
    acc, owner = acc[keep], owner[keep]
    counts = np.bincount(owner, minlength=num)
    return acc, np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


def _perm_seeds(num_perm: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 2**63, size=num_perm, dtype=np.int64).astype(np.uint64)


def minhash(values: np.ndarray, offsets: np.ndarray, num_perm: int, seed: int) -> np.ndarray:
    """MinHash signatures (num_texts x num_perm, uint64); rows of empty texts are all-max."""
    num = len(offsets) - 1
    sig = np.full((num, num_perm), _MASK, dtype=np.uint64)
    nonempty = np.flatnonzero(np.diff(offsets) > 0)
    if len(values) == 0 or len(nonempty) == 0:
        return sig
    starts = offsets[:-1][nonempty]
    for p, s in enumerate(_perm_seeds(num_perm, seed)):
        sig[nonempty, p] = np.minimum.reduceat(_mix(values ^ s), starts)
    return sig


def band_keys(sig: np.ndarray, num_bands: int, rows: int, empty: np.ndarray) -> np.ndarray:
    """One 64-bit key per band per text (num_texts x num_bands); empty texts get key 0."""
    keys = np.zeros((sig.shape[0], num_bands), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for b in range(num_bands):
            acc = np.full(sig.shape[0], np.uint64(b + 1), dtype=np.uint64)
            for r in range(rows):
                acc = _mix(acc ^ sig[:, b * rows + r]) * _POS[r]
            keys[:, b] = _mix(acc)
    keys[empty] = 0
    return keys


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Exact Jaccard similarity of two sorted unique hash arrays."""
    if len(a) == 0 and len(b) == 0:
        return 1.0
    inter = len(np.intersect1d(a, b, assume_unique=True))
    return inter / (len(a) + len(b) - inter)


def candidate_pairs(keys: Sequence[Sequence[int]]) -> set[tuple[int, int]]:
    """Index pairs (i < j) sharing at least one non-zero band key."""
    buckets: dict[tuple[int, int], list[int]] = {}
    for i, row in enumerate(keys):
        for b, k in enumerate(row):
            if k:
                buckets.setdefault((b, int(k)), []).append(i)
    pairs: set[tuple[int, int]] = set()
    for members in buckets.values():
        if len(members) > 1:
            pairs.update(combinations(sorted(members), 2))
    return pairs


def brute_force_pairs(shingles: Sequence[np.ndarray], threshold: float) -> set[tuple[int, int]]:
    """Every pair at or above ``threshold`` by exact Jaccard: the reference LSH must match."""
    out = set()
    sets = [set(s.tolist()) for s in shingles]
    sizes = [len(s) for s in sets]
    for i in range(len(sets)):
        if not sizes[i]:
            continue
        si = sets[i]
        for j in range(i + 1, len(sets)):
            if not sizes[j]:
                continue
            # |A∩B| <= min(|A|,|B|): skip pairs whose sizes alone rule the threshold out
            if min(sizes[i], sizes[j]) < threshold * max(sizes[i], sizes[j]):
                continue
            inter = len(si & sets[j])
            if inter / (sizes[i] + sizes[j] - inter) >= threshold:
                out.add((i, j))
    return out


class UnionFind:
    """Disjoint sets over hashable keys; ``root`` is the smallest key of the set."""

    def __init__(self) -> None:
        self.parent: dict[str, str] = {}

    def find(self, x: str) -> str:
        parent = self.parent
        parent.setdefault(x, x)
        root = x
        while parent[root] != root:
            root = parent[root]
        while parent[x] != root:
            parent[x], x = root, parent[x]
        return root

    def union(self, a: str, b: str) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            lo, hi = (ra, rb) if ra < rb else (rb, ra)
            self.parent[hi] = lo


def components(edges: Iterable[tuple[str, str]]) -> dict[str, str]:
    """Node -> smallest node of its connected component (only nodes that appear in edges)."""
    uf = UnionFind()
    for a, b in edges:
        uf.union(a, b)
    return {x: uf.find(x) for x in list(uf.parent)}
