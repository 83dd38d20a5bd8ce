"""``factory.tracing.setup`` exports GenAI spans over OTLP/HTTP that normalize to the sample."""

from __future__ import annotations

import gzip
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

import factory.tracing
from factory.ingest import normalize_record
from factory.normalize import NormalizeError
from factory.normalize.canon import sample_id
from factory.normalize.otlp import merge_traces, split_otlp
from tests.ingest import conversations as conv


class _Receiver(BaseHTTPRequestHandler):
    received: list[tuple[str, dict[str, str], bytes]] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.received.append((self.path, {k.lower(): v for k, v in self.headers.items()}, body))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture()
def receiver() -> Iterator[tuple[str, list[tuple[str, dict[str, str], bytes]]]]:
    _Receiver.received = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", _Receiver.received
    finally:
        server.shutdown()
        server.server_close()


def _attrs(final: bool) -> dict[str, str]:
    a = conv.semconv_chat_attributes(final)
    return factory.tracing.chat_attributes(
        provider="openai", model="gpt-4o-mini",
        input_messages=json.loads(a["gen_ai.input.messages"]),
        output_messages=json.loads(a["gen_ai.output.messages"]),
        system_instructions=json.loads(a["gen_ai.system_instructions"]),
        tool_definitions=json.loads(a["gen_ai.tool.definitions"]))


def test_agent_spans_reach_the_receiver_and_normalize(receiver: Any) -> None:
    url, received = receiver
    provider = factory.tracing.setup(endpoint=url, service_name="weather-agent",
                                     set_global=False, batch=False)
    try:
        tracer = provider.get_tracer("test-agent")
        with tracer.start_as_current_span("invoke_agent weather"):
            with tracer.start_as_current_span("chat gpt-4o-mini", attributes=_attrs(False)):
                pass
            with tracer.start_as_current_span("execute_tool get_weather", attributes={
                    "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "get_weather"}):
                pass
            with tracer.start_as_current_span("chat gpt-4o-mini", attributes=_attrs(True)):
                pass
        assert provider.force_flush(10_000)
    finally:
        provider.shutdown()
    assert received and all(path == "/v1/traces" for path, _, _ in received)
    records = []
    for _, headers, body in received:
        records += split_otlp(body, headers["content-type"], headers.get("content-encoding"))
    # One span per export (SimpleSpanProcessor); merged back per trace as a receiver would.
    assert len(records) == 4
    [trace] = merge_traces(records + records[:1])
    spans = trace["otlp_trace"]["spans"]
    assert len(spans) == 4 and spans[0]["resource"]["service.name"] == "weather-agent"
    [sample] = normalize_record(trace, "otlp")
    assert sample["sample_id"] == sample_id(conv.CANONICAL_MESSAGES, conv.CANONICAL_TOOLS)
    assert sample["model"] == "gpt-4o-mini" and sample["provider"] == "openai"


def test_split_otlp_accepts_gzip_and_refuses_what_it_cannot_read() -> None:
    body = gzip.compress(json.dumps(conv.otlp_export()).encode())
    [record] = split_otlp(body, "application/json", "gzip")
    assert normalize_record(record)[0]["sample_id"] == sample_id(conv.CANONICAL_MESSAGES,
                                                                 conv.CANONICAL_TOOLS)
    with pytest.raises(NormalizeError, match="invalid gzip"):
        split_otlp(body[:20], "application/json", "gzip")
    with pytest.raises(NormalizeError, match="Content-Type"):
        split_otlp(b"{}", "text/csv")
    with pytest.raises(NormalizeError, match="invalid OTLP protobuf"):
        split_otlp(b"\xff\xff\xff", "application/x-protobuf")
    with pytest.raises(ValueError, match="http"):
        factory.tracing.setup(endpoint="127.0.0.1:4318", set_global=False)
