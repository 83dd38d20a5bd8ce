"""One agent run exported in two OTLP requests is merged by the flusher into one sample."""

from __future__ import annotations

import copy
import json
from datetime import UTC, datetime
from pathlib import Path

from factory.gateway.flusher import merge_otel_records
from factory.ingest import RawRecord, ingest_records, normalize_record
from factory.lake import Lake
from factory.normalize.otlp import split_otlp
from tests.ingest import conversations as conv


def _records(export: dict[str, object]) -> list[RawRecord]:
    now = datetime.now(tz=UTC)
    return [RawRecord(payload=r, source="otel", received_at=now, tags={}, format_hint="otlp")
            for r in split_otlp(json.dumps(export).encode(), "application/json")]


def test_two_exports_of_one_trace_make_one_sample(factory_home: Path) -> None:
    whole = conv.otlp_export()
    first, second = copy.deepcopy(whole), copy.deepcopy(whole)
    spans = whole["resourceSpans"][0]["scopeSpans"][0]["spans"]  # type: ignore[index]
    first["resourceSpans"][0]["scopeSpans"][0]["spans"] = spans[:2]  # type: ignore[index]
    second["resourceSpans"][0]["scopeSpans"][0]["spans"] = spans[2:]  # type: ignore[index]

    separate = _records(first) + _records(second)
    merged = merge_otel_records(separate)
    assert len(separate) == 2 and len(merged) == 1

    lake = Lake()
    ingest_records(lake, merged)
    [row] = lake.read("samples").to_pylist()
    [whole_record] = split_otlp(json.dumps(whole).encode(), "application/json")
    assert [row["sample_id"]] == [c["sample_id"] for c in normalize_record(whole_record, "otlp")]


def test_records_of_other_traces_and_providers_pass_through(factory_home: Path) -> None:
    a = _records(conv.otlp_export(trace_id="a" * 32))
    b = _records(conv.otlp_export(trace_id="b" * 32))
    proxy = RawRecord(payload=conv.openai_call(), source="proxy",
                      received_at=datetime.now(tz=UTC), tags={})
    out = merge_otel_records(a + [proxy] + b)
    assert [r.source for r in out] == ["otel", "proxy", "otel"]
    assert out[0].payload == a[0].payload and out[2].payload == b[0].payload
