"""Records to table rows: the per-record work of an ingest, the part a worker process runs.

The pipeline (``factory.ingest.pipeline``) decides what is written (dedupe, batching,
commits); this module does the expensive part that needs no lake: parsing JSON Lines, the
content hash, format detection, normalization and the canonical JSON of each sample. It
imports neither the lake nor pyiceberg, so a worker process that imports it starts fast.
``process_lines`` is what a worker runs on a block of lines; the records handed in by a caller
go through the same functions, so both give the same rows.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import orjson

from factory import native
from factory.blobs import BlobStore
from factory.ingest.dedupe import known_mask
from factory.normalize.canon import (
    NormalizeError,
    canonical_json,
    canonical_json_strings,
    content_hash,
    sha256_hex,
    unix_time,
)
from factory.normalize.detect import detect_format, normalize_record
from factory.normalize.otlp import is_otlp_export, split_otlp_json

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger(__name__)

SampleRow = tuple[Any, ...]
"""(sample_id, provider, model, messages, tools, num_turns, has_images, has_tool_calls,
created_at): the columns of a ``samples`` row that come from the conversation itself."""

LineResult = tuple[int, str, str | None, str, str | None, list[SampleRow] | None]
"""One record of a chunk of lines: (line index in the chunk, raw_trace_id, text, format,
rejection reason, sample rows). ``text`` None: the line itself is the record's text. Sample
rows None with no reason: not normalized because the id may already be in the lake (the caller
normalizes it if it turns out not to be)."""


def parse_json(text: str | bytes) -> Any:
    """``orjson.loads``, falling back to ``json.loads`` for what only it accepts."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        # orjson refuses integers beyond 64 bits, which the JSON grammar allows.
        return json.loads(text)


def first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def id_and_text(payload: Any) -> tuple[str, str]:
    """(raw_trace_id, stored text) of a parsed record that came without its own text."""
    try:
        # One dump for both (what content_hash and canonical_json_strings each write).
        data = orjson.dumps(payload, option=orjson.OPT_SORT_KEYS)
    except (TypeError, orjson.JSONEncodeError):
        pass
    else:
        return hashlib.sha256(data).hexdigest(), data.decode("utf-8")
    try:
        return content_hash(payload), canonical_json_strings(payload)
    except NormalizeError:  # not JSON-able (a caller bug): keep a readable trace of it
        text = repr(payload)
        return sha256_hex(text), text


def id_of(payload: Any, text: str | bytes) -> str:
    """The raw_trace_id of a parsed record whose text is known (the content hash)."""
    try:
        return content_hash(payload)
    except NormalizeError:
        return sha256_hex(text if isinstance(text, str) else text.decode("utf-8", "replace"))


def sample_row(conv: dict[str, Any]) -> SampleRow:
    """The conversation's own ``samples`` columns (see ``SampleRow``)."""
    messages_json = conv.get("messages_json") or canonical_json(conv["messages"])
    tools_json = conv.get("tools_json") or canonical_json(conv["tools"])
    if "num_turns" in conv:  # counted by canon.finish as it built the messages
        return (conv["sample_id"], conv.get("provider"), conv.get("model"), messages_json,
                tools_json, conv["num_turns"], conv["has_images"], conv["has_tool_calls"],
                conv.get("created_at"))
    # Read off the canonical JSON instead of walking the messages again: in compact JSON a
    # quote inside a string is always escaped, so these only match the structure itself.
    return (conv["sample_id"], conv.get("provider"), conv.get("model"), messages_json,
            tools_json, messages_json.count('"role":"assistant"'),
            '"type":"image"' in messages_json, '"tool_calls":' in messages_json,
            conv.get("created_at"))


def outcome(payload: Any, fmt: str,
            blobs: BlobStore | None) -> tuple[str | None, list[SampleRow]]:
    """(rejection reason, sample rows) of one parsed record; never raises for bad input.

    The images of an accepted record are written to ``blobs`` (content-addressed, so writing
    one twice stores it once).
    """
    try:
        convs = normalize_record(payload, fmt if fmt != "unknown" else "auto")
    except NormalizeError as exc:
        return exc.reason, []
    except RecursionError:
        return "record: nested too deeply to normalize", []
    except Exception as bug:  # a normalizer bug quarantines one record, not a batch
        return f"normalizer failed ({type(bug).__name__}: {bug})", []
    rows = []
    for conv in convs:
        if blobs is not None:
            for digest, data in conv.get("blobs", {}).items():
                blobs.put(data, digest)
        rows.append(sample_row(conv))
    return None, rows


def _load_fast() -> tuple[Callable[[bytes], tuple[Any, ...] | None] | None, bool]:
    """(what of ``factory.normalize._fastpath`` reads a line, whether that applies the rules):
    ``fast_record`` while the Python rules are those it was verified against, else
    ``merge_stream`` where ``FACTORY_FASTPATH=streams`` asks for it, else None; None too where
    the C module is not built or the build is stale (``factory.native``)."""
    mode = native.fastpath()
    if mode not in ("rules", "streams"):
        if native.status() == "compiled":
            log.warning("the C fast path is not used, %s: the ingest runs every rule in "
                        "Python (slower)", mode.removeprefix("off "))
        return None, False
    try:
        module = importlib.import_module("factory.normalize._fastpath")
    except ImportError:
        return None, False
    if mode == "streams":
        return module.merge_stream, False
    return module.fast_record, True


_FAST, _FAST_RULES = _load_fast()


def fast_outcome(line: bytes, format_hint: str,
                 blobs: BlobStore | None) -> tuple[str, str, list[SampleRow]] | None:
    """(raw_trace_id, format, sample rows) of a record read by the C module
    (``factory.normalize._fastpath``), or None: it is not built, the line is not one of the
    records it reads, or it is not sure to give what the Python path gives (the caller then
    reads the line itself).

    - A logged OpenAI, Anthropic or Gemini call, or an OpenAI fine-tuning line, in the common
      shape (text, reasoning, tool calls and results, function tools, one choice) is
      normalized in C: only its row is built here.
    - A streamed OpenAI call is read with the text-only chunks of its stream merged (the same
      response, without a Python object per token) and normalized here as usual; kept only
      when accepted, since a rejection's reason names a chunk by its place in the stream as it
      came.
    """
    if _FAST is None:
        return None
    found = _FAST(line)
    if found is None:
        return None
    if found[0] == "stream":
        canonical, collapsed = found[1], found[2]
        try:
            value = orjson.loads(collapsed)
        except orjson.JSONDecodeError:  # (valid JSON by construction: only to be safe)
            return None
        if is_otlp_export(value):
            return None
        fmt = format_hint if format_hint != "auto" else detect_format(value)
        if fmt != "openai":
            return None
        reason, rows = outcome(value, fmt, blobs)
        if reason is not None:
            return None
        return hashlib.sha256(canonical).hexdigest(), fmt, rows
    canonical, messages, tools = found[1], found[2], found[3]
    model, created, turns, calls, provider = found[4], found[5], found[6], found[7], found[8]
    if format_hint not in ("auto", provider):
        return None
    digest = hashlib.sha256(b'{"messages":')  # as canon.finish hashes it
    digest.update(messages)
    digest.update(b',"tools":')
    digest.update(tools)
    digest.update(b"}")
    created_at = unix_time(orjson.loads(created)) if isinstance(created, bytes) else None
    row = (digest.hexdigest(), provider, model, messages.decode("utf-8"),
           tools.decode("utf-8"), turns, False, calls != 0, created_at)
    return hashlib.sha256(canonical).hexdigest(), provider, [row]


LineError = tuple[int, str, str, str]
"""A line that is not JSON: (line index in the chunk, raw_trace_id, text, parse error)."""


def invalid_json_reason(name: str, lineno: int, error: str) -> str:
    """The rejection reason of a line that is not JSON."""
    return f"{name}:{lineno}: invalid JSON ({error})"


def process_lines(lines: Sequence[bytes], *, name: str, first_lineno: int, format_hint: str,
                  known: Sequence[np.ndarray] = (), blobs: BlobStore | None = None,
                  line_errors: list[LineError] | None = None) -> list[LineResult]:
    """Every record of a chunk of JSON Lines, in order (see ``LineResult``).

    A line that is not JSON is a record rejected with its file name and line number (or,
    with ``line_errors``, put there for a caller that numbers the lines itself); an OTLP
    export on one line is one record per trace. Records whose id may be in ``known`` are not
    normalized (re-ingesting a file then costs little more than hashing it).
    """
    # With nothing known, each line is normalized as soon as it is parsed: holding a chunk's
    # parsed records alive until a vectorized check made parsing cost 2.5x as much (allocator
    # and cache misses). With known ids, lines are parsed twice instead: to hash, and to
    # normalize the ones that are new.
    check = any(len(a) for a in known)
    out: list[Any] = []
    traces: dict[int, Any] = {}  # the split OTLP traces to normalize, by position in ``out``
    for index, line in enumerate(lines):
        stripped = line.strip()
        if not stripped:
            continue
        # The C fast path, for the lines that look like what it reads (a logged call, a
        # fine-tuning line; a cheap test, not a rule: it decides, and other lines would cost
        # it a parse for nothing). Not on a re-ingest, which hashes before it normalizes.
        if not check and _FAST is not None and (
                (b'"request"' in stripped or stripped.startswith(b'{"messages"'))
                if _FAST_RULES else b'"stream"' in stripped):
            fast = fast_outcome(stripped, format_hint, blobs)
            if fast is not None:
                out.append((index, fast[0], None, fast[1], None, fast[2]))
                continue
        try:
            value = parse_json(stripped)
        except (ValueError, RecursionError) as exc:
            text = stripped.decode("utf-8", "replace")
            if line_errors is not None:
                line_errors.append((index, sha256_hex(text), text, first_line(exc)))
            else:
                reason = invalid_json_reason(name, first_lineno + index, first_line(exc))
                out.append((index, sha256_hex(text), text, "unknown", reason, []))
            continue
        if is_otlp_export(value):
            try:
                split = split_otlp_json(value)
            except NormalizeError as bad:
                text = stripped.decode("utf-8", "replace")
                out.append((index, sha256_hex(text), text, "unknown",
                            f"{name}: OTLP export: {bad.reason}", []))
                continue
            for trace in split:
                rid, text = id_and_text(trace)
                if check:
                    traces[len(out)] = trace
                    out.append((index, rid, text, "otlp", None, None))
                else:
                    out.append((index, rid, text, "otlp", *outcome(trace, "otlp", blobs)))
            continue
        fmt = format_hint if format_hint != "auto" else (detect_format(value) or "unknown")
        rid = id_of(value, stripped)
        if check:
            out.append((index, rid, None, fmt, None, None))
        else:
            out.append((index, rid, None, fmt, *outcome(value, fmt, blobs)))
    if not check:
        return out
    skip = known_mask([r[1] for r in out], known)
    for i, entry in enumerate(out):
        if entry[5] is not None or skip[i]:
            continue
        value = traces[i] if i in traces else parse_json(lines[entry[0]].strip())
        out[i] = (*entry[:4], *outcome(value, entry[3], blobs))
    return out
