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
    """Share of the traffic held out for eval: whole phrasing clusters in a seeded hash order
    (``factory.curation.phrasing``), or, where those cannot supply it, whole split groups by a
    stable hash of the group."""
    phrasing_threshold: float | None = 0.3
    """Share of the smaller skeleton's rarity-weighted word bigrams two samples must share to be
    one phrasing (``phrasing.linked_pairs``; 0.3 measured in ``bench/phrasing_split.py``);
    None holds out by split group only (scores then measure recall only)."""
    max_tokens: int = 2048
    """Samples longer than this (as ``factory.trainer.chat.encode`` counts them) are dropped."""
    near_dup_threshold: float = 0.85
    """Word-3-gram Jaccard similarity at or above which two samples are near-duplicates."""
    decontam_ngram: int = 13
    """Words per n-gram of decontamination's prompt view (``decide.overlap_share``)."""
    decontam_threshold: float = 0.9
    """A train prompt holding at least this share of an eval prompt's n-grams (rarity-weighted,
    ``decide.overlap_share``) is contamination: the eval prompt pasted into a train prompt.

    0.9: a pasted prompt scores 1.0; between distinct clean support tickets (600 a seed, 4
    seeds, ``synthetic.templated``'s generator) the highest share was 0.46, and 0.83 behind a
    fixed 90-word instruction in the user turn (a short ticket whose whole text but a one-word
    sign-off is in another)."""
    decontam_paraphrase_threshold: float = 0.6
    """A train sample holding at least this share of an eval sample's conversation
    ``shingle_words``-grams (prompt and answer, rarity-weighted) is contamination: a reworded
    copy that keeps the eval answer.

    0.6: between the same clean tickets (JSON or label answers) the highest share was 0.54;
    89-100% of their paraphrases (``synthetic.reword``: another greeting, every known phrase
    of the body reworded, same signature and answer) scored at least 0.6."""
    drop: tuple[str, ...] = DETECTOR_NAMES
    """Detectors whose flags drop the sample; the others only flag (reported, kept)."""
    judge_threshold: float | None = None
    """Rejection sampling: keep samples the judge scores at least this; None: no judge step."""
    synthetic_judge_threshold: float | None = None
    """Rejection sampling of synthetic samples (``data.synthesize``); None: not judged. From an
    experiment: its threshold, else 1.0 (the dataset asset lowers it to
    ``synthesis.default_judge_threshold`` for a rubric with LLM criteria)."""
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
        if self.phrasing_threshold is not None and not 0 < self.phrasing_threshold <= 1:
            raise ValueError(f"phrasing_threshold must be in (0, 1] or null, got "
                             f"{self.phrasing_threshold}")
        for name in ("decontam_threshold", "decontam_paraphrase_threshold"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
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
        synthesize = getattr(data, "synthesize", None)
        synthetic_bar = None
        if synthesize is not None:
            synthetic_bar = next(v for v in (synthesize.judge_threshold, data.judge_threshold,
                                             1.0) if v is not None)
        return cls(eval_fraction=data.eval_fraction, max_tokens=limit,
                   near_dup_threshold=data.near_dup_threshold,
                   decontam_ngram=data.decontam_ngram, drop=tuple(data.drop),
                   judge_threshold=data.judge_threshold, seed=data.seed,
                   synthetic_judge_threshold=synthetic_bar)

    def fingerprint(self) -> dict[str, Any]:
        """The settings that decide the result (recorded with each dataset version)."""
        return {"eval_fraction": self.eval_fraction,
                "phrasing_threshold": self.phrasing_threshold, "max_tokens": self.max_tokens,
                "near_dup_threshold": self.near_dup_threshold,
                "decontam_ngram": self.decontam_ngram,
                "decontam_threshold": self.decontam_threshold,
                "decontam_paraphrase_threshold": self.decontam_paraphrase_threshold,
                "drop": list(self.drop),
                "judge_threshold": self.judge_threshold, "seed": self.seed,
                **({"synthetic_judge_threshold": self.synthetic_judge_threshold}
                   if self.synthetic_judge_threshold is not None else {}),
                "num_bands": self.num_bands, "rows_per_band": self.rows_per_band,
                "shingle_words": self.shingle_words}
