"""Rubrics: what a good answer looks like for a task, inferred from the team's reference answers.

A rubric is a list of weighted criteria, each saying how it is checked (``check``):

=======================  ===================================================================
``json_valid``           the answer (stripped, code fences allowed) parses as JSON
``json_schema``          it is an object with the keys and value types the references have
                         (``params.properties``: key -> allowed JSON types; ``required``)
``json_fields_match``    share of the reference object's fields the answer gets equal
                         (strings compared case- and space-insensitively)
``tool_calls``           the answer calls the reference's tools, by name, with arguments that
                         validate against the request's declared parameter schema
``length_band``          answer length in characters within ``params.min_chars..max_chars``
``language``             the answer's language (``factory.curation.text.language``) is
                         ``params.language``
``single_line``          the answer is one line
``reference_similarity`` semantic similarity to the reference: cosine of sentence embeddings
                         (embedded judge) or the LLM judge's 1-10 agreement score
``llm``                  a task-specific criterion written by the judge model; only an LLM
                         judge can score it
=======================  ===================================================================

Every criterion scores 0..1 for one answer (the LLM judge's 1-10 maps to ``(s - 1) / 9``), and
a sample's score is the weighted mean over the criteria its judge can score: 0 is useless, 1
is as good as the reference. A rubric's ``version`` is a hash of its criteria, so scores from
different rubrics are never mixed.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

CHECKS = ("json_valid", "json_schema", "json_fields_match", "tool_calls", "length_band",
          "language", "single_line", "reference_similarity", "llm")
CODE_CHECKS = frozenset(CHECKS) - {"reference_similarity", "llm"}

# A property must hold for this share of reference answers before it becomes a criterion: one
# odd reference (a refusal, a truncated answer) must not remove a criterion the task clearly has.
_MAJORITY = 0.8


@dataclass(frozen=True, kw_only=True)
class Criterion:
    """One thing a good answer does."""

    name: str
    """Unique within the rubric (``json_valid``, ``mentions_refund_policy``...)."""
    description: str
    """What it means, in words a judge model and a person can follow."""
    check: str
    """How it is checked: one of ``CHECKS``."""
    weight: float = 1.0
    """Relative weight in the sample's score (> 0)."""
    params: dict[str, Any] = field(default_factory=dict)
    """The check's parameters (schema, length band, language...)."""

    def validate(self) -> None:
        if not isinstance(self.name, str) or not re.fullmatch(r"[a-z0-9_]{1,64}", self.name):
            raise ValueError(f"criterion name: must be 1-64 of [a-z0-9_], got {self.name!r}")
        if self.check not in CHECKS:
            raise ValueError(f"criterion {self.name}: check must be one of {', '.join(CHECKS)}, "
                             f"got {self.check!r}")
        if not isinstance(self.weight, int | float) or isinstance(self.weight, bool) \
                or not self.weight > 0:
            raise ValueError(f"criterion {self.name}: weight must be > 0, got {self.weight!r}")
        if not isinstance(self.description, str) or not self.description.strip():
            raise ValueError(f"criterion {self.name}: description must be non-empty")
        if not isinstance(self.params, dict):
            raise ValueError(f"criterion {self.name}: params must be a mapping")

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "check": self.check,
                "weight": self.weight, "params": self.params}


@dataclass(frozen=True, kw_only=True)
class Rubric:
    """Weighted criteria; ``version`` names this exact set."""

    criteria: tuple[Criterion, ...]
    """The criteria, in order."""
    source: str = "auto"
    """``auto`` (inferred from references), ``auto+llm`` (plus judge-written), ``inline``."""
    num_examples: int = 0
    """Reference answers it was inferred from (0 for an inline rubric)."""

    def __post_init__(self) -> None:
        if not self.criteria:
            raise ValueError("rubric: needs at least one criterion")
        names = [c.name for c in self.criteria]
        dup = [n for n, k in Counter(names).items() if k > 1]
        if dup:
            raise ValueError(f"rubric: duplicate criterion {dup[0]!r}")
        for c in self.criteria:
            c.validate()

    @property
    def version(self) -> str:
        blob = json.dumps([c.to_dict() for c in self.criteria], sort_keys=True,
                          separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "source": self.source,
                "num_examples": self.num_examples,
                "criteria": [c.to_dict() for c in self.criteria]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, raw: Any, *, source: str = "inline") -> Rubric:
        """A rubric from ``{"criteria": [...]}`` (an experiment file's inline rubric or a stored
        one); ValueError names what is wrong."""
        if not isinstance(raw, dict) or not isinstance(raw.get("criteria"), list):
            raise ValueError("rubric: must be a mapping with a list 'criteria'")
        allowed = {"name", "description", "check", "weight", "params"}
        criteria = []
        for i, c in enumerate(raw["criteria"]):
            if not isinstance(c, dict):
                raise ValueError(f"rubric.criteria[{i}]: must be a mapping")
            extra = set(c) - allowed
            if extra:
                raise ValueError(f"rubric.criteria[{i}]: unknown field {sorted(extra)[0]!r}")
            for key in ("name", "check"):
                if key not in c:
                    raise ValueError(f"rubric.criteria[{i}]: {key} is required")
            criteria.append(Criterion(name=c["name"], check=c["check"],
                                      description=c.get("description") or c["name"],
                                      weight=c.get("weight", 1.0), params=c.get("params") or {}))
        return cls(criteria=tuple(criteria), source=raw.get("source", source),
                   num_examples=int(raw.get("num_examples", 0)))


# --- reading answers --------------------------------------------------------------------------

_FENCE = re.compile(r"^```(?:json)?\s*\n(.*?)\n?```$", re.S)


def parse_json_answer(text: str) -> tuple[bool, Any]:
    """(parsed, value) of an answer that should be JSON; a lone code fence is tolerated."""
    s = text.strip()
    m = _FENCE.match(s)
    if m:
        s = m.group(1).strip()
    try:
        return True, json.loads(s)
    except json.JSONDecodeError:
        return False, None


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


@dataclass(frozen=True, kw_only=True)
class Answer:
    """An assistant answer reduced to what criteria look at."""

    text: str
    """Text content (parts joined by newlines)."""
    tool_calls: tuple[tuple[str, str], ...] = ()
    """(name, arguments JSON text) of each call, in order."""


# --- inference --------------------------------------------------------------------------------


def infer_rubric(references: Sequence[Answer], *,
                 tools: Sequence[Sequence[dict[str, Any]]] = ()) -> Rubric:
    """The code-checkable criteria the reference answers share, plus reference similarity.

    ``tools`` (per reference, canonical or OpenAI tool declarations) feed the tool-call
    argument schemas.
    """
    from factory.curation.text import language

    refs = list(references)
    if not refs:
        raise ValueError("infer_rubric: needs at least one reference answer")
    n = len(refs)
    crit: list[Criterion] = []
    with_calls = [r for r in refs if r.tool_calls]
    texts = [r.text for r in refs if r.text.strip()]
    if len(with_calls) >= _MAJORITY * n:
        schemas: dict[str, Any] = {}
        for decl in tools:
            for t in decl:
                fn = t.get("function", t)
                schemas.setdefault(fn["name"], fn.get("parameters") or {})
        crit.append(Criterion(
            name="tool_calls", check="tool_calls", weight=2.0, params={"schemas": schemas},
            description="Calls the same tools as the reference, with arguments that match each "
                        "tool's declared parameter schema."))
    parsed = [parse_json_answer(t) for t in texts]
    if texts and sum(ok for ok, _ in parsed) >= _MAJORITY * len(texts):
        crit.append(Criterion(name="json_valid", check="json_valid", weight=1.0,
                              description="The answer is valid JSON and nothing else."))
        objects = [v for ok, v in parsed if ok and isinstance(v, dict)]
        if len(objects) >= _MAJORITY * len(texts):
            key_count = Counter(k for o in objects for k in o)
            required = sorted(k for k, c in key_count.items() if c >= _MAJORITY * len(objects))
            types: dict[str, list[str]] = {}
            for k in sorted(key_count):
                types[k] = sorted({json_type(o[k]) for o in objects if k in o})
            crit.append(Criterion(
                name="json_schema", check="json_schema", weight=1.0,
                params={"required": required, "properties": types,
                        "additional": len(key_count) > len(required)},
                description="A JSON object with the keys " + ", ".join(required)
                            + " and the value types the references use."))
            crit.append(Criterion(
                name="json_fields_match", check="json_fields_match", weight=2.0,
                description="Each field has the same value as in the reference answer."))
    if texts:
        lengths = sorted(len(t.strip()) for t in texts)
        lo = lengths[int(0.05 * (len(lengths) - 1))]
        hi = lengths[int(round(0.95 * (len(lengths) - 1)))]
        crit.append(Criterion(
            name="length_band", check="length_band", weight=0.5,
            params={"min_chars": int(lo * 0.5), "max_chars": int(hi * 1.5) + 1},
            description=f"Between {int(lo * 0.5)} and {int(hi * 1.5) + 1} characters, like "
                        "the references."))
        langs = Counter(language(t) for t in texts)
        top, count = langs.most_common(1)[0]
        if top != "und" and count >= _MAJORITY * len(texts):
            crit.append(Criterion(name="language", check="language", weight=0.5,
                                  params={"language": top},
                                  description=f"Written in the references' language ({top})."))
        if sum("\n" not in t.strip() for t in texts) >= 0.95 * len(texts):
            crit.append(Criterion(name="single_line", check="single_line", weight=0.5,
                                  description="One line, like every reference answer."))
    crit.append(Criterion(name="reference_similarity", check="reference_similarity", weight=1.0,
                          description="Says what the reference answer says."))
    return Rubric(criteria=tuple(crit), source="auto", num_examples=n)


# --- code checks ------------------------------------------------------------------------------


def _norm(v: Any) -> Any:
    return " ".join(v.lower().split()) if isinstance(v, str) else v


def check_answer(c: Criterion, answer: Answer, reference: Answer) -> tuple[float, str]:
    """Score (0..1) and a one-line assessment of ``answer`` on a code-checkable criterion."""
    if c.check == "json_valid":
        ok, _ = parse_json_answer(answer.text)
        return (1.0, "valid JSON") if ok else (0.0, "not valid JSON")
    if c.check == "json_schema":
        ok, value = parse_json_answer(answer.text)
        if not ok or not isinstance(value, dict):
            return 0.0, "not a JSON object"
        props: dict[str, list[str]] = c.params.get("properties", {})
        required: list[str] = c.params.get("required", [])
        problems = [f"missing {k}" for k in required if k not in value]
        problems += [f"{k} is {json_type(value[k])}, expected {'|'.join(props[k])}"
                     for k in value if k in props and json_type(value[k]) not in props[k]]
        if not c.params.get("additional", False):
            problems += [f"unexpected key {k}" for k in value if k not in props]
        num_checks = max(1, len(required) + len(value))
        score = max(0.0, 1.0 - len(problems) / num_checks)
        return score, "; ".join(problems) or "keys and types as expected"
    if c.check == "json_fields_match":
        ok_ref, ref = parse_json_answer(reference.text)
        if not ok_ref or not isinstance(ref, dict) or not ref:
            return 1.0, "reference has no fields to match"
        ok, value = parse_json_answer(answer.text)
        if not ok or not isinstance(value, dict):
            return 0.0, "not a JSON object"
        wrong = [k for k in ref if _norm(value.get(k, "\0missing")) != _norm(ref[k])]
        score = 1.0 - len(wrong) / len(ref)
        return score, ("all fields match" if not wrong else "differs on " + ", ".join(wrong))
    if c.check == "tool_calls":
        return _check_tool_calls(c, answer, reference)
    if c.check == "length_band":
        n = len(answer.text.strip())
        lo, hi = int(c.params["min_chars"]), int(c.params["max_chars"])
        if lo <= n <= hi:
            return 1.0, f"{n} characters, within {lo}-{hi}"
        return 0.0, f"{n} characters, outside {lo}-{hi}"
    if c.check == "language":
        from factory.curation.text import language

        got = language(answer.text)
        want = c.params["language"]
        return (1.0 if got == want else 0.0), f"language {got}, expected {want}"
    if c.check == "single_line":
        lines = len(answer.text.strip().splitlines())
        return (1.0, "one line") if lines <= 1 else (0.0, f"{lines} lines")
    raise ValueError(f"criterion {c.name}: check {c.check!r} is not code-checkable")


def _check_tool_calls(c: Criterion, answer: Answer, reference: Answer) -> tuple[float, str]:
    import jsonschema

    want = [name for name, _ in reference.tool_calls]
    got = list(answer.tool_calls)
    if not want and not got:
        return 1.0, "no tool calls, like the reference"
    if not got:
        return 0.0, "no tool call; expected " + ", ".join(want)
    schemas: dict[str, Any] = c.params.get("schemas", {})
    points, problems = 0.0, []
    for i, (name, args) in enumerate(got):
        if i >= len(want) or name != want[i]:
            problems.append(f"call {i} is {name}, expected {want[i] if i < len(want) else 'none'}")
            continue
        try:
            parsed = json.loads(args)
        except json.JSONDecodeError:
            problems.append(f"call {i} ({name}): arguments are not JSON")
            continue
        schema = schemas.get(name)
        if schema:
            try:
                jsonschema.validate(parsed, schema)
            except jsonschema.ValidationError as e:
                problems.append(f"call {i} ({name}): {e.message}")
                continue
            except jsonschema.SchemaError:
                pass  # a malformed declared schema cannot be held against the model
        points += 1.0
    score = points / max(len(want), len(got))
    return score, "; ".join(problems) or "calls and arguments as expected"
