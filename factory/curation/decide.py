"""The curation decisions, shared by both engines: split groups, then the cleaning steps.

Engines compute the heavy, data-parallel facts (features, verified near-duplicate edges,
train->eval n-gram overlaps) and hand compact per-sample facts here; this module decides the
side of each sample and which rows each step drops, in a fixed order:

    empty -> max_tokens -> exact_dup -> near_dup -> decontamination (train) -> detectors -> judge

The eval side is finished first so that train is decontaminated against the final eval set.

Synthetic samples (``factory.curation.synthesis``) take the same steps on the train side only:
the split groups and sides are the traffic's alone (so synthesis never moves the eval set), a
synthetic sample near-duplicating a kept traffic sample is the one dropped, and its
decontamination also counts a near-duplicate of an eval sample (``eval_near_duplicate``) or
the same first user turn (``eval_prompt_match``), links that put a traffic sample in the eval
sample's group.

Decontamination asks how much of an eval sample a train sample holds (``overlap_share``), not
whether they share one phrase: templated traffic (one instruction, form-like user text) shares
long phrases between distinct clean samples (of 600 generated support tickets, 170 train
samples share a 13-word phrase with some eval sample, and none holds more than 0.51 of one in
either view).
"""

from __future__ import annotations

import hashlib
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from factory.curation import detectors
from factory.curation.config import DETECTOR_NAMES, CurationConfig
from factory.curation.neardup import components

TRAIN, EVAL = "train", "eval"

TRAFFIC, SYNTHETIC = "traffic", "synthetic"
"""``origin`` of a dataset row: captured traffic, or written by a teacher
(``factory.curation.synthesis``)."""

OVERLAP_KINDS = ("eval_prompt_match", "eval_near_duplicate", "eval_ngram_overlap",
                 "eval_conversation_overlap")
"""Decontamination reasons, in the order that names a drop when several hold: the same
normalized prompt; a near-duplicate (synthetic samples only: a traffic one shares the eval
sample's group); the prompt view of ``overlap_share``; its conversation view."""

BOILERPLATE_DF = 32
"""An n-gram in more distinct samples than this is template text and weighs 0 in
``overlap_share`` (it would weigh under 1/32 anyway); the cut also bounds the train x eval pairs
one n-gram can make, which keeps the overlap join linear in the data."""

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
    origin: str = TRAFFIC
    """``TRAFFIC`` or ``SYNTHETIC``."""


def ngram_weight(num_samples: int) -> float:
    """Weight of an n-gram found in ``num_samples`` distinct samples: text that only a pair
    shares weighs 1/2, template text shared by hundreds next to nothing (0 past
    ``BOILERPLATE_DF``)."""
    return 1.0 / num_samples if 0 < num_samples <= BOILERPLATE_DF else 0.0


NGRAM_WEIGHTS: tuple[float, ...] = tuple(ngram_weight(k) for k in range(BOILERPLATE_DF + 2))
"""``ngram_weight`` by document frequency, the last entry standing for every df past the cut:
the lookup the engines index with ``min(df, BOILERPLATE_DF + 1)``."""


def overlap_share(shared_weight: float, eval_weight: float) -> float:
    """The share of an eval sample that a train sample holds: the weight of the n-grams they
    share over the weight of all the eval sample's n-grams (``ngram_weight`` each), rounded to
    6 places so that both engines' sums (in different orders) give the same decision."""
    return round(shared_weight / eval_weight, 6) if eval_weight > 0 else 0.0


def threshold(kind: str, config: CurationConfig) -> float:
    """The share at which an overlap of ``kind`` (``OVERLAP_KINDS``) is contamination."""
    if kind == "eval_ngram_overlap":
        return config.decontam_threshold
    if kind == "eval_conversation_overlap":
        return config.decontam_paraphrase_threshold
    if kind == "eval_near_duplicate":
        return config.near_dup_threshold
    assert kind == "eval_prompt_match", kind
    return 1.0


def is_contamination(kind: str, share: float, config: CurationConfig) -> bool:
    """The decontamination rule: an overlap's share at or above its kind's threshold."""
    return share >= threshold(kind, config)


def candidate_floor(kind: str, config: CurationConfig) -> float:
    """Engines pass on the pairs whose unrounded share reaches this: a superset of those
    ``is_contamination`` accepts, since rounding to 6 places moves a share by at most 5e-7."""
    return threshold(kind, config) - 1e-6


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
    num_clean: int = 0
    """Distinct traffic samples with nothing wrong in them: not empty, renderable, no detector
    flag (what synthetic samples lose, the report shows apart)."""
    clean_lost: Counter[str] = field(default_factory=Counter)
    """Drop reason -> clean samples it removed from both datasets (an exact duplicate's extra
    rows remove no sample: its first row stays)."""


def format_flags(format_keys: dict[str, str], is_json: dict[str, bool],
                 json_cut: dict[str, bool], *, uncounted: frozenset[str] = frozenset()
                 ) -> dict[str, str]:
    """sample_id -> format detail, for non-JSON outputs in mostly-JSON format groups; the
    ``uncounted`` samples (synthetic ones) are judged by their group but do not make it."""
    size: Counter[str] = Counter(k for s, k in format_keys.items() if s not in uncounted)
    num_json: Counter[str] = Counter(k for s, k in format_keys.items()
                                     if is_json[s] and s not in uncounted)
    out = {}
    for sid, key in format_keys.items():
        if not size[key]:
            continue
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
           overlaps: dict[str, list[tuple[str, str, float]]], config: CurationConfig,
           judge_scores: Callable[[list[str]], dict[str, float]] | None = None,
           groups: dict[str, str] | None = None,
           sides: Mapping[str, str] | None = None,
           synthetic: frozenset[str] = frozenset()) -> Decisions:
    """Decide sides and drops.

    ``overlaps``: train-candidate sample_id -> [(kind, eval sample_id, share)] for samples on
    the other side: the same prompt (``eval_prompt_match``, share 1) or the ``overlap_share`` of
    the eval sample in the prompt view (``eval_ngram_overlap``) or the conversation view
    (``eval_conversation_overlap``). A pair counts when ``is_contamination`` holds and the eval
    sample is in the final eval set.

    ``synthetic``: the samples only synthetic rows hold; they are train samples, each its own
    group unless ``groups`` says otherwise, and ``config.synthetic_judge_threshold`` judges them.

    ``sides``: the side of each traffic sample (``factory.curation.phrasing``'s split); without
    it, ``split_side`` of its group.
    """
    by_id = {f.sample_id: f for f in facts}
    group = groups if groups is not None else split_groups(
        [f for f in facts if f.sample_id not in synthetic],
        [e for e in near_edges if e[0] not in synthetic and e[1] not in synthetic])
    group = {**{s: s for s in synthetic}, **group}
    side = {sid: TRAIN if sid in synthetic
            else sides[sid] if sides is not None else split_side(g, config)
            for sid, g in group.items()}
    rows_of: dict[str, list[RowFacts]] = defaultdict(list)
    for r in sorted(rows, key=lambda r: (r.sample_id, r.rank, r.row_key)):
        rows_of[r.sample_id].append(r)

    drops: list[dict[str, str | None]] = []
    flagged_kept: Counter[str] = Counter()
    deduped: set[str] = set()
    removed_by: dict[str, str] = {}

    def drop_sample(sid: str, step: str, reason: str, detail: str | None,
                    rows_: Sequence[RowFacts] | None = None) -> None:
        if rows_ is None:  # after the exact-dup step only the sample's first row is left
            rows_ = rows_of[sid][:1] if sid in deduped else rows_of[sid]
            removed_by[sid] = reason
        for r in rows_:
            drops.append({"sample_id": sid, "raw_trace_id": r.raw_trace_id, "split": side[sid],
                          "step": step, "reason": reason, "detail": detail,
                          "origin": r.origin})

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
                drop_sample(sid, "max_tokens", "too_long", too_long_detail(n, config))
            else:
                nxt.append(sid)
        # 3. exact duplicates: one row per sample id, the earliest kept
        alive = nxt
        for sid in alive:
            rs = rows_of[sid]
            if len(rs) > 1:
                kept = rs[0]
                drop_sample(sid, "exact_dup", "duplicate", duplicate_detail(kept.raw_trace_id),
                            rs[1:])
            deduped.add(sid)
        # 4. near duplicates: one sample per connected cluster, the smallest id kept
        alive_set = set(alive)
        live_edges = [(a, b, j) for a, b, j in near_edges if a in alive_set and b in alive_set]
        # traffic clusters from traffic edges alone; then a synthetic sample goes when it
        # near-duplicates a traffic sample, or a smaller synthetic one
        roots = components((a, b) for a, b, _ in live_edges
                           if a not in synthetic and b not in synthetic)
        if synthetic:
            roots.update(components((a, b) for a, b, _ in live_edges
                                    if a in synthetic and b in synthetic))
            for a, b, _ in live_edges:
                if (a in synthetic) != (b in synthetic):
                    syn, other = (a, b) if a in synthetic else (b, a)
                    roots[syn] = roots.get(other, other)
        best: dict[str, float] = {}
        for a, b, j in live_edges:
            best[a] = max(best.get(a, 0.0), j)
            best[b] = max(best.get(b, 0.0), j)
        nxt = []
        for sid in alive:
            root = roots.get(sid, sid)
            if root != sid:
                drop_sample(sid, "near_dup", "near_duplicate", near_dup_detail(root, best[sid]))
            else:
                nxt.append(sid)
        # 5. decontamination: train samples overlapping the final eval set
        if final_eval is not None:
            alive, nxt = nxt, []
            for sid in alive:
                hits = [(OVERLAP_KINDS.index(k), -share, e, k)
                        for k, e, share in overlaps.get(sid, [])
                        if e in final_eval and is_contamination(k, share, config)]
                if hits:
                    _, neg, other, kind = min(hits)
                    drop_sample(sid, "decontamination", kind,
                                overlap_detail(kind, -neg, other, config))
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
        bar = {sid: config.synthetic_judge_threshold if sid in synthetic
               else config.judge_threshold for sid in nxt}
        judged = [sid for sid in nxt if bar[sid] is not None]
        if config.judge_threshold is not None or judged:
            if judge_scores is None:
                raise ValueError("judge_threshold is set but no judge is configured")
            scores = judge_scores(judged) if judged else {}
            alive, nxt = nxt, []
            for sid in alive:
                at = bar[sid]
                if at is not None and scores[sid] < at:
                    drop_sample(sid, "judge", "judge_below_threshold",
                                judge_detail(scores[sid], at))
                else:
                    nxt.append(sid)
        return set(nxt)

    final_eval = clean(EVAL, None)
    final_train = clean(TRAIN, final_eval)
    kept_rows = {rows_of[s][0].row_key for s in final_eval | final_train}
    drops.sort(key=lambda d: (d["sample_id"] or "", d["step"] or "", d["raw_trace_id"] or ""))
    clean_ids = [f.sample_id for f in facts
                 if not f.empty_reason and not f.flags and f.sample_id not in synthetic]
    clean_lost = Counter(removed_by[s] for s in clean_ids if s in removed_by)
    return Decisions(side=side, group=group, kept_rows=kept_rows, drops=drops,
                     flagged_kept=flagged_kept, num_clean=len(clean_ids), clean_lost=clean_lost)


def clean_loss_shares(clean_lost: Mapping[str, int], num_clean: int) -> dict[str, float]:
    """Drop reason -> share of the ``num_clean`` clean samples it removed (6 places)."""
    return {k: round(v / num_clean, 6) if num_clean else 0.0
            for k, v in sorted(clean_lost.items())}


def too_long_detail(num_tokens: int, config: CurationConfig) -> str:
    """Detail of a ``too_long`` drop."""
    return f"{num_tokens} tokens > the {config.max_tokens}-token limit"


def duplicate_detail(kept_raw_trace_id: str | None) -> str:
    """Detail of an exact duplicate's extra row: the raw trace of the row kept."""
    return f"same sample_id as row from raw trace {kept_raw_trace_id}"


def near_dup_detail(root: str, best_jaccard: float) -> str:
    """Detail of a ``near_duplicate`` drop: the sample kept, the best Jaccard of its edges."""
    return f"near-duplicate of {root} (best jaccard {best_jaccard:.3f})"


def judge_detail(score: float, threshold: float) -> str:
    """Detail of a ``judge_below_threshold`` drop."""
    return f"score {score:.3f} < {threshold}"


def overlap_detail(kind: str, share: float, other: str, config: CurationConfig) -> str:
    """Detail of a decontamination drop of ``kind`` (``OVERLAP_KINDS``)."""
    if kind == "eval_prompt_match":
        return f"same prompt as eval sample {other}"
    if kind == "eval_near_duplicate":
        return f"near-duplicate of eval sample {other} (jaccard {share:.3f})"
    view = (f"prompt {config.decontam_ngram}-grams" if kind == "eval_ngram_overlap"
            else f"conversation {config.shingle_words}-grams")
    return (f"holds {share:.0%} of eval sample {other} ({view}, rarity-weighted; "
            f"threshold {threshold(kind, config):.0%})")
