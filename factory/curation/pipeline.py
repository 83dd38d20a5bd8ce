"""The embedded engine: curation in process over Arrow tables (numpy, pyarrow, DuckDB-free).

``curate(samples, config, counter)`` returns the train and eval rows, the drops, the report and
the profile. The Spark engine (``factory.curation.spark``) produces the same result for the same
input: it runs the same row function and hands the same facts to ``decide``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from factory.curation import neardup
from factory.curation.config import CurationConfig
from factory.curation.decide import (
    EVAL,
    Decisions,
    RowFacts,
    SampleFacts,
    decide,
    format_flags,
    split_groups,
    split_side,
)
from factory.curation.features import sample_features
from factory.curation.profile import build_profile
from factory.curation.report import pattern_report
from factory.curation.text import parse_json
from factory.curation.tokens import TokenCounter

# Rows per feature batch: bounds peak memory of the flat n-gram arrays (~150 MB at 20k).
BATCH = 20_000

ROW_ORDER = ["sample_id", "created_at", "raw_trace_id", "source", "provider", "model", "project"]
"""Columns ordering rows of one sample: the first row of a sample is the one kept."""

DATASET_EXTRA = ["split", "split_group", "num_tokens", "num_prompt_tokens",
                 "num_completion_tokens", "language"]


class Judge(Protocol):
    """Rejection-sampling judge: a score for one sample (higher is better). A judge that also
    has ``score_many(samples) -> list[float]`` gets all the samples of a step at once (so an
    LLM judge can send them concurrently); ``factory.evals.rejection.RejectionJudge`` does."""

    def score(self, sample: dict[str, Any]) -> float: ...


@dataclass(kw_only=True)
class CurationResult:
    """Everything one curation run produced."""

    train: pa.Table
    """Kept train rows: the samples columns plus DATASET_EXTRA, sorted by sample_id."""
    eval: pa.Table
    """Kept eval rows, same columns."""
    drops: list[dict[str, Any]]
    """One per dropped row: sample_id, raw_trace_id, split, step, reason, detail."""
    report: str
    """The trace-pattern report (Markdown)."""
    profile: dict[str, Any]
    """Profile of the result for the planner (``dataset_profile`` row, sans experiment)."""
    num_selected: int
    """Rows curation started from."""

    def drops_by_reason(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for d in self.drops:
            out[d["reason"]] += 1
        return dict(sorted(out.items()))


def order_rows(samples: pa.Table) -> pa.Table:
    """``samples`` sorted so each sample's rows come in keep order, with ``row_rank``."""
    keys = [(c, "ascending", "at_start") for c in ROW_ORDER if c in samples.column_names]
    idx = pc.sort_indices(samples, sort_keys=keys)
    t = samples.take(idx)
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


def eval_overlaps(features: pa.Table, side: dict[str, str]) -> dict[str, list[tuple[str, str]]]:
    """Train sample -> [(kind, eval sample)] by equal prompt or a shared prompt n-gram."""
    ids = features.column("sample_id").to_pylist()
    is_eval = np.array([side[s] == EVAL for s in ids], dtype=bool)
    out: dict[str, list[tuple[str, str]]] = defaultdict(list)
    pkeys = features.column("prompt_key").to_pylist()
    eval_prompt: dict[str, str] = {}
    for sid, k, e in zip(ids, pkeys, is_eval, strict=True):
        if e and k and (k not in eval_prompt or sid < eval_prompt[k]):
            eval_prompt[k] = sid
    for sid, k, e in zip(ids, pkeys, is_eval, strict=True):
        if not e and k in eval_prompt:
            out[sid].append(("eval_prompt_match", eval_prompt[k]))
    ng = features.column("prompt_ngrams").combine_chunks()
    offs = ng.offsets.to_numpy()
    vals = ng.values.to_numpy()
    owner = np.repeat(np.arange(len(ids)), np.diff(offs))
    ev_mask = is_eval[owner]
    ev_vals, ev_owner = vals[ev_mask], owner[ev_mask]
    order = np.lexsort((ev_owner, ev_vals))
    ev_vals, ev_owner = ev_vals[order], ev_owner[order]
    tr_mask = ~ev_mask
    tr_vals, tr_owner = vals[tr_mask], owner[tr_mask]
    hit = np.isin(tr_vals, ev_vals)
    hit_vals, hit_owner = tr_vals[hit], tr_owner[hit]
    lo = np.searchsorted(ev_vals, hit_vals, side="left")
    hi = np.searchsorted(ev_vals, hit_vals, side="right")
    found: dict[str, set[str]] = defaultdict(set)
    for o, a, b in zip(hit_owner.tolist(), lo.tolist(), hi.tolist(), strict=True):
        found[ids[o]].update(ids[e] for e in ev_owner[a:b].tolist())
    for sid, others in found.items():
        out[sid].extend(("eval_ngram_overlap", e) for e in others)
    return {k: sorted(set(v)) for k, v in out.items()}


def facts_from(features: pa.Table, rows: pa.Table) -> tuple[list[SampleFacts], list[RowFacts]]:
    """Compact per-sample and per-row facts (format flags included) for ``decide``."""
    f = features.to_pydict()
    fmt = format_flags(dict(zip(f["sample_id"], f["format_key"], strict=True)),
                       dict(zip(f["sample_id"], f["is_json"], strict=True)),
                       dict(zip(f["sample_id"], f["json_cut"], strict=True)))
    r = rows.select(["sample_id", "raw_trace_id", "row_rank"]).to_pydict()
    traces: dict[str, list[str]] = defaultdict(list)
    row_facts = []
    for sid, tid, rank in zip(r["sample_id"], r["raw_trace_id"], r["row_rank"], strict=True):
        row_facts.append(RowFacts(row_key=f"{sid}:{rank}", sample_id=sid, rank=rank,
                                  raw_trace_id=tid))
        if tid:
            traces[sid].append(tid)
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


def compute_features(distinct: pa.Table, config: CurationConfig,
                     counter: TokenCounter) -> pa.Table:
    parts = [sample_features(distinct.slice(i, BATCH), config, counter)
             for i in range(0, distinct.num_rows, BATCH)]
    if not parts:
        return sample_features(distinct, config, counter)
    return pa.concat_tables(parts)


def first_rows(rows: pa.Table) -> pa.Table:
    """The first row of each sample (rows are in keep order)."""
    mask = pc.equal(rows.column("row_rank"), 0)
    return rows.filter(mask)


def curate(samples: pa.Table, config: CurationConfig, counter: TokenCounter, *,
           judge: Judge | None = None) -> CurationResult:
    """Split, clean and profile ``samples`` (rows of the ``samples`` table)."""
    rows = order_rows(samples)
    distinct = first_rows(rows)
    features = compute_features(distinct.select(["sample_id", "messages", "tools", "tags"]),
                                config, counter)
    edges = verified_edges(features, config)
    facts, row_facts = facts_from(features, rows)
    groups = split_groups(facts, edges)
    side = {sid: split_side(g, config) for sid, g in groups.items()}
    overlaps = eval_overlaps(features, side)

    judge_scores: Callable[[list[str]], dict[str, float]] | None = None
    if judge is not None:
        by_id = {r["sample_id"]: r for r in distinct.select(
            ["sample_id", "messages", "tools"]).to_pylist()}

        def judge_scores(ids: list[str]) -> dict[str, float]:
            inputs = [_judge_input(by_id[s]) for s in ids]
            many = getattr(judge, "score_many", None)
            scores = many(inputs) if many is not None else [judge.score(x) for x in inputs]
            return {s: float(v) for s, v in zip(ids, scores, strict=True)}

    decisions = decide(facts=facts, rows=row_facts, near_edges=edges, overlaps=overlaps,
                       config=config, judge_scores=judge_scores, groups=groups)
    return assemble(rows, features, decisions, config, num_selected=samples.num_rows)


def _judge_input(row: dict[str, Any]) -> dict[str, Any]:
    return {"sample_id": row["sample_id"], "messages": parse_json(row["messages"]),
            "tools": parse_json(row["tools"])}


def stats_table(features: pa.Table) -> pa.Table:
    """Per-sample columns the datasets and the profile carry."""
    return features.select(["sample_id", "num_tokens", "num_prompt_tokens", "language",
                            "size_bytes", "refusal", "truncated", "tool_schema", "agent_loop"])


def assemble(rows: pa.Table, features: pa.Table, decisions: Decisions, config: CurationConfig,
             *, num_selected: int) -> CurationResult:
    keys = pc.binary_join_element_wise(rows.column("sample_id"),
                                       pc.cast(rows.column("row_rank"), pa.string()), ":")
    kept = rows.filter(pc.is_in(keys, value_set=pa.array(sorted(decisions.kept_rows),
                                                          type=pa.string())))
    kept = kept.drop_columns(["row_rank"])
    ids = kept.column("sample_id").to_pylist()
    where = {s: i for i, s in enumerate(features.column("sample_id").to_pylist())}
    stats = features.select(["num_tokens", "num_prompt_tokens", "language"]).take(
        pa.array([where[s] for s in ids], pa.int64()))
    for name in stats.column_names:
        kept = kept.append_column(name, stats.column(name))
    kept = kept.append_column("split", pa.array([decisions.side[s] for s in ids], pa.string()))
    kept = kept.append_column("split_group",
                              pa.array([decisions.group[s] for s in ids], pa.string()))
    kept = kept.append_column("num_completion_tokens", pc.subtract(
        kept.column("num_tokens"), kept.column("num_prompt_tokens")))
    kept = kept.sort_by("sample_id")
    train = kept.filter(pc.equal(kept.column("split"), "train"))
    ev = kept.filter(pc.equal(kept.column("split"), "eval"))
    report = pattern_report(features, decisions, config, num_selected=num_selected)
    profile = build_profile(train, ev, decisions.drops, num_selected=num_selected)
    return CurationResult(train=train, eval=ev, drops=decisions.drops, report=report,
                          profile=profile, num_selected=num_selected)


def dataset_columns(table: pa.Table, experiment: str, names: Sequence[str]) -> pa.Table:
    """``table`` shaped to a dataset table's columns, with the experiment filled in."""
    t = table.append_column("experiment", pa.array([experiment] * table.num_rows, pa.string()))
    return t.select([n for n in names if n in t.column_names])
