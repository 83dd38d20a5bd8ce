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
    eval: {every_steps: 20, judge: embedded, rubric: auto}
    sweep: {learning_rate: [1.0e-4, 2.0e-4, 4.0e-4], lora_rank: [8, 16]}
    schedule: "0 3 * * *"
    deploy: manual        # auto | manual; default: auto for a single run, manual for a sweep
    # or shadow first: serve the best checkpoint as a candidate beside gpt-4o-mini's traffic and
    # promote it behind factory/<name> once it agrees with the frontier model often enough
    # deploy: {shadow: {route: gpt-4o-mini, share: 0.2, agreement: 0.95, min_pairs: 200}}

Loading validates every field and raises ``ExperimentError`` naming the file, the line, the
field and what is allowed; unknown keys are errors with a did-you-mean, because a misspelt
``learnig_rate`` silently ignored would train the wrong model.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import yaml

from factory.errors import FactoryError
from factory.settings import get_settings


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
    balance: BalanceSpec | None = None
    """Draw the traffic's groups (its languages) closer to even than their counts; None: as
    the traffic has them."""


BALANCE_BY: tuple[str, ...] = ("language",)
"""Dataset columns ``data.balance`` can group the traffic by."""


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
# Plan keys that ``overrides`` and ``sweep`` may set, with their value checks. The planner owns
# the meaning of each; it is declared here so that a file is validated without planning it.

def _pos_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _nonneg_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _pos_float(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and v > 0


def _unit_float(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v < 1


def _bool(v: Any) -> bool:
    return isinstance(v, bool)


def _str_list(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, str) and x for x in v)


def _str_list_or_empty(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) and x for x in v)


def _one_of(*allowed: str) -> Callable[[Any], bool]:
    def check(v: Any) -> bool:
        return v in allowed
    return check


CURATION_ENGINES: tuple[str, ...] = ("embedded", "spark")

GPU_TYPES: tuple[str, ...] = ("H100", "H200", "A100-80G", "L40S", "L4", "CPU")

PLAN_KEYS: dict[str, tuple[Callable[[Any], bool], str]] = {
    # hardware
    "gpu": (_one_of(*GPU_TYPES), "one of " + ", ".join(GPU_TYPES)),
    "num_devices": (_pos_int, "a positive integer (accelerators for training)"),
    # the trainer's TrainConfig fields (same names)
    "max_seq_len": (_pos_int, "a positive integer (tokens)"),
    "packing": (_bool, "true or false"),
    "share_prefix": (_bool, "true or false"),
    "micro_batch_size": (_pos_int, "a positive integer"),
    "grad_accum_steps": (_pos_int, "a positive integer"),
    "learning_rate": (_pos_float, "a positive number such as 2.0e-4"),
    "lr_schedule": (_one_of("cosine", "linear", "constant"), "cosine, linear or constant"),
    "warmup_steps": (_nonneg_int, "a non-negative integer"),
    "num_steps": (_pos_int, "a positive integer (optimizer steps)"),
    "num_epochs": (_pos_float, "a positive number"),
    "weight_decay": (lambda v: isinstance(v, int | float) and not isinstance(v, bool) and v >= 0,
                     "a non-negative number"),
    "max_grad_norm": (lambda v: isinstance(v, int | float) and not isinstance(v, bool)
                      and v >= 0, "a non-negative number (0 disables clipping)"),
    "lora_rank": (_pos_int, "a positive integer"),
    "lora_alpha": (_pos_float, "a positive number"),
    "lora_dropout": (_unit_float, "a number in [0, 1)"),
    "lora_target_modules": (_str_list, "a non-empty list of module names"),
    "precision": (_one_of("fp32", "bf16-autocast", "bf16"), "fp32, bf16-autocast or bf16"),
    "gradient_checkpointing": (_bool, "true or false"),
    "frozen_modules": (_str_list_or_empty, "a list of module names"),
    "checkpoint_every_steps": (_pos_int, "a positive integer"),
    "eval_every_steps": (_pos_int, "a positive integer"),
    "seed": (_nonneg_int, "a non-negative integer"),
    "use_kernels": (_bool, "true or false"),
    "parallelism": (_one_of("single", "fsdp2"), "single or fsdp2"),
    # planner-only values
    "effective_batch_size": (_pos_int, "a positive integer (rows per optimizer step)"),
    "eval_devices": (_pos_int, "a positive integer"),
    "eval_gpu_memory_utilization": (lambda v: isinstance(v, int | float)
                                    and not isinstance(v, bool) and 0 < v <= 1,
                                    "a number in (0, 1]"),
    "eval_max_num_seqs": (_pos_int, "a positive integer"),
    "eval_batch_size": (_pos_int, "a positive integer"),
    "eval_max_new_tokens": (_pos_int, "a positive integer"),
}
"""Keys ``overrides`` and ``sweep`` accept -> (value check, what is allowed)."""


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

    def error(self, fieldpath: tuple[str, ...], message: str) -> ExperimentError:
        probe = fieldpath
        while probe and probe not in self.lines:
            probe = probe[:-1]
        line = self.lines.get(probe, 1)
        name = ".".join(fieldpath) or "(top level)"
        return ExperimentError(f"{self.path}:{line}: {name}: {message}")

    def unknown(self, fieldpath: tuple[str, ...], key: str, allowed: list[str]) -> ExperimentError:
        close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}? " if close else ""
        return self.error((*fieldpath, key),
                          f"unknown key {key!r}; {hint}allowed: {', '.join(allowed)}")


def _check_keys(ctx: _Ctx, where: tuple[str, ...], mapping: Mapping[str, Any],
                allowed: list[str]) -> None:
    for key in mapping:
        if not isinstance(key, str):
            raise ctx.error(where, f"keys must be strings, got {key!r}")
        if key not in allowed:
            raise ctx.unknown(where, key, allowed)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


_CRON_FIELDS = (("minute", 0, 59), ("hour", 0, 23), ("day of month", 1, 31), ("month", 1, 12),
                ("day of week", 0, 7))
_CRON_ALIASES = {"@hourly": "0 * * * *", "@daily": "0 0 * * *", "@weekly": "0 0 * * 0",
                 "@monthly": "0 0 1 * *", "@yearly": "0 0 1 1 *"}


def cron_problem(expr: str) -> str | None:
    """Why ``expr`` is not a 5-field cron string, or None if it is one."""
    expr = _CRON_ALIASES.get(expr.strip(), expr)
    parts = expr.split()
    if len(parts) != 5:
        return f"expected 5 fields (minute hour day month weekday), got {len(parts)}"
    for text, (label, lo, hi) in zip(parts, _CRON_FIELDS, strict=True):
        for item in text.split(","):
            base, _, step = item.partition("/")
            if step and not (step.isdigit() and int(step) > 0):
                return f"bad step {step!r} in the {label} field"
            if base == "*":
                continue
            bounds = base.split("-")
            if len(bounds) > 2 or not all(b.isdigit() for b in bounds):
                return f"bad {label} {item!r}"
            for b in bounds:
                if not lo <= int(b) <= hi:
                    return f"{label} {b} outside {lo}-{hi}"
    return None


def _cron_field_matches(text: str, value: int, lo: int, hi: int) -> bool:
    for item in text.split(","):
        base, _, step_text = item.partition("/")
        step = int(step_text) if step_text else 1
        if base == "*":
            start, end = lo, hi
        elif "-" in base:
            a, b = base.split("-")
            start, end = int(a), int(b)
        else:
            start = int(base)
            end = hi if step_text else start
        if start <= value <= end and (value - start) % step == 0:
            return True
    return False


def cron_matches(expr: str, when: datetime) -> bool:
    """Whether the 5-field cron ``expr`` fires at the minute ``when`` (UTC)."""
    parts = _CRON_ALIASES.get(expr.strip(), expr).split()
    weekday = (when.weekday() + 1) % 7  # cron: 0 (or 7) is Sunday
    values = (when.minute, when.hour, when.day, when.month, weekday)
    for text, value, (_, lo, hi) in zip(parts, values, _CRON_FIELDS, strict=True):
        if text.strip() in ("7", "0") and _ == "day of week":
            if weekday != 0:
                return False
            continue
        if not _cron_field_matches(text, value, lo, hi):
            return False
    return True


def last_cron_tick(expr: str, now: datetime, *, lookback_days: int = 8) -> datetime | None:
    """The latest minute at or before ``now`` at which ``expr`` fires (None within lookback)."""
    when = now.replace(second=0, microsecond=0)
    for _ in range(lookback_days * 24 * 60):
        if cron_matches(expr, when):
            return when
        when -= timedelta(minutes=1)
    return None


def check_plan_value(key: str, value: Any) -> str | None:
    """Why ``value`` is not allowed for plan key ``key``, or None if it is."""
    check, allowed = PLAN_KEYS[key]
    return None if check(value) else f"got {value!r}; allowed: {allowed}"


# ---------------------------------------------------------------------------------------------
# Parsing

def _parse_data(ctx: _Ctx, raw: Any) -> DataSpec:
    where = ("data",)
    if raw is None:
        return DataSpec()
    if not isinstance(raw, Mapping):
        raise ctx.error(where, "must be a mapping such as {where: \"true\", eval_fraction: 0.1}")
    allowed = list(DataSpec.__dataclass_fields__)
    _check_keys(ctx, where, raw, allowed)
    kw: dict[str, Any] = {}
    if "where" in raw:
        v = raw["where"]
        if not isinstance(v, str) or not v.strip():
            raise ctx.error((*where, "where"), f"got {v!r}; allowed: a non-empty SQL predicate "
                            "over samples columns and tags, such as \"tags['project'] = 'x'\"")
        if ";" in v:
            raise ctx.error((*where, "where"), "must be one predicate, without ';'")
        kw["where"] = v
    if "eval_fraction" in raw:
        v = raw["eval_fraction"]
        if not (_is_num(v) and 0 < v < 1):
            raise ctx.error((*where, "eval_fraction"), f"got {v!r}; allowed: a number in (0, 1)")
        kw["eval_fraction"] = float(v)
    if "max_tokens" in raw:
        v = raw["max_tokens"]
        if not (_is_int(v) and 16 <= v <= 1_048_576):
            raise ctx.error((*where, "max_tokens"), f"got {v!r}; allowed: an integer "
                            "from 16 to 1048576")
        kw["max_tokens"] = v
    if "near_dup_threshold" in raw:
        v = raw["near_dup_threshold"]
        if not (_is_num(v) and 0 < v <= 1):
            raise ctx.error((*where, "near_dup_threshold"),
                            f"got {v!r}; allowed: a number in (0, 1]")
        kw["near_dup_threshold"] = float(v)
    if "decontam_ngram" in raw:
        v = raw["decontam_ngram"]
        if not (_is_int(v) and v >= 1):
            raise ctx.error((*where, "decontam_ngram"), f"got {v!r}; allowed: a positive integer")
        kw["decontam_ngram"] = v
    if "drop" in raw:
        v = raw["drop"]
        if not isinstance(v, list):
            raise ctx.error((*where, "drop"), f"got {v!r}; allowed: a list of detectors "
                            f"from {', '.join(DETECTORS)}")
        for i, item in enumerate(v):
            if item not in DETECTORS:
                close = difflib.get_close_matches(str(item), DETECTORS, n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise ctx.error((*where, "drop", str(i)), f"unknown detector {item!r}; {hint}"
                                f"allowed: {', '.join(DETECTORS)}")
        kw["drop"] = tuple(dict.fromkeys(v))
    if "judge_threshold" in raw:
        v = raw["judge_threshold"]
        if v is not None and not _is_num(v):
            raise ctx.error((*where, "judge_threshold"),
                            f"got {v!r}; allowed: a number, or null to disable")
        kw["judge_threshold"] = None if v is None else float(v)
    if "min_new_samples" in raw:
        v = raw["min_new_samples"]
        if not (_is_int(v) and v >= 0):
            raise ctx.error((*where, "min_new_samples"),
                            f"got {v!r}; allowed: a non-negative integer")
        kw["min_new_samples"] = v
    if "seed" in raw:
        v = raw["seed"]
        if not _is_int(v):
            raise ctx.error((*where, "seed"), f"got {v!r}; allowed: an integer")
        kw["seed"] = v
    if "engine" in raw:
        v = raw["engine"]
        if v not in CURATION_ENGINES:
            raise ctx.error((*where, "engine"),
                            f"got {v!r}; allowed: {' or '.join(CURATION_ENGINES)}")
        kw["engine"] = v
    if "mix" in raw:
        kw["mix"] = _parse_mix(ctx, raw["mix"])
    if raw.get("balance") is not None:
        kw["balance"] = _parse_balance(ctx, raw["balance"])
        if kw.get("mix") and "traffic" not in {m.source for m in kw["mix"]}:
            raise ctx.error((*where, "balance"), "balance splits the traffic into groups, and "
                            "data.mix does not name traffic; add it or remove balance")
    if raw.get("synthesize") is not None:
        kw["synthesize"] = _parse_synthesize(ctx, raw["synthesize"])
        if kw.get("engine") == "spark":
            raise ctx.error((*where, "synthesize"), "the spark engine does not curate "
                            "synthetic samples; use engine: embedded")
    return DataSpec(**kw)


def _parse_balance(ctx: _Ctx, raw: Any) -> BalanceSpec:
    where = ("data", "balance")
    if isinstance(raw, str):
        raw = {"by": raw}
    if not isinstance(raw, Mapping):
        raise ctx.error(where, f"got {raw!r}; allowed: a column such as language, or "
                        "{by: language, alpha: 0.5}")
    _check_keys(ctx, where, raw, list(BalanceSpec.__dataclass_fields__))
    kw: dict[str, Any] = {}
    if "by" in raw:
        if raw["by"] not in BALANCE_BY:
            raise ctx.error((*where, "by"), f"got {raw['by']!r}; allowed: "
                            f"{', '.join(BALANCE_BY)}")
        kw["by"] = raw["by"]
    if "alpha" in raw:
        v = raw["alpha"]
        if not (_is_num(v) and 0 <= v <= 1):
            raise ctx.error((*where, "alpha"), f"got {v!r}; allowed: a number in [0, 1] (1 keeps "
                            "the traffic's shares, 0 draws every group equally)")
        kw["alpha"] = float(v)
    return BalanceSpec(**kw)


def _parse_synthesize(ctx: _Ctx, raw: Any) -> SynthesizeSpec:
    where = ("data", "synthesize")
    if not isinstance(raw, Mapping):
        raise ctx.error(where, "must be a mapping such as {teacher: gpt-4o, "
                        "api_key_env: OPENAI_API_KEY}")
    _check_keys(ctx, where, raw, list(SynthesizeSpec.__dataclass_fields__))
    teacher = raw.get("teacher")
    if not isinstance(teacher, str) or not teacher.strip():
        raise ctx.error((*where, "teacher"), f"got {teacher!r}; allowed: the teacher's model "
                        "name, such as gpt-4o or factory/<experiment>")
    kw: dict[str, Any] = {"teacher": teacher}
    for key in ("base_url", "api_key_env"):
        v = raw.get(key)
        if v is not None and (not isinstance(v, str) or not v.strip()):
            raise ctx.error((*where, key), f"got {v!r}; allowed: a non-empty string")
        kw[key] = v
    if kw["base_url"] is not None and not kw["base_url"].startswith(("http://", "https://")):
        raise ctx.error((*where, "base_url"), f"got {kw['base_url']!r}; allowed: an http(s) "
                        "URL such as http://127.0.0.1:8787/v1")
    if "max_per_slice" in raw:
        v = raw["max_per_slice"]
        if not (_is_int(v) and v >= 1):
            raise ctx.error((*where, "max_per_slice"), f"got {v!r}; allowed: a positive integer")
        kw["max_per_slice"] = v
    if "attempts_per_sample" in raw:
        v = raw["attempts_per_sample"]
        if not (_is_num(v) and 1 <= v < float("inf")):
            raise ctx.error((*where, "attempts_per_sample"),
                            f"got {v!r}; allowed: a number >= 1 (attempts per sample a slice "
                            "lacks)")
        kw["attempts_per_sample"] = float(v)
    if "timeout_s" in raw:
        v = raw["timeout_s"]
        if not (_is_num(v) and v > 0):
            raise ctx.error((*where, "timeout_s"), f"got {v!r}; allowed: a positive number")
        kw["timeout_s"] = float(v)
    if raw.get("judge_threshold") is not None:
        v = raw["judge_threshold"]
        if not _is_num(v):
            raise ctx.error((*where, "judge_threshold"),
                            f"got {v!r}; allowed: a number, or null for the default")
        kw["judge_threshold"] = float(v)
    if raw.get("min_confidence") is not None:
        v = raw["min_confidence"]
        if not (_is_num(v) and 0 < v <= 1):
            raise ctx.error((*where, "min_confidence"),
                            f"got {v!r}; allowed: a probability in (0, 1], or null")
        kw["min_confidence"] = float(v)
    return SynthesizeSpec(**kw)


def _parse_mix(ctx: _Ctx, raw: Any) -> tuple[MixEntry, ...]:
    where = ("data", "mix")
    example = ("a mapping of sources to weights, such as {traffic: 0.8, "
               "\"file:general.jsonl\": 0.2}")
    if not isinstance(raw, Mapping) or not raw:
        raise ctx.error(where, f"got {raw!r}; allowed: {example}")
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
        if not (_is_num(weight) and 0 < weight < float("inf")):
            raise ctx.error(at, f"got {weight!r}; allowed: a positive number (a relative "
                            "weight)")
        entries.append(MixEntry(source=source, weight=float(weight)))
    entries.sort(key=lambda e: e.source != "traffic")  # the primary source first
    return tuple(entries)


def _parse_eval(ctx: _Ctx, raw: Any) -> EvalSpec:
    where = ("eval",)
    if raw is None:
        return EvalSpec()
    if not isinstance(raw, Mapping):
        raise ctx.error(where, "must be a mapping such as {every_steps: 20, judge: embedded}")
    _check_keys(ctx, where, raw, list(EvalSpec.__dataclass_fields__))
    kw: dict[str, Any] = {}
    if "every_steps" in raw:
        v = raw["every_steps"]
        if v is not None and not (_is_int(v) and v > 0):
            raise ctx.error((*where, "every_steps"),
                            f"got {v!r}; allowed: a positive integer, or null for the planner")
        kw["every_steps"] = v
    if "judge" in raw:
        v = raw["judge"]
        if not isinstance(v, str) or not v:
            raise ctx.error((*where, "judge"), f"got {v!r}; allowed: 'embedded' or a model name")
        kw["judge"] = v
    if "rubric" in raw:
        v = raw["rubric"]
        if not ((isinstance(v, str) and v) or isinstance(v, Mapping)):
            raise ctx.error((*where, "rubric"),
                            f"got {v!r}; allowed: 'auto', a rubric name or a mapping")
        kw["rubric"] = dict(v) if isinstance(v, Mapping) else v
    if "max_samples" in raw:
        v = raw["max_samples"]
        if v is not None and not (_is_int(v) and v > 0):
            raise ctx.error((*where, "max_samples"),
                            f"got {v!r}; allowed: a positive integer, or null for all")
        kw["max_samples"] = v
    return EvalSpec(**kw)


def _parse_overrides(ctx: _Ctx, raw: Any) -> dict[str, Any]:
    where = ("overrides",)
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ctx.error(where, "must be a mapping of plan keys to values, such as "
                        "{learning_rate: 2.0e-4}")
    _check_keys(ctx, where, raw, sorted(PLAN_KEYS))
    for key, value in raw.items():
        problem = check_plan_value(key, value)
        if problem:
            raise ctx.error((*where, key), problem)
    return dict(raw)


def _parse_sweep(ctx: _Ctx, raw: Any) -> dict[str, list[Any]]:
    where = ("sweep",)
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ctx.error(where, "must be a mapping of plan keys to lists of values, such as "
                        "{learning_rate: [1.0e-4, 2.0e-4]}")
    _check_keys(ctx, where, raw, sorted(PLAN_KEYS))
    out: dict[str, list[Any]] = {}
    num_points = 1
    for key, values in raw.items():
        if not isinstance(values, list) or not values:
            raise ctx.error((*where, key), f"got {values!r}; allowed: a non-empty list of values")
        for i, value in enumerate(values):
            problem = check_plan_value(key, value)
            if problem:
                raise ctx.error((*where, key, str(i)), problem)
        if len({repr(v) for v in values}) != len(values):
            raise ctx.error((*where, key), "lists a value twice; each point must be distinct")
        out[key] = list(values)
        num_points *= len(values)
    if num_points > 256:
        raise ctx.error(where, f"expands to {num_points} runs; at most 256 are allowed, "
                        "shorten the value lists")
    return out


TOP_KEYS = ["name", "description", "data", "recipe", "overrides", "eval", "sweep", "schedule",
            "retrain_on_new_samples", "deploy"]

DEPLOY_POLICIES: tuple[str, ...] = ("auto", "manual")
"""Values of ``deploy``: what happens once a finished run's checkpoints are all scored."""


def parse_experiment(text: str, path: Path) -> Experiment:
    """Validate the YAML ``text`` of the experiment file at ``path``."""
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
    if not isinstance(raw, Mapping):
        raise ctx.error((), "an experiment file must be a mapping with at least "
                        "'recipe' (and usually 'name', 'data')")
    _check_keys(ctx, (), raw, TOP_KEYS)

    name = raw.get("name", path.stem)
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise ctx.error(("name",), f"got {name!r}; allowed: lowercase letters, digits, '-' and "
                        "'_', starting with a letter or digit, at most 64 characters")
    if "description" in raw and not isinstance(raw["description"], str):
        raise ctx.error(("description",), "must be text")

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
        if not isinstance(schedule, str):
            raise ctx.error(("schedule",), f"got {schedule!r}; allowed: a cron string such as "
                            "\"0 3 * * *\", or null")
        problem = cron_problem(schedule)
        if problem:
            raise ctx.error(("schedule",), f"{problem}; allowed: a cron string such as "
                            "\"0 3 * * *\" (minute hour day month weekday)")
        schedule = _CRON_ALIASES.get(schedule.strip(), schedule.strip())

    retrain = raw.get("retrain_on_new_samples", False)
    if not isinstance(retrain, bool):
        raise ctx.error(("retrain_on_new_samples",), f"got {retrain!r}; allowed: true or false")

    overrides = _parse_overrides(ctx, raw.get("overrides"))
    sweep = _parse_sweep(ctx, raw.get("sweep"))
    both = sorted(set(overrides) & set(sweep))
    if both:
        raise ctx.error(("sweep", both[0]), f"{both[0]!r} is both overridden and swept; "
                        "remove it from one of 'overrides' and 'sweep'")
    deploy = raw.get("deploy", "manual" if sweep else "auto")
    shadow = None
    if isinstance(deploy, Mapping):
        shadow = _parse_shadow(ctx, deploy)
        deploy = "shadow"
    elif deploy not in DEPLOY_POLICIES:
        raise ctx.error(("deploy",), f"got {deploy!r}; allowed: auto (deploy the best "
                        "checkpoint once every checkpoint is scored), manual, or "
                        "{shadow: {route: MODEL, ...}}")
    data = _parse_data(ctx, raw.get("data"))
    if f"experiment:{name}" in {m.source for m in data.mix}:
        raise ctx.error(("data", "mix", f"experiment:{name}"), "an experiment cannot mix in "
                        "its own training set; name it 'traffic'")
    return Experiment(
        name=name, path=path, data=data, recipe=recipe,
        overrides=overrides, eval=_parse_eval(ctx, raw.get("eval")), sweep=sweep,
        schedule=schedule, retrain_on_new_samples=retrain, deploy=deploy, raw=dict(raw),
        shadow=shadow,
    )


SHADOW_KEYS = ["route", "share", "agreement", "min_pairs", "pass_score"]


def _parse_shadow(ctx: _Ctx, deploy: Mapping[str, Any]) -> ShadowPolicy:
    _check_keys(ctx, ("deploy",), deploy, ["shadow"])
    raw = deploy.get("shadow")
    where = ("deploy", "shadow")
    if not isinstance(raw, Mapping):
        raise ctx.error(where, "must be a mapping with at least 'route' (the model name whose "
                        "calls the candidate shadows)")
    _check_keys(ctx, where, raw, SHADOW_KEYS)
    route = raw.get("route")
    if not isinstance(route, str) or not route.strip():
        raise ctx.error((*where, "route"), f"got {route!r}; allowed: the model name clients "
                        "send, e.g. gpt-4o-mini")

    def share_like(key: str, value: Any, low_open: bool) -> float | None:
        if value is None:
            return None
        ok = isinstance(value, int | float) and not isinstance(value, bool) and (
            0 < value <= 1 if low_open else 0 <= value <= 1)
        if not ok:
            raise ctx.error((*where, key), f"got {value!r}; allowed: a number in "
                            f"{'(0, 1]' if low_open else '[0, 1]'}")
        return float(value)

    min_pairs = raw.get("min_pairs", 200)
    if not isinstance(min_pairs, int) or isinstance(min_pairs, bool) or min_pairs < 1:
        raise ctx.error((*where, "min_pairs"), f"got {min_pairs!r}; allowed: a whole number "
                        ">= 1")
    return ShadowPolicy(route=route.strip(), share=share_like("share", raw.get("share", 1.0),
                                                              True) or 1.0,
                        agreement=share_like("agreement", raw.get("agreement"), False),
                        min_pairs=min_pairs,
                        pass_score=share_like("pass_score", raw.get("pass_score"), False))


def _recipe_names() -> list[str]:
    try:
        from factory.recipes import list_recipe_names
    except ImportError:  # recipes package not importable: the name is checked when planning
        return []
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

