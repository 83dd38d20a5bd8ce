"""The embedded engine: curation in process over Arrow tables (numpy, pyarrow, DuckDB-free).

``curate(samples, config, counter)`` returns the train and eval rows, the drops, the report and
the profile. Rows with ``origin`` ``synthetic`` (``factory.curation.synthesis``) are curated
with the traffic, on the train side only (``decide``). The Spark engine (``factory.curation.spark``) produces the same result for the same
input: it runs the same row function and hands the same facts to ``decide``.
"""

from __future__ import annotations

import multiprocessing
import os
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from factory.curation import neardup, phrasing
from factory.curation.config import CurationConfig
from factory.curation.decide import (
    BOILERPLATE_DF,
    EVAL,
    NGRAM_WEIGHTS,
    SYNTHETIC,
    TRAFFIC,
    TRAIN,
    Decisions,
    RowFacts,
    SampleFacts,
    candidate_floor,
    clean_loss_shares,
    decide,
    format_flags,
    overlap_share,
    split_groups,
)
from factory.curation.features import LIST_COLUMNS, sample_features
from factory.curation.profile import build_profile
from factory.curation.report import pattern_report
from factory.curation.text import parse_json
from factory.curation.tokens import TokenCounter

# Rows per feature batch: bounds peak memory of the flat n-gram arrays (~150 MB at 20k).
BATCH = 20_000

ROW_ORDER = ["sample_id", "created_at", "raw_trace_id", "source", "provider", "model", "project"]
"""Columns ordering rows of one sample: the first row of a sample is the one kept."""

DATASET_EXTRA = ["split", "split_group", "num_tokens", "num_prompt_tokens",
                 "num_completion_tokens", "language", "origin"]


class Judge(Protocol):
    """Rejection-sampling judge: a score for one sample (higher is better). A judge that also
    has ``score_many(samples) -> list[float]`` gets all the samples of a step at once (so an
    LLM judge can send them concurrently); ``factory.evals.rejection.RejectionJudge`` does."""

    def score(self, sample: dict[str, Any]) -> float: ...


TableT = TypeVar("TableT")


@dataclass(kw_only=True)
class CurationResult(Generic[TableT]):
    """Everything one curation run produced; ``TableT`` is ``pa.Table`` here and a Spark
    DataFrame on the Spark engine (``factory.curation.spark``)."""

    train: TableT
    """Kept train rows: the samples columns plus DATASET_EXTRA, sorted by sample_id."""
    eval: TableT
    """Kept eval rows, same columns."""
    drops: list[dict[str, Any]]
    """One per dropped row: sample_id, raw_trace_id, split, step, reason, detail."""
    report: str
    """The trace-pattern report (Markdown)."""
    profile: dict[str, Any]
    """Profile of the result for the planner (``dataset_profile`` row, sans experiment)."""
    num_selected: int
    """Rows curation started from."""
    num_clean: int
    """Distinct samples with nothing wrong in them (``Decisions.num_clean``)."""
    clean_lost: dict[str, int]
    """Drop reason -> clean samples it removed (``Decisions.clean_lost``)."""

    def drops_by_reason(self) -> dict[str, int]:
        return dict(sorted(Counter(d["reason"] for d in self.drops).items()))

    def clean_loss_by_reason(self) -> dict[str, float]:
        """Drop reason -> share of the clean samples it removed: what cleaning cost."""
        return clean_loss_shares(self.clean_lost, self.num_clean)


def order_rows(samples: pa.Table) -> pa.Table:
    """Each sample's rows in keep order: sample_id, raw_trace_id, ``row_rank`` and
    ``source_index`` (the row's index in ``samples``; the other columns are taken from there
    when needed, so the selection is never copied whole)."""
    keys = [(c, "ascending", "at_start") for c in ROW_ORDER if c in samples.column_names]
    if "origin" in samples.column_names:  # a traffic row before a synthetic one
        keys.insert(1, ("origin", "descending", "at_start"))
    idx = pc.sort_indices(samples, sort_keys=keys)
    cols = ["sample_id", "raw_trace_id"] + (["origin"] if "origin" in samples.column_names
                                            else [])
    t = samples.select(cols).take(idx)
    t = t.append_column("source_index", idx)
    ids = t.column("sample_id").to_numpy(zero_copy_only=False)
    rank = np.zeros(len(ids), dtype=np.int64)
    if len(ids):
        new = np.ones(len(ids), dtype=bool)
        new[1:] = ids[1:] != ids[:-1]
        starts = np.flatnonzero(new)
        run = np.repeat(starts, np.diff(np.append(starts, len(ids))))
        rank = np.arange(len(ids)) - run
    return t.append_column("row_rank", pa.array(rank))


def verified_edges(features: pa.Table, config: CurationConfig) -> list[tuple[str, str, float]]:
    """Near-duplicate pairs: LSH candidates (shared band key) with exact Jaccard >= threshold."""
    ids = features.column("sample_id").to_pylist()
    bands = features.column("band_keys").combine_chunks()
    keys = np.asarray(bands.values.to_numpy()).reshape(-1, config.num_bands)
    # Bucket by (band, key) with a sort instead of a Python dict: 1M x 16 keys in ~2 s.
    n = len(ids)
    band_idx = np.tile(np.arange(config.num_bands), n)
    owner = np.repeat(np.arange(n), config.num_bands)
    flat = keys.reshape(-1)
    nz = flat != 0
    band_idx, owner, flat = band_idx[nz], owner[nz], flat[nz]
    order = np.lexsort((owner, flat, band_idx))
    band_idx, owner, flat = band_idx[order], owner[order], flat[order]
    same = (flat[1:] == flat[:-1]) & (band_idx[1:] == band_idx[:-1])
    pairs: set[tuple[int, int]] = set()
    if same.any():
        starts = np.flatnonzero(np.diff(np.concatenate([[0], same.astype(np.int8), [0]])) == 1)
        ends = np.flatnonzero(np.diff(np.concatenate([[0], same.astype(np.int8), [0]])) == -1)
        for s, e in zip(starts, ends, strict=True):
            members = owner[s:e + 1].tolist()
            for i in range(len(members)):
                for j in range(i + 1, len(members)):
                    pairs.add((members[i], members[j]))
    shingles = features.column("shingles").combine_chunks()
    offs = shingles.offsets.to_numpy()
    vals = shingles.values.to_numpy()
    out = []
    for i, j in sorted(pairs):
        jac = neardup.jaccard(vals[offs[i]:offs[i + 1]], vals[offs[j]:offs[j + 1]])
        if jac >= config.near_dup_threshold:
            a, b = (ids[i], ids[j]) if ids[i] < ids[j] else (ids[j], ids[i])
            out.append((a, b, round(jac, 6)))
    return sorted(out)


def eval_overlaps(features: pa.Table, side: dict[str, str], config: CurationConfig
                  ) -> dict[str, list[tuple[str, str, float]]]:
    """Train sample -> [(kind, eval sample, share)]: an equal prompt (share 1), and the pairs
    whose ``overlap_share`` in the prompt view (``prompt_ngrams``) or the conversation view
    (``shingles``) may make ``decide.is_contamination`` hold."""
    ids = features.column("sample_id").to_pylist()
    is_eval = np.array([side[s] == EVAL for s in ids], dtype=bool)
    out: dict[str, list[tuple[str, str, float]]] = defaultdict(list)
    pkeys = features.column("prompt_key").to_pylist()
    eval_prompt: dict[str, str] = {}
    for sid, k, e in zip(ids, pkeys, is_eval, strict=True):
        if e and k and (k not in eval_prompt or sid < eval_prompt[k]):
            eval_prompt[k] = sid
    for sid, k, e in zip(ids, pkeys, is_eval, strict=True):
        if not e and k in eval_prompt:
            out[sid].append(("eval_prompt_match", eval_prompt[k], 1.0))
    for kind, column in (("eval_ngram_overlap", "prompt_ngrams"),
                         ("eval_conversation_overlap", "shingles")):
        lists = features.column(column).combine_chunks()
        train, ev, shared, total = weighted_overlaps(lists.values.to_numpy(),
                                                     lists.offsets.to_numpy(), is_eval)
        keep = np.flatnonzero(shared >= candidate_floor(kind, config) * total)
        for i in keep.tolist():
            out[ids[train[i]]].append((kind, ids[ev[i]], overlap_share(shared[i], total[i])))
    return {k: sorted(v) for k, v in out.items()}


def weighted_overlaps(values: np.ndarray, offsets: np.ndarray, is_eval: np.ndarray
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(train index, eval index, shared weight, eval sample's weight) of every train x eval
    pair sharing an n-gram of nonzero ``ngram_weight``; ``values``/``offsets`` are each
    sample's sorted unique n-gram hashes.

    Only n-grams some eval sample has can count, so those entries are picked first: a bitmap
    of the eval hashes' low 28 bits (32 MiB) passes ~10% of the entries on to an exact binary
    search, in chunks. The conversation view has ~100 entries a sample; a binary search of
    every entry took 6x as long, and sorting them all would hold GBs at 1M samples. One sort
    then groups equal n-grams; a group of ``df`` samples gives each of them weight
    ``ngram_weight(df)``, and its train x eval pairs (at most 32 x 32) that weight, summed per
    pair.
    """
    num = len(offsets) - 1
    ev_vals = _sorted_unique(values[np.repeat(is_eval, np.diff(offsets))])
    picked = [np.zeros(0, dtype=np.int64)]
    if len(ev_vals):
        low = (1 << _BITMAP_BITS) - 1
        bitmap = np.zeros(1 << (_BITMAP_BITS - 3), dtype=np.uint8)
        h = ev_vals & low
        np.bitwise_or.at(bitmap, h >> 3, np.left_shift(1, h & 7).astype(np.uint8))
        for lo in range(0, len(values), _CHUNK):
            chunk = values[lo:lo + _CHUNK]
            h = chunk & low
            maybe = lo + np.flatnonzero((bitmap[h >> 3] >> (h & 7).astype(np.uint8)) & 1)
            c = values[maybe]
            at = np.minimum(np.searchsorted(ev_vals, c), len(ev_vals) - 1)
            picked.append(maybe[ev_vals[at] == c])
    idx = np.concatenate(picked)
    owner = np.searchsorted(offsets, idx, side="right") - 1
    order = np.lexsort((owner, values[idx]))
    vals, own = values[idx][order], owner[order]
    new = np.ones(len(vals), dtype=bool)
    new[1:] = vals[1:] != vals[:-1]
    starts = np.flatnonzero(new)
    sizes = np.diff(np.append(starts, len(vals)))
    group = np.repeat(np.arange(len(starts)), sizes)
    weight = np.array(NGRAM_WEIGHTS)[np.minimum(sizes, BOILERPLATE_DF + 1)]
    total = np.bincount(own, weights=weight[group], minlength=num)
    ev = is_eval[own]
    num_eval = np.bincount(group, weights=ev, minlength=len(starts))
    mixed = (weight > 0) & (num_eval > 0) & (num_eval < sizes)
    # each train entry of a mixed group, paired with every entry of its group, then kept
    # where the partner is an eval sample
    left = np.flatnonzero(mixed[group] & ~ev)
    reps = sizes[group[left]]
    left = np.repeat(left, reps)
    right = starts[group[left]] + np.arange(len(left)) - np.repeat(np.cumsum(reps) - reps, reps)
    hit = ev[right]
    left, right = left[hit], right[hit]
    key = own[left] * num + own[right]
    by_key = np.argsort(key, kind="stable")
    key, contrib = key[by_key], weight[group[left]][by_key]
    first = np.ones(len(key), dtype=bool)
    first[1:] = key[1:] != key[:-1]
    pairs = key[first]
    shared = np.add.reduceat(contrib, np.flatnonzero(first)) if len(key) else contrib
    train, evs = pairs // num, pairs % num
    return train, evs, shared, total[evs]


_BITMAP_BITS = 28
_CHUNK = 4_000_000
"""Entries per chunk in ``weighted_overlaps`` (~100 MB of temporaries)."""


def _sorted_unique(values: np.ndarray) -> np.ndarray:
    """``np.unique`` by one sort: numpy's hash-based unique took ~100x as long on 10M hashes."""
    s = np.sort(values)
    keep = np.ones(len(s), dtype=bool)
    keep[1:] = s[1:] != s[:-1]
    return s[keep]


def facts_from(features: pa.Table, rows: pa.Table) -> tuple[list[SampleFacts], list[RowFacts]]:
    """Compact per-sample and per-row facts (format flags included) for ``decide``."""
    # Only the scalar columns: the hash lists as Python ints would cost ~5 KB a sample.
    f = features.select([c for c in features.column_names
                         if c not in LIST_COLUMNS]).to_pydict()
    r = rows.select(["sample_id", "raw_trace_id", "row_rank"]).to_pydict()
    origins = (rows.column("origin").to_pylist() if "origin" in rows.column_names
               else [TRAFFIC] * rows.num_rows)
    traces: dict[str, list[str]] = defaultdict(list)
    row_facts = []
    for sid, tid, rank, origin in zip(r["sample_id"], r["raw_trace_id"], r["row_rank"], origins,
                                      strict=True):
        row_facts.append(RowFacts(row_key=f"{sid}:{rank}", sample_id=sid, rank=rank,
                                  raw_trace_id=tid, origin=origin or TRAFFIC))
        if tid:
            traces[sid].append(tid)
    fmt = format_flags(dict(zip(f["sample_id"], f["format_key"], strict=True)),
                       dict(zip(f["sample_id"], f["is_json"], strict=True)),
                       dict(zip(f["sample_id"], f["json_cut"], strict=True)),
                       uncounted=synthetic_only(row_facts))
    facts = []
    for i, sid in enumerate(f["sample_id"]):
        flags = {d: f[d][i] for d in ("refusal", "truncated", "tool_schema", "agent_loop")
                 if f[d][i]}
        if sid in fmt:
            flags["format"] = fmt[sid]
        facts.append(SampleFacts(sample_id=sid, empty_reason=f["empty_reason"][i],
                                 num_tokens=f["num_tokens"][i], flags=flags,
                                 prefix_key=f["prefix_key"][i], prompt_key=f["prompt_key"][i],
                                 trace_ids=tuple(sorted(set(traces[sid])))))
    return facts, row_facts


def compute_features(distinct: pa.Table, config: CurationConfig, counter: TokenCounter, *,
                     num_workers: int = 1, indices: np.ndarray | None = None) -> pa.Table:
    """``sample_features`` over ``distinct`` (or its rows at ``indices``) in batches of BATCH.

    With ``num_workers > 1`` and more than one batch, batches run in that many worker processes
    (the function is row-local, so the result is the same table); at most two batches per
    worker are in flight, which bounds the memory the pool adds.
    """
    num = distinct.num_rows if indices is None else len(indices)
    starts = list(range(0, num, BATCH))

    def batch(i: int) -> pa.Table:
        if indices is None:
            return distinct.slice(i, BATCH)
        return distinct.take(pa.array(indices[i:i + BATCH], pa.int64()))

    if not starts:
        return sample_features(batch(0), config, counter)
    if num_workers <= 1 or len(starts) == 1:
        return pa.concat_tables([sample_features(batch(i), config, counter) for i in starts])
    ctx = multiprocessing.get_context("spawn")  # no fork: the tokenizer's threads may be live
    parts: list[pa.Table] = []
    with ProcessPoolExecutor(num_workers, mp_context=ctx, initializer=_worker_init) as pool:
        pending: deque[Future[bytes]] = deque()
        for i in starts:
            pending.append(pool.submit(_features_ipc, _to_ipc(batch(i)), config, counter))
            if len(pending) >= 2 * num_workers:
                parts.append(_from_ipc(pending.popleft().result()))
        parts.extend(_from_ipc(f.result()) for f in pending)
    return pa.concat_tables(parts)


def default_workers() -> int:
    """Worker processes for feature batches: one per CPU this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        (os.cpu_count() or 1)


def _worker_init() -> None:
    # One thread per worker: the processes already use every core, and the tokenizer's own
    # thread pool on top would only oversubscribe them.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _to_ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def _from_ipc(data: bytes) -> pa.Table:
    return pa.ipc.open_stream(data).read_all()


def _features_ipc(batch: bytes, config: CurationConfig, counter: TokenCounter) -> bytes:
    return _to_ipc(sample_features(_from_ipc(batch), config, counter))


def first_rows(rows: pa.Table) -> pa.Table:
    """The first row of each sample (rows are in keep order)."""
    mask = pc.equal(rows.column("row_rank"), 0)
    return rows.filter(mask)


def curate(samples: pa.Table, config: CurationConfig, counter: TokenCounter, *,
           judge: Judge | None = None, num_workers: int = 1) -> CurationResult[pa.Table]:
    """Split, clean and profile ``samples`` (rows of the ``samples`` table, with an ``origin``
    column when some are synthetic; without one, every row is traffic).

    ``num_workers``: processes computing the per-sample features (``default_workers()`` uses
    every core); the result does not depend on it.
    """
    if "origin" not in samples.column_names:
        samples = samples.append_column("origin", pa.array([TRAFFIC] * samples.num_rows,
                                                           pa.string()))
    rows = order_rows(samples)
    # the first row of each sample, gathered from ``samples`` batch by batch
    first = first_rows(rows).column("source_index").to_numpy()
    inputs = samples.select(["sample_id", "messages", "tools", "tags"])
    features = compute_features(inputs, config, counter, num_workers=num_workers,
                                indices=first)
    edges = verified_edges(features, config)
    facts, row_facts = facts_from(features, rows)
    synthetic = synthetic_only(row_facts)
    groups = split_groups([f for f in facts if f.sample_id not in synthetic],
                          [e for e in edges if e[0] not in synthetic and e[1] not in synthetic])
    held_out = phrasing.split_features(features, groups, config)
    side, groups = dict(held_out.side), dict(held_out.group)
    groups.update({s: s for s in synthetic})
    side.update({s: TRAIN for s in synthetic})
    overlaps = eval_overlaps(features, side, config)
    if synthetic:
        # n-gram rarity counts the traffic alone for traffic samples, so synthetic samples
        # never change a traffic sample's decontamination
        ids = features.column("sample_id").to_pylist()
        keep = pa.array([i for i, s in enumerate(ids) if s not in synthetic], pa.int64())
        overlaps = {**eval_overlaps(features.take(keep), side, config),
                    **{s: v for s, v in overlaps.items() if s in synthetic}}
    add_synthetic_links(overlaps, synthetic, facts, edges, side)

    judge_scores: Callable[[list[str]], dict[str, float]] | None = None
    if judge is not None:
        by_id = {r["sample_id"]: r for r in inputs.take(pa.array(first, pa.int64())).select(
            ["sample_id", "messages", "tools"]).to_pylist()}

        def judge_scores(ids: list[str]) -> dict[str, float]:
            inputs = [_judge_input(by_id[s]) for s in ids]
            many = getattr(judge, "score_many", None)
            scores = many(inputs) if many is not None else [judge.score(x) for x in inputs]
            return {s: float(v) for s, v in zip(ids, scores, strict=True)}

    decisions = decide(facts=facts, rows=row_facts, near_edges=edges, overlaps=overlaps,
                       config=config, judge_scores=judge_scores, groups=groups,
                       sides=side, synthetic=synthetic)
    result = assemble(rows, samples, features, decisions, config,
                      num_selected=samples.num_rows, synthetic=synthetic)
    result.profile.update(held_out.profile_fields())
    return result


def synthetic_only(rows: Sequence[RowFacts]) -> frozenset[str]:
    """The samples that only synthetic rows hold (a synthetic copy of a traffic sample is a
    duplicate row of that traffic sample)."""
    traffic = {r.sample_id for r in rows if r.origin != SYNTHETIC}
    return frozenset(r.sample_id for r in rows if r.origin == SYNTHETIC) - traffic


def add_synthetic_links(overlaps: dict[str, list[tuple[str, str, float]]],
                        synthetic: frozenset[str], facts: Sequence[SampleFacts],
                        edges: Sequence[tuple[str, str, float]], side: dict[str, str]) -> None:
    """Decontamination of synthetic samples by the links that group traffic with an eval
    sample: a near-duplicate edge (``eval_near_duplicate``, its Jaccard) and the same first
    user turn (``eval_prompt_match``)."""
    if not synthetic:
        return
    for a, b, jac in edges:
        for syn, other in ((a, b), (b, a)):
            if syn in synthetic and side.get(other) == EVAL:
                overlaps.setdefault(syn, []).append(("eval_near_duplicate", other, jac))
    eval_prefix: dict[str, str] = {}
    for f in facts:
        if side.get(f.sample_id) == EVAL and f.prefix_key:
            eval_prefix.setdefault(f.prefix_key, f.sample_id)
    for f in facts:
        if f.sample_id in synthetic and f.prefix_key in eval_prefix:
            overlaps.setdefault(f.sample_id, []).append(
                ("eval_prompt_match", eval_prefix[f.prefix_key], 1.0))
    for sid in synthetic:
        if sid in overlaps:
            overlaps[sid] = sorted(set(overlaps[sid]))


def _judge_input(row: dict[str, Any]) -> dict[str, Any]:
    return {"sample_id": row["sample_id"], "messages": parse_json(row["messages"]),
            "tools": parse_json(row["tools"])}


def stats_table(features: pa.Table) -> pa.Table:
    """Per-sample columns the datasets and the profile carry."""
    return features.select(["sample_id", "num_tokens", "num_prompt_tokens", "language",
                            "size_bytes", "refusal", "truncated", "tool_schema", "agent_loop"])


def assemble(rows: pa.Table, samples: pa.Table, features: pa.Table, decisions: Decisions,
             config: CurationConfig, *, num_selected: int,
             synthetic: frozenset[str] = frozenset()) -> CurationResult[pa.Table]:
    """The kept rows of ``samples`` with their stats, sorted by sample_id, split in two.

    Indices are chosen, ordered and split with numpy first, then each split is one gather
    from ``samples``: no filtered, re-sorted and re-filtered copies of the whole selection.
    """
    keys = pc.binary_join_element_wise(rows.column("sample_id"),
                                       pc.cast(rows.column("row_rank"), pa.string()), ":")
    mask = pc.is_in(keys, value_set=pa.array(sorted(decisions.kept_rows), type=pa.string()))
    kept = rows.filter(mask).select(["sample_id", "source_index"])
    kept = kept.take(pc.sort_indices(kept, sort_keys=[("sample_id", "ascending")]))
    ids = kept.column("sample_id").to_pylist()
    source = kept.column("source_index").to_numpy()
    where = {s: i for i, s in enumerate(features.column("sample_id").to_pylist())}
    feature_index = np.array([where[s] for s in ids], dtype=np.int64)
    sides = np.array([decisions.side[s] for s in ids] or [""], dtype=object)[:len(ids)]
    stats = features.select(["num_tokens", "num_prompt_tokens", "language"])

    def split(name: str) -> pa.Table:
        sel = np.flatnonzero(sides == name)
        t = samples.take(pa.array(source[sel], pa.int64()))
        st = stats.take(pa.array(feature_index[sel], pa.int64()))
        for col in st.column_names:
            t = t.append_column(col, st.column(col))
        t = t.append_column("split", pa.array([name] * len(sel), pa.string()))
        t = t.append_column("split_group", pa.array([decisions.group[ids[i]] for i in sel],
                                                    pa.string()))
        return t.append_column("num_completion_tokens", pc.subtract(
            t.column("num_tokens"), t.column("num_prompt_tokens")))

    train, ev = split("train"), split("eval")
    report = pattern_report(features, decisions, config, num_selected=num_selected,
                            synthetic=synthetic)
    profile = build_profile(train, ev, decisions.drops, num_selected=num_selected)
    return CurationResult(train=train, eval=ev, drops=decisions.drops, report=report,
                          profile=profile, num_selected=num_selected,
                          num_clean=decisions.num_clean, clean_lost=dict(decisions.clean_lost))


def dataset_columns(table: pa.Table, experiment: str, names: Sequence[str]) -> pa.Table:
    """``table`` shaped to a dataset table's columns, with the experiment filled in."""
    t = table.append_column("experiment", pa.array([experiment] * table.num_rows, pa.string()))
    return t.select([n for n in names if n in t.column_names])
