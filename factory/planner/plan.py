"""The decision tree: every training and eval value from the data profile, recipe and hardware.

``make_plan`` walks the decisions in dependency order (hardware, precision, sequence length,
packing, batch, memory fit, schedule, LoRA, eval serving size, then the time model's: eval
sample count and cadence within the eval budget, the final evals' sample count, checkpoints,
the predicted wall time in ``Plan.estimates``). Each value is a
``Decision`` carrying the rule that produced it and a reason in words; a value the experiment
overrides (or a sweep point sets) wins and is marked ``overridden``, with what the planner would
have picked kept in the reason. Validation (``validate``) runs last and refuses the plan with a
message that says what to change, before any compute is asked for.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from factory.curation.phrasing import RECALL
from factory.errors import FactoryError
from factory.evals.selection import CLEAR_MARGIN, FINAL_CANDIDATES, PLATEAU_PATIENCE
from factory.experiments import (
    UNDETERMINED,
    Experiment,
    MixEntry,
    group_of,
    group_source,
    run_key,
    train_keys,
)
from factory.planner.hardware import Hardware, get_hardware
from factory.planner.host import host_constants
from factory.planner.memory import GIB, MemoryEstimate, estimate_memory
from factory.planner.profile import DatasetProfile
from factory.planner.timing import (
    EVAL_SHARE,
    MIN_EVAL_SAMPLES,
    MIN_EVALS,
    EvalShape,
    attention_pairs,
    duration,
    eval_budget,
    eval_cost,
    eval_seconds,
    final_eval_seconds,
    fits,
    forward_flops,
    run_time,
    step_seconds,
    time_constants,
)
from factory.recipes import Recipe, load_recipe
from factory.settings import Settings
from factory.trainer.config import MIN_SHARED_PREFIX, PLAIN_ATTENTION_MODELS, TrainConfig

MEMORY_HEADROOM = 0.90
"""Share of a device's memory a plan may use (the rest: fragmentation, CUDA context)."""
MAX_MICRO_BATCH = 64
MAX_STEPS = 5000
"""Cap on optimizer steps of one run (a huge dataset trains on a sample of it)."""
MIN_STEPS = 160
"""Floor on optimizer steps from epochs: a few dozen samples make an epoch a few steps, and 3
passes leave the adapter undertrained. On dev requests (BENCHMARKS.md, "Human-written data"):
SNIPS at 10 an intent (63 samples), 48 steps 24% intent accuracy, 160 steps 70%; triage from 80
calls, 54 steps 45.0% of disjoint phrasings, 162 steps 77.0%. Triage's 500 calls plan ~170 steps
by epochs alone."""
MAX_FLOOR_EPOCHS = 20
"""The floor repeats a dataset at most this many times (20 samples: 100 steps, not 160)."""
MIN_LABEL_EXPOSURES = 36
"""Floor on how often a pass schedule shows each answer label, when the answers are a closed
label set: a few samples a label make a confusable label set (a refund request vs a refund not
showing up) need more passes than the dataset's size asks. On dev requests (BENCHMARKS.md,
"Human-written data"): CLINC150 at 10 an intent (~9 train samples a label), 2 passes 64.3%
right, 4 passes 82.9%, 6 passes 85.7% (inside the noise of 140 requests, for 1.5x the training).
At 30 an intent 2 passes already show a label ~58 times."""
CHECKPOINT_EVERY_S = 900.0
"""Target compute between checkpoints: a preemption loses at most ~15 minutes."""
MAX_WALL_HOURS = 24.0
"""Sandboxes die after 24 hours: add devices until the estimate fits."""
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")


TRAIN_KEYS = train_keys(TrainConfig)
"""The decisions that are ``TrainConfig`` fields (``Plan.train_config``), in its order: every
field but ``factory.experiments.NOT_PLANNED``. A field added to ``TrainConfig`` is one here, and
``make_plan`` refuses to plan until a rule decides it (``STANDING_RULES`` for a constant)."""

STANDING_RULES: tuple[tuple[str, Any, str, str], ...] = (
    ("lr_schedule", "cosine", "schedule.cosine", "cosine decay to zero after warmup"),
    ("weight_decay", 0.0, "lora.no_decay", "LoRA adapters start at zero; no decay"),
    ("max_grad_norm", 1.0, "clip.default", "clip gradients at norm 1"),
    ("use_kernels", False, "kernels.opt_in",
     "Triton kernels are opt-in (set use_kernels: true to use them)"),
)
"""Settings the planner does not derive: (key, value, rule, reason), each overridable."""


class PlanError(FactoryError):
    """A plan that cannot run; the message says what to change."""


@dataclass(frozen=True, kw_only=True)
class Decision:
    """One planned value and why."""

    value: Any
    """The value used."""
    rule: str
    """Id of the rule that produced it (``seq.cover_longest``...), ``override`` if forced."""
    reason: str
    """Why, in words, with the numbers that decided it."""
    overridden: bool = False
    """True when the experiment (overrides or sweep point) forced the value."""


@dataclass(kw_only=True)
class Plan:
    """A complete plan for one run of an experiment."""

    experiment: str
    """Experiment name."""
    run_key: str
    """Stable key of this run (``<experiment>`` or ``<experiment>/k=v/...``)."""
    recipe: str
    """Recipe name."""
    base_model: str
    """Local directory or hub id the trainer loads."""
    point: dict[str, Any]
    """The sweep point of this run (empty without a sweep)."""
    decisions: dict[str, Decision] = field(default_factory=dict)
    """Plan key -> decision, in decision order."""
    memory: MemoryEstimate | None = None
    """Estimated peak memory of one training step on one device."""
    memory_budget: int = 0
    """Bytes a device may use."""
    estimates: dict[str, float] = field(default_factory=dict)
    """The time model's prediction (``factory.planner.timing``): ``step_seconds``, ``steps``,
    ``tokens_per_step``, ``train_seconds``, ``num_evals``, ``first_eval_seconds``,
    ``eval_seconds`` (each later eval), ``final_evals_seconds`` (the leaders judged on the
    rest of the final eval set after the last eval; 0: none), ``evals_seconds`` (the wall
    they all add),
    ``wall_seconds`` and ``hours`` (the whole run), ``eval_share`` (of the run's wall on CPU,
    of its device time on GPUs), ``eval_wall_share`` and ``eval_budget_share``."""
    notes: list[str] = field(default_factory=list)
    """Warnings that do not block the plan."""
    mix: list[dict[str, Any]] = field(default_factory=list)
    """``data.mix`` as planned, one entry per source, the primary first: ``source``,
    ``weight``, ``share`` (of the samples drawn), ``rows`` (None: not counted), ``samples``
    (drawn over the run) and ``epochs`` (effective passes over the source; None: rows not
    counted). Empty: the experiment's training set alone."""

    def __getitem__(self, key: str) -> Any:
        return self.decisions[key].value

    def train_config(self) -> dict[str, Any]:
        """The training part: keyword arguments of ``factory.trainer.config.TrainConfig``."""
        cfg: dict[str, Any] = {"base_model": self.base_model,
                               **{key: self[key] for key in TRAIN_KEYS}}
        if cfg["num_steps"] is not None:
            cfg["num_epochs"] = None  # a run is sized by steps or by epochs, never both
        cfg["lora_alpha"] = float(cfg["lora_alpha"])
        cfg["lora_target_modules"] = list(cfg["lora_target_modules"])
        cfg["frozen_modules"] = list(cfg["frozen_modules"])
        cfg["trainable_token_ids"] = list(cfg["trainable_token_ids"])
        return cfg

    def eval_serving(self) -> dict[str, Any]:
        """The eval part: how big the eval server is and how it generates."""
        keys = ("eval_devices", "eval_gpu_memory_utilization", "eval_max_num_seqs",
                "eval_batch_size", "eval_max_new_tokens", "eval_judge")
        return {k.removeprefix("eval_"): self.decisions[k].value for k in keys}

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: values, reasons, the trainer config, the eval serving size, memory."""
        return {
            "experiment": self.experiment, "run_key": self.run_key, "recipe": self.recipe,
            "point": dict(self.point),
            "values": {k: v.value for k, v in self.decisions.items()},
            "reasons": {k: {"rule": v.rule, "reason": v.reason, "overridden": v.overridden}
                        for k, v in self.decisions.items()},
            "train_config": self.train_config(),
            "eval_serving": self.eval_serving(),
            "memory_gib": self.memory.as_gib() if self.memory else {},
            "memory_budget_gib": round(self.memory_budget / GIB, 3),
            "estimates": dict(self.estimates),
            "notes": list(self.notes),
            "mix": [dict(m) for m in self.mix],
        }


class _Decider:
    """Records decisions, letting the experiment's overrides win."""

    def __init__(self, plan: Plan, overrides: Mapping[str, Any], point: Mapping[str, Any]):
        self.plan = plan
        self.overrides = dict(overrides)
        self.point = dict(point)

    def forced(self, key: str) -> bool:
        return key in self.overrides or key in self.point

    def set(self, key: str, value: Any, rule: str, reason: str) -> Any:
        if key in self.point or key in self.overrides:
            where = "sweep point" if key in self.point else "override"
            forced = self.point[key] if key in self.point else self.overrides[key]
            decision = Decision(value=forced, rule=where, overridden=True,
                                reason=f"{where} (the planner would pick {_show(value)}: "
                                       f"{reason})")
        else:
            decision = Decision(value=value, rule=rule, reason=reason)
        self.plan.decisions[key] = decision
        return decision.value


def _show(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(map(str, value)) + "]"
    return str(value)


OUTLIER_ALLOWANCE = 1.25
"""max_seq_len covers the longest sample when that costs at most this factor over covering the
99th percentile; beyond it the rare long samples would set every row's memory budget."""


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _sig(x: float, digits: int = 3) -> float:
    return float(f"{x:.{digits}g}")


def make_plan(experiment: Experiment, profile: DatasetProfile, *,
              point: Mapping[str, Any] | None = None, recipe: Recipe | None = None,
              settings: Settings | None = None,
              source_rows: Mapping[str, int] | None = None,
              time_cache: Path | None = None) -> Plan:
    """Plan one run of ``experiment`` (the sweep ``point``, if any) on the data ``profile``;
    ``source_rows`` counts the rows of each ``data.mix`` source (a source left out is not
    counted: its effective epochs are unknown). ``time_cache``: where this host's calibrated
    time constants are cached (``factory.planner.host``): given, a CPU plan predicts with this
    host's rates, calibrating on the first plan; None, with the reference constants, the same
    whatever machine renders the plan.

    Raises ``PlanError`` when the plan cannot run, saying what to change.
    """
    point = dict(point or {})
    recipe = recipe or load_recipe(experiment.recipe)
    arch = recipe.architecture
    plan = Plan(experiment=experiment.name, run_key=run_key(experiment.name, point),
                recipe=recipe.name, base_model=recipe.base_model_path(settings), point=point)
    dec = _Decider(plan, experiment.overrides, point)
    data = experiment.data
    _validate_inputs(experiment, profile, recipe, dec)

    # --- hardware and precision -------------------------------------------------------------
    gpu = dec.set("gpu", recipe.gpu, "hardware.recipe",
                  f"recipe {recipe.name} targets {recipe.gpu}")
    hw = get_hardware(gpu)
    if hw.name == "CPU":
        dec.set("precision", "bf16-autocast", "precision.cpu_autocast",
                "CPU: fp32 weights with bf16 compute (about 2.4x the fp32 throughput on a "
                "CPU with bf16 instructions); a trainer on a CPU without them runs fp32, "
                "where emulated bf16 is ~22x slower")
    else:
        dec.set("precision", "bf16", "precision.gpu_bf16",
                f"{hw.name}: bf16 base weights (half the memory), fp32 adapters")
    precision = plan["precision"]

    # --- sequence length and packing --------------------------------------------------------
    cap = min(data.max_tokens, arch.max_context)
    longest, p99, p50 = profile.length_max, profile.length_p99, profile.length_p50
    # Lengths are the trainer's own (curation counts with factory.trainer.chat), and curation already
    # dropped samples over the cap; a sample longer than max_seq_len is dropped before training
    # (too_long_for_plan), never truncated, and the pre-launch check refuses more than 1%.
    cover_p99 = min(_round_up(max(p99, 16), 64), cap)
    cover_all = min(_round_up(max(longest, 16), 64), cap)
    if longest <= cap and cover_all <= _round_up(int(cover_p99 * OUTLIER_ALLOWANCE), 64):
        dec.set("max_seq_len", cover_all, "seq.cover_longest",
                f"the longest sample has {longest} tokens (p99 {p99}, median {p50}); "
                f"rounded up to a multiple of 64 so no sample is dropped")
    elif p99 > cap:
        dec.set("max_seq_len", cap, "seq.cap",
                f"the 99th percentile ({p99} tokens) exceeds "
                f"{'data.max_tokens' if cap == data.max_tokens else 'the model context'} "
                f"({cap}); longer samples are dropped before training (too_long_for_plan) and "
                f"the pre-launch check refuses the plan if that is over 1%")
    else:
        dec.set("max_seq_len", cover_p99, "seq.cover_p99",
                f"99% of training samples have at most {p99} tokens (median {p50}); the longest "
                f"has {longest}, over {OUTLIER_ALLOWANCE:g}x that: rounded up to a multiple of 64, "
                f"the few longer samples are dropped before training (too_long_for_plan)")
    seq_len = plan["max_seq_len"]
    padding = 1.0 - min(p50, seq_len) / seq_len
    if p50 * 2 <= seq_len:
        dec.set("packing", True, "packing.mixed_lengths",
                f"median sample ({p50} tokens) is under half of max_seq_len ({seq_len}): "
                f"unpacked rows would be ~{padding:.0%} padding")
    else:
        dec.set("packing", False, "packing.uniform_lengths",
                f"median sample ({p50} tokens) fills over half of max_seq_len ({seq_len}): "
                f"padding is ~{padding:.0%}, packing gains little")
    packing = plan["packing"]
    shared = min(profile.shared_prefix_tokens, profile.length_p50)
    mean = profile.length_mean
    if arch.family not in PLAIN_ATTENTION_MODELS:
        dec.set("share_prefix", False, "prefix.attention",
                f"{arch.family} attention is not plain causal attention (the per-segment "
                f"attention a shared prefix needs is exact for "
                f"{', '.join(sorted(PLAIN_ATTENTION_MODELS))})")
    elif shared >= MIN_SHARED_PREFIX:
        dec.set("share_prefix", True, "prefix.shared",
                f"samples begin with ~{shared} shared tokens (a system prompt) of ~{mean:.0f}: "
                f"each micro-batch computes them once, for the same loss and gradient")
    else:
        dec.set("share_prefix", False, "prefix.none",
                f"samples share {shared} leading tokens (under {MIN_SHARED_PREFIX}): nothing "
                f"worth computing once")

    # --- dataset size: rows, effective batch, epochs ----------------------------------------
    n = profile.num_samples
    num_rows = (max(1, math.ceil(profile.num_tokens / (seq_len * 0.95))) if packing else n)
    # The batch is chosen in samples, so packing changes the rows a step holds, never how many
    # samples (and so how many optimizer steps) an epoch gets: a packed row holds ~n/num_rows.
    per_row = n / num_rows
    if n < 100:
        eb_samples, size = 4, "tiny"
    elif n < 2_000:
        eb_samples, size = 8, "small"
    elif n < 20_000:
        eb_samples, size = 16, "medium"
    else:
        eb_samples, size = 32, "large"
    if packing:
        eb = 2 ** max(0, round(math.log2(eb_samples / per_row)))
        why = (f"{size} dataset ({n} samples): ~{eb_samples} samples per optimizer step keeps "
               f"enough steps per epoch to learn and evaluate; they pack into ~{num_rows} rows "
               f"of {seq_len} tokens, ~{per_row:.1f} samples a row: {eb} rows per step "
               f"(~{eb * per_row:.0f} samples)")
    else:
        eb = eb_samples
        why = (f"{size} dataset ({n} samples, one row each): {eb} rows per optimizer step "
               f"keeps enough steps per epoch to learn and evaluate")
    effective = dec.set("effective_batch_size", eb, f"batch.{size}_dataset", why)
    if n < 1_000:
        epochs, erule = 3.0, "tiny"
    elif n < 10_000:
        epochs, erule = 2.0, "small"
    else:
        epochs, erule = 1.0, "large"
    dec.set("num_epochs", epochs, f"epochs.{erule}_dataset",
            f"{n} samples: {epochs:g} pass(es) ({'few samples need repeats' if epochs > 1 else 'enough data for one pass'})")
    per_label = profile.samples_per_label
    if per_label is not None and per_label * epochs < MIN_LABEL_EXPOSURES:
        # per_label * epochs < MIN_LABEL_EXPOSURES makes this more than epochs (at most 3)
        raised = float(min(MAX_FLOOR_EPOCHS, math.ceil(MIN_LABEL_EXPOSURES / per_label)))
        dec.set("num_epochs", raised, "epochs.label_exposures",
                f"the answers are {len(profile.label_counts)} labels, ~{per_label:g} "
                f"samples each (median): {epochs:g} pass(es) show a label "
                f"~{per_label * epochs:g} times, so {raised:g} passes for at least "
                f"{MIN_LABEL_EXPOSURES} (at most {MAX_FLOOR_EPOCHS} passes): on dev "
                "requests, CLINC150 at 10 an intent went from 64% right at 2 passes "
                "to 83% at 4")

    # --- LoRA topology ----------------------------------------------------------------------
    if n >= 50_000:
        rank = dec.set("lora_rank", recipe.lora_rank * 2, "lora.rank_large_dataset",
                       f"{n} samples: twice the recipe rank ({recipe.lora_rank}) for capacity")
    else:
        rank = dec.set("lora_rank", recipe.lora_rank, "lora.recipe",
                       f"recipe {recipe.name} rank")
    ratio = recipe.lora_alpha / recipe.lora_rank
    dec.set("lora_alpha", _sig(ratio * rank), "lora.alpha_ratio",
            f"alpha = {ratio:g} x rank, the recipe's ratio (keeps the update scale)")
    if hw.name == "CPU":
        dec.set("lora_dropout", 0.0, "lora.no_dropout_cpu",
                "CPU: LoRA dropout draws a random mask for every adapted layer's input, about a "
                "third of a CPU step, and gained nothing on the dev requests of the demo and "
                "the triage loop (BENCHMARKS.md)")
    elif n < 1_000:
        dec.set("lora_dropout", max(recipe.lora_dropout, 0.1), "lora.dropout_small_dataset",
                f"only {n} samples: dropout 0.1 against overfitting")
    else:
        dec.set("lora_dropout", recipe.lora_dropout, "lora.recipe",
                f"recipe {recipe.name} dropout")
    targets = list(recipe.lora_target_modules)
    has_mlp = any(t in targets for t in MLP_MODULES)
    if profile.share_with_tool_calls > 0 and not has_mlp:
        dec.set("lora_target_modules", targets + list(MLP_MODULES), "lora.mlp_for_tool_calls",
                f"{profile.share_with_tool_calls:.0%} of samples call tools: structured "
                "outputs need the MLP adapted too, not only attention")
    elif n >= 50_000 and not has_mlp:
        dec.set("lora_target_modules", targets + list(MLP_MODULES), "lora.mlp_large_dataset",
                f"{n} samples: adapt the MLP too for capacity")
    else:
        dec.set("lora_target_modules", targets, "lora.recipe",
                f"recipe {recipe.name} targets"
                + (" (attention only: no tool calls, modest data)" if not has_mlp else ""))
    targets = list(plan["lora_target_modules"])
    bad = [t for t in targets if t not in arch.linear_modules]
    if bad:
        raise PlanError(f"lora_target_modules {bad} are not modules of {recipe.base_model_id}; "
                        f"choose from {', '.join(arch.linear_modules)}")

    # --- token rows -------------------------------------------------------------------------
    if arch.untrained_tokens:
        named = ", ".join(f"{token} ({i})" for token, i in arch.untrained_tokens)
        dec.set("trainable_token_ids", sorted(i for _, i in arch.untrained_tokens),
                "tokens.untrained_turn_tokens",
                f"{recipe.base_model_id} was never instruction-tuned: its turn tokens {named} "
                "have untrained embedding rows, near-copies of the unused tokens', so LoRA alone "
                "is slow to learn to end a turn; their rows train beside the adapter (the tied "
                "head follows)")
    else:
        dec.set("trainable_token_ids", [], "tokens.none",
                "the base model's chat tokens are trained: the embedding stays frozen")

    # --- frozen modules ---------------------------------------------------------------------
    if arch.vision_module and profile.share_with_images == 0:
        dec.set("frozen_modules", [arch.vision_module], "frozen.vision_language_only",
                f"no sample has an image: the vision tower ({arch.vision_module}) stays "
                "frozen and gets no adapter")
    elif arch.vision_module:
        dec.set("frozen_modules", [arch.vision_module], "frozen.vision_encoder",
                f"{profile.share_with_images:.0%} of samples have images: they pass through "
                f"the frozen vision tower ({arch.vision_module}); LoRA adapts the language "
                "model")
    else:
        dec.set("frozen_modules", [], "frozen.text_model", "text-only model: nothing to freeze")

    # --- memory fit: devices, parallelism, micro-batch, checkpointing -----------------------
    budget = int(hw.memory_gib * GIB * MEMORY_HEADROOM)
    plan.memory_budget = budget
    dropout = float(plan["lora_dropout"])

    def peak(mb: int, gc: bool, shards: int, cp: int = 1) -> MemoryEstimate:
        return estimate_memory(arch, micro_batch_size=mb, seq_len=seq_len, lora_rank=rank,
                               target_modules=targets, precision=precision,
                               gradient_checkpointing=gc, lora_dropout=dropout,
                               num_shards=shards, context_parallel=cp,
                               fused_attention=hw.fused_attention,
                               padding_mask=hw.name == "CPU" and not packing,
                               host_heap=hw.name == "CPU",
                               shared_prefix=shared if plan["share_prefix"] else 0)

    def largest_mb(gc: bool, shards: int, limit: int) -> int:
        best = 0
        mb = 1
        while mb <= limit and peak(mb, gc, shards).total <= budget:
            best, mb = mb, mb * 2
        return best

    if dec.forced("num_devices"):
        device_options = [int({**dec.overrides, **dec.point}["num_devices"])]
    else:
        device_options = [d for d in (1, 2, 4, 8) if d <= hw.max_devices]
    chosen: tuple[int, int, bool, str] | None = None
    forced_mb = (int({**dec.overrides, **dec.point}["micro_batch_size"])
                 if dec.forced("micro_batch_size") else None)
    unfit: tuple[int, int, bool, str] | None = None
    for devices in device_options:
        per_device = max(1, effective // devices)
        limit = min(MAX_MICRO_BATCH, per_device)
        gcs: list[bool] = ([bool({**dec.overrides, **dec.point}["gradient_checkpointing"])]
                           if dec.forced("gradient_checkpointing") else [False, True])
        for gc in gcs:
            if forced_mb is not None:
                # A forced micro-batch: recompute only if it does not fit without.
                mb = forced_mb
                if peak(mb, gc, devices).total > budget:
                    unfit = (devices, mb, gc, "")  # the last, most lenient, try
                    continue
            else:
                mb = largest_mb(gc, devices, limit)
                if mb == 0:
                    continue
                if not gc and mb < min(4, limit) and len(gcs) > 1 \
                        and largest_mb(True, devices, limit) > mb:
                    continue  # checkpointing buys a usefully larger micro-batch
            chosen = (devices, mb, gc, "")
            break
        if chosen:
            break
    if chosen is None and unfit is not None:
        chosen = unfit  # _validate_plan refuses it, saying what to change
    if chosen is None:
        devices = device_options[-1]
        cp_needed = next((cp for cp in (2, 4, 8) if cp <= devices
                          and peak(1, True, devices, cp).total <= budget), None)
        need = peak(1, True, devices).total
        if cp_needed:
            raise PlanError(
                f"a {seq_len}-token sequence does not fit one {hw.name} even with gradient "
                f"checkpointing and {devices} FSDP2 shards ({need / GIB:.1f} GiB > "
                f"{budget / GIB:.1f} GiB); it needs context parallelism over {cp_needed} "
                "devices, which the trainer does not implement: lower data.max_tokens, or use "
                "a larger GPU (overrides: {gpu: H200})")
        raise PlanError(
            f"does not fit: one row of {seq_len} tokens needs {need / GIB:.1f} GiB per device "
            f"on {devices} x {hw.name} ({budget / GIB:.1f} GiB usable) even with gradient "
            "checkpointing; lower data.max_tokens, pick a smaller recipe, or a larger GPU "
            "(overrides: {gpu: H200})")
    devices, mb, gc, _ = chosen
    weights_one = peak(1, True, 1).weights
    if devices == 1:
        dec.set("num_devices", 1, "devices.fits_one", f"fits one {hw.name}")
    else:
        dec.set("num_devices", devices, "devices.shard_to_fit",
                f"base weights ({weights_one / GIB:.1f} GiB) plus a micro-batch do not fit one "
                f"{hw.name} ({budget / GIB:.0f} GiB usable): FSDP2 over {devices}")
    sharded = parallelism_for(devices) != "single"
    dec.set("parallelism", parallelism_for(devices),
            f"parallel.fsdp{recipe.fsdp_version}" if sharded else "parallel.single",
            "one device" if not sharded else
            f"FSDP{recipe.fsdp_version} (fully_shard) shards the frozen base weights over "
            f"{devices} devices")
    gc_reason = (f"without it only micro-batch {largest_mb(False, devices, mb) or 0} fits; "
                 f"with it {mb}" if gc else
                 f"micro-batch {mb} fits without recomputation "
                 f"({peak(mb, False, devices).total / GIB:.1f} of {budget / GIB:.1f} GiB)")
    dec.set("gradient_checkpointing", gc, "memory.checkpointing" if gc else "memory.no_recompute",
            gc_reason)
    dec.set("micro_batch_size", mb, "memory.largest_micro_batch",
            f"largest power of two up to the per-device batch ({max(1, effective // devices)}) "
            f"that fits {hw.name} memory")
    devices, mb, gc = plan["num_devices"], plan["micro_batch_size"], plan["gradient_checkpointing"]
    plan.memory = peak(mb, gc, devices)
    if effective < devices:
        # Long packed rows can make the batch under a row per device: every device trains one.
        effective = dec.set("effective_batch_size", devices,
                            plan.decisions["effective_batch_size"].rule,
                            f"{why}; at least a row for each of the {devices} devices")

    accum = math.ceil(effective / (mb * devices))
    dec.set("grad_accum_steps", accum, "batch.accumulate",
            f"{effective} rows per step / ({mb} per micro-batch x {devices} device(s))")
    real_batch = mb * devices * plan["grad_accum_steps"]

    # --- learning rate, steps, warmup -------------------------------------------------------
    # The recipe's rate is for its reference batch of unpacked samples: scale by samples a step.
    batch_samples = real_batch * per_row
    shown = f"{batch_samples:.3g}" if packing else f"{real_batch}"
    lr = recipe.learning_rate * math.sqrt(batch_samples / recipe.reference_batch_size) \
        * math.sqrt(recipe.reference_rank / rank)
    dec.set("learning_rate", _sig(min(lr, 1e-3)), "lr.scaled",
            f"recipe {recipe.learning_rate:g} at batch {recipe.reference_batch_size}, rank "
            f"{recipe.reference_rank}; x sqrt({shown}/{recipe.reference_batch_size}) for "
            f"the batch{' (samples in its packed rows)' if packing else ''}, "
            f"x sqrt({recipe.reference_rank}/{rank}) for the rank"
            + (" (capped at 1e-3)" if lr > 1e-3 else ""))
    # An epoch is a pass over the primary source; in a mixture it draws 1 / share of it.
    mix = balanced_mix(experiment, source_rows or {}, notes=plan.notes)
    mix_rows = _mix_rows(mix, n, source_rows or {})
    epoch_rows = num_rows * mix_rows / n if mix else num_rows
    steps_per_epoch = max(1, math.ceil(epoch_rows / real_batch))
    if steps_per_epoch * plan["num_epochs"] < MIN_STEPS:
        floor = min(MAX_FLOOR_EPOCHS, math.ceil(MIN_STEPS / steps_per_epoch))
        if floor > plan["num_epochs"]:
            first = plan.decisions["num_epochs"]
            dec.set("num_epochs", float(floor), "epochs.step_floor",
                    f"{n} samples make a pass ~{steps_per_epoch} steps of {real_batch} rows: "
                    f"{_show(first.value)} pass(es) would be "
                    f"~{math.ceil(steps_per_epoch * first.value)} steps, so {floor} passes for "
                    f"at least {MIN_STEPS} steps (at most {MAX_FLOOR_EPOCHS} passes): on dev "
                    "requests, triage from 80 calls went from 45% right at 54 steps to 77% "
                    "at 162, SNIPS at 10 an intent from 24% of intents at 48 to 70% at 160")
    total = max(1, math.ceil(steps_per_epoch * plan["num_epochs"]))
    if total > MAX_STEPS:
        dec.set("num_steps", MAX_STEPS, "steps.cap",
                f"{plan['num_epochs']:g} epoch(s) would be {total} steps; capped at {MAX_STEPS}")
    else:
        dec.set("num_steps", None, "steps.from_epochs",
                f"the trainer runs {plan['num_epochs']:g} epoch(s) (~{total} steps of "
                f"{real_batch} rows)")
    if plan["num_steps"] is not None:
        total = plan["num_steps"]
    if mix:
        _plan_mix(plan, experiment, mix, source_rows or {},
                  samples=total * real_batch * n / num_rows)
    warm = math.ceil(0.03 * total) if total >= 10 else 0
    dec.set("warmup_steps", warm, "warmup.3pct",
            f"3% of ~{total} steps" if warm else f"only ~{total} steps: no warmup")
    dec.set("seed", data.seed, "seed.data", "data.seed of the experiment")
    for key, value, rule, reason in STANDING_RULES:
        dec.set(key, value, rule, reason)

    # --- time, eval serving, eval budget and cadence, checkpoints ---------------------------
    _plan_eval_serving(plan, dec, profile, recipe, hw)
    _plan_time(plan, dec, experiment, profile, recipe, hw, steps_per_epoch=steps_per_epoch,
               total=total, real_batch=real_batch, time_cache=time_cache)
    undecided = [key for key in TRAIN_KEYS if key not in plan.decisions]
    if undecided:
        raise PlanError(f"no planner rule decides {', '.join(undecided)}: add one to "
                        "factory/planner/plan.py (STANDING_RULES for a constant)")
    _validate_plan(plan, recipe, hw)
    return plan


AUTO_BALANCE_SKEW = 2.0
"""The planner balances the traffic by language (``data.balance`` left out: ``BalanceSpec.auto``)
when its largest language has at least this many times the rows of its smallest. Chosen on
the agent task's 140 dev requests (600 calls: 64% English, 12% each Spanish, German, French;
``bench/calibration.py --tasks agent --split dev [--data '{"balance": "language"}']``, one
seed): as drawn 80.0% exact calls, balanced **85.0%** (an epoch is a pass over the largest
language, so 303 steps of 8 instead of 198; base 22.1). BENCHMARKS.md, "Human-written data"."""

AUTO_BALANCE_MIN_ROWS = 20
"""... counting only languages of at least this many rows ..."""

AUTO_BALANCE_MIN_SHARE = 0.05
"""... and this share of the rows of a known language: a guess on a few short queries (16 of
CLINC150's 15,000 training queries read as French) is no slice to lift; such languages keep
their share, as ``und`` does."""


def balanced_mix(experiment: Experiment, source_rows: Mapping[str, int], *,
                 notes: list[str] | None = None) -> tuple[MixEntry, ...]:
    """The sources the trainer draws from: ``data.mix``, with ``data.balance`` splitting its
    ``traffic`` (all of the training set when there is no mix) into one source per group.

    Group ``g`` of ``n_g`` rows (``source_rows[group_source(by, g)]``) gets the traffic's
    weight times ``n_g ** alpha / sum(n ** alpha)``, but for the ``und`` group (no language
    found), which keeps its share of the rows; the largest group first (the primary source: an
    epoch is a pass over it, as the trainer counts). Without the groups' counts (no
    dataset yet, or a plan from a saved profile) the traffic is drawn as it is, with a note.
    The planner's default (``BalanceSpec.auto``, the file names no balance) balances only
    skewed traffic (``AUTO_BALANCE_SKEW``) over its languages of some size, the others at
    their share, and notes it; else the traffic is drawn as it is, without a note.
    """
    data = experiment.data
    mix = data.mix
    if data.balance is None:
        return mix
    auto = data.balance.auto
    if auto and mix and "traffic" not in {m.source for m in mix}:
        return mix
    mix = mix or (MixEntry(source="traffic", weight=1.0),)
    by, alpha = data.balance.by, data.balance.alpha
    groups = {source: rows for source, rows in source_rows.items()
              if rows and (group_of(source) or ("", ""))[0] == by}
    if not groups:
        if notes is not None and not auto:
            notes.append(f"data.balance: no counts of the traffic's {by} groups (materialize "
                         f"the dataset); the traffic is drawn as it is")
        return data.mix
    # Samples of no known group (``und``) keep their share: an unsure guess is no slice to lift.
    unsure = group_source(by, UNDETERMINED)
    kept = {unsure} & set(groups)
    if auto:
        known = sum(rows for source, rows in groups.items() if source != unsure)
        sized = {source: rows for source, rows in groups.items() if source != unsure
                 and rows >= max(AUTO_BALANCE_MIN_ROWS, AUTO_BALANCE_MIN_SHARE * known)}
        if len(sized) < 2 or max(sized.values()) < AUTO_BALANCE_SKEW * min(sized.values()):
            return data.mix
        kept = set(groups) - set(sized)
        if notes is not None:
            counts = ", ".join(f"{(group_of(s) or ('', '?'))[1]} {r}"
                               for s, r in sorted(sized.items(), key=lambda x: (-x[1], x[0])))
            notes.append(f"traffic balanced by {by} (the planner's default; data.balance: none "
                         f"draws it as it is): {counts} rows, the largest at least "
                         f"{AUTO_BALANCE_SKEW:g}x the smallest, each drawn by count ** "
                         f"{alpha:g}" + (f"; {len(kept)} other group(s) at their share"
                                         if kept else ""))
    traffic = next(m for m in mix if m.source == "traffic")
    rows_all = sum(groups.values())
    share = {source: groups[source] / rows_all for source in kept}
    mass = {source: rows ** alpha for source, rows in groups.items() if source not in kept}
    rest, total = 1.0 - sum(share.values()), sum(mass.values())
    share.update({source: rest * m / total for source, m in mass.items()})
    split = [MixEntry(source=source, weight=round(traffic.weight * share[source], 6))
             for source in sorted(groups, key=lambda s: (-groups[s], s))]
    return (*split, *(m for m in mix if m.source != "traffic"))


def _mix_rows(mix: tuple[MixEntry, ...], n: int, source_rows: Mapping[str, int]) -> float:
    """Samples drawn per pass over the mixture's primary source: its rows over its share (the
    profile's ``n`` when its rows are not counted)."""
    if not mix:
        return float(n)
    share = mix[0].weight / sum(m.weight for m in mix)
    return source_rows.get(mix[0].source, n) / share


def _plan_mix(plan: Plan, experiment: Experiment, mix: tuple[MixEntry, ...],
              source_rows: Mapping[str, int], *, samples: float) -> None:
    """The mixture's sources with their shares and effective epochs over ``samples`` drawn;
    a source with no rows refuses the plan."""
    total = sum(m.weight for m in mix)
    for m in mix:
        rows = source_rows.get(m.source)
        if rows == 0:
            raise PlanError(f"experiment {experiment.name} ({experiment.path}): data.mix source "
                            f"{m.source!r} has no samples"
                            + ("; materialize its dataset first"
                               if m.kind in ("traffic", "experiment") else "")
                            + ("; the dataset has no synthetic rows (data.synthesize)"
                               if m.kind == "synthetic" else ""))
        drawn = samples * m.weight / total
        plan.mix.append({"source": m.source, "weight": m.weight,
                         "share": round(m.weight / total, 4), "rows": rows,
                         "samples": round(drawn),
                         "epochs": round(drawn / rows, 3) if rows else None})
    parts = [f"{e['source']} {e['share']:.0%}"
             + (f" of {e['rows']} rows: {e['epochs']:g} epochs" if e["rows"] else "")
             for e in plan.mix]
    epochs = plan.decisions["num_epochs"]
    plan.decisions["num_epochs"] = replace(epochs, reason=(
        f"{epochs.reason}; passes over {mix[0].source}, the mix's primary source "
        f"(effective epochs: {'; '.join(parts)})"))
    thin = [e["source"] for e in plan.mix if e["epochs"] is not None and e["epochs"] > 10]
    if thin:
        plan.notes.append(f"data.mix repeats {', '.join(thin)} over 10 times: a small source "
                          "at a high weight is memorized; lower its weight or add samples")


EVAL_HALF_WIDTH = 0.05
"""The widest the 95% interval of the selected checkpoint's score (``selection.summarize``) may
reach to each side, where the eval set and the budget allow: 5 points."""


def eval_samples_needed(half_width: float = EVAL_HALF_WIDTH) -> int:
    """Eval samples whose 95% interval reaches at most ``half_width`` to each side at the widest
    per-sample spread (0/1 scores, half right, or graded scores at standard deviation 0.5):
    1.96 * 0.5 / sqrt(n) <= half_width. 385 at 0.05; the Wilson interval of 193 of 385 is
    [0.452, 0.551], 0.0497 to each side."""
    return math.ceil((1.96 * 0.5 / half_width) ** 2)


def interval_half_width(num_samples: int) -> float:
    """The widest 95% half-width of a mean score over ``num_samples`` eval samples
    (``eval_samples_needed`` inverted)."""
    return 1.96 * 0.5 / math.sqrt(max(1, num_samples))


def _plan_eval_serving(plan: Plan, dec: _Decider, profile: DatasetProfile, recipe: Recipe,
                       hw: Hardware) -> None:
    arch = recipe.architecture
    weights = arch.num_parameters * 2
    if hw.name == "CPU":
        dec.set("eval_devices", 1, "eval.cpu", "CPU: generation with transformers in process")
        dec.set("eval_gpu_memory_utilization", 0.5, "eval.cpu_share",
                "CPU: use at most half of the host memory for generation")
    else:
        devices = next((d for d in (1, 2, 4, 8) if weights * 1.3 <= d * hw.memory_gib * GIB
                        * 0.85), 8)
        dec.set("eval_devices", devices, "eval.tensor_parallel",
                f"bf16 weights ({weights / GIB:.1f} GiB) + 30% KV cache margin fit "
                f"{devices} x {hw.name}")
        util = 0.9 if hw.memory_gib >= 40 else 0.85
        dec.set("eval_gpu_memory_utilization", util, "eval.memory_utilization",
                f"{hw.memory_gib:g} GiB device: {util:.0%} for weights and KV cache"
                + (" (small card: keep room for activations)" if util < 0.9 else ""))
    new_tokens = _round_up(max(16, int(profile.completion_tokens_p99 * 1.25)), 16)
    dec.set("eval_max_new_tokens", new_tokens, "eval.completion_p99",
            f"1.25 x the p99 completion ({profile.completion_tokens_p99} tokens)")
    per_token = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * 2
    per_seq = per_token * (profile.prompt_tokens_p99 + plan["eval_max_new_tokens"])
    if hw.name == "CPU":
        seqs = 8
        dec.set("eval_max_num_seqs", seqs, "eval.cpu_batch", "CPU: 8 sequences at a time")
    else:
        free = plan["eval_devices"] * hw.memory_gib * GIB * plan["eval_gpu_memory_utilization"] \
            - weights
        seqs = max(1, min(256, int(free // per_seq)))
        dec.set("eval_max_num_seqs", seqs, "eval.kv_cache",
                f"KV cache: {free / GIB:.1f} GiB free / {per_seq / 2**20:.1f} MiB per sequence "
                f"of {profile.prompt_tokens_p99}+{plan['eval_max_new_tokens']} tokens "
                "(at most 256)")


def _plan_time(plan: Plan, dec: _Decider, experiment: Experiment, profile: DatasetProfile,
               recipe: Recipe, hw: Hardware, *, steps_per_epoch: int, total: int,
               real_batch: int, time_cache: Path | None = None) -> None:
    """The time model's decisions: eval sample count and cadence within the eval budget, the
    checkpoint cadence, and the predicted wall time (``factory.planner.timing``)."""
    arch = recipe.architecture
    judge = experiment.eval.judge if experiment.eval.judge != "embedded" else recipe.judge_model
    plan.decisions["eval_judge"] = Decision(
        value=judge, rule="eval.judge",
        reason="experiment eval.judge" if experiment.eval.judge != "embedded"
        else f"recipe {recipe.name} judge")
    c = (host_constants(recipe, hw, cache=time_cache, precision=plan["precision"],
                        judge=judge).constants if time_cache is not None
         else time_constants(recipe.name, arch, hw, judge=judge))
    dec.set("time_model", c.source, f"time.{c.source}",
            (f"{recipe.name} on {hw.name}: reference constants " if c.source == "measured"
             else "") + c.provenance)
    devices, seq_len = plan["num_devices"], plan["max_seq_len"]
    eval_devices = plan["eval_devices"]
    # Packed rows are ~95% full and each sample attends to itself; unpacked rows pad to the
    # longest row of their micro-batch (taken as the p99 sample).
    packing = plan["packing"]
    row = int(seq_len * 0.95) if packing else min(seq_len, profile.length_p99)
    tokens_per_step = real_batch * row
    # Samples a step trains: a packed row holds ~95% of its tokens' worth of mean samples.
    mean = profile.length_mean
    samples_per_row = seq_len * 0.95 / mean if packing else 1.0
    targets_per_step = real_batch * samples_per_row * profile.completion_tokens_p50
    pairs = attention_pairs(rows=real_batch, row=row, packing=packing,
                            sample=min(profile.length_p50, seq_len),
                            samples_per_row=samples_per_row)
    if plan["share_prefix"]:
        # A micro-batch is one unpadded row: its shared prefix once, then every sample's rest.
        shared = min(profile.shared_prefix_tokens, int(mean))
        micro_batches = real_batch // plan["micro_batch_size"]
        tokens_per_step = round(real_batch * samples_per_row * (mean - shared)
                                + micro_batches * shared)
        pairs = attention_pairs(rows=micro_batches, row=row, packing=packing, sample=mean,
                                samples_per_row=plan["micro_batch_size"] * samples_per_row,
                                shared=shared)
    step_s = step_seconds(c, arch, tokens_per_step=tokens_per_step,
                          targets_per_step=targets_per_step,
                          samples_per_step=real_batch * samples_per_row, pairs=pairs,
                          recompute=plan["gradient_checkpointing"], num_devices=devices,
                          precision=plan["precision"], share_prefix=plan["share_prefix"])
    budget_train_s = c.train_fixed_s + total * step_s
    budget = eval_budget(hw, train_s=budget_train_s, num_devices=devices)
    cost_kind = "wall" if hw.evals_share_devices else "device time"

    available = profile.num_eval_samples or max(1, round(
        profile.num_samples * experiment.data.eval_fraction / (1 - experiment.data.eval_fraction)))
    forced_batch = ({**dec.overrides, **dec.point}["eval_batch_size"]
                    if dec.forced("eval_batch_size") else None)

    def shape(n: int) -> EvalShape:
        batch = forced_batch or min(plan["eval_max_num_seqs"], n)
        return EvalShape(num_samples=n, batch=batch,
                         prompt_tokens=min(profile.prompt_tokens_p99, seq_len),
                         new_tokens=plan["eval_max_new_tokens"],
                         sample_tokens=min(profile.length_p99, seq_len))

    def times(n: int) -> tuple[float, float]:
        return (eval_seconds(c, arch, shape(n), first=True),
                eval_seconds(c, arch, shape(n), first=False))

    def final_s(n: int, k: int, final: int | None = None) -> float:
        """The final evals after ``k`` evals of ``n`` samples: the ``FINAL_CANDIDATES`` leaders
        on the rest of the final set (``final`` samples; default: the plan's so far). None
        where ``k`` is no more than the leaders: judging them all again would cost what judging
        each on the final set does."""
        final = final_num if final is None else final
        if n >= final or k <= FINAL_CANDIDATES:
            return 0.0
        rest = replace(shape(n), num_samples=final - n, batch=min(shape(n).batch, final - n))
        return final_eval_seconds(c, arch, rest, num_candidates=FINAL_CANDIDATES)

    def ok(n: int, k: int, final: int | None = None) -> bool:
        first, later = times(n)
        return fits(hw, c, first_s=first, eval_s=later, num_evals=k, train_s=budget_train_s,
                    num_devices=devices, eval_devices=eval_devices,
                    final_s=final_s(n, k, final))

    def cost(n: int, k: int, final: int | None = None) -> float:
        first, later = times(n)
        return eval_cost(hw, c, first_s=first, eval_s=later, num_evals=k,
                         train_s=budget_train_s, eval_devices=eval_devices,
                         final_s=final_s(n, k, final))

    budget_words = (f"{EVAL_SHARE:.0%} of the run's {cost_kind} ({duration(budget)} for "
                    f"~{duration(budget_train_s)} of training)")
    if not hw.evals_share_devices:
        budget_words += f", and the wall they add within {EVAL_SHARE:.0%} of the run's"

    # --- eval sample count and cadence within the budget. What gives way, in order: samples
    # down to MIN_EVAL_SAMPLES (keeping MIN_EVALS evals; the leaders are then judged on the
    # whole final set, counted in the budget), then the final evals (every checkpoint on the
    # most samples that fit), then evals down to one (the final checkpoint must be judged);
    # evals beyond MIN_EVALS only with budget to spare.
    needed = eval_samples_needed()
    min_evals = min(MIN_EVALS, total)
    wanted = min(available, needed)
    floor = min(wanted, MIN_EVAL_SAMPLES)
    cap = experiment.eval.max_samples
    whole = min(wanted, cap) if cap else wanted
    final_num = 0  # no final evals unless chosen below

    def most_samples(k: int, final: int = 0) -> int:
        """The most samples (at least ``floor``) with which ``k`` evals fit, and the final
        evals on ``final`` samples (0: none)."""
        # The cost grows with the sample count below the final set (k > FINAL_CANDIDATES:
        # each sample more for every checkpoint is one less for the leaders).
        lo, hi = floor, max(floor, final - 1) if final else wanted
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if ok(mid, k, final) else (lo, mid - 1)
        return lo

    if ok(wanted, min_evals):
        num, rule = wanted, "eval.resolution"
        why = (f"{num} of the {available} eval samples: a score's 95% interval reaches at most "
               f"±{interval_half_width(num):.3f}"
               + (f" ({needed} samples bring it to ±{EVAL_HALF_WIDTH:g})" if num < needed
                  else "")
               + f"; {min_evals} evals of them take ~{duration(cost(num, min_evals))}, within "
               + budget_words)
    else:
        keep = min_evals if ok(floor, min_evals) else next(
            (k for k in range(min_evals - 1, 0, -1) if ok(floor, k)), 1)
        num, rule = most_samples(keep), "eval.budget"
        why = (f"{num} of the {available} eval samples: {min_evals} evals of {wanted} would "
               f"take ~{duration(cost(wanted, min_evals))}, over {budget_words}")
        if ok(num, keep):
            why += f"; {keep} eval{'s' if keep > 1 else ''} of {num} fit"
        elif num < wanted:
            why += (f"; {num} is the fewest the budget cuts to (their 95% interval stays within "
                    f"{CLEAR_MARGIN:g} of the mean)")
        else:
            why += (f"; the budget cuts to no fewer than {MIN_EVAL_SAMPLES} (their 95% interval "
                    f"stays within {CLEAR_MARGIN:g} of the mean)")
        why += f"; a score's 95% interval reaches at most ±{interval_half_width(num):.3f}"
        if keep > FINAL_CANDIDATES and whole > num and ok(floor, keep, whole):
            # The final evals: every checkpoint judged on fewer samples, the leaders on the
            # whole final set; only where that fits whole (a partial final set would trade the
            # mid-training evals' resolution for a few points of the choice's).
            final_num, plain = whole, num
            num = most_samples(keep, whole)
            why = (f"{num} of the {available} eval samples for every checkpoint: {min_evals} "
                   f"evals of {wanted} would take ~{duration(cost(wanted, min_evals))}, over "
                   f"{budget_words}; the {FINAL_CANDIDATES} leading checkpoints are then "
                   f"judged on all {whole} (eval_final_num_samples) where every checkpoint "
                   f"could be judged on {plain}: {keep} evals of {num} and the final evals "
                   f"take ~{duration(cost(num, keep))}; a score's 95% interval reaches at most "
                   f"±{interval_half_width(num):.3f} mid-training, "
                   f"±{interval_half_width(whole):.3f} for the choice")
    if cap and cap < num:
        plan.decisions["eval_num_samples"] = Decision(
            value=cap, rule="experiment.eval", overridden=True,
            reason=f"eval.max_samples of the experiment file (the planner would pick {num}: "
                   f"{why}); with {cap} a score's 95% interval reaches at most "
                   f"±{interval_half_width(cap):.3f}")
    else:
        plan.decisions["eval_num_samples"] = Decision(value=num, rule=rule, reason=why)
    num_eval = plan["eval_num_samples"]
    if profile.eval_split == RECALL:
        plan.notes.append(f"eval scores measure recall only: {profile.eval_split_reason} "
                          "(curation's phrasing split needs more distinct phrasings; "
                          "a held-out test set of new requests is the only measure of "
                          "generalization here)")
    chosen_on = max(num_eval, final_num)
    if chosen_on < needed:
        plan.notes.append(f"{chosen_on} eval samples give the selected checkpoint's score a 95% "
                          f"interval of up to ±{interval_half_width(chosen_on):.3f}; {needed} "
                          f"would bring it to ±{EVAL_HALF_WIDTH:g}"
                          + (" (raise data.eval_fraction, eval.max_samples or the traffic)"
                             if chosen_on in (available, cap) else
                             " (the eval budget: a longer run affords more)"))
    batch = min(plan["eval_max_num_seqs"], num_eval)
    dec.set("eval_batch_size", batch, "eval.batch",
            f"{num_eval} eval samples, at most {plan['eval_max_num_seqs']} at once")
    first_s, eval_s = times(num_eval)

    epochs_run = max(1, math.ceil(total / steps_per_epoch))
    most = max(1, min(total, recipe.evals_per_epoch * epochs_run))
    afford = next((k for k in range(most, 0, -1) if ok(num_eval, k)), 0)
    count = max(1, min(most, afford))
    every = max(1, math.ceil(total / count))
    each = (f"one eval ~{duration(eval_s)} ({duration(first_s)} the first, with the base "
            f"model's answers) on {hw.name}")
    together = f"together ~{duration(cost(num_eval, count))}"
    if afford >= most:
        crule = "eval.per_epoch"
        cwhy = (f"{count} evals ({recipe.evals_per_epoch} per epoch of ~{steps_per_epoch} "
                f"steps, as the recipe asks): {each}; {together}, within {budget_words}")
    elif afford >= min_evals:
        crule = "eval.budget"
        cwhy = (f"{count} evals, the most within {budget_words}: {each}; {together} (the "
                f"recipe would take {most}, {recipe.evals_per_epoch} per epoch)")
    elif afford >= 1:
        crule = "eval.budget_few"
        cwhy = (f"{count} eval{'s' if count > 1 else ''}, all that fit "
                f"{budget_words}: {each}; {together}; fewer than the {MIN_EVALS} the plateau "
                "stop needs, so the run trains to its end and "
                + ("the best of these checkpoints is chosen" if count > 1
                   else "its final checkpoint is judged"))
    else:
        crule = "eval.final_only"
        cwhy = (f"one eval, of the final checkpoint: even that takes "
                f"~{duration(first_s)} (with the base model's answers), over {budget_words}")
    cwhy += f"; every {every} of ~{total} steps"
    if experiment.eval.every_steps is not None and not dec.forced("eval_every_steps"):
        plan.decisions["eval_every_steps"] = Decision(
            value=experiment.eval.every_steps, rule="experiment.eval", overridden=True,
            reason=f"eval.every_steps of the experiment file (the planner would pick {every}: "
                   f"{cwhy})")
    else:
        dec.set("eval_every_steps", every, crule, cwhy)
    eval_every = int(plan["eval_every_steps"])

    # --- checkpoint cadence: the checkpoint sensor judges every checkpoint, so checkpoints
    # beyond the evals' cadence are evals too, and only where the budget affords them ---
    ckpt = max(1, min(total, int(CHECKPOINT_EVERY_S // max(step_s, 1e-9))))
    judged = math.ceil(total / ckpt)
    if eval_every <= ckpt:
        # Mid-training evals judge checkpoints (the checkpoint sensor fires them), so every eval
        # step needs one; the preemption rule alone would checkpoint less often.
        dec.set("checkpoint_every_steps", eval_every, "ckpt.eval",
                f"every eval judges a checkpoint: one each {eval_every} steps (the 15-minute "
                f"preemption rule alone would give {ckpt})")
    elif ok(num_eval, judged):
        dec.set("checkpoint_every_steps", ckpt, "ckpt.15min",
                f"a step takes ~{step_s:.3g} s on {devices} x {hw.name}: every {ckpt} steps a "
                f"preemption loses at most ~15 minutes; the checkpoint sensor judges all "
                f"{judged}, ~{duration(cost(num_eval, judged))}, within {budget_words}")
    else:
        # As many checkpoints as the budget can judge, at least one per eval.
        evals = math.ceil(total / eval_every)
        most_judged = next((k for k in range(judged - 1, evals, -1) if ok(num_eval, k)), evals)
        every_ckpt = min(eval_every, math.ceil(total / most_judged))
        lost = duration(every_ckpt * step_s)
        dec.set("checkpoint_every_steps", every_ckpt, "ckpt.eval_budget",
                f"every {every_ckpt} steps (~{lost} of training), as often as the budget can "
                f"judge them: the checkpoint sensor judges every checkpoint, and the 15-minute "
                f"rule's {judged} would take ~{duration(cost(num_eval, judged))}, over "
                f"{budget_words}; a stop by SIGTERM still checkpoints, a hard kill loses at "
                f"most {lost}")

    # --- the prediction: every checkpoint is judged (checkpoint_sensor), the final one too,
    # then the leaders on the rest of the final eval set ---
    ckpt_every = int(plan["checkpoint_every_steps"])
    num_evals = math.ceil(total / ckpt_every)
    final_eval_s = final_s(num_eval, num_evals)
    if final_eval_s > 0:
        plan.decisions["eval_final_num_samples"] = Decision(
            value=final_num, rule="eval.final",
            reason=f"the {FINAL_CANDIDATES} leading of the {num_evals} judged checkpoints (by "
                   f"the lower bound of their interval on {num_eval} samples, "
                   f"±{interval_half_width(num_eval):.3f}) are judged on {final_num} of the "
                   f"{available} eval samples before the choice "
                   f"(±{interval_half_width(final_num):.3f}): ~{duration(final_eval_s)} after "
                   "the last eval, counted in the eval budget")
    elif num_eval >= whole:
        plan.decisions["eval_final_num_samples"] = Decision(
            value=num_eval, rule="eval.final_whole",
            reason=f"no final evals: every checkpoint is judged on the whole final eval set "
                   f"({num_eval} samples)")
    else:
        why = (f"{num_evals} judged checkpoint{'s' if num_evals > 1 else ''}, no more than the "
               f"{FINAL_CANDIDATES} leaders the final evals take: judging them all again would "
               "cost what judging each on more samples does"
               if num_evals <= FINAL_CANDIDATES else
               f"the budget cannot also judge the {FINAL_CANDIDATES} leading ones on all "
               f"{whole} samples of the final set")
        plan.decisions["eval_final_num_samples"] = Decision(
            value=num_eval, rule="eval.final_none",
            reason=f"no final evals: {why}; the choice is made on those {num_eval} samples")
    loss_span = min(profile.length_p50, seq_len)
    loss_pass_s = forward_flops(arch, tokens=available * loss_span,
                                targets=available * profile.completion_tokens_p50,
                                span=loss_span) / (c.forward_tflops * 1e12 * devices)
    rt = run_time(hw, c, step_s=step_s, num_steps=total, loss_passes=total // eval_every,
                  loss_pass_s=loss_pass_s, first_eval_s=first_s, eval_s=eval_s,
                  num_evals=num_evals, num_devices=devices, eval_devices=eval_devices,
                  final_eval_s=final_eval_s)
    plan.estimates = {
        "step_seconds": round(step_s, 3), "step_factor": round(c.step_factor, 4),
        "steps": float(total),
        "tokens_per_step": round(tokens_per_step), "targets_per_step": round(targets_per_step),
        "attention_pairs": round(pairs),
        "train_seconds": round(rt.train_s, 1), "num_evals": float(num_evals),
        "first_eval_seconds": round(first_s, 1), "eval_seconds": round(eval_s, 1),
        "final_evals_seconds": round(rt.final_eval_s, 1), "evals_seconds": round(rt.evals_s, 1), "wall_seconds": round(rt.wall_s, 1),
        "hours": round(rt.wall_s / 3600, 3), "eval_share": round(rt.share, 3),
        "eval_wall_share": round(rt.wall_share, 3), "eval_budget_share": EVAL_SHARE}
    extra = ckpt_every < eval_every and num_evals > math.ceil(total / eval_every)
    if extra:
        plan.notes.append(f"the checkpoint sensor judges every checkpoint: the 15-minute "
                          f"checkpoints make {num_evals} evals, the eval cadence "
                          f"{math.ceil(total / eval_every)}")
    if max(rt.share, rt.wall_share) > EVAL_SHARE + 5e-4:
        # The experiment's own choices that size the evals or the training they share.
        forced = {"eval_every_steps": "eval.every_steps", "eval_num_samples": "eval.max_samples",
                  **{k: k for k in ("num_steps", "num_epochs", "checkpoint_every_steps",
                                    "eval_batch_size", "eval_max_new_tokens",
                                    "eval_max_num_seqs")}}
        causes = [name for key, name in forced.items() if plan.decisions[key].overridden]
        cause = (f"the experiment file sets {', '.join(causes)}" if causes
                 else "the 15-minute checkpoints, each judged" if extra
                 else "even one eval of the fewest samples costs more than a run this short "
                      "affords")
        taken = (f"{rt.share:.0%} of the run's wall" if hw.evals_share_devices else
                 f"{rt.share:.0%} of the run's device time and {rt.wall_share:.0%} of its wall")
        plan.notes.append(f"evals are predicted to take {taken} (budget {EVAL_SHARE:.0%}): "
                          f"{cause}")
    if rt.train_s / 3600 > MAX_WALL_HOURS:
        plan.notes.append(f"estimated {rt.train_s / 3600:.0f} h of training exceeds a 24 h "
                          "sandbox; the run continues from checkpoints across sandboxes")
    epochs = plan.decisions["num_epochs"]
    per_epoch = steps_per_epoch * step_s
    if plan["num_steps"] is not None:
        stop = f"the run is {plan['num_steps']} steps long (num_steps)"
    elif num_evals >= MIN_EVALS:
        stop = (f"the plateau stop ends a run whose last {PLATEAU_PATIENCE} evals do not beat "
                "the best checkpoint before them beyond its 95% interval, so later passes "
                "run only while they help")
    else:
        stop = (f"with {num_evals} eval{'s' if num_evals > 1 else ''} the plateau stop cannot "
                f"act (it needs {MIN_EVALS}): every pass runs")
    plan.decisions["num_epochs"] = replace(epochs, reason=(
        f"{epochs.reason}; a pass is ~{steps_per_epoch} steps, ~{duration(per_epoch)} on "
        f"{hw.name}; {stop}"))


def parallelism_for(devices: int) -> str:
    """The rule: one device trains ``single``, more shard with ``fsdp2``."""
    return "single" if devices == 1 else "fsdp2"


def parallelism_problem(parallelism: str, devices: int) -> str | None:
    """Why ``parallelism`` cannot run on ``devices`` devices (the rule ``parallelism_for``
    broken by overrides), saying what to set; None when they agree."""
    if parallelism == parallelism_for(devices):
        return None
    if parallelism == "single":
        return (f"parallelism single runs on one device, num_devices is {devices}; set "
                "parallelism: fsdp2 or num_devices: 1")
    return (f"parallelism {parallelism} needs at least 2 devices, num_devices is {devices}; "
            "set num_devices: 2 (or more) or parallelism: single")


def _validate_inputs(experiment: Experiment, profile: DatasetProfile, recipe: Recipe,
                     dec: _Decider) -> None:
    arch = recipe.architecture
    where = f"experiment {experiment.name} ({experiment.path})"
    if profile.num_samples <= 0:
        raise PlanError(f"{where}: the dataset has no train samples; widen data.where "
                        f"({experiment.data.where!r}) or ingest traffic first")
    if experiment.data.max_tokens > arch.max_context:
        raise PlanError(f"{where}: data.max_tokens {experiment.data.max_tokens} exceeds the "
                        f"{arch.max_context}-token context of {recipe.base_model_id}; set "
                        f"data.max_tokens to at most {arch.max_context}")
    seq = {**dec.overrides, **dec.point}.get("max_seq_len")
    if seq is not None and seq > arch.max_context:
        raise PlanError(f"{where}: max_seq_len {seq} exceeds the {arch.max_context}-token "
                        f"context of {recipe.base_model_id}; set it to at most "
                        f"{arch.max_context}")
    targets = {**dec.overrides, **dec.point}.get("lora_target_modules")
    if targets:
        bad = [t for t in targets if t not in arch.linear_modules]
        if bad:
            raise PlanError(f"{where}: lora_target_modules {bad} do not exist in "
                            f"{recipe.base_model_id}; choose from "
                            f"{', '.join(arch.linear_modules)}")
    if profile.share_with_images > 0 and not arch.vision_module:
        raise PlanError(f"{where}: {profile.share_with_images:.0%} of samples have images but "
                        f"{recipe.base_model_id} reads no images; use recipe qwen2.5-vl-7b-lora "
                        "or exclude them with data.where (\"... AND NOT has_images\")")
    forced = {**dec.overrides, **dec.point}
    if "parallelism" in forced and "num_devices" in forced:
        problem = parallelism_problem(forced["parallelism"], forced["num_devices"])
        if problem:
            raise PlanError(f"{where}: {problem}")


def _validate_plan(plan: Plan, recipe: Recipe, hw: Hardware) -> None:
    assert plan.memory is not None
    arch = recipe.architecture
    if plan.memory.total > plan.memory_budget:
        need, have = plan.memory.total / GIB, plan.memory_budget / GIB
        hints = []
        if not plan["gradient_checkpointing"]:
            hints.append("gradient_checkpointing: true")
        if plan["micro_batch_size"] > 1:
            hints.append(f"micro_batch_size: {max(1, plan['micro_batch_size'] // 2)}")
        hints.append("a lower data.max_tokens")
        hints.append("a larger GPU (gpu: H200)")
        raise PlanError(f"{plan.run_key}: needs {need:.1f} GiB per device, {hw.name} has "
                        f"{have:.1f} GiB usable ({plan.memory.as_gib()}); try "
                        + ", or ".join(hints))
    problem = parallelism_problem(plan["parallelism"], plan["num_devices"])
    if problem:
        raise PlanError(f"{plan.run_key}: {problem}")
    if plan["num_devices"] > hw.max_devices:
        raise PlanError(f"{plan.run_key}: {hw.name} nodes have at most {hw.max_devices} "
                        f"devices; lower num_devices to {hw.max_devices}")
    if plan["max_seq_len"] > arch.max_context:
        raise PlanError(f"{plan.run_key}: max_seq_len {plan['max_seq_len']} exceeds the model "
                        f"context {arch.max_context}")
    frozen = set(plan["frozen_modules"])
    if arch.vision_module and arch.vision_module not in frozen:
        plan.notes.append(f"the vision tower ({arch.vision_module}) is not frozen: it trains "
                          "no adapter but its activations cost memory")
    if not recipe.architecture.supports_tools and "tool" in " ".join(
            d.reason for d in plan.decisions.values()):
        plan.notes.append(f"{recipe.base_model_id}'s chat template has no tool format; tool "
                          "calls are rendered as text")
