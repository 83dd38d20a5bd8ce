"""The one place that declares every lake table's schema.

Tables live in namespace ``factory`` and are created on first use. A field added here reaches an
existing table through Iceberg schema evolution (``union_by_name``); nothing is ever dropped.
Each capability adds its tables to ``TABLES`` below, next to the others.
"""

from __future__ import annotations

import pyarrow as pa

NAMESPACE = "factory"

_TS = pa.timestamp("us", tz="UTC")
_TAGS = pa.map_(pa.string(), pa.string())

TABLES: dict[str, pa.Schema] = {
    # Every input record, once (id = content hash), before anything else happens to it.
    "raw_traces": pa.schema([
        ("raw_trace_id", pa.string()),
        ("source", pa.string()),          # upload | proxy | otel
        ("format", pa.string()),          # detected (or forced) input format
        ("received_at", _TS),
        ("project", pa.string()),
        ("tags", _TAGS),
        ("payload", pa.string()),         # the record as received (JSON text)
    ]),
    # Canonical samples (shared/docs/canonical-sample.md): one row per conversation of a record.
    "samples": pa.schema([
        ("sample_id", pa.string()),
        ("raw_trace_id", pa.string()),
        ("source", pa.string()),
        ("provider", pa.string()),
        ("model", pa.string()),
        ("messages", pa.string()),        # canonical JSON
        ("tools", pa.string()),           # canonical JSON
        ("num_turns", pa.int32()),
        ("has_images", pa.bool_()),
        ("has_tool_calls", pa.bool_()),
        ("created_at", _TS),
        ("project", pa.string()),
        ("tags", _TAGS),
    ]),
    # Records that could not be normalized, with the field and what was wrong.
    "rejected_traces": pa.schema([
        ("raw_trace_id", pa.string()),
        ("source", pa.string()),
        ("format", pa.string()),
        ("received_at", _TS),
        ("reason", pa.string()),
        ("payload", pa.string()),
    ]),
    # Gateway routing table (append-only; the latest row per model wins, active=false removes).
    "routes": pa.schema([
        ("model", pa.string()),
        ("provider", pa.string()),        # openai | anthropic | gemini: the API it speaks
        ("base_url", pa.string()),
        ("deployment", pa.string()),      # upstream model name, when it differs
        ("version", pa.string()),
        ("active", pa.bool_()),
        ("registered_at", _TS),
    ]),
    # Base models built into plain Hugging Face directories.
    "base_models": pa.schema([
        ("name", pa.string()),
        ("path", pa.string()),
        ("source", pa.string()),
        ("sha256", pa.string()),          # hash of the weights file
        ("num_parameters", pa.int64()),
        ("built_at", _TS),
    ]),
    # Curation (factory/curation): per-experiment datasets; each overwrite is one version.
    **{name: pa.schema([
        ("experiment", pa.string()),
        ("sample_id", pa.string()),
        ("raw_trace_id", pa.string()),
        ("source", pa.string()),
        ("provider", pa.string()),
        ("model", pa.string()),
        ("messages", pa.string()),        # canonical JSON
        ("tools", pa.string()),           # canonical JSON
        ("num_turns", pa.int32()),
        ("has_images", pa.bool_()),
        ("has_tool_calls", pa.bool_()),
        ("created_at", _TS),
        ("project", pa.string()),
        ("tags", _TAGS),
        ("split", pa.string()),           # train | eval
        ("split_group", pa.string()),     # smallest sample_id of its related-samples group
        ("num_tokens", pa.int32()),       # base tokenizer + chat template
        ("num_prompt_tokens", pa.int32()),
        ("num_completion_tokens", pa.int32()),
        ("language", pa.string()),
    ]) for name in ("dataset_train", "dataset_eval")},
    # Every row curation removed, with the step and the reason.
    "dataset_drops": pa.schema([
        ("experiment", pa.string()),
        ("sample_id", pa.string()),
        ("raw_trace_id", pa.string()),
        ("split", pa.string()),
        ("step", pa.string()),            # empty | max_tokens | exact_dup | near_dup | ...
        ("reason", pa.string()),
        ("detail", pa.string()),
    ]),
    # One row per experiment (per version: its snapshots), read by the planner.
    "dataset_profile": pa.schema([
        ("experiment", pa.string()),
        ("dataset_version", pa.string()),  # content hash of the train/eval sample ids
        ("created_at", _TS),
        ("engine", pa.string()),           # embedded | spark
        ("tokenizer", pa.string()),
        ("samples_snapshot_id", pa.int64()),
        ("config", pa.string()),           # JSON of the curation settings
        ("num_selected", pa.int64()),
        ("num_train", pa.int64()),
        ("num_eval", pa.int64()),
        ("num_dropped", pa.int64()),
        ("prompt_tokens_p50", pa.int32()),
        ("prompt_tokens_p95", pa.int32()),
        ("prompt_tokens_p99", pa.int32()),
        ("prompt_tokens_max", pa.int32()),
        ("completion_tokens_p50", pa.int32()),
        ("completion_tokens_p95", pa.int32()),
        ("completion_tokens_p99", pa.int32()),
        ("completion_tokens_max", pa.int32()),
        ("total_tokens_p50", pa.int32()),
        ("total_tokens_p95", pa.int32()),
        ("total_tokens_p99", pa.int32()),
        ("total_tokens_max", pa.int32()),
        ("num_train_tokens", pa.int64()),
        ("turns_mean", pa.float64()),
        ("turns_p50", pa.int32()),
        ("turns_max", pa.int32()),
        ("share_with_images", pa.float64()),
        ("share_with_tool_calls", pa.float64()),
        ("languages", pa.string()),        # JSON {code: share of train samples}
        ("size_bytes", pa.int64()),
        ("drops_by_reason", pa.string()),  # JSON {reason: rows}
    ]),
}


def schema_of(name: str) -> pa.Schema:
    """The declared schema of table ``name``; ``UnknownTableError`` if none is declared."""
    from factory.errors import UnknownTableError

    try:
        return TABLES[name]
    except KeyError:
        known = ", ".join(sorted(TABLES))
        raise UnknownTableError(f"unknown table {name!r}; the lake has: {known}") from None
