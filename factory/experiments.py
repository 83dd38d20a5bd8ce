"""Experiment files: what to train, on which data, with which recipe, overrides and sweep.

An experiment is one YAML file in ``settings.experiments_dir`` (``$FACTORY_EXPERIMENTS_DIR``)::

    name: support-extractor
    data: {where: "tags['project'] = 'support'", eval_fraction: 0.1, max_tokens: 2048}
    # or also ask a teacher for samples of the thin slices (factory.curation.synthesis):
    # data: {where: "...", synthesize: {teacher: gpt-4o, api_key_env: OPENAI_API_KEY}}
    # or train on a weighted mixture the trainer streams (relative weights):
    # data: {mix: {traffic: 0.7, synthetic: 0.1, "experiment:triage": 0.1,
    #              "file:general/instructions.jsonl": 0.1}}
    # and draw the traffic's languages closer to even (count ** 0.5) than they come:
    # data: {where: "...", balance: language}
    recipe: smollm2-135m-lora
    overrides: {learning_rate: 2.0e-4}
    eval: {every_steps: 20, judge: embedded, rubric: auto}   # constrain: auto | on | off
    sweep: {learning_rate: [1.0e-4, 2.0e-4, 4.0e-4], lora_rank: [8, 16]}
    schedule: "0 3 * * *"
    deploy: manual        # auto | manual; default: auto for a single run, manual for a sweep
    # or shadow first: serve the best checkpoint as a candidate beside gpt-4o-mini's traffic and
    # promote it behind factory/<name> once it agrees with the frontier model often enough
    # deploy: {shadow: {route: gpt-4o-mini, share: 0.2, agreement: 0.95, min_pairs: 200}}

Loading validates every field and raises ``ExperimentError`` naming the file, the line, the
field and what is allowed; unknown keys are errors with a did-you-mean, because a misspelt
``learnig_rate`` silently ignored would train the wrong model.

The file is checked against a JSON Schema (``experiment_schema``) by ``jsonschema``: each
error's instance path is the YAML path whose line the composed node marks, with no
union-branch labels in it (pydantic's error locations carry those); every leaf of the schema
carries our words for what is allowed. The keys ``overrides`` and ``sweep`` take are derived from
the trainer's ``TrainConfig`` (``train_settings``): its field names, types, metadata (choices,
bounds) and docstrings are the one declaration of a training setting. Cron strings are checked
and stepped by ``croniter`` (standard cron: a restricted day of month and day of week fire on
either).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import re
import sys
import textwrap
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from croniter import croniter

from factory.errors import FactoryError
from factory.recipes import list_recipe_names
from factory.settings import get_settings
from factory.trainer.config import TrainConfig


class ExperimentError(FactoryError):
    """An experiment file that cannot be used, with file, line, field and what is allowed."""


DETECTORS: tuple[str, ...] = ("refusal", "format", "tool_schema", "truncated", "agent_loop")
"""Curation detectors whose flagged samples ``data.drop`` can drop."""

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")


@dataclass(frozen=True, kw_only=True)
class SynthesizeSpec:
    """``data.synthesize``: a teacher writes train samples for the dataset's thin slices
    (``factory.curation.synthesis``); they pass the same cleaning, decontamination and
    rejection sampling as the traffic, on the train side only."""

    teacher: str
    """The teacher's model name at ``base_url`` (a frontier model behind the gateway, or a
    deployed ``factory/<name>``)."""
    base_url: str | None = None
    """OpenAI base URL of the teacher; None: the gateway (``$FACTORY_GATEWAY_URL``, else
    ``http://127.0.0.1:8787``) + ``/v1``."""
    api_key_env: str | None = None
    """Environment variable holding the teacher's API key (the key is never in the file)."""
    max_per_slice: int = 200
    """Most samples a thin slice is filled with (its target: the samples it lacks of an even
    share, at most this many)."""
    attempts_per_sample: float = 1.0
    """Attempts planned per sample of a slice's target (rounded up), since many attempts are
    dropped; the slice stops once it holds its target, so the attempts beyond what it needs
    are never run. 1: one attempt per missing sample."""
    timeout_s: float = 60.0
    """Seconds per teacher call; a call past it is a ``timeout`` drop."""
    judge_threshold: float | None = None
    """Rejection-sampling score synthetic samples need; None: ``data.judge_threshold``, else
    1.0 when code checks every criterion of the rubric, 0.8 with an LLM judge's criteria
    (``factory.curation.synthesis.default_judge_threshold``)."""
    min_confidence: float | None = None
    """Least probability the teacher gives its own answer (the product of its tokens'
    probabilities, from the endpoint's ``logprobs``) for the sample to be kept; a less sure
    answer is a ``low_confidence`` drop. Meant for short answers (a label, a tool call), where
    an unsure teacher has written a request that reads like another slice; None: not asked."""


@dataclass(frozen=True, kw_only=True)
class DataSpec:
    """Which samples the experiment trains on and how curation cleans them."""

    where: str = "true"
    """SQL predicate over ``samples`` columns and tags selecting the experiment's samples."""
    eval_fraction: float = 0.1
    """Share of samples held out (by stable hash) for the eval set, in (0, 1)."""
    max_tokens: int = 2048
    """Samples longer than this (base model tokenizer + chat template) are dropped."""
    near_dup_threshold: float = 0.85
    """Jaccard similarity above which two samples count as near-duplicates."""
    decontam_ngram: int = 13
    """Length of the n-grams whose overlap with an eval prompt drops a train sample."""
    drop: tuple[str, ...] = DETECTORS
    """Detectors whose flagged samples are dropped (the others only flag)."""
    judge_threshold: float | None = None
    """Rejection sampling: keep only samples the judge scores at least this; None disables it."""
    min_new_samples: int = 100
    """New samples needed before ``retrain_on_new_samples`` retrains."""
    seed: int = 0
    """Seed of the split hash and of anything random in curation."""
    engine: str = "embedded"
    """Curation engine: ``embedded`` (DuckDB/pyarrow in process) or ``spark`` (a local Spark
    session, for data that outgrows one machine); both give the same datasets."""
    mix: tuple[MixEntry, ...] = ()
    """Weighted sources the trainer streams, the primary one first (``traffic`` when listed;
    ``num_epochs`` counts passes over it); empty: the experiment's training set alone."""
    synthesize: SynthesizeSpec | None = None
    """Synthetic samples for the thin slices from a teacher; None: traffic only."""
    balance: BalanceSpec | None = field(default_factory=lambda: BalanceSpec(auto=True))
    """Draw the traffic's groups (its languages) closer to even than their counts. Left out:
    the planner's default (``BalanceSpec.auto``: by language where the traffic's languages are
    skewed); ``balance: none``: as the traffic has them (None)."""


BALANCE_BY: tuple[str, ...] = ("language",)
"""Dataset columns ``data.balance`` can group the traffic by."""

BALANCE_OFF: tuple[Any, ...] = ("none", False)
"""``data.balance`` values that turn the planner's default balance off."""


@dataclass(frozen=True, kw_only=True)
class BalanceSpec:
    """``data.balance``: the trainer draws each group of the traffic (its samples with one value
    of the column ``by``) with probability proportional to ``count ** alpha`` instead of
    ``count`` (``factory.planner.plan.balanced_mix``): 1 keeps the traffic's shares, 0 draws
    every group equally, 0.5 (the default) lifts a language with 12% of the samples to ~19% of
    the draws among four. Temperature sampling as multilingual models train."""

    by: str = "language"
    """The dataset column that names a sample's group (``language``: the curation's guess,
    ``und`` when unsure)."""
    alpha: float = 0.5
    """Exponent of the group's count, in [0, 1]."""
    auto: bool = False
    """The planner's default, not the file's: balance only where the traffic's groups are
    skewed (``factory.planner.plan.balanced_mix``: at least two languages of some size, the
    largest at least ``AUTO_BALANCE_SKEW`` times the smallest); else as the traffic has them."""


MIX_KINDS: tuple[str, ...] = ("traffic", "synthetic", "experiment:<name>", "file:<path>")
"""Sources ``data.mix`` can name."""


@dataclass(frozen=True, kw_only=True)
class MixEntry:
    """One source of ``data.mix`` and its weight."""

    source: str
    """``traffic`` (the experiment's dataset rows from traffic), ``synthetic`` (its rows a
    teacher wrote, ``origin = 'synthetic'``), ``experiment:<name>`` (another experiment's
    training set), ``file:<path>`` (a JSONL file of canonical samples or OpenAI chat records,
    the path resolved against the experiment file's folder)."""
    weight: float
    """Relative weight: the share of drawn samples is ``weight / sum(weights)``."""

    @property
    def kind(self) -> str:
        """``traffic``, ``synthetic``, ``experiment`` or ``file``."""
        return "traffic" if group_of(self.source) else self.source.partition(":")[0]

    @property
    def target(self) -> str:
        """The experiment name or file path after the kind ('' for traffic and synthetic)."""
        return self.source.partition(":")[2]


UNDETERMINED = "und"
"""The group of samples whose ``by`` value is unknown (no language found): ``data.balance``
draws it at its own share, and a missing value counts as it."""


def group_source(by: str, value: str) -> str:
    """The name of the traffic's group ``by = value`` as a mixture source (``data.balance``):
    ``traffic[language=fr]``."""
    return f"traffic[{by}={value}]"


_GROUP = re.compile(r"traffic\[(\w+)=([^\]]*)\]")


def group_of(source: str) -> tuple[str, str] | None:
    """``(by, value)`` of a ``group_source`` name; None for any other source."""
    m = _GROUP.fullmatch(source)
    return (m.group(1), m.group(2)) if m else None


@dataclass(frozen=True, kw_only=True)
class ShadowPolicy:
    """``deploy: {shadow: ...}``: the best checkpoint is served as a candidate that shadows the
    live calls of ``route``; it is promoted behind ``factory/<name>`` once ``agreement`` of at
    least ``min_pairs`` scored pairs pass (never, with ``agreement: null``)."""

    route: str
    """The model name whose calls the candidate shadows (e.g. ``gpt-4o-mini``)."""
    share: float = 1.0
    """Share of the route's calls shadowed, 0 < share <= 1."""
    agreement: float | None = None
    """Promote automatically at this agreement (0..1); None: promote by hand only."""
    min_pairs: int = 200
    """Scored pairs needed before the agreement counts."""
    pass_score: float | None = None
    """The score a pair needs to pass; None: the rubric's threshold (1.0 for exact checks)."""


@dataclass(frozen=True, kw_only=True)
class EvalSpec:
    """How the fine-tuned model is evaluated."""

    every_steps: int | None = None
    """Evaluate every this many optimizer steps; None lets the planner decide."""
    judge: str = "embedded"
    """Judge model: ``embedded`` (the local judge) or a recipe/model name."""
    rubric: str | dict[str, Any] = "auto"
    """``auto`` (derived from the data), a rubric name, or an inline rubric mapping."""
    max_samples: int | None = None
    """Cap on evaluated samples; None evaluates the whole eval set."""
    constrain: str = "auto"
    """Constrain decoding to a closed task's answer set (the rubric's labels or JSON shape,
    ``factory.evals.rubric.structured_outputs``) when generating eval answers: ``on``,
    ``off``, or ``auto``: on for the kinds in ``CONSTRAIN_AUTO``, labels (the dev-split
    measurement that decides it is written there; JSON off until measured)."""


@dataclass(frozen=True, kw_only=True)
class Experiment:
    """A validated experiment file."""

    name: str
    """Experiment name (slug); the partition key of its assets."""
    path: Path
    """The file it was read from."""
    data: DataSpec
    """Sample selection and curation policy."""
    recipe: str
    """Name of the recipe (``factory/recipes/<recipe>.yaml``) it starts from."""
    overrides: dict[str, Any]
    """Plan values forced by the user; they always win over the planner."""
    eval: EvalSpec
    """Evaluation settings."""
    sweep: dict[str, list[Any]]
    """Plan key -> values; one run per point of the cartesian product. Empty: a single run."""
    schedule: str | None
    """Cron string (5 fields) on which the experiment retrains; None: no schedule."""
    retrain_on_new_samples: bool
    """Retrain when ``data.min_new_samples`` new samples match the selection."""
    deploy: str
    """Promotion policy once every checkpoint of a finished run (all sweep points) is scored:
    ``auto`` deploys the best checkpoint, ``manual`` stops at ``best_checkpoint`` (deploy with
    a click on ``deployment`` or ``factory deploy``), ``shadow`` serves it as a candidate
    shadowing live traffic first (``shadow`` holds the policy). Default: ``auto`` for a single
    run, ``manual`` for a sweep."""
    raw: dict[str, Any]
    """The file's parsed content, as written."""
    shadow: ShadowPolicy | None = None
    """The shadow policy when ``deploy`` is ``shadow``."""


# ---------------------------------------------------------------------------------------------
# Plan keys that ``overrides`` and ``sweep`` may set. The training settings are the trainer's
# ``TrainConfig`` fields, read from its one declaration (type, metadata, docstring); the planner
# owns the few keys beyond them.

NOT_PLANNED: tuple[str, ...] = ("base_model", "log_every_steps", "deterministic")
"""``TrainConfig`` fields no plan sets: the recipe names the base model; the logging cadence and
deterministic kernels are the job's."""


@dataclass(frozen=True, kw_only=True)
class Setting:
    """One plan key: what ``overrides`` and ``sweep`` accept for it, and what it means."""

    name: str
    """The key (a ``TrainConfig`` field name for a training setting)."""
    schema: dict[str, Any]
    """JSON Schema of one value, ``x-allowed`` saying in words what is allowed."""
    doc: str
    """What it means: the field's docstring."""


def _or_list(values: Sequence[str]) -> str:
    items = [str(v) for v in values]
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} or {items[-1]}"


def _number_schema(kind: str, meta: Mapping[str, Any]) -> dict[str, Any]:
    """``integer`` or ``number`` with the bounds ``ge``/``gt``/``le``/``lt`` of ``meta``."""
    noun = "integer" if kind == "integer" else "number"
    schema: dict[str, Any] = {"type": kind}
    ge, gt, le, lt = (meta.get(k) for k in ("ge", "gt", "le", "lt"))
    if ge is not None:
        schema["minimum"] = ge
    if gt is not None:
        schema["exclusiveMinimum"] = gt
    if le is not None:
        schema["maximum"] = le
    if lt is not None:
        schema["exclusiveMaximum"] = lt
    low = ("[", ge) if ge is not None else ("(", gt) if gt is not None else None
    high = ("]", le) if le is not None else (")", lt) if lt is not None else None
    if low and high:
        text = f"a {noun} in {low[0]}{low[1]}, {high[1]}{high[0]}"
    elif (ge == 1 and noun == "integer") or (gt == 0 and ge is None):
        text = f"a positive {noun}"
    elif ge == 0:
        text = f"a non-negative {noun}"
    elif low:
        text = f"a{'n' if noun == 'integer' else ''} {noun} {'>=' if low[0] == '[' else '>'} " \
               f"{low[1]}"
    else:
        text = f"a{'n' if noun == 'integer' else ''} {noun}"
    schema["x-allowed"] = text
    return schema


def value_schema(tp: Any, meta: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON Schema of a plan value of Python type ``tp`` (None left out: a plan value is
    never null) under the field metadata ``meta`` (``choices``, bounds, ``min_len``, ``hint``)."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 1:
        tp = args[0]
    if "choices" in meta:
        choices = list(meta["choices"])
        schema: dict[str, Any] = {"enum": choices, "x-allowed": _or_list(choices)}
    elif tp is bool:
        schema = {"type": "boolean", "x-allowed": "true or false"}
    elif tp is int:
        schema = _number_schema("integer", meta)
    elif tp is float:
        schema = _number_schema("number", meta)
    elif tp is str:
        schema = {"type": "string", "minLength": 1, "x-allowed": "a non-empty string"}
    elif typing.get_origin(tp) is list and typing.get_args(tp) == (str,):
        least = int(meta.get("min_len", 0))
        schema = {"type": "array", "items": {"type": "string", "minLength": 1},
                  "minItems": least,
                  "x-allowed": "a non-empty list of strings" if least else "a list of strings"}
    elif typing.get_origin(tp) is list and typing.get_args(tp) == (int,):
        schema = {"type": "array", "items": {"type": "integer", "minimum": 0},
                  "uniqueItems": True, "x-allowed": "a list of distinct integers >= 0"}
    else:
        raise TypeError(f"a plan value of type {tp!r} has no schema; give the field a bool, "
                        "int, float, str, list[str] or list[int] type")
    if meta.get("hint"):
        schema["x-allowed"] += f" ({meta['hint']})"
    return schema


def _parse(source: str, tries: int = 5) -> ast.Module:
    """``ast.parse``, again on CPython 3.11's "AST constructor recursion depth mismatch": the
    converter counts its depth per interpreter, not per thread, so a parse overlapping another
    thread's (a traceback formatted in a server thread parses its line) is refused spuriously."""
    for attempt in range(tries):
        try:
            return ast.parse(source)
        except SystemError as e:
            if "recursion depth mismatch" not in str(e) or attempt == tries - 1:
                raise
    raise AssertionError("unreachable")


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of the dataclass ``cls`` and its bases, joined on one
    line (Python keeps no attribute docstrings at run time: they are read from the source)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = _parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):  # no source (a class built at run time): no docs
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for stmt, after in zip(body, body[1:], strict=False):
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) \
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) \
                    and isinstance(after.value.value, str):
                docs[stmt.target.id] = " ".join(after.value.value.split())
    return docs


def train_settings(config: type = TrainConfig) -> dict[str, Setting]:
    """The training settings a plan sets, in ``config``'s field order: every field of the
    trainer's config dataclass but ``NOT_PLANNED``, its schema from its type and metadata."""
    return {s.name: s for s in _train_settings(config)}


@functools.cache
def _train_settings(config: type) -> tuple[Setting, ...]:
    hints = typing.get_type_hints(config)
    docs = field_docs(config)
    return tuple(Setting(name=f.name, schema=value_schema(hints[f.name], f.metadata),
                         doc=docs.get(f.name, ""))
                 for f in dataclasses.fields(config) if f.name not in NOT_PLANNED)


def train_keys(config: type = TrainConfig) -> tuple[str, ...]:
    """The plan keys that are ``config`` fields (``factory.planner.plan.Plan.train_config``)."""
    return tuple(train_settings(config))


CURATION_ENGINES: tuple[str, ...] = ("embedded", "spark")

GPU_TYPES: tuple[str, ...] = ("H100", "H200", "A100-80G", "L40S", "L4", "CPU")

PLANNER_SETTINGS: dict[str, Setting] = {s.name: s for s in (
    Setting(name="gpu", schema={"enum": list(GPU_TYPES),
                                "x-allowed": "one of " + ", ".join(GPU_TYPES)},
            doc="The accelerator type the run trains on."),
    Setting(name="effective_batch_size",
            schema=value_schema(int, {"ge": 1, "hint": "rows per optimizer step"}),
            doc="Rows per optimizer step over all devices and accumulation steps."),
    Setting(name="eval_devices", schema=value_schema(int, {"ge": 1}),
            doc="Devices of the eval server."),
    Setting(name="eval_gpu_memory_utilization", schema=value_schema(float, {"gt": 0, "le": 1}),
            doc="Share of a device's memory the eval server may take."),
    Setting(name="eval_max_num_seqs", schema=value_schema(int, {"ge": 1}),
            doc="Sequences the eval server batches at once."),
    Setting(name="eval_batch_size", schema=value_schema(int, {"ge": 1}),
            doc="Eval prompts sent per request batch."),
    Setting(name="eval_max_new_tokens", schema=value_schema(int, {"ge": 1}),
            doc="Longest completion an eval generates."),
)}
"""Plan keys beyond the trainer's config: hardware and the eval server's size."""


def plan_settings(config: type = TrainConfig) -> dict[str, Setting]:
    """Every key ``overrides`` and ``sweep`` accept: the training settings of ``config``, then
    the planner's own."""
    return {**train_settings(config), **PLANNER_SETTINGS}


PLAN_KEYS: dict[str, Setting] = plan_settings()
"""Keys ``overrides`` and ``sweep`` accept -> their setting."""


# ---------------------------------------------------------------------------------------------
# The file's schema (JSON Schema, checked by ``jsonschema``). Every leaf carries ``x-allowed``
# (the message is "got <value>; allowed: <x-allowed>") or ``x-message`` (the whole message, its
# ``{value!r}`` and ``{hint}``, a did-you-mean over the schema's ``enum``, filled in). Checks a
# schema cannot say (the recipe exists, the cron string, a mix source's file exists, values
# that depend on each other) are made in code after it.

_FINITE = sys.float_info.max


def _spec(cls: type, properties: dict[str, dict[str, Any]], *, nullable: bool = True,
          required: Sequence[str] = (), message: str | None = None,
          allowed: str | None = None) -> dict[str, Any]:
    """The schema of the mapping that builds the dataclass ``cls``: one property per field,
    in its order; ``message`` or ``allowed`` words what a value of another type gets."""
    fields = [f.name for f in dataclasses.fields(cls)]
    assert set(properties) == set(fields), (cls, set(properties) ^ set(fields))
    schema: dict[str, Any] = {"type": ["object", "null"] if nullable else "object",
                              "properties": {n: properties[n] for n in fields},
                              "additionalProperties": False, "required": list(required)}
    if message is not None:
        schema["x-message"] = message
    if allowed is not None:
        schema["x-allowed"] = allowed
    return schema


def _num(lo: str, lo_value: float, hi: str | None = None, hi_value: float = _FINITE,
         kind: str = "number", *, null: bool = False, allowed: str) -> dict[str, Any]:
    """A number (``kind``: or an integer) bounded by the JSON Schema keywords ``lo`` and ``hi``
    (``hi`` left out: finite)."""
    return {"type": [kind, "null"] if null else kind, lo: lo_value, hi or "maximum": hi_value,
            "x-allowed": allowed}


def _text(allowed: str, *, null: bool = False, pattern: str = r"\S") -> dict[str, Any]:
    return {"type": ["string", "null"] if null else "string", "pattern": pattern,
            "x-allowed": allowed}


_SYNTHESIZE = _spec(SynthesizeSpec, {
    "teacher": _text("the teacher's model name, such as gpt-4o or factory/<experiment>"),
    "base_url": _text("an http(s) URL such as http://127.0.0.1:8787/v1", null=True,
                      pattern=r"^https?://"),
    "api_key_env": _text("a non-empty string", null=True),
    "max_per_slice": _num("minimum", 1, kind="integer", allowed="a positive integer"),
    "attempts_per_sample": _num("minimum", 1, allowed="a number >= 1 (attempts per sample a "
                                                      "slice lacks)"),
    "timeout_s": _num("exclusiveMinimum", 0, allowed="a positive number"),
    "judge_threshold": _num("minimum", -_FINITE, null=True,
                            allowed="a number, or null for the default"),
    "min_confidence": _num("exclusiveMinimum", 0, "maximum", 1, null=True,
                           allowed="a probability in (0, 1], or null"),
}, required=["teacher"], message="must be a mapping such as {teacher: gpt-4o, api_key_env: "
                                  "OPENAI_API_KEY}")

_BALANCE_EXAMPLE = "a column such as language, or {by: language, alpha: 0.5}"
_BALANCE = {
    "if": {"type": ["string", "boolean"]},
    "then": {"enum": [*BALANCE_BY, *BALANCE_OFF],
             "x-allowed": ", ".join(BALANCE_BY) + ", or none (as the traffic has them)"},
    "else": _spec(BalanceSpec, {
        "by": {"enum": list(BALANCE_BY), "x-allowed": ", ".join(BALANCE_BY)},
        "alpha": _num("minimum", 0, "maximum", 1, allowed="a number in [0, 1] (1 keeps the "
                      "traffic's shares, 0 draws every group equally)"),
        "auto": {"enum": [False], "x-allowed": "false (leave balance out for the planner's "
                                               "default)"},
    }, allowed=_BALANCE_EXAMPLE),
}

_DATA = _spec(DataSpec, {
    "where": _text("a non-empty SQL predicate over samples columns and tags, such as "
                   "\"tags['project'] = 'x'\""),
    "eval_fraction": _num("exclusiveMinimum", 0, "exclusiveMaximum", 1,
                          allowed="a number in (0, 1)"),
    "max_tokens": _num("minimum", 16, "maximum", 1_048_576, kind="integer",
                       allowed="an integer from 16 to 1048576"),
    "near_dup_threshold": _num("exclusiveMinimum", 0, "maximum", 1,
                               allowed="a number in (0, 1]"),
    "decontam_ngram": _num("minimum", 1, kind="integer", allowed="a positive integer"),
    "drop": {"type": "array", "x-allowed": f"a list of detectors from {', '.join(DETECTORS)}",
             "items": {"enum": list(DETECTORS), "x-message": "unknown detector {value!r}; "
                       "{hint}allowed: " + ", ".join(DETECTORS)}},
    "judge_threshold": _num("minimum", -_FINITE, null=True,
                            allowed="a number, or null to disable"),
    "min_new_samples": _num("minimum", 0, kind="integer", allowed="a non-negative integer"),
    "seed": {"type": "integer", "x-allowed": "an integer"},
    "engine": {"enum": list(CURATION_ENGINES), "x-allowed": " or ".join(CURATION_ENGINES)},
    "mix": {"type": "object", "minProperties": 1,
            "additionalProperties": _num("exclusiveMinimum", 0, allowed="a positive number (a "
                                         "relative weight)"),
            "x-allowed": "a mapping of sources to weights, such as {traffic: 0.8, "
                         "\"file:general.jsonl\": 0.2}"},
    "synthesize": _SYNTHESIZE,
    "balance": _BALANCE,
}, message="must be a mapping such as {where: \"true\", eval_fraction: 0.1}")

CONSTRAIN_MODES: tuple[str, ...] = ("auto", "on", "off")
"""Values of ``eval.constrain``."""
CONSTRAIN_AUTO: frozenset[str] = frozenset({"choice"})
"""The answer sets ``eval.constrain: auto`` constrains to (``structured_outputs`` kinds):
labels. Measured on triage's dev split (100 held-out-frame tickets per seed, SmolLM2-135M LoRA
checkpoints of three seeds, greedy, on the CPU server): constraining to the labels left the
trained checkpoints' exact-label rate as it was or raised it (0.80 -> 0.82, 0.61 -> 0.61, 0.83 ->
0.83: it only removed the 1-2 answers per 100 outside the set), so it does not hurt and is on; a
deployment of the run is then constrained too, and never answers outside its label set. It
lifts the base model's rate as well (0.00 -> 0.17: constrained, the base guesses a label), so
the base is compared as it would serve under the same constraint. JSON schemas (``json``) are
not measured on a dev split: off, ``on`` asks for them."""

_EVAL = _spec(EvalSpec, {
    "every_steps": _num("exclusiveMinimum", 0, kind="integer", null=True,
                        allowed="a positive integer, or null for the planner"),
    "judge": _text("'embedded' or a model name"),
    "rubric": {"type": ["string", "object"], "minLength": 1,
               "x-allowed": "'auto', a rubric name or a mapping"},
    "max_samples": _num("exclusiveMinimum", 0, kind="integer", null=True,
                        allowed="a positive integer, or null for all"),
    # YAML reads a bare on/off as true/false: both spellings mean the mode.
    "constrain": {"enum": [*CONSTRAIN_MODES, True, False],
                  "x-message": "got {value!r}; {hint}allowed: auto, on (answers of a closed task "
                               "constrained to its labels or JSON shape) or off"},
}, message="must be a mapping such as {every_steps: 20, judge: embedded}")

_SHADOW = _spec(ShadowPolicy, {
    "route": _text("the model name clients send, e.g. gpt-4o-mini"),
    "share": _num("exclusiveMinimum", 0, "maximum", 1, null=True, allowed="a number in (0, 1]"),
    "agreement": _num("minimum", 0, "maximum", 1, null=True, allowed="a number in [0, 1]"),
    "min_pairs": _num("minimum", 1, kind="integer", allowed="a whole number >= 1"),
    "pass_score": _num("minimum", 0, "maximum", 1, null=True, allowed="a number in [0, 1]"),
}, nullable=False, required=["route"],
    message="must be a mapping with at least 'route' (the model name whose calls the candidate "
            "shadows)")

DEPLOY_POLICIES: tuple[str, ...] = ("auto", "manual")
"""Values of ``deploy``: what happens once a finished run's checkpoints are all scored."""

_DEPLOY = {
    "if": {"type": "object"},
    "then": {"type": "object", "properties": {"shadow": _SHADOW}, "required": ["shadow"],
             "additionalProperties": False},
    "else": {"enum": list(DEPLOY_POLICIES),
             "x-allowed": "auto (deploy the best checkpoint once every checkpoint is scored), "
                          "manual, or {shadow: {route: MODEL, ...}}"},
}

_NAME = {"type": "string", "pattern": NAME_RE.pattern,
         "x-allowed": "lowercase letters, digits, '-' and '_', starting with a letter or digit, "
                      "at most 64 characters"}


def experiment_schema(config: type = TrainConfig) -> dict[str, Any]:
    """The JSON Schema of an experiment file whose plan keys are those of ``config``."""
    keys = plan_settings(config)
    names = sorted(keys)
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "x-message": "an experiment file must be a mapping with at least 'recipe' (and usually "
                     "'name', 'data')",
        "additionalProperties": False,
        "properties": {
            "name": _NAME,
            "description": {"type": "string", "x-message": "must be text"},
            "data": _DATA,
            "recipe": {},  # checked in code: the recipes are known only when loading
            "overrides": {"type": ["object", "null"], "additionalProperties": False,
                          "properties": {k: keys[k].schema for k in names},
                          "x-message": "must be a mapping of plan keys to values, such as "
                                       "{learning_rate: 2.0e-4}"},
            "eval": _EVAL,
            "sweep": {"type": ["object", "null"], "additionalProperties": False,
                      "properties": {k: {"type": "array", "minItems": 1,
                                         "items": keys[k].schema,
                                         "x-allowed": "a non-empty list of values"}
                                     for k in names},
                      "x-message": "must be a mapping of plan keys to lists of values, such as "
                                   "{learning_rate: [1.0e-4, 2.0e-4]}"},
            "schedule": {"type": ["string", "null"],
                         "x-allowed": "a cron string such as \"0 3 * * *\", or null"},
            "retrain_on_new_samples": {"type": "boolean", "x-allowed": "true or false"},
            "deploy": _DEPLOY,
        },
    }


TOP_KEYS = list(experiment_schema()["properties"])


def _strict_integer(checker: Any, instance: Any) -> bool:
    """An integer is an ``int`` (JSON Schema's would take ``2.0``, YAML's ``2.0`` is a float)."""
    return isinstance(instance, int) and not isinstance(instance, bool)


_Validator = jsonschema.validators.extend(
    jsonschema.Draft202012Validator,
    type_checker=jsonschema.Draft202012Validator.TYPE_CHECKER.redefine("integer",
                                                                       _strict_integer))


@functools.cache
def _validator(config: type) -> Any:
    return _Validator(experiment_schema(config))


def _value_problem(value: Any, schema: Mapping[str, Any]) -> str:
    """Today's message for a value its schema refuses."""
    if "x-message" in schema:
        close = difflib.get_close_matches(str(value), [str(v) for v in schema.get("enum", ())],
                                          n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        return str(schema["x-message"]).replace("{value!r}", repr(value)).replace("{hint}", hint)
    return f"got {value!r}; allowed: {schema['x-allowed']}"


def check_plan_value(key: str, value: Any, config: type = TrainConfig) -> str | None:
    """Why ``value`` is not allowed for plan key ``key``, or None if it is."""
    schema = plan_settings(config)[key].schema
    return None if _Validator(schema).is_valid(value) else _value_problem(value, schema)


# ---------------------------------------------------------------------------------------------
# YAML with line numbers

def _lines(node: yaml.Node, path: tuple[str, ...], out: dict[tuple[str, ...], int]) -> None:
    out[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = str(key_node.value)
            out[(*path, key)] = key_node.start_mark.line + 1
            _lines(value_node, (*path, key), out)
            out[(*path, key)] = key_node.start_mark.line + 1
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _lines(item, (*path, str(i)), out)


class _Ctx:
    """Where errors point: the file and the line of each field path."""

    def __init__(self, path: Path, lines: dict[tuple[str, ...], int]) -> None:
        self.path = path
        self.lines = lines

    def line(self, fieldpath: tuple[str, ...]) -> int:
        probe = fieldpath
        while probe and probe not in self.lines:
            probe = probe[:-1]
        return self.lines.get(probe, 1)

    def error(self, fieldpath: tuple[str, ...], message: str) -> ExperimentError:
        name = ".".join(fieldpath) or "(top level)"
        return ExperimentError(f"{self.path}:{self.line(fieldpath)}: {name}: {message}")

    def unknown(self, fieldpath: tuple[str, ...], key: str, allowed: list[str]) -> ExperimentError:
        close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}? " if close else ""
        return self.error((*fieldpath, key),
                          f"unknown key {key!r}; {hint}allowed: {', '.join(allowed)}")


def _schema_error(ctx: _Ctx, error: jsonschema.ValidationError) -> tuple[tuple[str, ...], str]:
    """The field path and message of one schema error, in the words of ``x-allowed``."""
    where = tuple(str(p) for p in error.absolute_path)
    schema, instance = error.schema, error.instance
    if error.validator == "additionalProperties":
        allowed = list(schema.get("properties", {}))
        extra = next(k for k in instance if k not in allowed)
        if not isinstance(extra, str):
            return where, f"keys must be strings, got {extra!r}"
        close = difflib.get_close_matches(extra, allowed, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}? " if close else ""
        return (*where, extra), f"unknown key {extra!r}; {hint}allowed: {', '.join(allowed)}"
    if error.validator == "required":
        missing = next(k for k in error.validator_value if k not in instance)
        return (*where, missing), _value_problem(None, schema["properties"][missing])
    return where, _value_problem(instance, schema)


def _check_schema(ctx: _Ctx, raw: Any, config: type) -> None:
    """Raise the first (by line) of the errors the schema finds in ``raw``."""
    found = [_schema_error(ctx, e) for e in _validator(config).iter_errors(raw)]
    if found:
        where, message = min(found, key=lambda f: (ctx.line(f[0]), -len(f[0])))
        raise ctx.error(where, message)


# ---------------------------------------------------------------------------------------------
# Cron strings, checked and stepped by ``croniter``

_CRON_FIELDS = (("minute", 0, 59), ("hour", 0, 23), ("day of month", 1, 31), ("month", 1, 12),
                ("day of week", 0, 7))
"""The five fields, for messages that name the bad one (croniter's name only the string)."""
_CRON_ALIASES = {"@hourly": "0 * * * *", "@daily": "0 0 * * *", "@weekly": "0 0 * * 0",
                 "@monthly": "0 0 1 * *", "@yearly": "0 0 1 1 *"}


def cron_problem(expr: str) -> str | None:
    """Why ``expr`` is not a 5-field cron string, or None if it is one."""
    parts = _CRON_ALIASES.get(expr.strip(), expr).split()
    if len(parts) != 5:  # croniter also takes 6 and 7 fields (seconds, years)
        return f"expected 5 fields (minute hour day month weekday), got {len(parts)}"
    if croniter.is_valid(" ".join(parts)):
        return None
    for i, (text, (label, lo, hi)) in enumerate(zip(parts, _CRON_FIELDS, strict=True)):
        if croniter.is_valid(" ".join(text if j == i else "*" for j in range(5))):
            continue
        for item in text.split(","):
            base, _, step = item.partition("/")
            if step and not (step.isdigit() and int(step) > 0):
                return f"bad step {step!r} in the {label} field"
            outside = [n for n in re.findall(r"\d+", base) if not lo <= int(n) <= hi]
            if outside:
                return f"{label} {outside[0]} outside {lo}-{hi}"
        return f"bad {label} {text!r}"
    return f"not a cron string {expr!r}"


def cron_matches(expr: str, when: datetime) -> bool:
    """Whether the 5-field cron ``expr`` fires at the minute ``when`` (UTC)."""
    return bool(croniter.match(expr, when.replace(second=0, microsecond=0)))


def last_cron_tick(expr: str, now: datetime, *, lookback_days: int = 8) -> datetime | None:
    """The latest minute at or before ``now`` at which ``expr`` fires (None within lookback)."""
    after = now.replace(second=0, microsecond=0) + timedelta(minutes=1)
    tick: datetime = croniter(expr, after).get_prev(datetime)
    return tick if tick > after - timedelta(days=lookback_days) else None


# ---------------------------------------------------------------------------------------------
# Parsing: the schema first, then what it cannot say

def _floats(cls: type, raw: Mapping[str, Any]) -> dict[str, Any]:
    """``raw``'s values with the integers of ``float`` fields as floats (YAML ``1`` is an int)."""
    types_ = {f.name: str(f.type) for f in dataclasses.fields(cls)}
    return {k: float(v) if types_[k].startswith("float") and isinstance(v, int) else v
            for k, v in raw.items()}


def _parse_data(ctx: _Ctx, raw: Mapping[str, Any] | None) -> DataSpec:
    where = ("data",)
    if raw is None:
        return DataSpec()
    kw = _floats(DataSpec, {k: v for k, v in raw.items()
                            if k not in ("mix", "balance", "synthesize")})
    if ";" in kw.get("where", ""):
        raise ctx.error((*where, "where"), "must be one predicate, without ';'")
    if "drop" in kw:
        kw["drop"] = tuple(dict.fromkeys(kw["drop"]))
    if "mix" in raw:
        kw["mix"] = _parse_mix(ctx, raw["mix"])
    if raw.get("balance") in BALANCE_OFF:
        kw["balance"] = None
    elif raw.get("balance") is not None:
        balance = raw["balance"]
        kw["balance"] = BalanceSpec(**_floats(BalanceSpec, {"by": balance}
                                              if isinstance(balance, str) else balance))
        if kw.get("mix") and "traffic" not in {m.source for m in kw["mix"]}:
            raise ctx.error((*where, "balance"), "balance splits the traffic into groups, and "
                            "data.mix does not name traffic; add it or remove balance")
    if raw.get("synthesize") is not None:
        kw["synthesize"] = SynthesizeSpec(**_floats(SynthesizeSpec, raw["synthesize"]))
        if kw.get("engine") == "spark":
            raise ctx.error((*where, "synthesize"), "the spark engine does not curate "
                            "synthetic samples; use engine: embedded")
    return DataSpec(**kw)


def _parse_mix(ctx: _Ctx, raw: Mapping[str, Any]) -> tuple[MixEntry, ...]:
    where = ("data", "mix")
    entries = []
    for key, weight in raw.items():
        at = (*where, str(key))
        if not isinstance(key, str):
            raise ctx.error(where, f"source {key!r} is not text; allowed: "
                            f"{', '.join(MIX_KINDS)}")
        kind, colon, target = key.partition(":")
        if kind in ("traffic", "synthetic") and not colon:
            source = kind
        elif kind == "experiment" and colon:
            if not NAME_RE.match(target):
                raise ctx.error(at, f"{target!r} is not an experiment name (lowercase letters, "
                                "digits, '-' and '_')")
            source = key
        elif kind == "file" and colon and target:
            path = Path(target).expanduser()
            path = path if path.is_absolute() else ctx.path.parent / path
            if not path.is_file():
                raise ctx.error(at, f"no such file {path}")
            source = f"file:{path.resolve()}"
        else:
            close = difflib.get_close_matches(kind, ["traffic", "synthetic", "experiment",
                                                     "file"], n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ctx.error(at, f"unknown source {key!r}; {hint}allowed: "
                            f"{', '.join(MIX_KINDS)}")
        entries.append(MixEntry(source=source, weight=float(weight)))
    entries.sort(key=lambda e: e.source != "traffic")  # the primary source first
    return tuple(entries)


def _parse_eval(raw: Mapping[str, Any] | None) -> EvalSpec:
    if raw is None:
        return EvalSpec()
    kw: dict[str, Any] = {k: dict(v) if isinstance(v, Mapping) else v for k, v in raw.items()}
    if isinstance(kw.get("constrain"), bool):
        kw["constrain"] = "on" if kw["constrain"] else "off"
    return EvalSpec(**kw)


def _parse_sweep(ctx: _Ctx, raw: Mapping[str, Any] | None) -> dict[str, list[Any]]:
    where = ("sweep",)
    out: dict[str, list[Any]] = {}
    num_points = 1
    for key, values in (raw or {}).items():
        if len({repr(v) for v in values}) != len(values):
            raise ctx.error((*where, key), "lists a value twice; each point must be distinct")
        out[key] = list(values)
        num_points *= len(values)
    if num_points > 256:
        raise ctx.error(where, f"expands to {num_points} runs; at most 256 are allowed, "
                        "shorten the value lists")
    return out


def parse_experiment(text: str, path: Path, *, config: type = TrainConfig) -> Experiment:
    """Validate the YAML ``text`` of the experiment file at ``path``; ``overrides`` and
    ``sweep`` take the training settings of ``config`` (the trainer's ``TrainConfig``)."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else 1
        problem = getattr(exc, "problem", None) or str(exc)
        raise ExperimentError(f"{path}:{line}: not valid YAML: {problem}") from None
    lines: dict[tuple[str, ...], int] = {}
    if node is not None:
        _lines(node, (), lines)
    ctx = _Ctx(path, lines)
    _check_schema(ctx, raw, config)

    name = raw.get("name", path.stem)
    if not NAME_RE.match(name):  # the file's stem, when it has no name
        raise ctx.error(("name",), _value_problem(name, _NAME))
    if "recipe" not in raw:
        raise ctx.error((), "missing 'recipe'; name one of: " + ", ".join(_recipe_names()))
    recipe = raw["recipe"]
    known = _recipe_names()
    if not isinstance(recipe, str) or (known and recipe not in known):
        close = difflib.get_close_matches(str(recipe), known, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ctx.error(("recipe",), f"unknown recipe {recipe!r}; {hint}"
                        f"allowed: {', '.join(known)}")

    schedule = raw.get("schedule")
    if schedule is not None:
        problem = cron_problem(schedule)
        if problem:
            raise ctx.error(("schedule",), f"{problem}; allowed: a cron string such as "
                            "\"0 3 * * *\" (minute hour day month weekday)")
        schedule = _CRON_ALIASES.get(schedule.strip(), schedule.strip())

    overrides = dict(raw.get("overrides") or {})
    sweep = _parse_sweep(ctx, raw.get("sweep"))
    both = sorted(set(overrides) & set(sweep))
    if both:
        raise ctx.error(("sweep", both[0]), f"{both[0]!r} is both overridden and swept; "
                        "remove it from one of 'overrides' and 'sweep'")
    deploy = raw.get("deploy", "manual" if sweep else "auto")
    shadow = None
    if isinstance(deploy, Mapping):
        shadow = _parse_shadow(deploy["shadow"])
        deploy = "shadow"
    data = _parse_data(ctx, raw.get("data"))
    if f"experiment:{name}" in {m.source for m in data.mix}:
        raise ctx.error(("data", "mix", f"experiment:{name}"), "an experiment cannot mix in "
                        "its own training set; name it 'traffic'")
    return Experiment(
        name=name, path=path, data=data, recipe=recipe,
        overrides=overrides, eval=_parse_eval(raw.get("eval")), sweep=sweep,
        schedule=schedule, retrain_on_new_samples=raw.get("retrain_on_new_samples", False),
        deploy=deploy, raw=dict(raw), shadow=shadow,
    )


def _parse_shadow(raw: Mapping[str, Any]) -> ShadowPolicy:
    kw = _floats(ShadowPolicy, {k: v for k, v in raw.items() if v is not None})
    kw["route"] = kw["route"].strip()
    return ShadowPolicy(**kw)


def _recipe_names() -> list[str]:
    return list_recipe_names()


def experiment_path(name_or_path: str | Path) -> Path:
    """The file of an experiment given by name (``<experiments_dir>/<name>.yaml``) or path."""
    candidate = Path(name_or_path)
    if candidate.suffix in (".yaml", ".yml") or candidate.is_file():
        return candidate
    directory = get_settings().experiments_dir
    for suffix in (".yaml", ".yml"):
        path = directory / f"{name_or_path}{suffix}"
        if path.is_file():
            return path
    for path in experiment_files(directory):  # a file whose ``name:`` differs from its stem
        try:
            raw = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError):
            continue
        if isinstance(raw, Mapping) and raw.get("name") == str(name_or_path):
            return path
    known = ", ".join(p.stem for p in experiment_files(directory)) or "none"
    raise ExperimentError(f"no experiment {str(name_or_path)!r} in {directory} "
                          f"(expected {directory / (str(name_or_path) + '.yaml')}); "
                          f"experiments there: {known}")


def experiment_files(directory: Path) -> list[Path]:
    if not directory.is_dir():
        return []
    return sorted([*directory.glob("*.yaml"), *directory.glob("*.yml")])


def load_experiment(name_or_path: str | Path) -> Experiment:
    """Load and validate an experiment by name (looked up in the experiments folder) or path."""
    path = experiment_path(name_or_path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ExperimentError(f"{path}: cannot read: {exc.strerror or exc}") from None
    return parse_experiment(text, path)


def list_experiments(directory: Path | None = None) -> list[Experiment]:
    """Every experiment of the experiments folder, sorted by name; a bad file raises."""
    directory = directory or get_settings().experiments_dir
    experiments = [load_experiment(path) for path in experiment_files(directory)]
    seen: dict[str, Path] = {}
    for exp in experiments:
        if exp.name in seen:
            raise ExperimentError(f"{exp.path}:1: name: {exp.name!r} is also the name of "
                                  f"{seen[exp.name]}; experiment names must be unique")
        seen[exp.name] = exp.path
    return sorted(experiments, key=lambda e: e.name)


def sweep_points(experiment: Experiment) -> list[dict[str, Any]]:
    """The sweep's points (cartesian product, in file order); ``[{}]`` without a sweep."""
    points: list[dict[str, Any]] = [{}]
    for key, values in experiment.sweep.items():
        points = [{**p, key: v} for p in points for v in values]
    return points


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list):
        return "+".join(_fmt(v) for v in value)
    return str(value)


def run_key(experiment_name: str, point: Mapping[str, Any]) -> str:
    """Stable key of one run (a sweep point): ``<experiment>`` or ``<experiment>/k=v/k=v``.

    Keys are sorted so that reordering the sweep block in the file keeps each run's key.
    """
    if not point:
        return experiment_name
    # '/' rather than ',' because the Dagster UI reads commas in partition selections as lists.
    body = "/".join(f"{k}={_fmt(point[k])}" for k in sorted(point))
    return f"{experiment_name}/{body}"


def run_id(key: str) -> str:
    """A trainer-safe run id for a run key (``[A-Za-z0-9._-]``, at most 128 characters).

    Readable prefix plus a hash of the exact key, so two keys never share an id.
    """
    import hashlib

    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", key).strip("-.") or "run"
    digest = hashlib.sha256(key.encode()).hexdigest()[:10]
    return f"{slug[:110]}-{digest}"


def experiment_sha(experiment: Experiment) -> str:
    """sha256 of the experiment's parsed content (stable across comments and key order)."""
    import hashlib
    import json

    blob = json.dumps(experiment.raw, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()


def run_keys(experiment: Experiment) -> list[str]:
    """Stable keys of every run of the experiment, one per sweep point."""
    return [run_key(experiment.name, p) for p in sweep_points(experiment)]

