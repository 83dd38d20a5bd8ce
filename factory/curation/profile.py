"""The dataset profile the planner reads: token percentiles, turns, modalities, languages, size,
and the share of synthetic samples (``dataset_profile`` adds the slices,
``factory.curation.slices``)."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from typing import Any

import numpy as np
import pyarrow as pa

from factory.curation.decide import SYNTHETIC


def _pct(values: np.ndarray, q: float) -> int:
    return int(np.percentile(values, q, method="higher")) if len(values) else 0


def dataset_version(train: pa.Table, ev: pa.Table) -> str:
    """Content hash of the two datasets (sample ids per side): equal data, equal version."""
    h = hashlib.sha256()
    for name, t in (("train", train), ("eval", ev)):
        h.update(name.encode())
        for sid in t.column("sample_id").to_pylist():
            h.update(sid.encode())
    return h.hexdigest()[:16]


def build_profile(train: pa.Table, ev: pa.Table, drops: list[dict[str, Any]], *,
                  num_selected: int) -> dict[str, Any]:
    """One ``dataset_profile`` row (without experiment): computed over the train set."""
    total = train.column("num_tokens").to_numpy(zero_copy_only=False).astype(np.int64) \
        if train.num_rows else np.zeros(0, dtype=np.int64)
    prompt = train.column("num_prompt_tokens").to_numpy(zero_copy_only=False).astype(np.int64) \
        if train.num_rows else np.zeros(0, dtype=np.int64)
    completion = total - prompt
    turns = np.asarray(train.column("num_turns").to_pylist() if train.num_rows else [],
                       dtype=np.float64)
    turns = np.nan_to_num(turns)
    n = train.num_rows
    langs = Counter(train.column("language").to_pylist()) if n else Counter()
    size = 0
    for t in (train, ev):
        if "size_bytes" in t.column_names:  # precomputed (the Spark engine ships no text)
            size += int(sum(v or 0 for v in t.column("size_bytes").to_pylist()))
            continue
        for col in ("messages", "tools"):
            if t.num_rows:
                size += sum(len(x.encode()) for x in t.column(col).to_pylist() if x)
    reasons = Counter(d["reason"] for d in drops)
    num_synthetic = (sum(1 for o in train.column("origin").to_pylist() if o == SYNTHETIC)
                     if "origin" in train.column_names else 0)

    def share(col: str) -> float:
        return round(sum(1 for v in train.column(col).to_pylist() if v) / n, 6) if n else 0.0

    return {
        "dataset_version": dataset_version(train, ev),
        "num_selected": num_selected,
        "num_train": n,
        "num_eval": ev.num_rows,
        "num_dropped": len(drops),
        "prompt_tokens_p50": _pct(prompt, 50), "prompt_tokens_p95": _pct(prompt, 95),
        "prompt_tokens_p99": _pct(prompt, 99), "prompt_tokens_max": int(prompt.max(initial=0)),
        "completion_tokens_p50": _pct(completion, 50),
        "completion_tokens_p95": _pct(completion, 95),
        "completion_tokens_p99": _pct(completion, 99),
        "completion_tokens_max": int(completion.max(initial=0)),
        "total_tokens_p50": _pct(total, 50), "total_tokens_p95": _pct(total, 95),
        "total_tokens_p99": _pct(total, 99), "total_tokens_max": int(total.max(initial=0)),
        "num_train_tokens": int(total.sum()),
        "turns_mean": round(float(turns.mean()), 4) if n else 0.0,
        "turns_p50": _pct(turns, 50), "turns_max": int(turns.max(initial=0)),
        "share_with_images": share("has_images"),
        "share_with_tool_calls": share("has_tool_calls"),
        "languages": json.dumps({k: round(v / n, 6) for k, v in sorted(langs.items())}),
        "size_bytes": size,
        "drops_by_reason": json.dumps(dict(sorted(reasons.items()))),
        "num_synthetic": num_synthetic,
        "share_synthetic": round(num_synthetic / n, 6) if n else 0.0,
    }
