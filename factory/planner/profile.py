"""``DatasetProfile``: what the planner knows about a curated dataset (a ``dataset_profile`` row).

The curation asset writes one ``dataset_profile`` row per experiment and dataset snapshot; the
planner reads the newest row of its experiment into this dataclass by column name, so columns
added later are ignored and missing optional ones keep their defaults.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from factory.errors import FactoryError, UnknownTableError

ALIASES = {"num_train": "num_samples", "num_eval": "num_eval_samples",
           "turns_p50": "num_turns_p50", "turns_max": "num_turns_max"}
"""``dataset_profile`` column -> field, where the table's name differs."""


@dataclass(frozen=True, kw_only=True)
class DatasetProfile:
    """Token and shape statistics of an experiment's curated train set."""

    num_samples: int
    """Train samples after curation."""
    prompt_tokens_p50: int
    """Median prompt tokens (everything but the trained assistant turns)."""
    prompt_tokens_p95: int
    """95th percentile of prompt tokens."""
    prompt_tokens_p99: int
    """99th percentile of prompt tokens."""
    prompt_tokens_max: int
    """Longest prompt in tokens."""
    completion_tokens_p50: int
    """Median completion (trained assistant) tokens."""
    completion_tokens_p95: int
    """95th percentile of completion tokens."""
    completion_tokens_p99: int
    """99th percentile of completion tokens."""
    completion_tokens_max: int
    """Longest completion in tokens."""
    num_eval_samples: int = 0
    """Eval samples after curation (0: unknown, the planner derives it from eval_fraction)."""
    total_tokens_p50: int | None = None
    """Median whole-sample tokens (chat template included); None: prompt + completion."""
    total_tokens_p99: int | None = None
    """99th percentile of whole-sample tokens; None: prompt p99 + completion p99."""
    total_tokens_max: int | None = None
    """Longest whole sample; None: prompt max + completion max."""
    num_turns_p50: float = 2.0
    """Median messages per sample."""
    num_turns_max: int = 2
    """Most messages in one sample."""
    share_with_images: float = 0.0
    """Share of samples with at least one image."""
    share_with_tool_calls: float = 0.0
    """Share of samples with at least one tool call."""
    languages: dict[str, float] = field(default_factory=dict)
    """Language code -> share of samples."""
    num_train_tokens: int | None = None
    """Tokens in the train set (chat template included); None: median length x samples."""
    shared_prefix_tokens: int = 0
    """Median tokens that the samples of a micro-batch-sized group (8) all begin with, before
    any trained token (a shared system prompt): what ``share_prefix`` computes once."""
    eval_split: str | None = None
    """How curation held out the eval set: ``phrasing`` or ``recall only``
    (``factory.curation.phrasing``); None for a dataset curated before the column existed."""
    eval_split_reason: str | None = None
    """That split's one-sentence account, with its numbers."""
    label_counts: dict[str, int] = field(default_factory=dict)
    """Train samples per answer label, when the answers are a closed label set (the ``label``
    slices of ``factory.curation.slices``, traffic and synthetic); empty otherwise."""

    @property
    def samples_per_label(self) -> float | None:
        """Median train samples per answer label; None without a label set, or where labelled
        answers are under half the train set (an agent's few text replies beside its calls)."""
        counts = list(self.label_counts.values())
        if len(counts) < 2 or 2 * sum(counts) < self.num_samples:
            return None
        return float(statistics.median(counts))

    @property
    def length_p50(self) -> int:
        return self.total_tokens_p50 or self.prompt_tokens_p50 + self.completion_tokens_p50

    @property
    def length_p99(self) -> int:
        return self.total_tokens_p99 or self.prompt_tokens_p99 + self.completion_tokens_p99

    @property
    def length_max(self) -> int:
        return self.total_tokens_max or self.prompt_tokens_max + self.completion_tokens_max

    @property
    def length_mean(self) -> float:
        """Mean whole-sample tokens."""
        return self.num_tokens / max(1, self.num_samples)

    @property
    def num_tokens(self) -> int:
        """Tokens in the train set (measured, else median length times samples)."""
        return self.num_train_tokens or self.num_samples * self.length_p50

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> DatasetProfile:
        """Build from a ``dataset_profile`` row, reading columns by name."""
        kwargs: dict[str, Any] = {}
        data = {**{ALIASES[k]: v for k, v in row.items() if k in ALIASES
                   and row.get(ALIASES[k]) is None}, **row}
        if data.get("slices"):
            data["label_counts"] = _label_counts(data["slices"])
        for f in fields(cls):
            if f.name not in data or data[f.name] is None:
                continue
            value = data[f.name]
            if f.name == "languages":
                value = _languages(value)
            kwargs[f.name] = value
        missing = [f.name for f in fields(cls) if f.name not in kwargs
                   and f.default is MISSING and f.default_factory is MISSING]
        if missing:
            raise FactoryError(f"dataset_profile row lacks {', '.join(missing)}")
        return cls(**kwargs)


def _label_counts(slices: Any) -> dict[str, int]:
    """Samples per ``label`` slice, from the profile's ``slices`` (JSON text or a list)."""
    if isinstance(slices, str):
        slices = json.loads(slices)
    return {str(s["value"]): int(s.get("num_traffic") or 0) + int(s.get("num_synthetic") or 0)
            for s in slices or [] if isinstance(s, Mapping) and s.get("dimension") == "label"}


def _languages(value: Any) -> dict[str, float]:
    if isinstance(value, str):
        value = json.loads(value) if value.strip().startswith(("{", "[")) else {value: 1.0}
    if isinstance(value, Mapping):
        return {str(k): float(v) for k, v in value.items()}
    if isinstance(value, list):
        if value and isinstance(value[0], tuple | list) and len(value[0]) == 2:
            return {str(k): float(v) for k, v in value}  # Arrow map as key/value pairs
        if value and isinstance(value[0], Mapping):
            return {str(v.get("language") or v.get("key")): float(v.get("share")
                                                                   or v.get("value") or 0)
                    for v in value}
        return {str(v): 1.0 / len(value) for v in value}
    return {}


def read_profile(lake: Any, experiment: str) -> DatasetProfile:
    """The newest ``dataset_profile`` row of ``experiment`` (``PlanError``-style message if none).

    ``lake`` is a ``Lake`` or ``LakeSession`` (anything with ``.sql``).
    """
    try:
        table = lake.sql("SELECT * FROM dataset_profile WHERE experiment = ? "
                         "ORDER BY created_at DESC LIMIT 1", [experiment])
    except UnknownTableError:
        table = None
    except FactoryError as exc:  # table declared but never written
        if "dataset_profile" not in str(exc):
            raise
        table = None
    if table is None or table.num_rows == 0:
        raise FactoryError(f"no dataset_profile for experiment {experiment!r}: materialize it "
                           f"first (`factory dataset {experiment}`)")
    return DatasetProfile.from_row(table.to_pylist()[0])
