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
    # Base models built into plain Hugging Face directories.
    "base_models": pa.schema([
        ("name", pa.string()),
        ("path", pa.string()),
        ("source", pa.string()),
        ("sha256", pa.string()),          # hash of the weights file
        ("num_parameters", pa.int64()),
        ("built_at", _TS),
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
