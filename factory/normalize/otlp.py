"""OTLP traces: decoding (protobuf and JSON, gzip) and GenAI spans into canonical conversations.

``split_otlp`` turns one OTLP/HTTP export body into one JSON-able record per trace:
``{"otlp_trace": {"trace_id", "spans": [{"span_id", "parent_span_id", "name", "kind",
"start_time_unix_nano", "end_time_unix_nano", "attributes", "events", "status", "resource",
"scope"}]}}`` with attribute values as plain JSON. ``normalize`` reads the OpenTelemetry GenAI
semantic conventions from those spans: the structured ``gen_ai.input.messages``,
``gen_ai.output.messages``, ``gen_ai.system_instructions`` and ``gen_ai.tool.definitions``; the
older indexed ``gen_ai.prompt.N.*``/``gen_ai.completion.N.*`` (with ``llm.request.functions.N.*``);
and the ``gen_ai.*.message``/``gen_ai.choice`` span events. Each chat span yields the
conversation it saw plus its output; within a trace, a conversation that is a strict prefix of
another is dropped.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import zlib
from typing import Any

from factory.normalize import openai as openai_fmt
from factory.normalize.canon import (
    NormalizeError,
    expect_dict,
    expect_list,
    finish,
    kind,
    text_part,
    tool_call,
    tool_def,
    tool_message,
    tool_result_parts,
    turn_messages,
    unix_time,
)
from factory.normalize.images import inline_image, url_image

_MAX_BODY = 256 << 20  # a decompressed export larger than this is refused, not buffered
_HEX = re.compile(r"^[0-9a-fA-F]*$")
_INDEXED = re.compile(r"^gen_ai\.(prompt|completion)\.(\d+)\.(.+)$")
_FUNCTIONS = re.compile(r"^llm\.request\.functions\.(\d+)\.(name|description|parameters)$")
_MESSAGE_EVENTS = {"gen_ai.system.message": "system", "gen_ai.user.message": "user",
                   "gen_ai.assistant.message": "assistant", "gen_ai.tool.message": "tool"}
_SPAN_KINDS = {"SPAN_KIND_UNSPECIFIED": 0, "SPAN_KIND_INTERNAL": 1, "SPAN_KIND_SERVER": 2,
               "SPAN_KIND_CLIENT": 3, "SPAN_KIND_PRODUCER": 4, "SPAN_KIND_CONSUMER": 5}


# -- decoding ------------------------------------------------------------------------------------
def split_otlp(body: bytes, content_type: str,
               content_encoding: str | None = None) -> list[dict[str, Any]]:
    """One OTLP/HTTP export body (protobuf or JSON, optionally gzip) -> one record per trace.

    Raises ``NormalizeError`` when the body cannot be decoded.
    """
    encoding = (content_encoding or "").strip().lower()
    if encoding in ("gzip", "x-gzip") or body[:2] == b"\x1f\x8b":
        try:
            body = _gunzip(body)
        except (OSError, EOFError, zlib.error) as exc:
            raise NormalizeError(f"body: invalid gzip data ({exc})") from None
    elif encoding not in ("", "identity"):
        raise NormalizeError(f"Content-Encoding: unsupported {content_encoding!r} (gzip only)")
    ctype = (content_type or "").split(";", 1)[0].strip().lower()
    if ctype in ("application/x-protobuf", "application/protobuf", "application/octet-stream"):
        return _split_protobuf(body)
    if ctype in ("application/json", "text/json", ""):
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError) as bad:  # its own name (compiled: one type each)
            raise NormalizeError(f"body: invalid JSON ({bad})") from None
        return split_otlp_json(obj)
    raise NormalizeError(f"Content-Type: unsupported {content_type!r} "
                         f"(application/x-protobuf or application/json)")


def _gunzip(body: bytes) -> bytes:
    decomp = zlib.decompressobj(16 + zlib.MAX_WBITS)
    out = decomp.decompress(body, _MAX_BODY + 1)
    if len(out) > _MAX_BODY or decomp.unconsumed_tail:
        raise OSError(f"decompressed body is larger than {_MAX_BODY >> 20} MiB")
    if not decomp.eof:
        raise EOFError("gzip stream is truncated")
    return out


def is_otlp_export(value: Any) -> bool:
    """Whether ``value`` is an OTLP ``ExportTraceServiceRequest`` in JSON."""
    return isinstance(value, dict) and ("resourceSpans" in value or "resource_spans" in value)


def _pick(obj: dict[str, Any], camel: str, snake: str, default: Any = None) -> Any:
    if camel in obj:
        return obj[camel]
    return obj.get(snake, default)


def split_otlp_json(obj: Any) -> list[dict[str, Any]]:
    """An OTLP JSON export (``{"resourceSpans": [...]}``) -> one record per trace."""
    obj = expect_dict(obj, "body")
    if not is_otlp_export(obj):
        raise NormalizeError("resourceSpans: missing (not an OTLP trace export)")
    traces: dict[str, list[dict[str, Any]]] = {}
    for i, rs in enumerate(expect_list(_pick(obj, "resourceSpans", "resource_spans"),
                                       "resourceSpans")):
        at = f"resourceSpans[{i}]"
        rs = expect_dict(rs, at)
        resource = _attrs_json(expect_dict(rs.get("resource") or {}, f"{at}.resource")
                               .get("attributes"), f"{at}.resource.attributes")
        for j, ss in enumerate(expect_list(_pick(rs, "scopeSpans", "scope_spans", []),
                                           f"{at}.scopeSpans")):
            sat = f"{at}.scopeSpans[{j}]"
            ss = expect_dict(ss, sat)
            scope = expect_dict(ss.get("scope") or {}, f"{sat}.scope")
            scope_info = {"name": scope.get("name", ""), "version": scope.get("version", "")}
            for k, span in enumerate(expect_list(ss.get("spans", []), f"{sat}.spans")):
                spat = f"{sat}.spans[{k}]"
                span = expect_dict(span, spat)
                trace_id = _id_json(_pick(span, "traceId", "trace_id"), f"{spat}.traceId")
                kind_ = span.get("kind", 0)
                if isinstance(kind_, str):
                    kind_ = _SPAN_KINDS.get(kind_, 0)
                status = expect_dict(span.get("status") or {}, f"{spat}.status")
                traces.setdefault(trace_id, []).append({
                    "span_id": _id_json(_pick(span, "spanId", "span_id"), f"{spat}.spanId"),
                    "parent_span_id": _id_json(_pick(span, "parentSpanId", "parent_span_id"),
                                               f"{spat}.parentSpanId", optional=True),
                    "name": span.get("name", ""),
                    "kind": kind_ if isinstance(kind_, int) else 0,
                    "start_time_unix_nano": _nanos(_pick(span, "startTimeUnixNano",
                                                         "start_time_unix_nano")),
                    "end_time_unix_nano": _nanos(_pick(span, "endTimeUnixNano",
                                                       "end_time_unix_nano")),
                    "attributes": _attrs_json(span.get("attributes"), f"{spat}.attributes"),
                    "events": [
                        {"name": expect_dict(ev, f"{spat}.events[{e}]").get("name", ""),
                         "time_unix_nano": _nanos(_pick(ev, "timeUnixNano", "time_unix_nano")),
                         "attributes": _attrs_json(ev.get("attributes"),
                                                   f"{spat}.events[{e}].attributes")}
                        for e, ev in enumerate(expect_list(span.get("events") or [],
                                                           f"{spat}.events"))],
                    "status": {"code": status.get("code", 0), "message": status.get("message", "")},
                    "resource": resource,
                    "scope": scope_info,
                })
    return [{"otlp_trace": {"trace_id": tid, "spans": spans}} for tid, spans in traces.items()]


def merge_traces(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per-trace records from several exports, merged per trace id (spans deduped by id).

    Exporters batch by time, not by trace, so one agent run usually arrives in several
    requests; a receiver buffers them and merges before ingest, so prefix dropping sees the
    whole run.
    """
    merged: dict[str, dict[str, dict[str, Any]]] = {}
    for i, record in enumerate(records):
        trace = expect_dict(expect_dict(record, f"records[{i}]").get("otlp_trace"),
                            f"records[{i}].otlp_trace")
        spans = merged.setdefault(str(trace.get("trace_id")), {})
        for span in expect_list(trace.get("spans"), f"records[{i}].otlp_trace.spans"):
            spans.setdefault(str(expect_dict(span, "span").get("span_id")), span)
    return [{"otlp_trace": {"trace_id": tid, "spans": list(spans.values())}}
            for tid, spans in merged.items()]


def _nanos(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return 0


def _id_json(value: Any, where: str, optional: bool = False) -> str:
    """A trace/span id as lower-case hex (OTLP JSON uses hex; protobuf-JSON mapping base64)."""
    if value in (None, ""):
        if optional:
            return ""
        raise NormalizeError(f"{where}: missing")
    if not isinstance(value, str):
        raise NormalizeError(f"{where}: expected a hex string, got {kind(value)}")
    if _HEX.match(value) and len(value) in (16, 32):
        return value.lower()
    try:
        return base64.b64decode(value, validate=True).hex()
    except (binascii.Error, ValueError):
        raise NormalizeError(f"{where}: neither hex nor base64") from None


def _attrs_json(attrs: Any, where: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i, kv in enumerate(expect_list(attrs or [], where)):
        kv = expect_dict(kv, f"{where}[{i}]")
        key = kv.get("key")
        if not isinstance(key, str):
            raise NormalizeError(f"{where}[{i}].key: expected a string")
        out[key] = _any_json(kv.get("value"), f"{where}[{i}].value")
    return out


def _any_json(value: Any, where: str) -> Any:
    if value is None:
        return None
    value = expect_dict(value, where)
    if not value:
        return None
    if (v := _pick(value, "stringValue", "string_value")) is not None:
        return v
    if (v := _pick(value, "boolValue", "bool_value")) is not None:
        return bool(v)
    if (v := _pick(value, "intValue", "int_value")) is not None:
        try:
            return int(v)
        except (TypeError, ValueError):
            raise NormalizeError(f"{where}.intValue: not an integer") from None
    if (v := _pick(value, "doubleValue", "double_value")) is not None:
        if not isinstance(v, int | float | str):
            raise NormalizeError(f"{where}.doubleValue: not a number")
        try:
            return float(v)
        except ValueError:
            raise NormalizeError(f"{where}.doubleValue: not a number") from None
    if (v := _pick(value, "arrayValue", "array_value")) is not None:
        items = expect_dict(v, f"{where}.arrayValue").get("values") or []
        return [_any_json(x, f"{where}.arrayValue.values[{i}]")
                for i, x in enumerate(expect_list(items, f"{where}.arrayValue.values"))]
    if (v := _pick(value, "kvlistValue", "kvlist_value")) is not None:
        return _attrs_json(expect_dict(v, f"{where}.kvlistValue").get("values"),
                           f"{where}.kvlistValue.values")
    if (v := _pick(value, "bytesValue", "bytes_value")) is not None:
        return v if isinstance(v, str) else None
    raise NormalizeError(f"{where}: unknown AnyValue (has {', '.join(sorted(value))})")


def _split_protobuf(body: bytes) -> list[dict[str, Any]]:
    from google.protobuf.message import DecodeError
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    try:
        req = ExportTraceServiceRequest.FromString(body)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise NormalizeError(f"body: invalid OTLP protobuf ({exc})") from None
    traces: dict[str, list[dict[str, Any]]] = {}
    for rs in req.resource_spans:
        resource = _attrs_pb(rs.resource.attributes)
        for ss in rs.scope_spans:
            scope = {"name": ss.scope.name, "version": ss.scope.version}
            for span in ss.spans:
                traces.setdefault(span.trace_id.hex(), []).append({
                    "span_id": span.span_id.hex(),
                    "parent_span_id": span.parent_span_id.hex(),
                    "name": span.name,
                    "kind": int(span.kind),
                    "start_time_unix_nano": int(span.start_time_unix_nano),
                    "end_time_unix_nano": int(span.end_time_unix_nano),
                    "attributes": _attrs_pb(span.attributes),
                    "events": [{"name": ev.name, "time_unix_nano": int(ev.time_unix_nano),
                                "attributes": _attrs_pb(ev.attributes)} for ev in span.events],
                    "status": {"code": int(span.status.code), "message": span.status.message},
                    "resource": resource,
                    "scope": scope,
                })
    return [{"otlp_trace": {"trace_id": tid, "spans": spans}} for tid, spans in traces.items()]


def _attrs_pb(attrs: Any) -> dict[str, Any]:
    return {kv.key: _any_pb(kv.value) for kv in attrs}


def _any_pb(value: Any) -> Any:
    which = value.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [_any_pb(v) for v in value.array_value.values]
    if which == "kvlist_value":
        return _attrs_pb(value.kvlist_value.values)
    if which == "bytes_value":
        return base64.b64encode(value.bytes_value).decode("ascii")
    return getattr(value, which)


# -- normalization -------------------------------------------------------------------------------
def normalize(payload: Any) -> list[dict[str, Any]]:
    """The conversations of one trace record (or of a whole OTLP JSON export)."""
    if is_otlp_export(payload):
        traces = split_otlp_json(payload)
        if not traces:
            raise NormalizeError("resourceSpans: the export holds no spans")
        return [conv for trace in traces for conv in normalize(trace)]
    body = expect_dict(payload, "record")
    trace = expect_dict(body.get("otlp_trace"), "otlp_trace")
    spans = expect_list(trace.get("spans"), "otlp_trace.spans")
    indexed = []
    for i, span in enumerate(spans):
        span = expect_dict(span, f"otlp_trace.spans[{i}]")
        start = span.get("start_time_unix_nano")
        indexed.append((start if isinstance(start, int) else 0, i, span))
    indexed.sort(key=lambda t: (t[0], t[1]))
    convs: list[dict[str, Any]] = []
    for _, i, span in indexed:
        convs += _span_conversations(span, f"otlp_trace.spans[{i}]")
    if not convs:
        raise NormalizeError("otlp_trace.spans: no span carries GenAI messages "
                             "(gen_ai.input.messages, gen_ai.prompt.N.*, or gen_ai.*.message "
                             "events)")
    return _drop_prefixes(convs)


def _drop_prefixes(convs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Drop each conversation that is a strict prefix of (or equal to an earlier) another."""
    keep = []
    for i, conv in enumerate(convs):
        n = len(conv["messages"])
        dominated = False
        for j, other in enumerate(convs):
            if i == j or other["tools_json"] != conv["tools_json"]:
                continue
            m = len(other["messages"])
            if (m > n and other["messages"][:n] == conv["messages"]) or (
                    j < i and other["sample_id"] == conv["sample_id"]):
                dominated = True
                break
        if not dominated:
            keep.append(conv)
    return keep


def _json_attr(value: Any, where: str) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            raise NormalizeError(f"{where}: not valid JSON") from None
    return value


def _span_conversations(span: dict[str, Any], where: str) -> list[dict[str, Any]]:
    attrs = expect_dict(span.get("attributes") or {}, f"{where}.attributes")
    events = expect_list(span.get("events") or [], f"{where}.events")
    # Newer instrumentations put the structured attributes on an event instead of the span.
    structured = dict(attrs)
    for e, event in enumerate(events):
        event = expect_dict(event, f"{where}.events[{e}]")
        ev_attrs = expect_dict(event.get("attributes") or {}, f"{where}.events[{e}].attributes")
        for key in ("gen_ai.input.messages", "gen_ai.output.messages",
                    "gen_ai.system_instructions", "gen_ai.tool.definitions"):
            if key in ev_attrs and key not in structured:
                structured[key] = ev_attrs[key]
    model = attrs.get("gen_ai.response.model") or attrs.get("gen_ai.request.model")
    provider = attrs.get("gen_ai.provider.name") or attrs.get("gen_ai.system")
    meta = {"provider": provider if isinstance(provider, str) else None,
            "model": model if isinstance(model, str) else None,
            "created_at": unix_time(span.get("end_time_unix_nano", 0) / 1e9
                                    if isinstance(span.get("end_time_unix_nano"), int) else None)}
    blobs: dict[str, bytes] = {}
    if "gen_ai.input.messages" in structured or "gen_ai.output.messages" in structured:
        return _structured(structured, where, blobs, meta)
    if any(_INDEXED.match(k) for k in attrs):
        return _indexed(attrs, where, blobs, meta)
    if any(isinstance(ev, dict) and (ev.get("name") in _MESSAGE_EVENTS
                                     or ev.get("name") == "gen_ai.choice") for ev in events):
        return _from_events(attrs, events, where, blobs, meta)
    return []


def _tools_from(value: Any, where: str) -> list[dict[str, Any]]:
    out = []
    for i, tool in enumerate(expect_list(_json_attr(value, where), where)):
        at = f"{where}[{i}]"
        tool = expect_dict(tool, at)
        if isinstance(tool.get("function"), dict):
            tool, at = tool["function"], f"{at}.function"
        params = tool.get("parameters")
        if params is None:
            params = tool.get("input_schema")
        out.append(tool_def(tool.get("name"), tool.get("description"), params, at))
    return out


def _structured(attrs: dict[str, Any], where: str, blobs: dict[str, bytes],
                meta: dict[str, Any]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if "gen_ai.system_instructions" in attrs:
        at = f"{where}.attributes[gen_ai.system_instructions]"
        parts = _parts(_json_attr(attrs["gen_ai.system_instructions"], at), at, blobs, "system")
        messages.append({"role": "system", "content": parts[0]})
    in_at = f"{where}.attributes[gen_ai.input.messages]"
    for i, msg in enumerate(expect_list(_json_attr(attrs.get("gen_ai.input.messages", []),
                                                   in_at), in_at)):
        messages += _message(msg, f"{in_at}[{i}]", blobs)
    tools: list[dict[str, Any]] = []
    if "gen_ai.tool.definitions" in attrs:
        tools = _tools_from(attrs["gen_ai.tool.definitions"],
                            f"{where}.attributes[gen_ai.tool.definitions]")
    out_at = f"{where}.attributes[gen_ai.output.messages]"
    outputs = expect_list(_json_attr(attrs.get("gen_ai.output.messages", []), out_at), out_at)
    if not outputs:
        return [finish(messages, tools, blobs=blobs, where=in_at, **meta)]
    convs = []
    for i, msg in enumerate(outputs):
        reply = _message(msg, f"{out_at}[{i}]", blobs)
        convs.append(finish(messages + reply, tools, blobs=blobs, where=out_at, **meta))
    return convs


def _message(msg: Any, at: str, blobs: dict[str, bytes]) -> list[dict[str, Any]]:
    msg = expect_dict(msg, at)
    role = msg.get("role")
    if role not in ("system", "user", "assistant", "tool"):
        raise NormalizeError(f"{at}.role: unknown role {role!r}")
    content, calls, results = _parts(msg.get("parts"), f"{at}.parts", blobs, role)
    if role == "tool":
        if content:
            raise NormalizeError(f"{at}.parts: a tool message holds only tool_call_response parts")
        return list(results)
    return turn_messages(role, results, content, calls)


def _parts(parts: Any, where: str, blobs: dict[str, bytes],
           role: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """(content parts, tool calls, tool messages) of a semconv ``parts`` list."""
    content: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for k, part in enumerate(expect_list(parts, where)):
        at = f"{where}[{k}]"
        part = expect_dict(part, at)
        ptype = part.get("type")
        if ptype == "text":
            content.append(text_part(part.get("content"), f"{at}.content"))
        elif ptype == "reasoning":
            content.append({"type": "reasoning",
                            "text": text_part(part.get("content"), f"{at}.content")["text"]})
        elif ptype == "tool_call":
            if role != "assistant":
                raise NormalizeError(f"{at}.type: tool_call parts belong to assistant messages")
            calls.append(tool_call(part.get("id"), part.get("name"), part.get("arguments"), at))
        elif ptype == "tool_call_response":
            result = part.get("response", part.get("result"))
            results.append(tool_message(part.get("id"), None, tool_result_parts(
                result if result is not None else "")))
        elif ptype in ("blob", "uri"):
            modality = part.get("modality")
            mime = part.get("mime_type")
            if modality not in (None, "image") or (isinstance(mime, str)
                                                   and not mime.startswith("image/")):
                raise NormalizeError(f"{at}.modality: only images are supported, got "
                                     f"{modality or mime!r}")
            if ptype == "blob":
                content.append(inline_image(part.get("content"), mime, f"{at}.content", blobs))
            else:
                content.append(url_image(part.get("uri"), mime, f"{at}.uri", blobs))
        else:
            raise NormalizeError(f"{at}.type: unsupported part type {ptype!r}")
    return content, calls, results


def _indexed(attrs: dict[str, Any], where: str, blobs: dict[str, bytes],
             meta: dict[str, Any]) -> list[dict[str, Any]]:
    """The older flat attributes: gen_ai.prompt.N.role/content/tool_calls.M.* and completions."""
    groups: dict[str, dict[int, dict[str, Any]]] = {"prompt": {}, "completion": {}}
    for key, value in attrs.items():
        match = _INDEXED.match(key)
        if match:
            groups[match.group(1)].setdefault(int(match.group(2)), {})[match.group(3)] = value
    prompt = [_flat_message(groups["prompt"][i], f"{where}.attributes[gen_ai.prompt.{i}]")
              for i in sorted(groups["prompt"])]
    tools_raw: dict[int, dict[str, Any]] = {}
    for key, value in attrs.items():
        match = _FUNCTIONS.match(key)
        if match:
            tools_raw.setdefault(int(match.group(1)), {})[match.group(2)] = value
    tools = [tool_def(t.get("name"), t.get("description"), t.get("parameters"),
                      f"{where}.attributes[llm.request.functions.{i}]")
             for i, t in sorted(tools_raw.items())]
    if "gen_ai.tool.definitions" in attrs:
        tools += _tools_from(attrs["gen_ai.tool.definitions"],
                             f"{where}.attributes[gen_ai.tool.definitions]")
    at = f"{where}.attributes[gen_ai.prompt]"
    messages = openai_fmt.convert_messages(prompt, blobs, where=at)
    completions = [_flat_message(groups["completion"][i],
                                 f"{where}.attributes[gen_ai.completion.{i}]", "assistant")
                   for i in sorted(groups["completion"])]
    if not completions:
        return [finish(messages, tools, blobs=blobs, where=at, **meta)]
    cat = f"{where}.attributes[gen_ai.completion]"
    return [finish(messages + openai_fmt.convert_messages([c], blobs, where=cat), tools,
                   blobs=blobs, where=cat, **meta) for c in completions]


def _flat_message(fields: dict[str, Any], where: str, default_role: str = "user") -> dict[str, Any]:
    """An OpenAI-shaped message from ``role``/``content``/``tool_calls.M.*`` fields."""
    msg: dict[str, Any] = {"role": fields.get("role") or default_role}
    content = fields.get("content")
    if isinstance(content, str) and content.lstrip().startswith("["):
        try:
            parsed = json.loads(content)
        except ValueError:
            parsed = None
        if isinstance(parsed, list) and all(isinstance(p, dict) and "type" in p for p in parsed):
            content = parsed
    msg["content"] = content
    if fields.get("tool_call_id") is not None:
        msg["tool_call_id"] = fields["tool_call_id"]
    calls: dict[int, dict[str, Any]] = {}
    for key, value in fields.items():
        match = re.match(r"^tool_calls\.(\d+)\.(id|name|arguments)$", key)
        if match:
            calls.setdefault(int(match.group(1)), {})[match.group(2)] = value
    if calls:
        msg["tool_calls"] = [{"id": c.get("id"), "type": "function",
                              "function": {"name": c.get("name"), "arguments": c.get("arguments")}}
                             for _, c in sorted(calls.items())]
    if msg["role"] == "tool" and "tool_call_id" not in msg:
        raise NormalizeError(f"{where}.tool_call_id: missing on a tool message")
    return msg


def _from_events(attrs: dict[str, Any], events: list[Any], where: str, blobs: dict[str, bytes],
                 meta: dict[str, Any]) -> list[dict[str, Any]]:
    """The span-event form: gen_ai.{system,user,assistant,tool}.message and gen_ai.choice."""
    prompt: list[dict[str, Any]] = []
    choices: list[dict[str, Any]] = []
    for e, event in enumerate(events):
        at = f"{where}.events[{e}]"
        name = event.get("name")
        body = expect_dict(event.get("attributes") or {}, f"{at}.attributes")
        if isinstance(body.get("gen_ai.event.content"), str):
            body = expect_dict(_json_attr(body["gen_ai.event.content"], f"{at}.content"),
                               f"{at}.content")
        if isinstance(name, str) and name in _MESSAGE_EVENTS:
            msg: dict[str, Any] = {"role": body.get("role") or _MESSAGE_EVENTS[name],
                                   "content": _json_content(body.get("content"))}
            if body.get("tool_calls") is not None:
                msg["tool_calls"] = _json_attr(body["tool_calls"], f"{at}.tool_calls")
            if msg["role"] == "tool":
                msg["tool_call_id"] = body.get("id", body.get("tool_call_id"))
            prompt.append(msg)
        elif name == "gen_ai.choice":
            message = _json_attr(body.get("message", {}), f"{at}.message")
            message = dict(expect_dict(message, f"{at}.message"))
            message.setdefault("role", "assistant")
            message["content"] = _json_content(message.get("content"))
            choices.append(message)
    tools: list[dict[str, Any]] = []
    if "gen_ai.tool.definitions" in attrs:
        tools = _tools_from(attrs["gen_ai.tool.definitions"],
                            f"{where}.attributes[gen_ai.tool.definitions]")
    at = f"{where}.events"
    messages = openai_fmt.convert_messages(prompt, blobs, where=at)
    if not choices:
        return [finish(messages, tools, blobs=blobs, where=at, **meta)]
    return [finish(messages + openai_fmt.convert_messages([c], blobs, where=f"{at}[gen_ai.choice]"),
                   tools, blobs=blobs, where=at, **meta) for c in choices]


def _json_content(content: Any) -> Any:
    if isinstance(content, str) and content.lstrip().startswith("["):
        try:
            parsed = json.loads(content)
        except ValueError:
            return content
        if isinstance(parsed, list) and all(isinstance(p, dict) and "type" in p for p in parsed):
            return parsed
    return content


