"""The time model's constants of the host that runs a CPU job: measured once per host, cached.

``MEASURED`` in ``timing.py`` holds constants fitted on one machine; on another CPU the same plan
runs at another pace (an AVX2 host without bf16 instructions trains in fp32, about half the
speed). ``host_constants`` replaces the rates of those constants with rates measured on this
host by a short calibration, the first time a (host, model size, precision) is planned, and
caches them under ``<home>/cache/time-model/`` keyed by the host (``HostKey``: CPU model, its
flags and the cores this process may use); later plans on the host read the cache.

The calibration (``calibrate``) runs a real forward and backward of a model of the base
model's shape: the recipe's ``Architecture`` as a Llama-shaped transformers model with random
weights (timing does not depend on the weights, and nothing is downloaded), PEFT LoRA on the
recipe's target modules, frozen linears stored in bf16 under bf16 autocast as the trainer stores
them, ``CALIBRATION_ROWS`` rows of ``CALIBRATION_TOKENS``. It runs in the precision the trainer
would run on this CPU (``factory.trainer.precision.effective_precision``). Three rates come out,
each as the planner's FLOP count over the best of ``CALIBRATION_REPEATS`` timings:

- ``train_tflops``: forward and backward of a training step, less its attention's seconds at
  the rate below;
- ``attention_tflops``: one layer's causal attention (SDPA, the model's heads, key-value heads
  and head size) over ``ATTENTION_TOKENS`` tokens, forward and backward, in the trainer's
  precision: on the bf16 host ~0.026 TFLOP/s against a training rate of ~0.2, so a
  700-token system prompt's attention is a third of its step (CLINC150's plan:
  ``bench/shared_prefix.py --task clinc150``, profiled);
- ``forward_tflops``: the held-out loss pass (forward, no gradients);
- ``prefill_tflops``: forward in fp32 on one thread, as the CPU eval server runs.

The decode constants scale with the prefill rate (both fp32 on one thread); fixed costs, the
judge, the overlap factor and the ``share_prefix`` rate keep the recipe's uncalibrated values
(``timing.time_constants``: none of them is a rate of this CPU's arithmetic). The reference's
per-sample seconds of a ``share_prefix`` step do not: they stood for its rests' attention
calls at the training rate, which a calibrated host prices at its measured attention rate
(re-planned with this host's constants, the steps of CLINC150's, the agent task's, SNIPS's and
triage's finished runs on the bf16 host came within 0.83-1.22 of measured with them left out,
three calibrations; 0.94-1.47 with them, one: ``bench/time_model.py --runs``).
``method="matmul"`` times the same linear layers' matrix products alone (no attention, norms,
LoRA or loss): cheaper to run, and an upper bound on the rate. ``model`` is the default
because it comes nearer a real step than the proxy (``bench/time_model.py``, bf16 host, one
thread, SmolLM2-135M, 6 steps of 2 x 128; predicted over measured seconds a step: at load 9-10, ``model`` 0.88 (38 s to calibrate), ``matmul``
0.23 (3 s), the reference constants 0.15; at load 3, 0.48 (14 s), 0.18 (1 s) and 0.25): with
AMX the matrix products are a quarter to a third of a step, and the rest (attention, norms,
LoRA, the loss, autograd) does not scale with them from one CPU to another. Neither reaches a
step's per-step costs outside the model (optimizer, packed attention's per-sample calls, the
data): on steps this small they are half of the step, and only the pace correction, 0.91-1.02
after 3 steps, came within 25% on this shared host.

The factory's own plans (the ``training_plan`` asset, ``factory plan``) use this host's
constants (``time_model_cache``): the first plan of a model size on a host calibrates (~30 s
for SmolLM2 on a 2-core AVX2 host), later plans read the cache, which lives per user and host
(``~/.cache/factory/time-model``), not per factory home. ``FACTORY_TIME_MODEL=reference`` plans
with the reference constants instead, the same plan on every machine (the tests do). A
calibration made while another process held the cores measures a fraction of the rate (one
beside a test measured a ninth); its CPU share shows it (``Calibration.contended``), and such a
measurement serves its own plan but is not cached. What the load does during a run shows in the
run's own steps, and ``factory.planner.pace`` corrects the prediction from them (0.93-1.01 of
the measured seconds after 3 steps, the ``training_run`` step logs and records it).

A calibration times one shape of step; the trainer's batches are other shapes, and a step holds
costs no rate of matrix products counts (the optimizer, per-sample attention calls, the data).
So each finished run on this host teaches the next plans: ``record_pace`` (called by the
``training_run`` asset at a run's end) keeps the run's observed seconds a step over what the
calibrated rates predicted for it, the newest ``PACE_RUNS`` per (host, model size, precision),
and ``host_constants`` multiplies a step's predicted seconds by their median
(``TimeConstants.step_factor``; the plan's provenance names it and the runs behind it). A pace
belongs to the calibration it was measured against: a new calibration starts without any.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from factory.errors import SettingsError
from factory.planner.hardware import Hardware
from factory.planner.timing import (
    TimeConstants,
    attention_flops,
    causal_pairs,
    forward_flops,
    time_constants,
    training_flops,
)
from factory.recipes import Architecture, Recipe
from factory.trainer.precision import effective_precision

TIME_MODEL_ENV = "FACTORY_TIME_MODEL"
"""``host`` (the default): plans calibrate on this host; ``reference``: the reference constants."""
TIME_MODELS = ("host", "reference")
TIME_MODEL_CACHE_ENV = "FACTORY_TIME_MODEL_CACHE"
"""The folder of the host's cached constants (``time_model_cache``)."""
MIN_CPU_SHARE = 0.8
"""Share of its threads' wall seconds a calibration must get on the CPU to be cached: below it,
another process held the cores while it measured (an idle host gives it ~0.95)."""

CALIBRATION_ROWS = 1
CALIBRATION_TOKENS = 256
"""Rows and tokens per row of a calibration step: 256 tokens, a forward of SmolLM2-135M in
~0.15 s (bf16) to ~0.35 s (fp32) on the bf16 host at load 3: long enough that Python's
per-layer overhead is a small part of it, short enough to time each rate twice in seconds."""
CALIBRATION_TARGETS = 64
"""Trained tokens of a calibration row (its last quarter, an answer after its prompt): the
trainer's loss runs the LM head on those only, as a real step does."""
ATTENTION_TOKENS = 512
"""Tokens of the calibration's attention call: a system prompt's length, long enough that the
call's arithmetic, not its launch, is timed."""
CALIBRATION_REPEATS = 4
"""Timed steps after one warm-up; the best is kept (another process's burst only slows one).
Best of 2 gave training rates of 0.16-0.24 TFLOP/s in consecutive calibrations on the bf16
host, the seven runs above re-planned 0.72-1.33 of measured in three; best of 4, 0.83-1.22
in three calibrations (15-22 s each)."""
PACE_RUNS = 5
"""Finished runs whose pace a host's entry keeps (the newest); their median corrects a step."""
PACE_MIN_STEPS = 20
"""Steps a run's pace must be observed over to be kept (a short run's steps are mostly warm-up)."""
METHODS = ("model", "matmul")


@dataclass(frozen=True, kw_only=True)
class HostKey:
    """What makes one host's arithmetic differ from another's."""

    cpu: str
    """CPU model name (``/proc/cpuinfo``'s ``model name``, else ``platform.processor()``)."""
    flags: str
    """The CPU's flags that decide matrix throughput (AVX-512, bf16, AMX), comma-separated."""
    flags_sha: str
    """First 8 hex digits of the sha256 of all its flags (a microcode or VM change shows)."""
    cores: int
    """Cores this process may run on."""

    @property
    def label(self) -> str:
        return f"{self.cpu}, {self.cores} cores, {self.flags or 'no AVX-512'} ({self.flags_sha})"

    @property
    def slug(self) -> str:
        """The cache file's name."""
        return hashlib.sha256(self.label.encode()).hexdigest()[:16]


ARITHMETIC_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16",
                    "amx_tile", "amx_bf16", "amx_int8", "bf16", "sve", "sme")
"""Flags named in the key: those that change how fast torch multiplies matrices on a CPU."""


def host_key() -> HostKey:
    """This host's key, from ``/proc/cpuinfo`` (other systems: ``platform``)."""
    cpu, flags = "", ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "Model", "CPU part") and not cpu:
                    cpu = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = value.strip()
    except OSError:
        pass
    cpu = cpu or platform.processor() or platform.machine() or "unknown CPU"
    present = set(flags.split())
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        (os.cpu_count() or 1)
    return HostKey(cpu=" ".join(cpu.split()),
                   flags=",".join(f for f in ARITHMETIC_FLAGS if f in present),
                   flags_sha=hashlib.sha256(" ".join(sorted(present)).encode()).hexdigest()[:8],
                   cores=cores)


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """What one calibration measured on one host for one model size and precision."""

    method: str
    """``model`` (a real step of a model of the base model's shape) or ``matmul``."""
    precision: str
    """The precision it trained in (what the trainer runs on this CPU)."""
    train_tflops: float
    """A training step's rate, TFLOP/s of the planner's FLOP count (as ``TimeConstants``)."""
    forward_tflops: float
    """The held-out loss pass's rate (forward, no gradients)."""
    prefill_tflops: float
    """The eval server's prompt rate (fp32 forward on one thread)."""
    seconds: float
    """Wall seconds the calibration took, model build included."""
    load: float
    """The 1-minute load average when it ran (a busy host measures slow)."""
    measured_at: str
    """ISO time of the measurement (UTC)."""
    torch_threads: int
    """Threads torch trained with."""
    cpu_share: float = 1.0
    """CPU seconds the timed training and forward steps got over their wall seconds times
    ``torch_threads`` (below ``MIN_CPU_SHARE``: another process held the cores)."""
    attention_tflops: float | None = None
    """Attention's rate, forward and backward (``timing.attention_flops`` over its seconds); a
    cached calibration without it predates the rate and is measured again."""

    @property
    def contended(self) -> bool:
        """Whether it measured a host busy with something else (then it is not cached)."""
        return self.cpu_share < MIN_CPU_SHARE


def size_class(arch: Architecture) -> str:
    """The cache's key of a model's shape (two recipes of one base model share it)."""
    return (f"{arch.family}-L{arch.num_layers}-h{arch.hidden_size}-i{arch.intermediate_size}"
            f"-a{arch.num_heads}x{arch.head_dim}-kv{arch.num_kv_heads}-v{arch.vocab_size}")


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


@dataclass
class _Meter:
    """CPU and wall seconds of the timed multi-threaded steps (the CPU share they got)."""

    cpu: float = 0.0
    wall: float = 0.0

    def best(self, fn: Any, repeats: int) -> float:
        cpu, wall = time.process_time(), time.perf_counter()
        try:
            return _best(fn, repeats)
        finally:
            self.cpu += time.process_time() - cpu
            self.wall += time.perf_counter() - wall


def _best(fn: Any, repeats: int) -> float:
    fn()  # warm-up: oneDNN picks and caches its kernels on the first call
    times = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _llama_model(arch: Architecture) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=arch.vocab_size, hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size, num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_heads, num_key_value_heads=arch.num_kv_heads,
        head_dim=arch.head_dim, max_position_embeddings=max(arch.max_context,
                                                            CALIBRATION_TOKENS),
        tie_word_embeddings=arch.tie_word_embeddings, use_cache=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def calibrate(recipe: Recipe, *, method: str = "model", precision: str = "bf16-autocast",
              repeats: int = CALIBRATION_REPEATS) -> Calibration:
    """Measure this host's rates for ``recipe``'s model shape (see the module docstring).

    ``precision``: the plan's; the trainer's effective precision on this CPU is measured.
    """
    import torch

    if method not in METHODS:
        raise ValueError(f"calibration method {method!r}: use one of {', '.join(METHODS)}")
    start, load = time.perf_counter(), _load()
    ran, _ = effective_precision(precision, "cpu")
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=ran == "bf16-autocast")
    arch = recipe.architecture
    tokens = CALIBRATION_ROWS * CALIBRATION_TOKENS
    targets = CALIBRATION_ROWS * CALIBRATION_TARGETS
    train_flops = training_flops(arch, tokens=tokens, targets=targets, recompute=False)
    fwd_flops = forward_flops(arch, tokens=tokens, targets=targets, span=CALIBRATION_TOKENS)
    threads = torch.get_num_threads()
    meter = _Meter()
    attention_s = _time_attention(arch, autocast, ran, repeats, meter)
    attention_rate = attention_flops(arch, pairs=causal_pairs(ATTENTION_TOKENS),
                                     recompute=False) / arch.num_layers / attention_s
    if method == "model":
        train_s, fwd_s, prefill_s = _time_model(recipe, autocast, ran, repeats, meter)
        # The step's own causal attention, at the rate just measured (at most half the step:
        # a bound against a burst of load during the attention's timing).
        train_s -= min(train_s / 2, attention_flops(
            arch, pairs=CALIBRATION_ROWS * causal_pairs(CALIBRATION_TOKENS),
            recompute=False) / attention_rate)
    else:
        train_s, fwd_s, prefill_s = _time_matmuls(arch, autocast, ran, repeats, meter)
    return Calibration(
        method=method, precision=ran, train_tflops=train_flops / train_s / 1e12,
        attention_tflops=attention_rate / 1e12,
        forward_tflops=fwd_flops / fwd_s / 1e12,
        prefill_tflops=tokens * 2 * arch.num_parameters / prefill_s / 1e12,
        seconds=time.perf_counter() - start, load=load,
        measured_at=datetime.now(UTC).isoformat(timespec="seconds"), torch_threads=threads,
        cpu_share=meter.cpu / max(1e-9, meter.wall * threads))


def _one_thread(fn: Any, repeats: int) -> float:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _best(fn, repeats)
    finally:
        torch.set_num_threads(threads)


def _time_model(recipe: Recipe, autocast: Any, ran: str, repeats: int, meter: _Meter
                ) -> tuple[float, float, float]:
    import torch
    from peft import LoraConfig, get_peft_model

    arch = recipe.architecture
    base = _llama_model(arch)
    targets = [m for m in recipe.lora_target_modules
               if m in {n.rsplit(".", 1)[-1] for n, _ in base.named_modules()}] or "all-linear"
    config = LoraConfig(r=recipe.lora_rank, lora_alpha=int(recipe.lora_alpha), lora_dropout=0.0,
                        target_modules=targets, bias="none", task_type="CAUSAL_LM")
    with warnings.catch_warnings():
        # peft 0.21 probes transformers' deprecated `is_gradient_checkpointing` (as the trainer).
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*",
                                category=FutureWarning)
        model = get_peft_model(base, config)
    if ran == "bf16-autocast":
        # As the trainer stores them (factory.trainer.model._store_frozen_linears_in).
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and not module.weight.requires_grad:
                module.to(torch.bfloat16)
    ids = torch.randint(0, arch.vocab_size, (CALIBRATION_ROWS, CALIBRATION_TOKENS))
    decoder, head = base.get_decoder(), base.get_output_embeddings()
    # As the trainer's loss (factory.trainer.model.CausalLMLoss): the decoder over every token,
    # the head on the trained positions only (the row's last CALIBRATION_TARGETS).
    trained = slice(CALIBRATION_TOKENS - CALIBRATION_TARGETS - 1, CALIBRATION_TOKENS - 1)
    answer = ids[:, trained.start + 1:].reshape(-1)

    def loss() -> Any:
        hidden = decoder(input_ids=ids, use_cache=False).last_hidden_state[:, trained]
        logits = head(hidden.reshape(-1, hidden.shape[-1])).float()
        return torch.nn.functional.cross_entropy(logits, answer, reduction="sum")

    def train() -> None:
        with autocast:
            value = loss()
        value.backward()
        model.zero_grad(set_to_none=True)

    def forward() -> None:
        with torch.no_grad(), autocast:
            loss()

    train_s, fwd_s = meter.best(train, repeats), meter.best(forward, repeats)
    if ran == "bf16-autocast":
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.float()

    def prefill() -> None:
        with torch.no_grad():
            model(input_ids=ids)

    return train_s, fwd_s, _one_thread(prefill, max(1, repeats - 1))


def _time_attention(arch: Architecture, autocast: Any, ran: str, repeats: int, meter: _Meter
                    ) -> float:
    """Seconds of one layer's causal attention over ``ATTENTION_TOKENS`` tokens, forward and
    backward, as the trainer calls it (SDPA, grouped key-value heads, in the precision autocast
    gives the projections' outputs)."""
    import torch
    import torch.nn.functional as F

    dtype = torch.bfloat16 if ran == "bf16-autocast" else torch.float32
    torch.manual_seed(0)
    q = torch.randn(1, arch.num_heads, ATTENTION_TOKENS, arch.head_dim, dtype=dtype,
                    requires_grad=True)
    k, v = (torch.randn(1, arch.num_kv_heads, ATTENTION_TOKENS, arch.head_dim, dtype=dtype,
                        requires_grad=True) for _ in range(2))
    grad = torch.randn_like(q)

    def step() -> None:
        with autocast:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                 enable_gqa=arch.num_heads != arch.num_kv_heads)
        torch.autograd.grad(out, (q, k, v), grad)

    return meter.best(step, repeats)


def _time_matmuls(arch: Architecture, autocast: Any, ran: str, repeats: int, meter: _Meter
                  ) -> tuple[float, float, float]:
    """The model's linear layers' products alone (one layer's, times the layer count, and the
    output head's on the trained tokens): frozen weights, so the backward computes input
    gradients only."""
    import torch

    tokens = CALIBRATION_ROWS * CALIBRATION_TOKENS
    targets = CALIBRATION_ROWS * CALIBRATION_TARGETS
    h, q, kv, i = (arch.hidden_size, arch.num_heads * arch.head_dim,
                   arch.num_kv_heads * arch.head_dim, arch.intermediate_size)
    dtype = torch.bfloat16 if ran == "bf16-autocast" else torch.float32
    layer = [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]
    weights = [torch.randn(o, n, dtype=dtype) * 0.02 for n, o in layer]
    head = torch.randn(arch.vocab_size, h, dtype=dtype) * 0.02
    inputs = {n: torch.randn(tokens, n, requires_grad=True) for n in {n for n, _ in layer}}
    trained = torch.randn(targets, h, requires_grad=True)

    def products(grad: bool, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        with autocast, torch.set_grad_enabled(grad):
            outs = [torch.nn.functional.linear(x, w) for x, w in pairs]
        if grad:
            torch.autograd.backward([o.float().sum() for o in outs])

    body = [(inputs[w.shape[1]], w) for w in weights]
    last = [(trained, head)]
    train_s = arch.num_layers * meter.best(lambda: products(True, body), repeats) \
        + meter.best(lambda: products(True, last), repeats)
    fwd_s = arch.num_layers * meter.best(lambda: products(False, body), repeats) \
        + meter.best(lambda: products(False, last), repeats)
    body32 = [(x, w.float()) for x, w in body]
    head32 = [(inputs[h], head.float())]

    def fp32(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        with torch.no_grad():
            for x, w in pairs:
                torch.nn.functional.linear(x, w)

    # The server's prefill: every prompt token through the layers and the head (2N a token).
    prefill_s = arch.num_layers * _one_thread(lambda: fp32(body32), max(1, repeats - 1)) \
        + _one_thread(lambda: fp32(head32), max(1, repeats - 1))
    return train_s, fwd_s, prefill_s


def constants_from(calibration: Calibration, key: HostKey, base: TimeConstants
                   ) -> TimeConstants:
    """``base`` (the recipe's constants without calibration) with this host's measured rates;
    the decode steps scale with the prefill rate (see the module docstring)."""
    slower = base.prefill_tflops / calibration.prefill_tflops
    source = base.provenance.split(":", 1)[0] if base.measured else "defaults"
    contended = (f" < {MIN_CPU_SHARE}: another process held the cores, so it is not cached"
                 if calibration.contended else "")
    return replace(
        base, train_tflops=calibration.train_tflops, forward_tflops=calibration.forward_tflops,
        attention_tflops=calibration.attention_tflops, shared_prefix_sample_s=0.0,
        prefill_tflops=calibration.prefill_tflops, decode_step_s=base.decode_step_s * slower,
        decode_seq_s=base.decode_seq_s * slower, measured=True, calibrated=True,
        train_precision=calibration.precision,
        provenance=(f"calibrated on this host ({key.label}) at {calibration.measured_at} "
                    f"by a {calibration.method} step in {calibration.precision} "
                    f"({calibration.seconds:.0f} s, load {calibration.load:.1f}, CPU share "
                    f"{calibration.cpu_share:.2f}{contended}): train "
                    f"{calibration.train_tflops:.3g}, attention "
                    f"{calibration.attention_tflops or 0:.3g}, forward "
                    f"{calibration.forward_tflops:.3g}, "
                    f"prefill {calibration.prefill_tflops:.3g} TFLOP/s; fixed costs, judge and "
                    f"overlap as {source}"))


@dataclass(frozen=True, kw_only=True)
class HostConstants:
    """The constants a plan on this host uses, and whether this call measured them."""

    constants: TimeConstants
    fresh: bool
    """True when this call ran the calibration (the cache had no entry)."""
    cache: Path | None
    """The cache file (None: the defaults, no calibration applies)."""


def cache_path(cache: Path, key: HostKey) -> Path:
    """The cache file of ``key``'s host under the cache folder ``cache``."""
    return cache / f"{key.slug}.json"


def host_constants(recipe: Recipe, hw: Hardware, *, cache: Path,
                   precision: str = "bf16-autocast", judge: str = "embedded",
                   key: HostKey | None = None, method: str = "model") -> HostConstants:
    """This host's constants for ``recipe`` on ``hw``, calibrated on first use and cached in the
    folder ``cache``.

    Only a CPU plan is calibrated (the planning host is the training host); a GPU plan gets
    ``timing.time_constants`` unchanged. A calibration that did not get its cores
    (``Calibration.contended``) serves this plan and is not cached: the next plan measures again.
    """
    if not hw.evals_share_devices:
        return HostConstants(constants=time_constants(recipe.name, recipe.architecture, hw,
                                                      judge=judge), fresh=False, cache=None)
    key = key or host_key()
    path = cache_path(cache, key)
    entry, size, dtype = _entry(recipe, precision)
    cached = _read(path)
    found: dict[str, Any] | None = (cached.get("entries") or {}).get(entry)
    if found is not None and not found.get("attention_tflops"):
        found = None  # measured before attention had a rate of its own: measured again
    fresh = found is None
    if fresh:
        # Said before it starts: a plan's first call on a host otherwise pauses without a word.
        print(f"planner: timing {key.label} for this model size ({size}, {dtype}), once per "
              f"host and size (about 30 s for SmolLM2-135M); cached in {path}",
              file=sys.stderr, flush=True)
        calibration = calibrate(recipe, method=method, precision=precision)
        if not calibration.contended:
            cached = {**cached, "host": asdict(key),
                      "entries": {**(cached.get("entries") or {}), entry: asdict(calibration)}}
            _write(path, cached)
    else:
        assert found is not None
        calibration = Calibration(**found)
    base = time_constants(recipe.name, recipe.architecture, hw, judge=judge)
    constants = constants_from(calibration, key, base)
    ratios = [p["ratio"] for p in _paces(cached, entry, calibration)]
    if ratios:
        factor = statistics.median(ratios)
        constants = replace(
            constants, step_factor=factor,
            provenance=f"{constants.provenance}; a step's seconds x{factor:.2f}: the median pace "
                       f"of this host's last {len(ratios)} finished run"
                       f"{'s' if len(ratios) > 1 else ''} against these rates "
                       f"({', '.join(f'{r:.2f}' for r in ratios)})")
    return HostConstants(constants=constants, fresh=fresh, cache=path)


def _entry(recipe: Recipe, precision: str) -> tuple[str, str, str]:
    """(cache entry, size class, precision) of ``recipe`` planned in ``precision``: the
    precision the trainer runs here (FACTORY_CPU_BF16 can change it), not the plan's."""
    size, dtype = size_class(recipe.architecture), effective_precision(precision, "cpu")[0]
    return f"{size}|{dtype}", size, dtype


def _read(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        found = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"time-model cache {path} is not JSON ({exc}): delete it and the "
                         "next plan calibrates again") from None
    return found if isinstance(found, dict) else {}


def _write(path: Path, cached: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # a sweep's plans may write at once
    tmp.write_text(json.dumps(cached, indent=1, sort_keys=True))
    tmp.replace(path)


def _paces(cached: dict[str, Any], entry: str, calibration: Calibration
           ) -> list[dict[str, Any]]:
    """The entry's kept paces measured against ``calibration`` (not an older one's)."""
    return [p for p in (cached.get("paces") or {}).get(entry) or []
            if p.get("calibration") == calibration.measured_at][-PACE_RUNS:]


def record_pace(cache: Path, recipe: Recipe, precision: str, *, ratio: float, steps: int,
                run_id: str, key: HostKey | None = None) -> Path | None:
    """Keep a finished run's pace on this host: ``ratio``, its observed seconds a step over what
    the calibrated rates alone (no ``step_factor``) predicted, over ``steps`` steps. Kept only
    where this host has a cached calibration of ``recipe``'s size and precision (the one the
    plan used) and the run was observed over ``PACE_MIN_STEPS`` steps or more: returns the
    cache file then, else None. A run recorded again replaces its pace."""
    if steps < PACE_MIN_STEPS or not ratio > 0:
        return None
    path = cache_path(cache, key or host_key())
    entry = _entry(recipe, precision)[0]
    cached = _read(path)
    found = (cached.get("entries") or {}).get(entry)
    if found is None:
        return None
    calibration = Calibration(**found)
    kept = [p for p in _paces(cached, entry, calibration) if p.get("run_id") != run_id]
    kept.append({"run_id": run_id, "ratio": round(ratio, 4), "steps": steps,
                 "calibration": calibration.measured_at,
                 "measured_at": datetime.now(UTC).isoformat(timespec="seconds")})
    cached["paces"] = {**(cached.get("paces") or {}), entry: kept[-PACE_RUNS:]}
    _write(path, cached)
    return path


def time_model_cache() -> Path | None:
    """The folder where the factory's plans cache this host's constants: ``$FACTORY_TIME_MODEL_
    CACHE``, else ``$XDG_CACHE_HOME/factory/time-model`` (``~/.cache/factory/time-model``): one
    per user and host, shared by every factory home on it (the constants are the host's, not a
    project's). None (the reference constants, the same on every machine) under
    ``FACTORY_TIME_MODEL=reference``; ``SettingsError`` for any other value than ``host``."""
    mode = os.environ.get(TIME_MODEL_ENV, "").strip() or "host"
    if mode not in TIME_MODELS:
        raise SettingsError(f"{TIME_MODEL_ENV}={mode!r}: use host (calibrate on this machine, "
                            "the default) or reference (the reference constants)")
    if mode == "reference":
        return None
    if folder := os.environ.get(TIME_MODEL_CACHE_ENV, "").strip():
        return Path(folder).expanduser()
    root = os.environ.get("XDG_CACHE_HOME", "").strip() or "~/.cache"
    return Path(root).expanduser() / "factory" / "time-model"
