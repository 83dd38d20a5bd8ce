"""Per-sample facts every curation step decides on, computed row by row from one batch.

``sample_features`` is the one row-local function both engines run: in process over Arrow
batches, and on Spark inside ``mapInArrow``. Everything global (split groups, duplicates,
contamination, format majorities) is decided afterwards from these columns.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pyarrow as pa

from factory.curation import detectors, neardup, phrasing
from factory.curation.config import CurationConfig
from factory.curation.text import (
    conversation_text,
    normalize,
    parse_json,
    prompt_text,
    system_text,
    user_texts,
)
from factory.curation.tokens import TokenCounter
from factory.language import language

FEATURES_SCHEMA = pa.schema([
    ("sample_id", pa.string()),
    ("empty_reason", pa.string()),
    ("num_tokens", pa.int32()),
    ("num_prompt_tokens", pa.int32()),
    ("prefix_key", pa.string()),
    ("prompt_key", pa.string()),
    ("prompt_ngrams", pa.list_(pa.int64())),
    ("shingles", pa.list_(pa.int64())),
    ("band_keys", pa.list_(pa.int64())),
    ("phrasing_key", pa.string()),
    ("phrasing_ngrams", pa.list_(pa.int64())),
    ("answer_label", pa.string()),
    ("format_key", pa.string()),
    ("is_json", pa.bool_()),
    ("json_cut", pa.bool_()),
    ("refusal", pa.string()),
    ("truncated", pa.string()),
    ("tool_schema", pa.string()),
    ("agent_loop", pa.string()),
    ("language", pa.string()),
    ("size_bytes", pa.int64()),
])
"""Columns of ``sample_features`` (hashes are uint64 values stored as int64)."""

LIST_COLUMNS = ("prompt_ngrams", "shingles", "band_keys", "phrasing_ngrams")
"""The hash-list columns (everything else is one scalar a sample)."""


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def empty_reason(messages: list[dict[str, Any]]) -> str | None:
    """Why a sample has nothing to learn from, or None."""
    if not messages:
        return "no_messages"
    if not any(m.get("role") == "assistant" for m in messages):
        return "no_assistant_turn"
    for m in messages:
        has_content = bool(m.get("content"))
        if m.get("role") == "assistant" and not has_content and not m.get("tool_calls"):
            return "empty_assistant_turn"
        if m.get("role") in ("user", "system") and not has_content:
            return "empty_message"
    return None


def _as_dict(tags: Any) -> dict[str, str]:
    if tags is None:
        return {}
    if isinstance(tags, dict):
        return tags
    return {k: v for k, v in tags}


def _lists(values: np.ndarray, offsets: np.ndarray) -> pa.Array:
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)),
                                    pa.array(values.view(np.int64)))


def sample_features(batch: pa.Table | pa.RecordBatch, config: CurationConfig,
                    counter: TokenCounter) -> pa.Table:
    """Facts of each row of ``batch`` (columns sample_id, messages, tools, optional tags)."""
    cols = batch.column_names
    ids = batch.column("sample_id").to_pylist()
    raw_messages = batch.column("messages").to_pylist()
    raw_tools = batch.column("tools").to_pylist()
    tags = batch.column("tags").to_pylist() if "tags" in cols else [None] * len(ids)
    msgs = [parse_json(m) for m in raw_messages]
    tools = [parse_json(t) for t in raw_tools]

    counts = counter.count(msgs, tools)
    conv = [conversation_text(m) for m in msgs]
    prompts = [prompt_text(m) for m in msgs]

    flat, offs = neardup.flat_words(conv)
    sh_vals, sh_offs = neardup.ngram_hashes(flat, offs, config.shingle_words)
    sig = neardup.minhash(sh_vals, sh_offs, config.num_perm, config.seed)
    empty = np.diff(sh_offs) == 0
    bands = neardup.band_keys(sig, config.num_bands, config.rows_per_band, empty)
    pflat, poffs = neardup.flat_words(prompts)
    ng_vals, ng_offs = neardup.ngram_hashes(pflat, poffs, config.decontam_ngram)
    skeletons = [phrasing.skeleton(phrasing.user_text(m)) for m in msgs]
    ph_vals, ph_offs = phrasing.skeleton_ngrams(skeletons)

    rows: dict[str, list[Any]] = {f.name: [] for f in FEATURES_SCHEMA
                                  if f.name not in LIST_COLUMNS}
    for i, m in enumerate(msgs):
        firsts = user_texts(m)
        looks, ok, cut = detectors.json_status(m)
        rows["sample_id"].append(ids[i])
        count = counts[i]
        rows["empty_reason"].append(empty_reason(m) or (
            None if count else getattr(counter, "failures", {}).get(i, "unrenderable")))
        rows["num_tokens"].append(count[0] if count else 0)
        rows["num_prompt_tokens"].append(count[1] if count else 0)
        rows["prefix_key"].append(_digest(normalize(firsts[0])) if firsts else "")
        rows["phrasing_key"].append(phrasing.phrasing_key(skeletons[i]))
        rows["answer_label"].append(phrasing.answer_label(m))
        norm_prompt = normalize(prompts[i])
        rows["prompt_key"].append(_digest(norm_prompt) if norm_prompt else "")
        rows["format_key"].append(_digest(normalize(system_text(m))))
        rows["is_json"].append(ok)
        rows["json_cut"].append(looks and not ok and cut)
        rows["refusal"].append(detectors.refusal(m))
        rows["truncated"].append(detectors.truncated(m, _as_dict(tags[i])))
        rows["tool_schema"].append(detectors.tool_schema(m, tools[i]))
        rows["agent_loop"].append(detectors.agent_loop(m))
        rows["language"].append(language(prompts[i] or conv[i]))
        rows["size_bytes"].append(len((raw_messages[i] or "").encode())
                                  + len((raw_tools[i] or "").encode()))
    arrays = []
    for f in FEATURES_SCHEMA:
        if f.name == "prompt_ngrams":
            arrays.append(_lists(ng_vals, ng_offs))
        elif f.name == "shingles":
            arrays.append(_lists(sh_vals, sh_offs))
        elif f.name == "phrasing_ngrams":
            arrays.append(_lists(ph_vals, ph_offs))
        elif f.name == "band_keys":
            arrays.append(_lists(bands.reshape(-1),
                                 np.arange(0, bands.size + 1, config.num_bands, dtype=np.int64)))
        else:
            arrays.append(pa.array(rows[f.name], type=f.type))
    return pa.Table.from_arrays(arrays, schema=FEATURES_SCHEMA)
