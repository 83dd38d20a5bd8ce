"""The curation decisions, shared by both engines: split groups, then the cleaning steps.

Engines compute the heavy, data-parallel facts (features, verified near-duplicate edges,
train->eval n-gram overlaps) and hand compact per-sample facts here; this module decides the
side of each sample and which rows each step drops, in a fixed order:

    empty -> max_tokens -> exact_dup -> near_dup -> decontamination (train) -> detectors -> judge

The eval side is finished first so that train is decontaminated against the final eval set.
"""

from __future__ import annotations

import hashlib
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from factory.curation import detectors
from factory.curation.config import DETECTOR_NAMES, CurationConfig
from factory.curation.neardup import components

TRAIN, EVAL = "train", "eval"
# Node prefixes for the split graph; "~" sorts after hex digits, so a component's smallest node
# is always one of its sample ids.
TRACE, PREFIX = "~t:", "~p:"


@dataclass(frozen=True, kw_only=True)
class SampleFacts:
    """What the decisions need to know about one distinct sample."""

    sample_id: str
    """The canonical sample id."""
    empty_reason: str | None
    """Why it has nothing to learn from (see ``features.empty_reason``), or None."""
    num_tokens: int
    """Tokens as the trainer renders and tokenizes it (``factory.trainer.chat.encode``)."""
    flags: dict[str, str]
    """Detector name -> detail, for every detector that fired (format included)."""
    prefix_key: str
    """Digest of the normalized first user turn ("" without one)."""
    prompt_key: str
    """Digest of the normalized prompt ("" when empty)."""
    trace_ids: tuple[str, ...]
    """raw_trace_ids of the rows holding this sample."""


@dataclass(frozen=True, kw_only=True)
class RowFacts:
    """One ``samples`` row: several rows may hold the same sample (exact duplicates)."""

    row_key: str
    """Unique key of the row."""
    sample_id: str
    """The sample it holds."""
    rank: int
    """Keep order among rows of the same sample (lowest is kept)."""
    raw_trace_id: str | None
    """Where it came from."""


@dataclass(kw_only=True)
class Decisions:
    """What the steps decided."""

    side: dict[str, str]
    """sample_id -> train | eval."""
    group: dict[str, str]
    """sample_id -> split group (the smallest sample id of its group)."""
    kept_rows: set[str]
    """row keys that end in a dataset."""
    drops: list[dict[str, str | None]]
    """One per dropped row: sample_id, raw_trace_id, split, step, reason, detail."""
    flagged_kept: Counter[str] = field(default_factory=Counter)
    """Detector -> samples it flagged that the policy keeps."""


def format_flags(format_keys: dict[str, str], is_json: dict[str, bool],
                 json_cut: dict[str, bool]) -> dict[str, str]:
    """sample_id -> format detail, for non-JSON outputs in mostly-JSON format groups."""
    size: Counter[str] = Counter(format_keys.values())
    num_json: Counter[str] = Counter(k for s, k in format_keys.items() if is_json[s])
    out = {}
    for sid, key in format_keys.items():
        detail = detectors.format_flag(is_json[sid], json_cut[sid], num_json[key] / size[key],
                                       size[key])
        if detail:
            out[sid] = detail
    return out


def split_side(group: str, config: CurationConfig) -> str:
    """eval when the group's hash falls under eval_fraction; integer compare, same in Spark."""
    h = int(hashlib.sha256(f"{config.seed}:{group}".encode()).hexdigest()[:15], 16)
    return EVAL if h < eval_cutoff(config) else TRAIN


def eval_cutoff(config: CurationConfig) -> int:
    return int(config.eval_fraction * (1 << 60))


def split_groups(facts: Iterable[SampleFacts], near_edges: Iterable[tuple[str, str, float]]
                 ) -> dict[str, str]:
    """sample_id -> group: samples sharing a trace, a first user turn or a near-duplicate edge
    (transitively) form one group, named by its smallest sample id."""
    by_key: dict[str, list[str]] = defaultdict(list)
    ids = []
    for f in facts:
        ids.append(f.sample_id)
        for t in f.trace_ids:
            if t:
                by_key[TRACE + t].append(f.sample_id)
        if f.prefix_key:
            by_key[PREFIX + f.prefix_key].append(f.sample_id)
    edges: list[tuple[str, str]] = [(a, b) for a, b, _ in near_edges]
    for members in by_key.values():
        if len(members) > 1:
            first = members[0]
            edges.extend((first, m) for m in members[1:] if m != first)
    roots = components(edges)
    return {sid: roots.get(sid, sid) for sid in ids}


def decide(*, facts: Sequence[SampleFacts], rows: Sequence[RowFacts],
           near_edges: Sequence[tuple[str, str, float]],
           overlaps: dict[str, list[tuple[str, str]]], config: CurationConfig,
           judge_scores: Callable[[list[str]], dict[str, float]] | None = None,
           groups: dict[str, str] | None = None) -> Decisions:
    """Decide sides and drops.

    ``overlaps``: train-candidate sample_id -> [(kind, eval sample_id)] for every sample on the
    other side whose prompt it matches (kind ``eval_prompt_match``) or shares a
    ``decontam_ngram``-gram with (``eval_ngram_overlap``); only pairs on opposite sides count.
    """
    by_id = {f.sample_id: f for f in facts}
    group = groups if groups is not None else split_groups(facts, near_edges)
    side = {sid: split_side(g, config) for sid, g in group.items()}
    rows_of: dict[str, list[RowFacts]] = defaultdict(list)
    for r in sorted(rows, key=lambda r: (r.sample_id, r.rank, r.row_key)):
        rows_of[r.sample_id].append(r)

    drops: list[dict[str, str | None]] = []
    flagged_kept: Counter[str] = Counter()
    deduped: set[str] = set()

    def drop_sample(sid: str, step: str, reason: str, detail: str | None,
                    rows_: Sequence[RowFacts] | None = None) -> None:
        if rows_ is None:  # after the exact-dup step only the sample's first row is left
            rows_ = rows_of[sid][:1] if sid in deduped else rows_of[sid]
        for r in rows_:
            drops.append({"sample_id": sid, "raw_trace_id": r.raw_trace_id, "split": side[sid],
                          "step": step, "reason": reason, "detail": detail})

    def clean(which: str, final_eval: set[str] | None) -> set[str]:
        alive = sorted(s for s in by_id if side[s] == which)
        # 1. nothing to learn from
        nxt = []
        for sid in alive:
            reason = by_id[sid].empty_reason
            if reason:
                drop_sample(sid, "empty", reason, None)
            else:
                nxt.append(sid)
        # 2. too long for the base model
        alive, nxt = nxt, []
        for sid in alive:
            n = by_id[sid].num_tokens
            if n > config.max_tokens:
                drop_sample(sid, "max_tokens", "too_long",
                            f"{n} tokens > the {config.max_tokens}-token limit")
            else:
                nxt.append(sid)
        # 3. exact duplicates: one row per sample id, the earliest kept
        alive = nxt
        for sid in alive:
            rs = rows_of[sid]
            if len(rs) > 1:
                kept = rs[0]
                drop_sample(sid, "exact_dup", "duplicate",
                            f"same sample_id as row from raw trace {kept.raw_trace_id}", rs[1:])
            deduped.add(sid)
        # 4. near duplicates: one sample per connected cluster, the smallest id kept
        alive_set = set(alive)
        live_edges = [(a, b, j) for a, b, j in near_edges if a in alive_set and b in alive_set]
        roots = components((a, b) for a, b, _ in live_edges)
        best: dict[str, float] = {}
        for a, b, j in live_edges:
            best[a] = max(best.get(a, 0.0), j)
            best[b] = max(best.get(b, 0.0), j)
        nxt = []
        for sid in alive:
            root = roots.get(sid, sid)
            if root != sid:
                drop_sample(sid, "near_dup", "near_duplicate",
                            f"near-duplicate of {root} (best jaccard {best[sid]:.3f})")
            else:
                nxt.append(sid)
        # 5. decontamination: train samples overlapping the final eval set
        if final_eval is not None:
            alive, nxt = nxt, []
            for sid in alive:
                hits = [(k, e) for k, e in overlaps.get(sid, []) if e in final_eval]
                if hits:
                    kind, other = sorted(hits)[0]
                    what = "same prompt as" if kind == "eval_prompt_match" else \
                        f"shares a {config.decontam_ngram}-word n-gram with"
                    drop_sample(sid, "decontamination", kind, f"{what} eval sample {other}")
                else:
                    nxt.append(sid)
        # 6. detectors, by policy
        alive, nxt = nxt, []
        for sid in alive:
            flags = by_id[sid].flags
            dropping = [d for d in DETECTOR_NAMES if d in flags and d in config.drop]
            for d in DETECTOR_NAMES:
                if d in flags and d not in config.drop:
                    flagged_kept[d] += 1
            if dropping:
                drop_sample(sid, "detectors", dropping[0], flags[dropping[0]])
            else:
                nxt.append(sid)
        # 7. rejection sampling
        if config.judge_threshold is not None:
            if judge_scores is None:
                raise ValueError("judge_threshold is set but no judge is configured")
            scores = judge_scores(nxt)
            alive, nxt = nxt, []
            for sid in alive:
                score = scores[sid]
                if score < config.judge_threshold:
                    drop_sample(sid, "judge", "judge_below_threshold",
                                f"score {score:.3f} < {config.judge_threshold}")
                else:
                    nxt.append(sid)
        return set(nxt)

    final_eval = clean(EVAL, None)
    final_train = clean(TRAIN, final_eval)
    kept_rows = {rows_of[s][0].row_key for s in final_eval | final_train}
    drops.sort(key=lambda d: (d["sample_id"] or "", d["step"] or "", d["raw_trace_id"] or ""))
    return Decisions(side=side, group=group, kept_rows=kept_rows, drops=drops,
                     flagged_kept=flagged_kept)
