"""Slices of a dataset, and which are thin: where synthesis (``factory.curation.synthesis``)
asks a teacher for more samples.

A train sample belongs to a slice of each dimension it has a value in:

- ``tool:<name>``: each tool its final assistant turn calls;
- ``label:<label>``: its answer's label, when the answers are a closed label set
  (``factory.evals.rubric.closed_labels``), or, when they are JSON objects, the value of the
  one field whose values are such a set (``label:intent=refund``);
- ``length:<bucket>``: its token count (base tokenizer + chat template) in power-of-two
  buckets (``length:128-255``).

The thin rule, per dimension holding at least two slices: a slice is thin when its traffic
samples are fewer than ``THIN_SHARE`` of an even share of the dimension (the dimension's
traffic samples over its number of slices). Counting traffic only keeps the rule stable once
synthetic samples fill a slice: the same slices stay thin, and a resumed synthesis plans the
same attempts. Synthesis fills a thin slice up to the even share.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from factory.curation.decide import SYNTHETIC, TRAFFIC
from factory.curation.text import last_assistant_index, message_text, parse_json
from factory.evals.rubric import closed_labels, normalize_label, parse_json_answer

DIMENSIONS: tuple[str, ...] = ("tool", "label", "length")

THIN_SHARE = 0.5
"""A slice under half an even share of its dimension is thin. With five equal labels, one cut
to 3% of its traffic holds 0.6% of the samples against an even 20%: thin; the natural spread of
generated tasks (equal shares, or 58/20/22 for agent_orders' kinds) stays above it."""

LENGTH_FLOOR = 64
"""Samples under this many tokens share the first length bucket."""

_JSON_FIELD_MAJORITY = 0.8
"""A JSON field labels the answers when at least this share of them hold it (as text)."""


def length_bucket(num_tokens: int) -> str:
    """``<64``, then power-of-two ranges: ``64-127``, ``128-255``, ..."""
    if num_tokens < LENGTH_FLOOR:
        return f"<{LENGTH_FLOOR}"
    low = 1 << (int(num_tokens).bit_length() - 1)
    return f"{low}-{2 * low - 1}"


def final_turn(messages: list[dict[str, Any]]) -> tuple[str, list[str]]:
    """(text, tool names called) of the final assistant turn."""
    i = last_assistant_index(messages)
    if i < 0:
        return "", []
    msg = messages[i]
    return (message_text(msg, with_reasoning=False).strip(),
            [str(c.get("name", "")) for c in msg.get("tool_calls") or []])


@dataclass(frozen=True, kw_only=True)
class Labeler:
    """How an answer's text gives its label: the text itself (``field`` None) or a JSON field."""

    labels: tuple[str, ...]
    """The closed label set (normalized)."""
    field: str | None = None
    """The JSON field holding the label; None: the whole answer is the label."""

    @classmethod
    def fit(cls, answers: Sequence[str]) -> Labeler | None:
        """The labeler of these answers (the traffic train set's), or None when they carry no
        closed label set."""
        texts = [a for a in answers if a]
        if not texts:
            return None
        labels = closed_labels(texts)
        if labels is not None and len(labels) >= 2:
            return cls(labels=tuple(labels))
        objects = [v for ok, v in (parse_json_answer(t) for t in texts)
                   if ok and isinstance(v, dict)]
        if len(objects) < _JSON_FIELD_MAJORITY * len(texts):
            return None
        best: tuple[float, int, str, list[str]] | None = None
        for key in sorted({k for o in objects for k in o}):
            values = [o[key] for o in objects if isinstance(o.get(key), str) and o[key]]
            if len(values) < _JSON_FIELD_MAJORITY * len(objects):
                continue
            found = closed_labels(values)
            if found is None or len(found) < 2:
                continue
            rank = (-len(values) / len(objects), len(found), key, found)
            if best is None or rank < best:
                best = rank
        if best is None:
            return None
        return cls(labels=tuple(best[3]), field=best[2])

    def label(self, answer: str) -> str | None:
        """The answer's label (``intent=refund`` for a JSON field), or None outside the set."""
        if self.field is None:
            value = normalize_label(answer)
            return value if value in self.labels else None
        ok, obj = parse_json_answer(answer)
        if not ok or not isinstance(obj, dict) or not isinstance(obj.get(self.field), str):
            return None
        value = normalize_label(obj[self.field])
        return f"{self.field}={value}" if value in self.labels else None


def sample_slices(messages: list[dict[str, Any]], num_tokens: int | None,
                  labeler: Labeler | None) -> list[str]:
    """The slices (``<dimension>:<value>``) a sample belongs to."""
    text, tools = final_turn(messages)
    out = [f"tool:{name}" for name in dict.fromkeys(tools) if name]
    if labeler is not None and not tools:
        label = labeler.label(text)
        if label is not None:
            out.append(f"label:{label}")
    if num_tokens is not None:
        out.append(f"length:{length_bucket(num_tokens)}")
    return out


@dataclass(frozen=True, kw_only=True)
class Slice:
    """One slice of the train set."""

    dimension: str
    value: str
    num_traffic: int
    """Train samples of origin traffic in it."""
    num_synthetic: int
    """Train samples of origin synthetic in it."""
    thin: bool
    """Thin by the rule of this module."""
    even: int
    """An even share of its dimension (traffic samples), rounded up: what synthesis fills a
    thin slice to."""

    @property
    def key(self) -> str:
        return f"{self.dimension}:{self.value}"

    def to_dict(self) -> dict[str, Any]:
        return {"dimension": self.dimension, "value": self.value,
                "num_traffic": self.num_traffic, "num_synthetic": self.num_synthetic,
                "thin": self.thin, "even": self.even}


def origins(train: pa.Table) -> list[str]:
    """Each row's origin (``traffic`` where the table has no ``origin`` column)."""
    if "origin" not in train.column_names:
        return [TRAFFIC] * train.num_rows
    return [o or TRAFFIC for o in train.column("origin").to_pylist()]


def fit_labeler(train: pa.Table) -> Labeler | None:
    """The labeler of the train set's traffic answers."""
    return _fit([parse_json(m) for m in train.column("messages").to_pylist()], origins(train))


def _fit(messages: Sequence[list[dict[str, Any]]], origin: Sequence[str]) -> Labeler | None:
    return Labeler.fit([final_turn(m)[0] for m, o in zip(messages, origin, strict=True)
                        if o == TRAFFIC])


def _tokens(train: pa.Table) -> list[int | None]:
    return (train.column("num_tokens").to_pylist() if "num_tokens" in train.column_names
            else [None] * train.num_rows)


def membership(train: pa.Table, labeler: Labeler | None) -> list[list[str]]:
    """Each train row's slices, in row order."""
    return [sample_slices(parse_json(m), n, labeler)
            for m, n in zip(train.column("messages").to_pylist(), _tokens(train), strict=True)]


def profile_slices(train: pa.Table) -> list[Slice]:
    """The train set's slices with their counts and thin flags, sorted by dimension, value."""
    messages = [parse_json(m) for m in train.column("messages").to_pylist()]
    origin = origins(train)
    labeler = _fit(messages, origin)
    traffic: Counter[str] = Counter()
    synthetic: Counter[str] = Counter()
    for m, n, o in zip(messages, _tokens(train), origin, strict=True):
        (synthetic if o == SYNTHETIC else traffic).update(sample_slices(m, n, labeler))
    out = []
    for dim in DIMENSIONS:
        keys = sorted(k for k in set(traffic) | set(synthetic) if k.startswith(dim + ":"))
        present = [k for k in keys if traffic[k]]
        total = sum(traffic[k] for k in present)
        even = math.ceil(total / len(present)) if present else 0
        for k in keys:
            thin = len(present) >= 2 and traffic[k] < THIN_SHARE * total / len(present)
            out.append(Slice(dimension=dim, value=k[len(dim) + 1:], num_traffic=traffic[k],
                             num_synthetic=synthetic[k], thin=thin, even=even))
    return out
