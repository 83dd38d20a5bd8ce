"""The trainer's inputs: ``TrainConfig`` (the plan's training part) and ``TrainerJob`` (plan +
data + I/O).

A job is a JSON file. ``TrainerJob.from_json`` validates every field and raises ``ValueError``
naming the bad one (``plan.learning_rate: must be > 0, got -1``) before any model or data is
loaded, so a bad job costs a second, not a GPU allocation. Unknown keys are errors too: a typo
in a plan must not silently fall back to a default. The webhook secret is never in the file: the
job names the environment variable that holds it.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PRECISIONS = ("fp32", "bf16-autocast", "bf16")
PLAIN_ATTENTION_MODELS = frozenset({"llama", "mistral", "qwen2", "qwen3"})
"""Decoders whose attention is plain causal softmax attention (no sliding window unless it is
wider than the rows, no logit softcapping, no learned position bias): attending within each
packed segment, or to a shared prefix, is exactly what their own mask does."""
MIN_SHARED_PREFIX = 16
"""Shorter common beginnings are left in their rows (``share_prefix``): the saving would not
pay for the extra attention calls."""
REST_CALL_WORK = 4.0
"""A shared-prefix row's rests attend in one call where that call's query x key pairs are at
most this many times the pairs they need (each rest: its prefix and itself); else one call a
rest (``factory.trainer.model._rests_in_one_call``; the planner's ``timing.attention_pairs``
counts the same)."""
LR_SCHEDULES = ("cosine", "linear", "constant")
PARALLELISMS = ("single", "fsdp2")
TRACKERS = ("jsonl", "mlflow", "neptune", "none")
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class ExitCode(enum.IntEnum):
    """The trainer process's exit status (the control plane acts on it; kept here, beside the job it
    runs, so the control plane reads it without importing the training code)."""

    FINISHED = 0
    FAILED = 1
    INVALID_JOB = 2
    NAN = 3
    DATA_ERROR = 65  # EX_DATAERR: the input is wrong; never retried
    OWNER_GONE = 69  # EX_UNAVAILABLE: the process following the run died; never retried
    PREEMPTED = 75  # EX_TEMPFAIL: "try again later", i.e. resume


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """What to train and how: the training part of a plan (the planner fills it).

    A field's ``metadata`` states the values a plan may give it, read by the factory's
    experiment schema and planner (``factory.experiments.train_settings``) so that a setting is
    declared once, here: ``choices`` (the allowed values), ``ge``/``gt``/``lt`` (bounds of a
    number), ``min_len`` (of a list) and ``hint`` (the unit or an example, in words). Its
    docstring is its documentation there too.
    """

    base_model: str
    """A local Hugging Face directory, or a hub id where a hub is reachable."""
    max_seq_len: int = field(metadata={"ge": 16, "hint": "tokens"})
    """Longest sample (and packed row) in tokens; a longer sample is dropped whole
    (``too_long_for_plan``), never cut."""
    packing: bool = True
    """Pack several samples per row (per-sample positions, no cross-sample attention)."""
    share_prefix: bool = False
    """Compute the tokens every sample of a micro-batch begins with (a shared system prompt)
    once: the micro-batch becomes one row, the prefix and then each sample's rest, each rest
    attending to the prefix and to itself (``trainer.data.collate_shared``). The same loss and
    gradient as separate rows, for fewer tokens. Needs a plain-attention model."""
    micro_batch_size: int = field(default=1, metadata={"ge": 1})
    """Rows per forward pass on one device."""
    grad_accum_steps: int = field(default=1, metadata={"ge": 1})
    """Micro-batches per optimizer step on one device."""
    learning_rate: float = field(metadata={"gt": 0, "hint": "such as 2.0e-4"})
    """Peak learning rate of AdamW."""
    lr_schedule: str = field(default="cosine", metadata={"choices": LR_SCHEDULES})
    """``cosine``, ``linear`` (both decay to zero after warmup) or ``constant``."""
    warmup_steps: int = field(default=0, metadata={"ge": 0})
    """Optimizer steps of linear warmup from zero."""
    num_steps: int | None = field(default=None, metadata={"ge": 1, "hint": "optimizer steps"})
    """Optimizer steps to run; exactly one of ``num_steps`` and ``num_epochs``."""
    num_epochs: float | None = field(default=None, metadata={"gt": 0})
    """Passes over the data (fractions allowed); converted to steps once the data is packed."""
    weight_decay: float = field(default=0.0, metadata={"ge": 0})
    """AdamW weight decay on the adapter weights."""
    max_grad_norm: float = field(default=1.0, metadata={"ge": 0,
                                                        "hint": "0 disables clipping"})
    """Gradient clipping norm; 0 disables clipping (the norm is still measured and guarded)."""
    lora_rank: int = field(default=8, metadata={"ge": 1})
    """LoRA rank r."""
    lora_alpha: float = field(default=16.0, metadata={"gt": 0})
    """LoRA alpha (scale alpha / r)."""
    lora_dropout: float = field(default=0.0, metadata={"ge": 0, "lt": 1})
    """Dropout on the LoRA input."""
    lora_target_modules: list[str] = field(default_factory=lambda: ["all-linear"],
                                           metadata={"min_len": 1, "hint": "module names"})
    """Module names to adapt (``q_proj``...), or ``["all-linear"]``."""
    trainable_token_ids: list[int] = field(default_factory=list,
                                           metadata={"hint": "token ids"})
    """Token ids whose input-embedding rows train beside the adapter (PEFT's trainable tokens;
    a tied output head follows them): a base model's chat-turn tokens, which pretraining never
    used, so the head barely tells ``<end_of_turn>`` from the unused tokens it was copied like.
    Saved in the adapter as PEFT names them; empty: the embedding stays frozen."""
    precision: str = field(default="fp32", metadata={"choices": PRECISIONS})
    """``fp32``; ``bf16-autocast`` (bf16 compute, fp32 weights except frozen linear ones, kept
    in bf16 as autocast would cast them: same results); ``bf16`` (bf16 frozen base weights,
    fp32 adapters, bf16 compute: the GPU default, half the weight memory)."""
    gradient_checkpointing: bool = False
    """Recompute decoder-layer activations in backward (less memory, ~30% more compute)."""
    frozen_modules: list[str] = field(default_factory=list, metadata={"hint": "module names"})
    """Module-name prefixes that get no adapter (e.g. a vision tower); checked after wrapping."""
    checkpoint_every_steps: int = field(default=100, metadata={"ge": 1})
    """Write a resumable checkpoint every N optimizer steps (and at the end, and on SIGTERM)."""
    eval_every_steps: int | None = field(default=None, metadata={"ge": 1})
    """Compute held-out loss on ``TrainerJob.eval_data_files`` every N steps (None: never)."""
    log_every_steps: int = field(default=1, metadata={"ge": 1})
    """Send a ``progress`` event every N steps."""
    seed: int = field(default=0, metadata={"ge": 0})
    """Seeds data order, adapter init and dropout."""
    deterministic: bool = False
    """Deterministic kernels: bitwise-reproducible runs and resumes (slower on GPU)."""
    use_kernels: bool = False
    """Patch the model with our Triton kernels (``kernels.patcher.apply_kernels``)."""
    num_devices: int = field(default=1, metadata={"ge": 1, "hint": "accelerators for training"})
    """Processes (one per accelerator) to train with."""
    parallelism: str = field(default="single", metadata={"choices": PARALLELISMS})
    """``single`` (one device) or ``fsdp2`` (``fully_shard``, one process per device)."""

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        _positive(self, "max_seq_len", "micro_batch_size", "grad_accum_steps",
                  "checkpoint_every_steps", "log_every_steps", "lora_rank", "num_devices")
        if not isinstance(self.base_model, str) or not self.base_model:
            raise ValueError("base_model: must be a non-empty path or hub id")
        if self.max_seq_len < 16:
            raise ValueError(f"max_seq_len: must be >= 16, got {self.max_seq_len}")
        _number(self, "learning_rate", lo=0.0, lo_open=True)
        _number(self, "weight_decay", lo=0.0)
        _number(self, "max_grad_norm", lo=0.0)
        _number(self, "lora_alpha", lo=0.0, lo_open=True)
        _number(self, "lora_dropout", lo=0.0, hi=1.0)
        if self.lora_dropout >= 1.0:
            raise ValueError(f"lora_dropout: must be < 1, got {self.lora_dropout}")
        _choice(self, "lr_schedule", LR_SCHEDULES)
        _choice(self, "precision", PRECISIONS)
        _choice(self, "parallelism", PARALLELISMS)
        for name in ("packing", "share_prefix", "gradient_checkpointing", "deterministic",
                     "use_kernels"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.warmup_steps, int) or isinstance(self.warmup_steps, bool) \
                or self.warmup_steps < 0:
            raise ValueError(f"warmup_steps: must be an integer >= 0, got {self.warmup_steps!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed: must be an integer, got {self.seed!r}")
        if (self.num_steps is None) == (self.num_epochs is None):
            raise ValueError("num_steps: give exactly one of num_steps and num_epochs")
        if self.num_steps is not None:
            _positive(self, "num_steps")
        if self.num_epochs is not None:
            _number(self, "num_epochs", lo=0.0, lo_open=True)
        if self.eval_every_steps is not None:
            _positive(self, "eval_every_steps")
        for name in ("lora_target_modules", "frozen_modules"):
            value = getattr(self, name)
            if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
                raise ValueError(f"{name}: must be a list of non-empty strings, got {value!r}")
        if not self.lora_target_modules:
            raise ValueError("lora_target_modules: must name at least one module")
        ids = self.trainable_token_ids
        if not isinstance(ids, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids) \
                or len(set(ids)) != len(ids):
            raise ValueError("trainable_token_ids: must be a list of distinct token ids >= 0, "
                             f"got {ids!r}")
        if ids and self.parallelism != "single":
            raise ValueError("trainable_token_ids: trained on one device only (parallelism "
                             f"'single'), got {self.parallelism!r}")
        if self.parallelism == "single" and self.num_devices != 1:
            raise ValueError(f"num_devices: parallelism 'single' needs 1, got {self.num_devices}")
        if self.parallelism == "fsdp2" and self.num_devices < 2:
            raise ValueError("num_devices: parallelism 'fsdp2' needs at least 2 devices")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, kw_only=True)
class Debug:
    """Fault injection for tests of the guards and the control plane; off by default."""

    nan_at_step: int | None = None
    """Make the loss of this optimizer step NaN (only in a run not resumed from a checkpoint,
    so a resumed run models a transient fault)."""
    sleep_per_step_s: float = 0.0
    """Sleep after every step, so tests can signal a process at a chosen step."""


@dataclass(frozen=True, kw_only=True)
class TrackerConfig:
    """Where metrics go besides the events file."""

    backend: str = "jsonl"
    """``jsonl`` (``output_dir/metrics.jsonl`` or ``path``), ``mlflow``, ``neptune`` or ``none``."""
    uri: str | None = None
    """MLflow tracking URI (default: a SQLite store beside the events file)."""
    experiment: str = "factory"
    """MLflow experiment name."""
    project: str | None = None
    """Neptune project (``workspace/project``)."""
    path: str | None = None
    """JSONL backend file (default ``metrics.jsonl`` beside the events file)."""

    def validate(self) -> None:
        _choice(self, "backend", TRACKERS, prefix="tracker.")
        if self.backend == "neptune" and not self.project:
            raise ValueError("tracker.project: the neptune backend needs 'workspace/project'")


@dataclass(frozen=True, kw_only=True)
class MixSource:
    """One source of a data mixture: its files and its share of the samples drawn."""

    name: str
    """What reports and the plan call it (``traffic``, ``synthetic``, ``experiment:<name>``,
    ``file:<path>``)."""
    weight: float
    """Relative weight: each drawn sample comes from this source with probability
    ``weight / sum(weights)``."""
    data_files: list[str] = field(default_factory=list)
    """Parquet files of its samples (columns ``sample_id``, ``messages``, ``tools``)."""
    payload_file: str | None = None
    """Or one JSONL file of samples (``messages``, ``tools``, optional ``sample_id``)."""

    def validate(self, prefix: str) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"{prefix}name: must be a non-empty string, got {self.name!r}")
        if not isinstance(self.weight, int | float) or isinstance(self.weight, bool) \
                or not self.weight > 0 or self.weight == float("inf"):
            raise ValueError(f"{prefix}weight: must be a number > 0, got {self.weight!r}")
        _check_files(self.data_files, self.payload_file, prefix)


@dataclass(frozen=True, kw_only=True)
class TrainerJob:
    """One training job: the plan, where the data is, where results and events go."""

    run_id: str
    """Stable id of the logical run (kept across resumes and rollovers)."""
    plan: TrainConfig
    """The training plan."""
    output_dir: str
    """Local path or fsspec URL (``s3://...``); checkpoints go under ``checkpoints/``."""
    data_files: list[str] = field(default_factory=list)
    """Parquet files of the dataset snapshot (columns ``sample_id``, ``messages``, ``tools``)."""
    payload_file: str | None = None
    """Or one JSONL file of samples (``messages``, ``tools``, optional ``sample_id``)."""
    mix: list[MixSource] = field(default_factory=list)
    """Or a mixture of sources sampled by weight (``trainer.data.MixtureStream``); the first
    is the primary one: ``plan.num_epochs`` counts passes over it."""
    eval_data_files: list[str] = field(default_factory=list)
    """Optional held-out Parquet files for eval loss every ``plan.eval_every_steps``."""
    blob_dir: str | None = None
    """The factory's blob store folder (``<blob_dir>/<aa>/<sha256>``), where a vision-language
    base model reads the images of the samples; None: such a model drops every image sample
    (``missing_image``). Text-only models never read it."""
    resume_from: str | None = None
    """A checkpoint directory, or ``latest`` (newest verified checkpoint under output_dir)."""
    events_file: str | None = None
    """Local JSONL of every event (default ``output_dir/events.jsonl`` for a local output)."""
    webhook_url: str | None = None
    """Where signed events are POSTed (None: events go only to the events file)."""
    webhook_key_id: str | None = None
    """Key id sent with each signature; the receiver picks the secret by it."""
    webhook_secret_env: str | None = None
    """Name of the environment variable holding the webhook secret."""
    tracker: TrackerConfig = field(default_factory=TrackerConfig)
    """Metrics backend."""
    owner: str | None = None
    """The process that follows this run (``host:pid:start``, ``trainer.pids.owner_token``):
    the Dagster step of its ``training_run``. When it dies, the trainer checkpoints the step it
    is at and exits ``OWNER_GONE``, which the control plane does not retry. None: no owner."""
    debug: Debug = field(default_factory=Debug)
    """Fault injection (tests only)."""

    def sources(self) -> list[MixSource]:
        """What the job trains on: ``mix``, or its data files as one source named ``train``."""
        if self.mix:
            return list(self.mix)
        return [MixSource(name="train", weight=1.0, data_files=list(self.data_files),
                          payload_file=self.payload_file)]

    @property
    def is_local_output(self) -> bool:
        return "://" not in self.output_dir or self.output_dir.startswith("file://")

    @property
    def events_path(self) -> Path:
        if self.events_file:
            return Path(self.events_file)
        return Path(_local(self.output_dir)) / "events.jsonl"

    def webhook_secret(self) -> bytes | None:
        if not self.webhook_secret_env:
            return None
        return os.environ[self.webhook_secret_env].encode()

    def validate(self) -> None:
        if not isinstance(self.run_id, str) or not _RUN_ID.match(self.run_id):
            raise ValueError(f"run_id: must match {_RUN_ID.pattern}, got {self.run_id!r}")
        if not isinstance(self.output_dir, str) or not self.output_dir:
            raise ValueError("output_dir: must be a non-empty path or URL")
        self.plan.validate()
        if not isinstance(self.mix, list):
            raise ValueError(f"mix: must be a list of sources, got {self.mix!r}")
        if self.mix:
            if self.data_files or self.payload_file:
                raise ValueError("mix: give either mix or data_files/payload_file, not both")
            names = [s.name for s in self.mix]
            for i, source in enumerate(self.mix):
                source.validate(f"mix.{i}.")
                if names.index(source.name) != i:
                    raise ValueError(f"mix.{i}.name: {source.name!r} is listed twice")
        else:
            _check_files(self.data_files, self.payload_file, "")
        _check_paths(self.eval_data_files, "eval_data_files")
        if self.plan.eval_every_steps is not None and not self.eval_data_files:
            raise ValueError("eval_data_files: plan.eval_every_steps is set but no eval data")
        if self.resume_from is not None and self.resume_from != "latest" \
                and "://" not in self.resume_from and not Path(self.resume_from).is_dir():
            raise ValueError(f"resume_from: no such checkpoint directory {self.resume_from}")
        if not self.is_local_output and not self.events_file:
            raise ValueError("events_file: required when output_dir is a remote URL")
        hook = (self.webhook_url, self.webhook_key_id, self.webhook_secret_env)
        if any(hook) and not all(hook):
            missing = [n for n, v in zip(("webhook_url", "webhook_key_id", "webhook_secret_env"),
                                         hook, strict=True) if not v]
            raise ValueError(f"{missing[0]}: required when any webhook field is set")
        if self.webhook_url:
            if not self.webhook_url.startswith(("http://", "https://")):
                raise ValueError(f"webhook_url: must be http(s), got {self.webhook_url!r}")
            assert self.webhook_secret_env is not None
            if not _ENV_NAME.match(self.webhook_secret_env):
                raise ValueError(f"webhook_secret_env: not an environment variable name: "
                                 f"{self.webhook_secret_env!r}")
            if not os.environ.get(self.webhook_secret_env):
                raise ValueError(f"webhook_secret_env: environment variable "
                                 f"{self.webhook_secret_env} is not set")
        self.tracker.validate()
        if self.debug.nan_at_step is not None:
            _positive(self.debug, "nan_at_step", prefix="debug.")

    @classmethod
    def from_dict(cls, raw: Any) -> TrainerJob:
        if not isinstance(raw, dict):
            raise ValueError("job: must be a JSON object")
        kwargs = _fields(cls, raw, "")
        for key in ("run_id", "plan", "output_dir"):
            if key not in kwargs:
                raise ValueError(f"{key}: required")
        kwargs["plan"] = _build(TrainConfig, kwargs["plan"], "plan.")
        if "tracker" in kwargs:
            kwargs["tracker"] = _build(TrackerConfig, kwargs["tracker"] or {}, "tracker.")
        if "debug" in kwargs:
            kwargs["debug"] = _build(Debug, kwargs["debug"] or {}, "debug.")
        if "mix" in kwargs:
            if not isinstance(kwargs["mix"], list):
                raise ValueError(f"mix: must be a list of sources, got {kwargs['mix']!r}")
            kwargs["mix"] = [_build(MixSource, s, f"mix.{i}.", validate=False)
                             for i, s in enumerate(kwargs["mix"])]
        job = cls(**kwargs)
        job.validate()
        return job

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> TrainerJob:
        """Read and validate a job file; ValueError names the bad field."""
        try:
            raw = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ValueError(f"job: no such file {path}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"job: {path} is not JSON ({e})") from None
        return cls.from_dict(raw)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> TrainerJob:
        return dataclasses.replace(self, **changes)


def _local(path: str) -> str:
    return path[len("file://"):] if path.startswith("file://") else path


def _check_paths(files: Any, name: str) -> None:
    if not isinstance(files, list) or not all(isinstance(f, str) and f for f in files):
        raise ValueError(f"{name}: must be a list of paths, got {files!r}")
    for f in files:
        if "://" not in f and not Path(f).is_file():
            raise ValueError(f"{name}: no such file {f}")


def _check_files(data_files: Any, payload_file: Any, prefix: str) -> None:
    """Exactly one of ``data_files`` (Parquet) and ``payload_file`` (JSONL), and they exist."""
    if bool(data_files) == bool(payload_file):
        raise ValueError(f"{prefix}data_files: give exactly one of data_files and payload_file")
    _check_paths(data_files, f"{prefix}data_files")
    if payload_file is not None and not Path(payload_file).is_file():
        raise ValueError(f"{prefix}payload_file: no such file {payload_file}")


def _fields(cls: type, raw: dict[str, Any], prefix: str) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in names:
            raise ValueError(f"{prefix}{key}: unknown field (allowed: {', '.join(sorted(names))})")
    return dict(raw)


def _build(cls: type, raw: Any, prefix: str, *, validate: bool = True) -> Any:
    if not isinstance(raw, dict):
        raise ValueError(f"{prefix.rstrip('.')}: must be an object")
    kwargs = _fields(cls, raw, prefix)
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    for name in required:
        if name not in kwargs:
            raise ValueError(f"{prefix}{name}: required")
    try:
        obj = cls(**kwargs)
    except TypeError as e:  # pragma: no cover - _fields already names unknown keys
        raise ValueError(f"{prefix}: {e}") from None
    try:
        if validate and hasattr(obj, "validate") and cls is not TrackerConfig:
            obj.validate()
    except ValueError as e:
        raise ValueError(f"{prefix}{e}") from None
    return obj


def _positive(obj: object, *names: str, prefix: str = "") -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{prefix}{name}: must be an integer >= 1, got {value!r}")


def _number(obj: object, name: str, *, lo: float | None = None, hi: float | None = None,
            lo_open: bool = False) -> None:
    value = getattr(obj, name)
    if not isinstance(value, int | float) or isinstance(value, bool) or value != value:
        raise ValueError(f"{name}: must be a number, got {value!r}")
    if lo is not None and (value < lo or (lo_open and value == lo)):
        raise ValueError(f"{name}: must be {'>' if lo_open else '>='} {lo}, got {value!r}")
    if hi is not None and value > hi:
        raise ValueError(f"{name}: must be <= {hi}, got {value!r}")


def _choice(obj: object, name: str, allowed: tuple[str, ...], prefix: str = "") -> None:
    value = getattr(obj, name)
    if value not in allowed:
        raise ValueError(f"{prefix}{name}: must be one of {', '.join(allowed)}, got {value!r}")
