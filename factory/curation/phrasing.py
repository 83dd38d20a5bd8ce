"""Phrasing clusters: the eval set holds out whole ways of asking, so it measures generalization.

Holding out by trace, first user turn and near-duplicate group (``decide.split_groups``) still
puts a template's fresh fills on both sides: on templated traffic the eval split then measures
recall of the traffic's phrasings (a triage run's judge said 1.000 where new phrasings scored
84%). Here samples are clustered by how their user turns are phrased, and whole clusters go to
one side:

- a sample's *skeleton* is the text of its user turns with what varies between fills of one
  phrasing masked: e-mail addresses, URLs, quoted values, tokens holding a digit (ids, amounts,
  dates, order numbers) and capitalized words inside a sentence (names, places, products);
- two samples are linked when they have the same skeleton, or when the rarer word pairs of one
  skeleton are mostly in the other: the shared weight of their skeleton word bigrams over the
  smaller sample's, each bigram weighing ``1 / (samples holding it)`` so that greetings and
  sign-offs shared by many phrasings count for little (``linked_pairs``);
- clusters are the connected components of those links and of the existing split groups.

Why bigrams at 0.3 of the smaller and 0.1 of the larger (``bench/phrasing_split.py``: 500
triage tickets of 77 core frames, 600 agent requests of 91 frames, two seeds each, the
generators' frame of each sample as the truth; CLINC150 at 10 and 30 queries per intent): the
share of eval samples whose frame also trains (*frame leak*) is 0.96-1.00 for the trace/prefix
split, 0.13-0.32 here. Other linkings measured: the smaller's share alone left one cluster of
2,855 of CLINC150's 4,500 queries (short queries chain); the larger's share or Jaccard alone
(>= 0.2-0.3) leaked 0.40-0.94 of triage's frames; word unigrams >= 0.6 leaked 0.10-0.20 on
triage but 0.56-0.58 on agent requests and could not split CLINC150; all-MiniLM-L6-v2 embedding
clusters (cosine >= 0.75) leaked 0.33-0.82. What leaks is a frame whose fills differ enough to
form two clusters. A memorizing 1-nearest-neighbour classifier scores 1.00 on the trace/prefix
eval set, 0.79 on this one and 0.78 on new requests (core frames the traffic never used, in its
own detail and aside sentences), means over five triage seeds (``tests/curation/
test_phrasing.py``): this split measures new phrasings of the traffic's requests. Triage's
disjoint set, which also changes those sentences, scores it 0.55; no hold-out of the traffic
can show that shift.

``assign`` then picks the eval clusters (``eval_fraction`` of the samples, every label present
where a label lives in more than one cluster) and falls back to the trace/prefix split, labelled
``RECALL``, when the clusters cannot supply such an eval set: too few of them, or a cluster
holding most of the data.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from factory.curation.config import CurationConfig
from factory.curation.decide import EVAL, TRAIN, split_side
from factory.curation.neardup import UnionFind, flat_words, ngram_hashes
from factory.curation.text import message_text, normalize, parse_json

PHRASING, RECALL = "phrasing", "recall only"
"""``EvalSplit.kind``: held out by phrasing cluster; or by trace, first user turn and
near-duplicate group only, whose scores measure recall of the traffic's phrasings."""

SPLIT_FIELDS = ("eval_split", "eval_split_reason", "num_phrasing_clusters")
"""The ``dataset_profile`` columns (and ``dataset`` metadata) saying how the eval set was held
out: ``EvalSplit.kind``, ``EvalSplit.reason``, ``EvalSplit.num_clusters``."""

NGRAM = 2
"""Skeleton words per n-gram (see the module docstring for the measurement)."""

LARGER_SHARE = 0.1
"""... and at least this share of the larger sample's weight: short human queries sharing one
rare pair of words are otherwise wholly "contained" in each other, and single links chain them
(CLINC150 at 30 a class: one cluster of 2,855 of 4,500 queries without it, 1,522 with it)."""

MAX_DF = 256
"""An n-gram held by more samples than this links no pair (it still weighs in each sample's
total): it bounds the pairs one n-gram makes to 256 x 255 / 2, and its weight (under 1/256) is
too small to decide a link."""

MIN_EVAL_SHARE = 0.9
"""The phrasing split stands when its eval set holds at least this share of the samples wanted
(``eval_fraction`` of the traffic); below it, the trace/prefix split is used."""

MAX_MISSING_LABELS = 0.1
"""... and when at most this share of the labels are missing from its eval set (labels whose
samples all share one cluster cannot be held out without leaving the train set)."""

MIN_CLUSTERS = 2
"""... and when there are at least this many clusters per eval share (20 at the default 10%):
fewer, and one or two phrasings would make the whole eval set."""

LABEL_ROOM = 2
"""Every label present comes first: to hold each label out, the eval set may grow to twice its
target (a label task of many labels and few samples each, such as 10 logged calls per intent,
needs a cluster per label)."""

LABEL_QUOTA = 1.5
"""A label's eval samples stay within this many times its share of the target, so the eval set
keeps the traffic's label mix and no label loses much more than ``eval_fraction`` of its
training samples. Without it one cluster of 15 billing tickets made up half of a 30-sample
triage eval set: the eval score was 0.267 where the deployment was right on 68% of new
tickets (``bench/calibration.py``, seed 1)."""

KEY = "~k:"
"""Node prefix of a skeleton in the cluster graph (sorts after hex digits, like
``decide.TRACE``)."""

_MASKS = (
    (re.compile(r"\S+@\S+\.\w+"), " qqemail "),
    (re.compile(r"(?:https?://|www\.)\S+"), " qqurl "),
    # a single quote inside a word is an apostrophe (I'd, it's, d'annuler), not a quote mark
    (re.compile(r"\"[^\"\n]{1,80}\"|(?<!\w)'[^'\n]{1,80}'(?!\w)|«[^»\n]{1,80}»|„[^“\n]{1,80}“"),
     " qqquote "),
    (re.compile(r"[\w$€£¥.,:/#+-]*\d[\w$€£¥.,:/#+-]*"), " qqnum "),
    # a capitalized word after a lower-case word or a comma: a name, a place, a product (not
    # English "I" with its contractions: I'd, I'm)
    (re.compile(r"(?<=[a-zà-ÿ,;] )(?!I['’])[A-ZÀ-Þ][\w'’-]+"), "qqname"),
)


def skeleton(text: str) -> str:
    """``text`` with its fill-ins masked (see the module docstring), lower-cased words joined
    by single spaces."""
    for pattern, mask in _MASKS:
        text = pattern.sub(mask, text)
    return normalize(text)


def user_text(messages: Sequence[Mapping[str, Any]]) -> str:
    """The user turns' text, the system prompt and every answer left out."""
    return "\n".join(message_text(dict(m)) for m in messages if m.get("role") == "user")


def phrasing_key(skeleton_text: str) -> str:
    """Digest of a skeleton ("" for an empty one): samples with equal keys share a cluster."""
    return hashlib.sha256(skeleton_text.encode()).hexdigest()[:32] if skeleton_text else ""


def skeleton_ngrams(skeletons: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Sorted unique word-``NGRAM`` hashes of each skeleton: (values, offsets)."""
    flat, offsets = flat_words(skeletons)
    return ngram_hashes(flat, offsets, NGRAM)


def answer_label(messages: Sequence[Mapping[str, Any]]) -> str | None:
    """What the last answer says, when it reads as a label: the names of the tools it calls;
    a short text (at most 4 words, 40 characters: a class name); a JSON object's ``intent``,
    ``label``, ``category`` or ``class``. None for free text: it stratifies nothing."""
    last = next((m for m in reversed(messages) if m.get("role") == "assistant"), None)
    if last is None:
        return None
    calls = last.get("tool_calls") or []
    if calls:
        return "tools:" + ",".join(sorted(str(c.get("name", "")) for c in calls))
    text = message_text(dict(last), with_reasoning=False).strip()
    if text.startswith("{"):
        try:
            obj = parse_json(text)
        except ValueError:
            obj = None
        if isinstance(obj, dict):
            for key in ("intent", "label", "category", "class"):
                if isinstance(obj.get(key), str):
                    return f"{key}:{obj[key].strip().lower()}"
        return None
    norm = normalize(text)
    return norm if norm and len(norm) <= 40 and norm.count(" ") < 4 else None


def linked_pairs(values: np.ndarray, offsets: np.ndarray, threshold: float
                 ) -> list[tuple[int, int]]:
    """(i, j), i < j, of the samples whose shared n-gram weight reaches ``threshold`` of the
    smaller of their two totals and ``LARGER_SHARE`` of the larger; each n-gram weighs
    ``1 / df`` (``df``: samples holding it), and only n-grams with ``2 <= df <= MAX_DF`` make
    pairs. ``values``/``offsets``: each sample's sorted unique n-gram hashes."""
    num = len(offsets) - 1
    if num < 2 or not len(values):
        return []
    owner = np.repeat(np.arange(num), np.diff(offsets))
    order = np.lexsort((owner, values))
    vals, own = values[order], owner[order]
    new = np.ones(len(vals), dtype=bool)
    new[1:] = vals[1:] != vals[:-1]
    starts = np.flatnonzero(new)
    sizes = np.diff(np.append(starts, len(vals)))
    group = np.repeat(np.arange(len(starts)), sizes)
    weight = 1.0 / sizes
    total = np.bincount(own, weights=weight[group], minlength=num)
    shared: dict[int, float] = defaultdict(float)
    for g in np.flatnonzero((sizes >= 2) & (sizes <= MAX_DF)).tolist():
        members = own[starts[g]:starts[g] + sizes[g]]
        w = float(weight[g])
        a, b = np.triu_indices(len(members), 1)
        for key in (members[a] * num + members[b]).tolist():
            shared[key] += w
    out = []
    for key, s in shared.items():
        i, j = divmod(key, num)
        small, large = sorted((total[i], total[j]))
        if s >= threshold * small - 1e-12 and s >= LARGER_SHARE * large - 1e-12:
            out.append((i, j))
    return sorted(out)


@dataclass(frozen=True, kw_only=True)
class EvalSplit:
    """The side of every sample, and how the eval set was held out."""

    side: dict[str, str]
    """sample_id -> train | eval."""
    group: dict[str, str]
    """sample_id -> the unit held out: its phrasing cluster (``PHRASING``) or its split group
    (``RECALL``), named by the smallest sample id in it."""
    kind: str
    """``PHRASING`` or ``RECALL``."""
    reason: str
    """One sentence for people: how the eval set was held out, with the numbers."""
    num_clusters: int
    """Phrasing clusters of the traffic (0 when they were not computed)."""

    def profile_fields(self) -> dict[str, Any]:
        """The ``dataset_profile`` columns this split fills."""
        return dict(zip(SPLIT_FIELDS, (self.kind, self.reason, self.num_clusters), strict=True))


def _rank(seed: int, name: str) -> str:
    return hashlib.sha256(f"{seed}:phrasing:{name}".encode()).hexdigest()


def assign(groups: Mapping[str, str], recall_side: Mapping[str, str], *,
           keys: Mapping[str, str], links: Iterable[tuple[str, str]],
           labels: Mapping[str, str | None], eval_fraction: float, seed: int,
           enabled: bool = True) -> EvalSplit:
    """Sides by phrasing cluster, or ``recall_side`` (the trace/prefix split) with the reason.

    ``groups``: sample -> split group (``decide.split_groups``) of every traffic sample;
    ``keys``: sample -> ``phrasing_key``; ``links``: sample pairs from ``linked_pairs``;
    ``labels``: sample -> ``answer_label``. First, for each label (the rarest first) not yet in
    the eval set, the smallest cluster holding it (ties in a seeded hash order) that leaves
    every label it holds in the train set too, while the eval set stays within
    ``LABEL_ROOM`` times the target (``eval_fraction`` of the samples); then clusters in the
    hash order while they fit the target (5% over allowed). No label takes more than
    ``LABEL_QUOTA`` times its share of the target, and a cluster larger than half the target is
    never held out: it would decide the eval set alone.
    """
    ids = sorted(groups)
    uf = UnionFind()
    for sid in ids:
        uf.union(sid, groups[sid])
        if keys.get(sid):
            uf.union(sid, KEY + keys[sid])
    for a, b in links:
        uf.union(a, b)
    cluster = {sid: uf.find(sid) for sid in ids}
    members: dict[str, list[str]] = defaultdict(list)
    for sid in ids:
        members[cluster[sid]].append(sid)
    num_clusters = len(members)
    n = len(ids)
    recall_eval = sum(1 for s in ids if recall_side[s] == EVAL)

    def fallback(why: str) -> EvalSplit:
        return EvalSplit(
            side=dict(recall_side), group=dict(groups), kind=RECALL, num_clusters=num_clusters,
            reason=f"recall only: {why}; the eval set is held out by trace, first user turn and "
                   f"near-duplicate group ({recall_eval} samples), so its scores measure recall "
                   "of the traffic's own phrasings, not new ones")

    if not enabled:
        return fallback("the phrasing split is off (curation phrasing_threshold: null)")
    if n == 0:
        return fallback("no samples")
    if num_clusters < MIN_CLUSTERS / eval_fraction:
        return fallback(f"{num_clusters} phrasing clusters of {n} samples, fewer than the "
                        f"{math.ceil(MIN_CLUSTERS / eval_fraction)} an eval set of "
                        f"{eval_fraction:.0%} needs")
    target = max(1, round(eval_fraction * n))
    cap = max(1, target // 2)
    sizes = {c: len(m) for c, m in members.items()}
    distinct = {labels.get(s) for s in ids} - {None}
    use_labels = 2 <= len(distinct) <= n / 3
    label_of: dict[str, str] = {s: lbl for s in ids
                                if use_labels and (lbl := labels.get(s)) is not None}
    label_count = {c: Counter(label_of[s] for s in m if s in label_of)
                   for c, m in members.items()}
    label_sets = {c: set(k) for c, k in label_count.items()}
    train_left: Counter[str] = Counter(label_of.values())
    per_label: Counter[str] = Counter(lbl for ls in label_sets.values() for lbl in ls)
    order = sorted(members, key=lambda c: _rank(seed, c))
    held: set[str] = set()
    size = 0

    total_of: Counter[str] = Counter(label_of.values())
    quota = {lbl: max(1, math.ceil(LABEL_QUOTA * target * k / n)) for lbl, k in total_of.items()}
    held_of: Counter[str] = Counter()

    def can_take(c: str) -> bool:
        return c not in held and sizes[c] <= cap and all(
            train_left[lbl] > k and held_of[lbl] + k <= quota[lbl]
            for lbl, k in label_count[c].items())

    def take(c: str) -> None:
        nonlocal size
        held.add(c)
        size += sizes[c]
        for lbl, k in label_count[c].items():
            train_left[lbl] -= k
            held_of[lbl] += k

    in_eval: set[str] = set()
    for lbl in sorted(per_label, key=lambda x: (per_label[x], x)):
        if lbl in in_eval:
            continue
        pick = min((c for c in order if lbl in label_sets[c] and can_take(c)
                    and size + sizes[c] <= LABEL_ROOM * target),
                   key=lambda c: sizes[c], default=None)
        if pick is not None:
            take(pick)
            in_eval |= label_sets[pick]
    slack = max(1, target // 20)
    for c in order:
        if size >= target:
            break
        if can_take(c) and size + sizes[c] <= target + slack:
            take(c)
            in_eval |= label_sets[c]
    largest = max(sizes.values())
    missing = sorted(set(per_label) - in_eval)
    if size < MIN_EVAL_SHARE * target:
        return fallback(
            f"{num_clusters} phrasing clusters of {n} samples (the largest holds {largest}) "
            f"could hold out {size} of the {target} eval samples wanted "
            f"(at least {MIN_EVAL_SHARE:.0%})")
    if len(missing) > MAX_MISSING_LABELS * len(per_label):
        return fallback(
            f"{len(missing)} of {len(per_label)} labels could not be held out by phrasing "
            f"cluster (each lives in one cluster, or its clusters are too large), e.g. "
            f"{', '.join(missing[:3])}")
    side = {}
    group = {}
    for sid in ids:
        side[sid] = EVAL if cluster[sid] in held else TRAIN
        group[sid] = cluster[sid]
    label_words = (f", {len(in_eval)} of {len(per_label)} labels"
                   + (f" ({len(missing)} live in one cluster only: not in the eval set)"
                      if missing else "")) if use_labels else ""
    return EvalSplit(
        side=side, group=group, kind=PHRASING, num_clusters=num_clusters,
        reason=f"held out by phrasing: {len(held)} of {num_clusters} phrasing clusters, "
               f"{size} of {n} samples{label_words}; no phrasing of the eval set trains")


def split_features(features: pa.Table, groups: Mapping[str, str], config: CurationConfig
                   ) -> EvalSplit:
    """``assign`` over a features table (``features.FEATURES_SCHEMA``: ``sample_id``,
    ``phrasing_key``, ``phrasing_ngrams``, ``answer_label``) of the traffic samples in
    ``groups``; the recall side is ``decide.split_side`` of each group. Both engines call
    this, so their splits are one computation."""
    wanted = [i for i, s in enumerate(features.column("sample_id").to_pylist()) if s in groups]
    t = features.take(wanted) if len(wanted) != features.num_rows else features
    ids = t.column("sample_id").to_pylist()
    recall_side = {sid: split_side(groups[sid], config) for sid in ids}
    threshold = config.phrasing_threshold
    links: list[tuple[str, str]] = []
    if threshold is not None:
        lists = t.column("phrasing_ngrams").combine_chunks()
        pairs = linked_pairs(lists.values.to_numpy(), lists.offsets.to_numpy(), threshold)
        links = [(ids[i], ids[j]) for i, j in pairs]
    return assign({s: groups[s] for s in ids}, recall_side,
                  keys=dict(zip(ids, t.column("phrasing_key").to_pylist(), strict=True)),
                  links=links,
                  labels=dict(zip(ids, t.column("answer_label").to_pylist(), strict=True)),
                  eval_fraction=config.eval_fraction, seed=config.seed,
                  enabled=threshold is not None)
