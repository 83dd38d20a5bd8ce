"""The time model: what a training step, an eval and a whole run cost on the target hardware.

The planner budgets time with it the way it budgets memory with ``memory.py``: it predicts a
step's seconds, one eval's seconds and the run's wall time, and chooses the eval sample count and
cadence so that evals take a bounded share of the run (``EVAL_SHARE``).

Constants are per (recipe, hardware type) (``TimeConstants``). Measured ones (``MEASURED``) say
where and how they were measured; every other pair gets conservative defaults derived from the
hardware table's FLOPs and memory bandwidth (``default_constants``), slower than every
measurement so far, and the plan's reasons say so. A missing measurement never fails a plan.
A CPU plan made on the host that trains takes this host's rates instead
(``factory.planner.host``: measured once per host, cached, and its steps corrected by the
pace of the host's finished runs, ``TimeConstants.step_factor``), and ``factory.planner.pace``
corrects a running plan's prediction from its own steps.

What the model counts (BENCHMARKS.md, "Planner time model", compares it with real runs):
- a training step: the planner's FLOP count of the rows it trains (unpacked rows pad to the
  longest row of their micro-batch, taken as the p99 sample) at the achieved rate: every token
  through the decoder's linear layers, the LM head only on the trained (assistant) tokens, as
  the trainer's loss computes it (``factory.trainer.model.CausalLMLoss``); plus the attention's
  query-key pairs as the trainer's calls compute them (``attention_pairs``) at attention's own
  rate (``TimeConstants.attention_tflops``: SDPA's backward on a CPU runs at a fraction of the
  linear layers' rate, so a long system prompt's attention is a third of its step); the run
  adds a fixed launch-and-load cost and the trainer's held-out loss pass at each eval step;
- an eval (``checkpoint_evals``): a fixed cost (run launch, server boot, adapter, the trainer-side
  model of the equivalence check), the equivalence check's two samples scored on both sides, then
  per batch of ``eval_batch_size`` answers a prefill of the batch's prompts (left-padded to the
  longest: the p99 prompt) and ``eval_max_new_tokens`` decode steps (a batch runs until its
  longest answer; early checkpoints and the base often reach the budget), then the judge per
  answer. The run's first eval also answers with the base model and judges the references
  (counted: whether another run's scores can be reused is only known when the eval runs);
- the final evals (``final_evals``), where mid-training evals judge a subset of the final eval
  set: after the last eval, one server boot (``eval_fixed_s``) with the leading checkpoints'
  adapters, each answering the final set's samples the subset left out, then the judge per
  answer (no equivalence check, no base model: each leader was judged before);
- where evals run: on CPU they share the training cores, so each eval during training adds its
  seconds times ``overlap_factor`` to the wall (the two processes slow each other), and the last
  one, after the final step, adds its own; on GPUs they run on their own devices (vLLM) beside
  training and lengthen the run only by the last eval (and by any queue if they fall behind).
  The final evals wait for every checkpoint's score, so they add their seconds to the wall on
  both, and to the device time on GPUs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from factory.evals.selection import CLEAR_MARGIN, PLATEAU_PATIENCE
from factory.planner.hardware import Hardware
from factory.recipes import Architecture
from factory.trainer.config import REST_CALL_WORK

EVAL_SHARE = 0.20
"""Most of a run's cost evals may take. On CPU the cost is wall time (evals share the cores: at
most 20% of the predicted wall); on GPUs, where evals run on their own devices, both their
device time (at most 20% of the run's device-seconds) and the wall they add (the last eval, and
any backlog behind training: at most 20% of the wall)."""
MIN_EVALS = PLATEAU_PATIENCE + 1
"""Evals a run needs before the plateau stop can end it (``factory.evals.selection``: the last
``PLATEAU_PATIENCE`` checkpoints against the best one before them)."""
MIN_EVAL_SAMPLES = math.ceil((1.96 * 0.5 / CLEAR_MARGIN) ** 2)
"""The fewest eval samples the budget may cut to (43): with them the 95% interval of a mean score
reaches at most ``CLEAR_MARGIN`` (0.15) to each side at the widest spread (0/1 scores, half
right), so a checkpoint that clearly beats the base is seen to."""
EQUIVALENCE_SAMPLES = 2
"""Samples the train/serve equivalence check scores per eval (``checkpoint_evals``)."""
UNMEASURED_DERATE = 0.4
"""Share of the hardware table's throughput (peak x MFU) and memory bandwidth the defaults
assume. On the one pair measured (SmolLM2-135M on CPU) training reached 0.74 of peak x MFU and
fp32 prefill 0.44: 0.4 keeps every default slower than what was measured."""
CPU_FP32_SLOWDOWN = 76.6 / 140.1
"""Training tokens/s of fp32 over bf16 autocast on CPU (BENCHMARKS.md, "Trainer"): the measured
CPU constants are bf16 autocast's."""


@dataclass(frozen=True, kw_only=True)
class TimeConstants:
    """Time constants of one recipe on one hardware type."""

    train_tflops: float
    """Achieved training throughput per device, TFLOP/s of the planner's FLOP count."""
    forward_tflops: float
    """Achieved forward-only throughput per device (the trainer's held-out loss pass)."""
    prefill_tflops: float
    """Achieved prompt throughput of one eval server, TFLOP/s (2 x parameters per token)."""
    decode_step_s: float
    """Seconds of one decode step of a batch of one sequence."""
    decode_seq_s: float
    """Seconds each further sequence of the batch adds to a decode step."""
    train_fixed_s: float
    """Seconds a training run spends outside its steps (launch, model and data load, the end)."""
    eval_fixed_s: float
    """Seconds an eval spends outside prefill, decode and judging (run launch, server boot and
    adapter load, the trainer-side model of the equivalence check, writing the scores)."""
    judge_s: float
    """Seconds to judge one answer."""
    overlap_factor: float
    """Wall seconds an eval costs per second of its own while training runs on the same devices
    (unused where evals run on their own devices)."""
    measured: bool
    """Whether these were measured (else derived defaults)."""
    provenance: str
    """Where and how they were measured, or how the defaults were derived."""
    attention_tflops: float | None = None
    """Achieved rate of attention, forward and backward, per device: TFLOP/s of
    ``attention_flops`` over the query-key pairs the trainer's calls compute. A host's
    calibration measures it (SDPA on the model's head shape); None: ``train_tflops``, how the
    reference constants were fitted (their runs' attention at the training rate)."""
    shared_prefix_rate: float = 0.5
    """The share of ``train_tflops`` a step reaches on ``share_prefix`` rows (one row per
    micro-batch: smaller matmuls); the defaults' conservative guess, 1.0 where measured."""
    shared_prefix_sample_s: float = 0.0
    """Seconds a ``share_prefix`` step spends per sample beyond its FLOPs (an attention call per
    sample's rest in every layer, forward and backward): a cost of calls, not of arithmetic, so
    a calibration of this host's rates keeps it."""
    calibrated: bool = False
    """Whether the rates were measured on the host that plans (``factory.planner.host``)."""
    train_precision: str = "bf16-autocast"
    """The precision ``train_tflops`` was measured in (a CPU without bf16 instructions trains
    ``bf16-autocast`` plans in fp32)."""
    step_factor: float = 1.0
    """A step's measured seconds over what the rates above give it: the median pace of the
    host's last finished runs (``factory.planner.host.record_pace``); 1.0 before any."""

    @property
    def attention_rate(self) -> float:
        """``attention_tflops``, else ``train_tflops``."""
        return self.attention_tflops or self.train_tflops

    @property
    def source(self) -> str:
        """``calibrated`` (on this host), ``measured`` (on the reference host) or
        ``defaults``: the plan's ``time_model`` value."""
        return "calibrated" if self.calibrated else "measured" if self.measured else "defaults"


MEASURED: dict[tuple[str, str], TimeConstants] = {
    ("smollm2-135m-lora", "CPU"): TimeConstants(
        # Steps: 4.72 s for 8 rows padded to ~197 tokens, 33 trained each (make demo), and
        # 21.44 s for 8 rows of ~800, 40 trained (agent task): 0.155 and 0.153 TFLOP/s.
        # Held-out loss: 3.84 s for 27 x 177 tokens, 32.5 s for 54 x 675: 0.285 and 0.268.
        train_tflops=0.154, forward_tflops=0.276,
        # 1 thread, CPU-seconds (what load moves least), fp32 as the server runs: batch of 8
        # prompts of 150 / 700 tokens at 486 / 408 tokens/s (x 2 x 134.5M FLOPs); a decode step
        # 0.058-0.068 s at batch 1, 0.132-0.141 s at batch 8.
        prefill_tflops=0.11, decode_step_s=0.063, decode_seq_s=0.0105,
        # Training run launch to trainer start 10.5 / 14.1 s, finish to run end 4.6 / 3.2 s.
        # Eval: the demo's eval at step 8 took 33.3 s from its run's creation to its end, of
        # which the model above gives 17.9 s to the equivalence check, prefill, decode (46
        # steps, its longest answer) and judging.
        train_fixed_s=16.0, eval_fixed_s=15.4, judge_s=0.05,
        # The demo's eval at step 4 ran beside the trainer's last step: 88.9 s of wall for
        # 50.4 s of eval and 9.1 s of training as the model gives them alone: (88.9 - 9.1) / 50.4.
        overlap_factor=1.58, measured=True,
        # bench/shared_prefix.py (the triage plan, 366 tokens a step, its rests then attending
        # a call each): 1.539 s per step where the rates give 1.111 s: 0.428 s more for its 8
        # samples. (On an AVX2 host in fp32, 2026-12-06, the same plan's steps cost the
        # calibrated FLOP rate's time plus 0.08 s, not the 1.45x a rate factor would give: the
        # excess is per call.)
        shared_prefix_rate=1.0, shared_prefix_sample_s=0.0535,
        provenance="measured on dev-cpu (2 cores): the steps, evals and run launches of the "
                   "`make demo` and agent-task runs in BENCHMARKS.md (idle machine), the "
                   "generation rates with the CPU server's engine on one thread"),
}
"""Measured constants by (recipe name, hardware type); BENCHMARKS.md "Planner time model"."""


@dataclass(frozen=True, kw_only=True)
class KindDefaults:
    """Fixed costs of a kind of hardware the FLOP count cannot give."""

    train_fixed_s: float
    """Seconds a training run spends launching, before model weights are counted."""
    eval_fixed_s: float
    """Seconds an eval spends launching and booting its server, before weights are counted."""
    load_bytes_per_s: float
    """Weight bytes loaded per second (an eval loads them twice: server and equivalence)."""
    decode_overhead_s: float
    """Seconds of each decode step besides reading the weights."""
    decode_seq_overhead_s: float
    """Seconds each further sequence adds to a decode step besides its FLOPs."""
    overlap_factor: float
    """As ``TimeConstants.overlap_factor``."""
    reason: str
    """Where the numbers come from."""


CPU_DEFAULTS = KindDefaults(
    train_fixed_s=15.0, eval_fixed_s=10.5, load_bytes_per_s=0.1e9, decode_overhead_s=0.0,
    decode_seq_overhead_s=0.0105, overlap_factor=1.58,
    reason="the CPU server's fixed costs as measured for SmolLM2-135M, weights loaded at "
           "0.1 GB/s (SmolLM2: 0.27 GB in ~3 s)")
GPU_DEFAULTS = KindDefaults(
    train_fixed_s=120.0, eval_fixed_s=120.0, load_bytes_per_s=1e9, decode_overhead_s=0.01,
    decode_seq_overhead_s=0.0, overlap_factor=1.0,
    reason="unmeasured: 2 minutes to start a training container and to boot vLLM (CUDA graphs, "
           "compilation), weights loaded at 1 GB/s, 10 ms of scheduling per decode step")


def default_constants(arch: Architecture, hw: Hardware, *, judge: str = "embedded"
                      ) -> TimeConstants:
    """Conservative constants from the hardware table (peak x MFU and bandwidth, derated by
    ``UNMEASURED_DERATE``) and the kind's fixed costs: for a pair nobody measured."""
    kind = CPU_DEFAULTS if hw.evals_share_devices else GPU_DEFAULTS
    flops = hw.bf16_tflops * hw.mfu * UNMEASURED_DERATE
    # The CPU server generates in fp32, vLLM in bf16; every decode step reads every weight.
    served = arch.num_parameters * (4 if hw.evals_share_devices else 2)
    on_disk = arch.num_parameters * 2
    decode = served / (hw.memory_bandwidth_gbs * 1e9 * UNMEASURED_DERATE) \
        + kind.decode_overhead_s
    return TimeConstants(
        train_tflops=flops, forward_tflops=flops, prefill_tflops=flops, decode_step_s=decode,
        decode_seq_s=2 * arch.num_parameters / (flops * 1e12) + kind.decode_seq_overhead_s,
        train_fixed_s=kind.train_fixed_s + on_disk / kind.load_bytes_per_s,
        eval_fixed_s=kind.eval_fixed_s + 2 * on_disk / kind.load_bytes_per_s,
        judge_s=judge_seconds(judge), overlap_factor=kind.overlap_factor, measured=False,
        provenance=f"no measured time constants: defaults from {hw.name}'s "
                   f"{hw.bf16_tflops:g} TFLOP/s x MFU {hw.mfu:g} and "
                   f"{hw.memory_bandwidth_gbs:g} GB/s, each x {UNMEASURED_DERATE:g}; "
                   + kind.reason)


def duration(seconds: float) -> str:
    """Seconds for people: 45 s, 3.2 min, 2.4 h."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def judge_seconds(judge: str) -> float:
    """Seconds per judged answer: the embedded judge (exact checks and a MiniLM embedding,
    which loads in 0.14 s: 0.05 s bounds it) or an LLM judge (unmeasured: one ~2 s call per
    answer, four at a time as ``LLMJudge`` sends them)."""
    return 0.05 if judge == "embedded" else 0.5


def time_constants(recipe: str, arch: Architecture, hw: Hardware, *,
                   judge: str = "embedded") -> TimeConstants:
    """The measured constants of (``recipe``, ``hw``), else ``default_constants``."""
    found = MEASURED.get((recipe, hw.name))
    if found is None:
        return default_constants(arch, hw, judge=judge)
    if judge != "embedded":
        return replace(found, judge_s=judge_seconds(judge))
    return found


def head_parameters(arch: Architecture) -> int:
    """Parameters of the LM head (the embedding matrix where they are tied)."""
    return arch.vocab_size * arch.hidden_size


def body_parameters(arch: Architecture) -> int:
    """Parameters every token multiplies through: the decoder's, without the input embedding
    (a lookup), the LM head or the vision tower."""
    embeddings = head_parameters(arch) * (1 if arch.tie_word_embeddings else 2)
    return arch.num_parameters - arch.vision_parameters - embeddings


def training_flops(arch: Architecture, *, tokens: float, targets: float,
                   recompute: bool) -> float:
    """FLOPs of a LoRA step's matrix products over ``tokens`` tokens of which ``targets`` are
    trained, attention apart (``attention_flops``): through the decoder forward 2N, backward
    through the frozen weights 2N (no weight gradients), recomputation another 2N; the frozen LM
    head on the targets only, its logits and their gradient with respect to the hidden states (4
    x its parameters: the trainer's fused loss computes both in forward, and never recomputes
    them)."""
    per_token = (6 if recompute else 4) * body_parameters(arch)
    return tokens * per_token + targets * 4 * head_parameters(arch)


def attention_flops(arch: Architecture, *, pairs: float, recompute: bool) -> float:
    """FLOPs of attention over ``pairs`` query-key pairs in every layer, forward and backward
    (another forward where recomputed): 2 a pair and head dimension forward, 4 backward."""
    return (8 if recompute else 6) * arch.num_layers * pairs * arch.num_heads * arch.head_dim


def causal_pairs(length: float) -> float:
    """Query-key pairs a causal call over ``length`` tokens computes (SDPA skips the masked
    half)."""
    return length * (length + 1) / 2


def attention_pairs(*, rows: float, row: float, packing: bool, sample: float,
                    samples_per_row: float, shared: float = 0.0) -> float:
    """Query-key pairs a step's attention computes, as the trainer's calls do
    (``factory.trainer.model.packed_sdpa_attention``): an unpacked row of ``row`` tokens, one
    masked call over all its pairs (padding included); a packed row, one causal call a sample
    of ``sample`` tokens; a shared-prefix row (``shared`` > 0, the ``rows`` its micro-batches),
    the prefix causally, then its ``samples_per_row`` rests in one masked call over the row."""
    if shared:
        rests = samples_per_row * (sample - shared)
        needed = rests * sample  # each rest's token: the prefix and its own rest
        one_call = rests * (shared + rests)
        return rows * (causal_pairs(shared)
                       + (one_call if one_call <= REST_CALL_WORK * needed else needed))
    if packing:
        return rows * samples_per_row * causal_pairs(sample)
    return rows * row * row


def forward_flops(arch: Architecture, *, tokens: float, targets: float, span: int) -> float:
    """FLOPs of a forward pass with the loss on ``targets`` of its ``tokens`` (the held-out
    loss)."""
    per_token = 2 * body_parameters(arch) + 2 * arch.num_layers * span * arch.num_heads \
        * arch.head_dim
    return tokens * per_token + targets * 2 * head_parameters(arch)


def step_seconds(c: TimeConstants, arch: Architecture, *, tokens_per_step: float,
                 targets_per_step: float, pairs: float, recompute: bool, num_devices: int,
                 precision: str, share_prefix: bool = False,
                 samples_per_step: float = 0.0) -> float:
    """Seconds of one optimizer step (``tokens_per_step``: the tokens its rows compute,
    ``targets_per_step`` of them trained, ``pairs`` the query-key pairs its attention computes
    (``attention_pairs``), ``samples_per_step`` samples)."""
    slower = precision == "fp32" and c.measured and c.train_precision != "fp32"
    factor = CPU_FP32_SLOWDOWN if slower else 1.0
    rate = c.train_tflops * factor
    calls = 0.0
    if share_prefix:
        rate *= c.shared_prefix_rate
        calls = samples_per_step * c.shared_prefix_sample_s
    flops = training_flops(arch, tokens=tokens_per_step, targets=targets_per_step,
                           recompute=recompute)
    attention = attention_flops(arch, pairs=pairs, recompute=recompute) \
        / (c.attention_rate * factor * 1e12)
    return (flops / (rate * 1e12) + attention + calls) / num_devices * c.step_factor


def generation_seconds(c: TimeConstants, arch: Architecture, *, num_samples: int, batch: int,
                       prompt_tokens: int, new_tokens: int) -> float:
    """Seconds to answer ``num_samples`` prompts in batches of ``batch``."""
    full, rest = divmod(num_samples, max(1, batch))
    sizes = [batch] * full + ([rest] if rest else [])
    prefill_rate = c.prefill_tflops * 1e12 / (2 * arch.num_parameters)
    return sum(b * prompt_tokens / prefill_rate
               + new_tokens * (c.decode_step_s + (b - 1) * c.decode_seq_s) for b in sizes)


@dataclass(frozen=True, kw_only=True)
class EvalShape:
    """What one eval generates: the plan's eval serving values and the data's lengths."""

    num_samples: int
    """Eval samples answered."""
    batch: int
    """Answers generated together."""
    prompt_tokens: int
    """Prompt tokens of a batch's longest prompt (the p99 prompt)."""
    new_tokens: int
    """Decode steps of a batch (the answer budget)."""
    sample_tokens: int
    """Tokens of a whole sample (the equivalence check scores two)."""


def eval_seconds(c: TimeConstants, arch: Architecture, shape: EvalShape, *,
                 first: bool) -> float:
    """Seconds of one eval; the ``first`` also answers with the base model and judges the
    references."""
    prefill_rate = c.prefill_tflops * 1e12 / (2 * arch.num_parameters)
    check = 2 * EQUIVALENCE_SAMPLES * shape.sample_tokens / prefill_rate  # server + trainer
    answer = generation_seconds(c, arch, num_samples=shape.num_samples, batch=shape.batch,
                                prompt_tokens=shape.prompt_tokens, new_tokens=shape.new_tokens)
    answers = 2 if first else 1
    judged = shape.num_samples * (answers + (1 if first else 0))
    return c.eval_fixed_s + check + answers * answer + judged * c.judge_s


def final_eval_seconds(c: TimeConstants, arch: Architecture, shape: EvalShape, *,
                       num_candidates: int) -> float:
    """Seconds of the final evals: ``num_candidates`` checkpoints each answering
    ``shape.num_samples`` more samples on one server (0 when there is nothing to judge)."""
    if num_candidates <= 0 or shape.num_samples <= 0:
        return 0.0
    answer = generation_seconds(c, arch, num_samples=shape.num_samples, batch=shape.batch,
                                prompt_tokens=shape.prompt_tokens, new_tokens=shape.new_tokens)
    return c.eval_fixed_s + num_candidates * (answer + shape.num_samples * c.judge_s)


@dataclass(frozen=True, kw_only=True)
class RunTime:
    """Predicted seconds of one run."""

    step_s: float
    """One optimizer step."""
    train_s: float
    """The training run: fixed cost, steps and held-out loss passes."""
    first_eval_s: float
    """The first eval, alone."""
    eval_s: float
    """Each later eval, alone."""
    num_evals: int
    """Evals of the run (judged checkpoints)."""
    final_eval_s: float
    """The final evals, alone (0: none)."""
    evals_s: float
    """Wall seconds the evals add to the run, the final evals' included."""
    eval_cost_s: float
    """What the budget counts: the evals' wall seconds where they share the devices, their
    device-seconds where they have their own."""
    train_cost_s: float
    """The same for training: wall seconds, or device-seconds."""

    @property
    def wall_s(self) -> float:
        return self.train_s + self.evals_s

    @property
    def share(self) -> float:
        """The evals' share of the run's cost: wall on CPU, device time on GPUs."""
        total = self.train_cost_s + self.eval_cost_s
        return self.eval_cost_s / total if total > 0 else 0.0

    @property
    def wall_share(self) -> float:
        """The evals' share of the run's wall."""
        return self.evals_s / self.wall_s if self.wall_s > 0 else 0.0


def evals_wall(hw: Hardware, c: TimeConstants, *, first_s: float, eval_s: float,
               num_evals: int, train_s: float, final_s: float = 0.0) -> float:
    """Wall seconds ``num_evals`` evals and the final evals (``final_s``, after them) add to a
    run of ``train_s`` seconds of training."""
    if num_evals <= 0:
        return 0.0
    if hw.evals_share_devices:
        # All but the last run beside the trainer; the last judges the final checkpoint.
        last = eval_s if num_evals > 1 else first_s
        during = (first_s + (num_evals - 2) * eval_s) if num_evals > 1 else 0.0
        return during * c.overlap_factor + last + final_s
    # Own devices: only the last eval lengthens the run, and any backlog past the training.
    total = first_s + (num_evals - 1) * eval_s
    last = eval_s if num_evals > 1 else first_s
    return last + max(0.0, total - last - train_s) + final_s


def eval_cost(hw: Hardware, c: TimeConstants, *, first_s: float, eval_s: float,
              num_evals: int, train_s: float, eval_devices: int, final_s: float = 0.0) -> float:
    """The evals' cost as ``EVAL_SHARE`` counts it (``RunTime.eval_cost_s``), the final
    evals' (``final_s``) included."""
    if hw.evals_share_devices:
        return evals_wall(hw, c, first_s=first_s, eval_s=eval_s, num_evals=num_evals,
                          train_s=train_s, final_s=final_s)
    if num_evals <= 0:
        return 0.0
    return (first_s + (num_evals - 1) * eval_s + final_s) * eval_devices


def eval_budget(hw: Hardware, *, train_s: float, num_devices: int) -> float:
    """The most the evals may cost (as ``eval_cost``) for a share of ``EVAL_SHARE``."""
    train_cost = train_s if hw.evals_share_devices else train_s * num_devices
    return EVAL_SHARE / (1 - EVAL_SHARE) * train_cost


def fits(hw: Hardware, c: TimeConstants, *, first_s: float, eval_s: float, num_evals: int,
         train_s: float, num_devices: int, eval_devices: int, final_s: float = 0.0) -> bool:
    """Whether ``num_evals`` evals and the final evals (``final_s``) stay within the budget (on
    their own devices: their device time, and the wall they add, the last eval's, any
    backlog's and the final evals', each within the share)."""
    cost = eval_cost(hw, c, first_s=first_s, eval_s=eval_s, num_evals=num_evals,
                     train_s=train_s, eval_devices=eval_devices, final_s=final_s)
    if cost > eval_budget(hw, train_s=train_s, num_devices=num_devices) + 1e-9:
        return False
    if not hw.evals_share_devices:
        walls = evals_wall(hw, c, first_s=first_s, eval_s=eval_s, num_evals=num_evals,
                           train_s=train_s, final_s=final_s)
        return walls <= EVAL_SHARE / (1 - EVAL_SHARE) * train_s + 1e-9
    return True


def run_time(hw: Hardware, c: TimeConstants, *, step_s: float, num_steps: int,
             loss_passes: int, loss_pass_s: float, first_eval_s: float, eval_s: float,
             num_evals: int, num_devices: int, eval_devices: int,
             final_eval_s: float = 0.0) -> RunTime:
    """The run's predicted seconds from its parts."""
    train_s = c.train_fixed_s + num_steps * step_s + loss_passes * loss_pass_s
    walls = evals_wall(hw, c, first_s=first_eval_s, eval_s=eval_s, num_evals=num_evals,
                       train_s=train_s, final_s=final_eval_s)
    cost = eval_cost(hw, c, first_s=first_eval_s, eval_s=eval_s, num_evals=num_evals,
                     train_s=train_s, eval_devices=eval_devices, final_s=final_eval_s)
    return RunTime(step_s=step_s, train_s=train_s, first_eval_s=first_eval_s, eval_s=eval_s,
                   num_evals=num_evals, final_eval_s=final_eval_s, evals_s=walls,
                   eval_cost_s=cost,
                   train_cost_s=train_s if hw.evals_share_devices else train_s * num_devices)
