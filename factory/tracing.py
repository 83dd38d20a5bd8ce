"""Send an agent's GenAI spans to the factory over OTLP/HTTP, in one call.

    import factory.tracing
    factory.tracing.setup(endpoint="http://127.0.0.1:8787", service_name="my-agent")

``setup`` configures the OpenTelemetry SDK (a ``TracerProvider`` with a batching OTLP/HTTP
protobuf exporter posting to ``<endpoint>/v1/traces``). Spans from any GenAI instrumentation
that follows the semantic conventions then reach the factory's receiver; ``chat_attributes``
builds those attributes for code that records its own model calls.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

DEFAULT_ENDPOINT = "http://127.0.0.1:8787"  # the `factory serve` default port


def setup(endpoint: str | None = None, *, service_name: str = "agent",
          headers: Mapping[str, str] | None = None, set_global: bool = True,
          batch: bool = True, capture_content: bool = True) -> Any:
    """Configure the OpenTelemetry SDK to export spans to the factory; returns the provider.

    ``endpoint``: the factory's base URL (default ``$FACTORY_URL`` or ``DEFAULT_ENDPOINT``).
    ``set_global``: install it as the process-wide provider (instrumentations use that one).
    ``batch``: export in the background (``False`` exports each span as it ends: for tests).
    ``capture_content``: ask instrumentations to record message content
    (``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT``), which the factory needs.
    """
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    base = (endpoint or os.environ.get("FACTORY_URL") or DEFAULT_ENDPOINT).rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise ValueError(f"endpoint must be an http(s) URL, got {base!r}")
    url = base if base.endswith("/v1/traces") else f"{base}/v1/traces"
    if capture_content:
        os.environ.setdefault("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "true")
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    exporter = OTLPSpanExporter(endpoint=url, headers=dict(headers or {}))
    provider.add_span_processor(BatchSpanProcessor(exporter) if batch
                                else SimpleSpanProcessor(exporter))
    if set_global:
        trace.set_tracer_provider(provider)
    return provider


def chat_attributes(*, provider: str, model: str, input_messages: Sequence[Mapping[str, Any]],
                    output_messages: Sequence[Mapping[str, Any]] = (),
                    system_instructions: Sequence[Mapping[str, Any]] | None = None,
                    tool_definitions: Sequence[Mapping[str, Any]] | None = None
                    ) -> dict[str, str]:
    """The GenAI semantic-convention attributes of one chat call (messages as JSON strings).

    Messages are semconv messages: ``{"role", "parts": [{"type": "text", "content": ...},
    {"type": "tool_call", "id", "name", "arguments"}, {"type": "tool_call_response", "id",
    "response"}, {"type": "blob", "modality": "image", "mime_type", "content": <base64>}]}``.
    """
    attrs = {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": provider,
        "gen_ai.request.model": model,
        "gen_ai.input.messages": json.dumps(list(input_messages), ensure_ascii=False),
    }
    if output_messages:
        attrs["gen_ai.output.messages"] = json.dumps(list(output_messages), ensure_ascii=False)
    if system_instructions:
        attrs["gen_ai.system_instructions"] = json.dumps(list(system_instructions),
                                                         ensure_ascii=False)
    if tool_definitions:
        attrs["gen_ai.tool.definitions"] = json.dumps(list(tool_definitions), ensure_ascii=False)
    return attrs
