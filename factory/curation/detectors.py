"""Detectors that flag bad samples: refusals, truncation, JSON format breaks, tool-call schema
violations and agent pathologies. Each returns a short detail string when it fires, else None.

``format`` needs the dataset's context (are outputs in this kind of sample mostly JSON?), so
here it only reports whether an output is JSON; ``format_flags`` decides per format group.
"""

from __future__ import annotations

import re
from collections import Counter
from functools import lru_cache
from typing import Any

import jsonschema
import orjson

from factory.curation.text import final_output, message_text

# Refusal openers in several languages, matched at the start of the final answer (first 300
# chars) so that an answer quoting "I can't" later on is not a refusal.
_REFUSALS = [
    r"i'?m sorry,? (but )?i (can'?t|cannot|am unable|won'?t)",
    r"i (can'?t|cannot|am unable to|won'?t) (help|assist|provide|do|comply|fulfil)",
    r"sorry,? (but )?i (can'?t|cannot)",
    r"as an ai( language model)?,? i (can'?t|cannot|don'?t|am not able)",
    r"i apologi[sz]e,? but i (can'?t|cannot)",
    r"(je suis )?désolée?,? (mais )?je ne (peux|suis pas en mesure)",
    r"je ne peux pas (vous )?(aider|répondre|fournir)",
    r"lo siento,? (pero )?no (puedo|me es posible)",
    r"no puedo (ayudar|ayudarte|proporcionar|responder)",
    r"es tut mir leid,? (aber )?(ich kann|das kann ich) (nicht|dabei nicht)",
    r"ich kann (ihnen |dir )?(dabei )?nicht helfen",
    r"mi dispiace,? (ma )?non posso",
    r"desculpe,? (mas )?(eu )?não posso",
    r"sinto muito,? mas não posso",
    r"het spijt me,? maar ik kan",
    r"抱歉[，,]?\s*我(无法|不能)",
    r"对不起[，,]?\s*我(无法|不能)",
    r"申し訳(ありません|ございません)が",
    r"извините,? (но )?я не (могу|в состоянии)",
]
_REFUSAL_RE = re.compile("|".join(f"(?:{p})" for p in _REFUSALS), re.IGNORECASE)

_TOOL_ERROR_RE = re.compile(
    r"\b(error|exception|traceback|failed|failure|not found|invalid|denied|timed? ?out)\b|"
    r"\bstatus(?: code)?\W*[45]\d\d\b", re.IGNORECASE)

# Agent pathologies: a failing call retried unchanged this many times, or any call/answer
# repeated this many times, is a loop rather than a retry.
_REPEATED_FAILURES = 2
_LOOP_REPEATS = 3


def refusal(messages: list[dict[str, Any]]) -> str | None:
    out = final_output(messages)
    m = _REFUSAL_RE.search(out[:300])
    return f"refusal: {m.group(0)!r}" if m else None


def strip_fence(text: str) -> str:
    """The body of a single fenced block (```json ... ```), else the text."""
    t = text.strip()
    if t.startswith("```") and t.endswith("```") and t.count("```") == 2:
        body = t[3:-3]
        first_nl = body.find("\n")
        return body[first_nl + 1:] if first_nl >= 0 else body
    return t


def json_status(messages: list[dict[str, Any]]) -> tuple[bool, bool, bool]:
    """(looks like JSON, parses as JSON, fails only at the end i.e. cut off) of the final output."""
    out = strip_fence(final_output(messages))
    if not out or out[0] not in "{[":
        return False, False, False
    try:
        orjson.loads(out)
        return True, True, False
    except orjson.JSONDecodeError as exc:
        pos = getattr(exc, "pos", 0) or 0
        return True, False, pos >= len(out.encode()) - 1 or "unexpected end" in str(exc).lower()


def truncated(messages: list[dict[str, Any]], tags: dict[str, str] | None) -> str | None:
    if tags and tags.get("finish_reason") in ("length", "max_tokens"):
        return f"truncated: finish_reason={tags['finish_reason']}"
    out = final_output(messages)
    if not out:
        return None
    if out.count("```") % 2 == 1:
        return "truncated: unclosed code block"
    looks, ok, cut = json_status(messages)
    if looks and not ok and cut:
        return "truncated: JSON ends before it is complete"
    if out[-1] in ",;:" or out.endswith(("(", "[", "{")):
        return f"truncated: ends with {out[-12:]!r}"
    return None


@lru_cache(maxsize=4096)
def _validator(schema_json: str) -> Any:
    schema = orjson.loads(schema_json)
    cls = jsonschema.validators.validator_for(schema)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError:
        return None  # a broken tool schema says nothing about the call
    return cls(schema)


def tool_schema(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> str | None:
    """First tool call whose arguments are not JSON or break the tool's parameter schema."""
    if not tools:
        return None
    by_name = {t.get("name"): t.get("parameters") or {} for t in tools if isinstance(t, dict)}
    for msg in messages:
        if msg.get("role") != "assistant":
            continue
        for call in msg.get("tool_calls") or []:
            name = call.get("name")
            if name not in by_name:
                return f"tool_schema: call to unknown tool {name!r}"
            raw = call.get("arguments", "")
            try:
                args = orjson.loads(raw) if isinstance(raw, str) else raw
            except orjson.JSONDecodeError:
                return f"tool_schema: arguments of {name!r} are not JSON: {str(raw)[:60]!r}"
            schema = by_name[name]
            if not schema:
                continue
            validator = _validator(orjson.dumps(schema, option=orjson.OPT_SORT_KEYS).decode())
            if validator is None:
                continue
            err = jsonschema.exceptions.best_match(validator.iter_errors(args))
            if err is not None:
                where = "/".join(str(p) for p in err.absolute_path) or "(root)"
                return f"tool_schema: {name!r} arguments at {where}: {err.message[:120]}"
    return None


def agent_loop(messages: list[dict[str, Any]]) -> str | None:
    results: dict[str, str] = {}
    for msg in messages:
        if msg.get("role") == "tool" and msg.get("tool_call_id"):
            results[str(msg["tool_call_id"])] = message_text(msg)
    calls: Counter[tuple[str, str]] = Counter()
    failures: Counter[tuple[str, str]] = Counter()
    answers: Counter[str] = Counter()
    for msg in messages:
        if msg.get("role") != "assistant":
            continue
        text = message_text(msg, with_reasoning=False).strip()
        if text:
            answers[text] += 1
        for call in msg.get("tool_calls") or []:
            key = (str(call.get("name")), str(call.get("arguments")))
            calls[key] += 1
            result = results.get(str(call.get("id")), "")
            if result and _is_failure(result):
                failures[key] += 1
    for key, n in sorted(failures.items()):
        if n >= _REPEATED_FAILURES:
            return f"agent_loop: failing call {key[0]}({key[1][:60]}) repeated {n} times"
    for key, n in sorted(calls.items()):
        if n >= _LOOP_REPEATS:
            return f"agent_loop: call {key[0]}({key[1][:60]}) repeated {n} times"
    for text, n in sorted(answers.items()):
        if n >= _LOOP_REPEATS:
            return f"agent_loop: same answer repeated {n} times: {text[:60]!r}"
    return None


def _is_failure(result: str) -> bool:
    try:
        value = orjson.loads(result)
        if isinstance(value, dict):
            return any(k in value for k in ("error", "errors", "exception")) or \
                value.get("ok") is False or value.get("success") is False
    except orjson.JSONDecodeError:
        pass
    return bool(_TOOL_ERROR_RE.search(result[:500]))


# A format group (samples sharing a system prompt) is "JSON" when at least this share of its
# outputs parse as JSON and it has at least this many samples: one stray JSON answer in a chat
# dataset must not turn every prose answer into a format error.
JSON_MAJORITY = 0.5
JSON_MIN_GROUP = 4


def format_flag(is_json: bool, looks_json_cut: bool, group_json_share: float,
                group_size: int) -> str | None:
    """Flag a non-JSON output in a group whose outputs are mostly JSON."""
    if group_size >= JSON_MIN_GROUP and group_json_share > JSON_MAJORITY and not is_json \
            and not looks_json_cut:
        return f"format: output is not valid JSON while {group_json_share:.0%} of " \
               f"{group_size} similar samples answer in JSON"
    return None
