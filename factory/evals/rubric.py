"""Rubrics: what a good answer looks like for a task, inferred from the team's reference answers.

Inference first recognizes what the references are and checks that exactly; similarity (or an
LLM judge) is left for free text, where nothing exact exists:

==============  =============================================  ====================================
kind            recognized when                                criterion (check)
==============  =============================================  ====================================
``tool_calls``  at least half the references call a tool       ``tool_call_match``
``json``        80% of text references parse as an object or   ``json_match``
                array
``labels``      80% are short one-line labels from a set that  ``label_match``
                repeats (at most half as many labels as
                references)
``free_text``   otherwise                                      ``length_band``, ``language``,
                                                               ``single_line``,
                                                               ``reference_similarity``
==============  =============================================  ====================================

A criterion's ``check`` says how it is checked:

=======================  ===================================================================
``tool_call_match``      each call has the reference call's name and exactly its arguments
                         (parsed JSON); a reference without calls wants none. Without a
                         reference: the calls name declared tools with arguments that validate
                         against their schemas (``params.schemas``)
``json_match``           share of the reference object's fields the answer gets equal
                         (strings case- and space-insensitively; a non-object reference: equal
                         JSON). Without a reference: keys and value types of ``params``
``label_match``          the answer is the reference label (case, spacing, quotes and a final
                         period aside). Without a reference: one of ``params.labels``
``json_valid``           the answer (stripped, code fences allowed) parses as JSON
``json_schema``          it is an object with the keys and value types the references have
                         (``params.properties``: key -> allowed JSON types; ``required``)
``json_fields_match``    share of the reference object's fields the answer gets equal
                         (strings compared case- and space-insensitively)
``tool_calls``           the answer calls the reference's tools, by name, with arguments that
                         validate against the request's declared parameter schema
``length_band``          answer length in characters within ``params.min_chars..max_chars``
``language``             the answer's language (``factory.language.language``) is
                         ``params.language``
``single_line``          the answer is one line
``reference_similarity`` semantic similarity to the reference: cosine of sentence embeddings
                         (embedded judge) or the LLM judge's 1-10 agreement score
``llm``                  a task-specific criterion written by the judge model; only an LLM
                         judge can score it
=======================  ===================================================================

Inference writes only the exact checks and the free-text ones; ``json_valid``,
``json_schema``, ``json_fields_match`` and ``tool_calls`` serve inline and stored rubrics. A closed task's
answer set (its labels, the shape of its JSON) is ``structured_outputs(rubric)``, what an eval
may constrain decoding to (``eval.constrain``).

Every criterion scores 0..1 for one answer (the LLM judge's 1-10 maps to ``(s - 1) / 9``), and
a sample's score is the weighted mean over the criteria its judge can score: 0 is useless, 1
is as good as the reference. An exact kind's rubric is its one criterion, so the score is the
task's exact metric: a wrong label scores 0. A rubric's ``version`` is a hash of its criteria,
so scores from different rubrics are never mixed.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from factory.language import language

CHECKS = ("tool_call_match", "json_match", "label_match", "json_valid", "json_schema",
          "json_fields_match", "tool_calls", "length_band", "language", "single_line",
          "reference_similarity", "llm")
CODE_CHECKS = frozenset(CHECKS) - {"reference_similarity", "llm"}
KIND_OF_CHECK = {"tool_call_match": "tool_calls", "json_match": "json", "label_match": "labels",
                 "tool_calls": "tool_calls", "json_fields_match": "json", "json_schema": "json",
                 "json_valid": "json"}
"""The kind of references each check is for (``Rubric.kind``); the first three are the exact
checks inference writes, the others what stored rubrics may hold."""

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
    def kind(self) -> str:
        """What the references are (``tool_calls``, ``json``, ``labels``), by the first
        criterion whose check is for one kind (``KIND_OF_CHECK``); else ``free_text``."""
        for c in self.criteria:
            if c.check in KIND_OF_CHECK:
                return KIND_OF_CHECK[c.check]
        return "free_text"

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


def stored_rubric(session: Any, experiment: str) -> Rubric | None:
    """The experiment's newest row of ``rubrics`` (None before its first rubric)."""
    rows = session.sql("SELECT rubric FROM rubrics WHERE experiment = ? "
                       "ORDER BY created_at DESC LIMIT 1", [experiment]).to_pylist()
    return Rubric.from_dict(json.loads(rows[0]["rubric"])) if rows else None


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
    """The criteria that check what the references are (see the module's table).

    ``tools`` (per reference, canonical or OpenAI tool declarations) feed the tool-call
    argument schemas, which score calls when there is no reference (rejection sampling).
    """
    refs = list(references)
    if not refs:
        raise ValueError("infer_rubric: needs at least one reference answer")
    n = len(refs)
    if 2 * sum(1 for r in refs if r.tool_calls) >= n:
        schemas: dict[str, Any] = {}
        for decl in tools:
            for t in decl:
                fn = t.get("function", t)
                schemas.setdefault(fn["name"], fn.get("parameters") or {})
        crit = [Criterion(
            name="tool_calls", check="tool_call_match", params={"schemas": schemas},
            description="Makes the reference's tool calls: the same tool names with exactly "
                        "the same arguments; no call where the reference makes none.")]
        return Rubric(criteria=tuple(crit), source="auto", num_examples=n)
    texts = [r.text for r in refs if r.text.strip()]
    json_rubric = _json_criteria(texts)
    labels = None if json_rubric else closed_labels(texts)
    if json_rubric:
        crit = json_rubric
    elif labels:
        crit = [Criterion(
            name="label_match", check="label_match", params={"labels": labels},
            description="Answers with exactly the reference's label, one of "
                        + ", ".join(labels[:20]) + (" ..." if len(labels) > 20 else "") + ".")]
    else:
        crit = _free_text_criteria(texts)
    return Rubric(criteria=tuple(crit), source="auto", num_examples=n)


def _json_criteria(texts: Sequence[str]) -> list[Criterion]:
    """``json_match`` when most text references are JSON objects or arrays; [] otherwise."""
    parsed = [parse_json_answer(t) for t in texts]
    containers = [v for ok, v in parsed if ok and isinstance(v, dict | list)]
    if not texts or len(containers) < _MAJORITY * len(texts):
        return []
    params: dict[str, Any] = {}
    objects = [v for v in containers if isinstance(v, dict)]
    described = "JSON with the reference's values"
    if len(objects) >= _MAJORITY * len(texts):
        key_count = Counter(k for o in objects for k in o)
        common = {k for k, c in key_count.items() if c >= _MAJORITY * len(objects)}
        # In the order the references write them: the answer set's JSON Schema
        # (``structured_outputs``) lists them so, and grammar engines keep a schema's order.
        orders = Counter(tuple(k for k in o if k in common) for o in objects)
        written = orders.most_common(1)[0][0]
        required = [*written, *sorted(common - set(written))]
        params = {"required": required,
                  "properties": {k: sorted({json_type(o[k]) for o in objects if k in o})
                                 for k in sorted(key_count)},
                  "additional": len(key_count) > len(required)}
        described = "A JSON object whose fields (" + ", ".join(required) + ") equal the " \
            "reference's"
    return [Criterion(name="json_fields_match", check="json_match", params=params,
                      description=described + "; without a reference, the keys and value "
                                              "types the references use.")]


def _free_text_criteria(texts: Sequence[str]) -> list[Criterion]:
    """Length, language and line shape of the references, and similarity to them."""
    crit: list[Criterion] = []
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
    return crit


_LABEL_MAX_CHARS = 40
_LABEL_MAX_WORDS = 4


def normalize_label(text: str) -> str:
    """A label as compared: case, spacing, surrounding quotes or backticks and a final period
    aside (``" Refund."`` is ``refund``; ``bug report`` is not ``bug_report``)."""
    s = " ".join(text.split()).strip("`'\"").strip()
    if s.endswith("."):
        s = s[:-1].rstrip()
    return s.lower()


def closed_labels(texts: Sequence[str]) -> list[str] | None:
    """The label set, when the texts are labels: at least 80% short one-line labels (at most
    40 characters and 4 words) drawn from a set that repeats (at most half as many distinct
    labels as texts, 2 allowed); None otherwise."""
    if not texts:
        return None
    norm = [normalize_label(t) for t in texts]
    label_like = [x for x, t in zip(norm, texts, strict=True)
                  if x and "\n" not in t.strip() and len(x) <= _LABEL_MAX_CHARS
                  and len(x.split()) <= _LABEL_MAX_WORDS]
    if len(label_like) < _MAJORITY * len(texts):
        return None
    distinct = sorted(set(label_like))
    return distinct if len(distinct) <= max(2, len(texts) // 2) else None


# --- closed answers -----------------------------------------------------------------------------


def label_forms(label: str) -> list[str]:
    """The ways of writing ``label`` (a normalized one) that ``normalize_label`` reads as it:
    as stored, capitalized, title-cased and upper-cased, so a model trained on ``Billing``
    may write it so."""
    return list(dict.fromkeys([label, label.capitalize(), label.title(), label.upper()]))


def structured_outputs(rubric: Rubric) -> dict[str, Any] | None:
    """The answer set of a closed task, as the serving protocol's ``structured_outputs``
    (``factory.inference.constrain``): ``{"choice": [...]}`` for labels (each label in its
    ``label_forms``), ``{"json": SCHEMA}`` for JSON (an object with the references' keys in
    the order they write them, ``required`` first: llguidance, xgrammar and outlines all keep
    a schema's property order; their value types; no other key unless the references had
    optional ones). None for tool calls (references that call no tool are right answers too,
    and a call is text around JSON) and for free text."""
    for c in rubric.criteria:
        kind = KIND_OF_CHECK.get(c.check)
        if kind == "labels":
            labels = c.params.get("labels") or []
            if not labels:
                return None
            return {"choice": [f for label in labels for f in label_forms(str(label))]}
        if kind == "json":
            props: dict[str, list[str]] = c.params.get("properties") or {}
            if not props:
                return {"json": {"json_match": {"type": ["object", "array"]},
                                 "json_fields_match": {"type": "object"}}.get(c.check, {})}
            required = [k for k in c.params.get("required") or [] if k in props]
            order = [*required, *sorted(set(props) - set(required))]
            return {"json": {
                "type": "object",
                "properties": {k: {"type": props[k][0] if len(props[k]) == 1
                                   else list(props[k])} for k in order},
                "required": required,
                "additionalProperties": bool(c.params.get("additional", False))}}
        if kind is not None:
            return None
    return None


# --- code checks ------------------------------------------------------------------------------


def _norm(v: Any) -> Any:
    return " ".join(v.lower().split()) if isinstance(v, str) else v


def check_answer(c: Criterion, answer: Answer, reference: Answer | None) -> tuple[float, str]:
    """Score (0..1) and a one-line assessment of ``answer`` on a code-checkable criterion.

    ``reference`` None: judged without one (rejection sampling); the exact checks then check
    what they can without it, and a check that needs one (``json_fields_match``) refuses.
    """
    if c.check == "tool_call_match":
        if reference is None:
            return _check_tool_calls(c, answer, answer)
        return _tool_calls_exact(answer, reference)
    if c.check == "json_match":
        if reference is None:
            return _json_schema(c.params, answer) if c.params else _json_valid(answer)
        ok_ref, ref = parse_json_answer(reference.text)
        if ok_ref and isinstance(ref, dict) and ref:
            return _json_fields(answer, ref)
        ok, value = parse_json_answer(answer.text)
        if ok and ok_ref and json_equal(value, ref):
            return 1.0, "the reference's JSON"
        return 0.0, "not the reference's JSON" if ok else "not valid JSON"
    if c.check == "label_match":
        got = normalize_label(answer.text)
        if reference is None:
            labels = c.params.get("labels") or []
            if got in labels:
                return 1.0, f"label {got!r}"
            return 0.0, f"{got[:40]!r} is not one of the labels"
        want = normalize_label(reference.text)
        if got == want:
            return 1.0, f"label {got!r}"
        return 0.0, f"answered {got[:40]!r}, expected {want!r}"
    if c.check == "json_valid":
        return _json_valid(answer)
    if c.check == "json_schema":
        return _json_schema(c.params, answer)
    if c.check == "json_fields_match":
        if reference is None:
            raise ValueError(f"criterion {c.name}: json_fields_match needs a reference")
        ok_ref, ref = parse_json_answer(reference.text)
        if not ok_ref or not isinstance(ref, dict) or not ref:
            return 1.0, "reference has no fields to match"
        return _json_fields(answer, ref)
    if c.check == "tool_calls":
        return _check_tool_calls(c, answer, reference or answer)
    if c.check == "length_band":
        n = len(answer.text.strip())
        lo, hi = int(c.params["min_chars"]), int(c.params["max_chars"])
        if lo <= n <= hi:
            return 1.0, f"{n} characters, within {lo}-{hi}"
        return 0.0, f"{n} characters, outside {lo}-{hi}"
    if c.check == "language":
        got_lang = language(answer.text)
        want_lang = c.params["language"]
        return (1.0 if got_lang == want_lang else 0.0), \
            f"language {got_lang}, expected {want_lang}"
    if c.check == "single_line":
        lines = len(answer.text.strip().splitlines())
        return (1.0, "one line") if lines <= 1 else (0.0, f"{lines} lines")
    raise ValueError(f"criterion {c.name}: check {c.check!r} is not code-checkable")


def _json_valid(answer: Answer) -> tuple[float, str]:
    ok, _ = parse_json_answer(answer.text)
    return (1.0, "valid JSON") if ok else (0.0, "not valid JSON")


def _json_schema(params: dict[str, Any], answer: Answer) -> tuple[float, str]:
    ok, value = parse_json_answer(answer.text)
    if not ok or not isinstance(value, dict):
        return 0.0, "not a JSON object"
    props: dict[str, list[str]] = params.get("properties", {})
    required: list[str] = params.get("required", [])
    problems = [f"missing {k}" for k in required if k not in value]
    problems += [f"{k} is {json_type(value[k])}, expected {'|'.join(props[k])}"
                 for k in value if k in props and json_type(value[k]) not in props[k]]
    if not params.get("additional", False):
        problems += [f"unexpected key {k}" for k in value if k not in props]
    num_checks = max(1, len(required) + len(value))
    score = max(0.0, 1.0 - len(problems) / num_checks)
    return score, "; ".join(problems) or "keys and types as expected"


def _json_fields(answer: Answer, ref: dict[str, Any]) -> tuple[float, str]:
    ok, value = parse_json_answer(answer.text)
    if not ok or not isinstance(value, dict):
        return 0.0, "not a JSON object"
    wrong = [k for k in ref if _norm(value.get(k, "\0missing")) != _norm(ref[k])]
    score = 1.0 - len(wrong) / len(ref)
    return score, ("all fields match" if not wrong else "differs on " + ", ".join(wrong))


def json_equal(a: Any, b: Any) -> bool:
    """JSON equality: 24.5 == 24.50 and 80 == 80.0, but a boolean is not a number."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    return type(a) is type(b) and a == b


def _tool_calls_exact(answer: Answer, reference: Answer) -> tuple[float, str]:
    """Calls compared in order: a point for each with the reference call's name and equal
    arguments, over the larger number of calls."""
    want, got = reference.tool_calls, answer.tool_calls
    if not want:
        return (1.0, "no tool call, like the reference") if not got else \
            (0.0, "called " + ", ".join(n for n, _ in got) + "; the reference makes no call")
    if not got:
        return 0.0, "no tool call; expected " + ", ".join(n for n, _ in want)
    points, problems = 0, []
    for i, (name, args) in enumerate(got):
        if i >= len(want):
            problems.append(f"call {i} ({name}) is extra")
            continue
        if name != want[i][0]:
            problems.append(f"call {i} is {name}, expected {want[i][0]}")
            continue
        try:
            same = json_equal(json.loads(args), json.loads(want[i][1]))
        except json.JSONDecodeError:
            problems.append(f"call {i} ({name}): arguments are not JSON")
            continue
        if not same:
            problems.append(f"call {i} ({name}): arguments differ from the reference's")
            continue
        points += 1
    problems += [f"missing call {i} ({want[i][0]})" for i in range(len(got), len(want))]
    return points / max(len(want), len(got)), "; ".join(problems) or "the reference's calls"


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
