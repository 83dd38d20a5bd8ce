"""The curation settings: what an experiment's ``data`` block asks for, plus derived constants."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

DETECTOR_NAMES: tuple[str, ...] = ("refusal", "truncated", "format", "tool_schema", "agent_loop")
"""Every detector, in the order that decides a sample's drop reason when several flag it."""

_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+$")


def check_experiment_name(name: str) -> str:
    """``name`` if it is safe inside a lake filter expression; ``ValueError`` otherwise."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"experiment name {name!r} must match {_NAME_RE.pattern}")
    return name


@dataclass(frozen=True, kw_only=True)
class CurationConfig:
    """How samples become a train set and an eval set."""

    eval_fraction: float = 0.1
    """Share of split groups held out for eval, decided by a stable hash of the group."""
    max_tokens: int = 2048
    """Samples longer than this (as ``factory.trainer.chat.encode`` counts them) are dropped."""
    near_dup_threshold: float = 0.85
    """Word-3-gram Jaccard similarity at or above which two samples are near-duplicates."""
    decontam_ngram: int = 13
    """A train prompt sharing a word n-gram this long with an eval prompt is contamination."""
    drop: tuple[str, ...] = DETECTOR_NAMES
    """Detectors whose flags drop the sample; the others only flag (reported, kept)."""
    judge_threshold: float | None = None
    """Rejection sampling: keep samples the judge scores at least this; None: no judge step."""
    seed: int = 0
    """Seed of the split hash and of the MinHash permutations."""
    num_bands: int = 16
    """LSH bands. 16 bands of 4 rows catch a pair at Jaccard 0.85 with probability 0.99999."""
    rows_per_band: int = 4
    """MinHash values per band (num_perm = num_bands * rows_per_band)."""
    shingle_words: int = 3
    """Words per shingle for near-duplicate detection."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form notes carried into the report (e.g. the experiment name)."""

    def __post_init__(self) -> None:
        if not 0 < self.eval_fraction < 1:
            raise ValueError(f"eval_fraction must be in (0, 1), got {self.eval_fraction}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be positive, got {self.max_tokens}")
        if not 0 < self.near_dup_threshold <= 1:
            raise ValueError(f"near_dup_threshold must be in (0, 1], got "
                             f"{self.near_dup_threshold}")
        if self.decontam_ngram < 1:
            raise ValueError(f"decontam_ngram must be positive, got {self.decontam_ngram}")
        unknown = sorted(set(self.drop) - set(DETECTOR_NAMES))
        if unknown:
            raise ValueError(f"unknown detector(s) {unknown}; known: {', '.join(DETECTOR_NAMES)}")
        if self.num_bands < 1 or self.rows_per_band < 1 or self.shingle_words < 1:
            raise ValueError("num_bands, rows_per_band and shingle_words must be positive")

    @property
    def num_perm(self) -> int:
        return self.num_bands * self.rows_per_band

    @classmethod
    def from_data_spec(cls, data: Any, *, context_limit: int | None = None) -> CurationConfig:
        """Build from an experiment's ``DataSpec`` (``factory.experiments``); ``max_tokens`` is
        the smaller of ``data.max_tokens`` and the recipe's ``context_limit``."""
        limit = data.max_tokens if context_limit is None else min(data.max_tokens, context_limit)
        return cls(eval_fraction=data.eval_fraction, max_tokens=limit,
                   near_dup_threshold=data.near_dup_threshold,
                   decontam_ngram=data.decontam_ngram, drop=tuple(data.drop),
                   judge_threshold=data.judge_threshold, seed=data.seed)

    def fingerprint(self) -> dict[str, Any]:
        """The settings that decide the result (recorded with each dataset version)."""
        return {"eval_fraction": self.eval_fraction, "max_tokens": self.max_tokens,
                "near_dup_threshold": self.near_dup_threshold,
                "decontam_ngram": self.decontam_ngram, "drop": list(self.drop),
                "judge_threshold": self.judge_threshold, "seed": self.seed,
                "num_bands": self.num_bands, "rows_per_band": self.rows_per_band,
                "shingle_words": self.shingle_words}
