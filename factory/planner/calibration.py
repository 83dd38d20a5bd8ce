"""Check the memory model against real trainer runs: plan a job, run ``python -m factory.trainer``, compare.

``measure(config)`` writes synthetic chat samples, profiles them as curation would (token
counts from the model's own tokenizer and chat template), lets the planner plan an experiment
on that profile (``MeasureConfig`` fields become the experiment's overrides), writes the
planner's ``Plan.train_config()`` as a trainer job exactly as ``factory.control.jobs`` does,
and runs the trainer in a fresh process through ``RUNNER``: it imports torch, transformers,
peft and the trainer, records that RSS as the baseline, then runs the ``trainer`` package as
``__main__`` with ``--job`` (``python -m factory.trainer``'s own code path) and reports its peak RSS.

Why peak minus baseline: on CPU, "accelerator memory" is process memory, and the process also
holds the Python interpreter and the code of torch/transformers/peft (~0.5-0.7 GB of RSS before
any model exists), which on a GPU stays in host memory and which the memory model does not
count. Everything allocated after that point (tokenizer, data, weights, adapters, optimizer,
activations, loss buffers, allocator slack) is counted on both sides.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from factory.errors import FactoryError
from factory.experiments import parse_experiment
from factory.planner.plan import Plan, make_plan
from factory.planner.profile import DatasetProfile
from factory.recipes import Architecture, Recipe, load_recipe
from factory.trainer.base_models import (
    GEMMA3_NAME,
    SMOLLM2_NAME,
    TINY_NAME,
    build_gemma3,
    build_smollm2,
    build_tiny_llama,
)
from factory.trainer.chat import IGNORE_INDEX, encode, install_chat_template
from factory.trainer.pids import owner_token

ROOT = Path(__file__).resolve().parents[2]

RUNNER = r"""
import json, os, runpy, sys, threading, time

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")

# Everything the trainer imports before it loads a model, so the baseline is the code alone.
import torch, transformers, peft, safetensors, fsspec, pyarrow.parquet  # noqa: F401
import transformers.models.llama.modeling_llama  # noqa: F401
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401
import factory.trainer.train, factory.trainer.model, factory.trainer.data  # noqa: F401
import factory.trainer.chat, factory.trainer.checkpoint  # noqa: F401
out_path, job = sys.argv[1], sys.argv[2]
baseline = rss()
samples = []
done = threading.Event()

def sample():
    while not done.is_set():
        samples.append((time.time(), rss()))
        time.sleep(0.005)

thread = threading.Thread(target=sample, daemon=True)
thread.start()
sys.argv = ["python -m factory.trainer", "--job", job]
start = time.time()
cpu0 = os.times()
code = 0
try:
    runpy.run_module("factory.trainer", run_name="__main__", alter_sys=True)
except SystemExit as e:
    code = e.code if isinstance(e.code, int) else 1
done.set()
thread.join()
cpu1 = os.times()
with open(out_path, "w") as f:
    json.dump({"baseline": baseline, "peak": hwm(), "code": code, "samples": samples,
               "wall_s": time.time() - start,
               "cpu_s": (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)}, f)
"""
"""The measuring wrapper around ``python -m factory.trainer`` (run with ``python -c``)."""

WORDS = ("red", "blue", "green", "cat", "dog", "sun", "moon", "tree", "river", "stone", "cloud",
         "paper", "orange", "window", "seven", "quiet", "market", "garden", "copper", "winter")


@dataclass(frozen=True, kw_only=True)
class MeasureConfig:
    """One configuration to plan, run and compare."""

    model: str
    """``tiny-llama`` (the test model), ``smollm2-135m`` (the embedded SmolLM2-135M) or
    ``gemma3-270m`` (the embedded Gemma 3 270M)."""
    seq_len: int
    """``data.max_tokens`` of the experiment; samples are generated up to it, so the planner's
    ``max_seq_len`` is this value and packed rows are full."""
    micro_batch_size: int
    """Override: rows per forward pass."""
    gradient_checkpointing: bool | None = None
    """Override (None: the planner decides)."""
    precision: str | None = None
    """Override (None: the planner's CPU choice, ``bf16-autocast``)."""
    packing: bool | None = None
    """Override (None: the planner decides from the length mix)."""
    lora_dropout: float | None = None
    """Override (None: the planner's choice, 0.1 for a small dataset)."""
    num_steps: int = 2
    """Override: optimizer steps (the second runs with AdamW state allocated)."""
    num_samples: int = 48
    """Synthetic samples to write (enough for ``num_steps`` full micro-batches)."""

    @property
    def label(self) -> str:
        parts = [self.model, f"b{self.micro_batch_size}x{self.seq_len}"]
        if self.precision:
            parts.append(self.precision)
        if self.gradient_checkpointing:
            parts.append("gc")
        if self.packing is False:
            parts.append("unpacked")
        return " ".join(parts)


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """A planned job, its estimate and what the trainer used."""

    config: MeasureConfig
    """What was asked."""
    plan: Plan
    """What the planner emitted (with the config's overrides)."""
    estimated: int
    """``plan.memory.total``: the planner's peak estimate, bytes."""
    measured: int
    """Peak RSS of the trainer process minus its RSS before loading anything, bytes."""
    baseline: int
    """RSS after importing torch/transformers/peft/the trainer, bytes."""
    load_peak: int
    """Peak RSS above the baseline before the first training step (loading), bytes."""
    wall_s: float
    """Wall seconds of the trainer run."""
    cpu_s: float
    """CPU seconds (user + system) of the trainer run."""

    @property
    def error(self) -> float:
        """(estimated - measured) / measured."""
        return (self.estimated - self.measured) / self.measured

    def row(self) -> dict[str, Any]:
        cfg = self.plan.train_config()
        gib = 1024**3
        return {"config": self.config.label, "precision": cfg["precision"],
                "packing": cfg["packing"], "micro_batch_size": cfg["micro_batch_size"],
                "max_seq_len": cfg["max_seq_len"],
                "gradient_checkpointing": cfg["gradient_checkpointing"],
                "lora_dropout": cfg["lora_dropout"], "lora_rank": cfg["lora_rank"],
                "estimated_gib": round(self.estimated / gib, 3),
                "measured_gib": round(self.measured / gib, 3),
                "error": round(self.error, 3),
                "load_peak_gib": round(self.load_peak / gib, 3),
                "baseline_gib": round(self.baseline / gib, 3),
                "wall_s": round(self.wall_s, 1), "cpu_s": round(self.cpu_s, 1),
                "estimate_gib": self.plan.memory.as_gib() if self.plan.memory else {}}


def models_dir() -> Path:
    """Where the test models are cached (``$FACTORY_TEST_MODELS``, as tests/conftest.py)."""
    return Path(os.environ.get("FACTORY_TEST_MODELS") or ROOT / ".cache" / "test-models")


def model_dir(name: str) -> Path:
    """The model's directory, built on first use."""
    if name == "tiny-llama":
        return build_tiny_llama(models_dir() / TINY_NAME)
    if name == "smollm2-135m":
        return build_smollm2(models_dir() / SMOLLM2_NAME)
    if name == "gemma3-270m":
        return build_gemma3(models_dir() / GEMMA3_NAME)
    raise FactoryError(f"unknown calibration model {name!r}: tiny-llama, smollm2-135m or "
                       "gemma3-270m")


def architecture_from_dir(path: Path) -> Architecture:
    """The memory model's facts of a local Hugging Face model (config + safetensors shapes)."""
    from safetensors import safe_open

    cfg = json.loads((path / "config.json").read_text())
    num = 0
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as fh:
            for key in fh.keys():  # noqa: SIM118 - safe_open has no __iter__
                n = 1
                for d in fh.get_slice(key).get_shape():
                    n *= d
                num += n
    modules = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    # A vision-language model keeps its language model's sizes under text_config and its
    # vision tower (model.visual in transformers 5) under vision_config.
    text = cfg.get("text_config") or cfg
    vision = "model.visual" if "vision_config" in cfg else None
    return Architecture(
        family=cfg["model_type"], num_parameters=num, num_layers=text["num_hidden_layers"],
        hidden_size=text["hidden_size"], intermediate_size=text["intermediate_size"],
        num_heads=text["num_attention_heads"], num_kv_heads=text["num_key_value_heads"],
        head_dim=text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"],
        vocab_size=text["vocab_size"], max_context=text["max_position_embeddings"],
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings")), linear_modules=modules,
        vision_module=vision, vision_parameters=_vision_parameters(path) if vision else 0)


def _vision_parameters(path: Path) -> int:
    from safetensors import safe_open

    num = 0
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as fh:
            for key in fh.keys():  # noqa: SIM118 - safe_open has no __iter__
                if ".visual." in f".{key}":
                    n = 1
                    for d in fh.get_slice(key).get_shape():
                        n *= d
                    num += n
    return num


def recipe_for(name: str, path: Path) -> Recipe:
    """The shipped recipe of the model, pointed at ``path`` (for the tiny model: SmolLM2's with
    its architecture)."""
    recipe = load_recipe("gemma3-270m-lora" if name == "gemma3-270m" else "smollm2-135m-lora")
    recipe = replace(recipe, base_model_id=str(path), local_dir=None, builder=None)
    if name == "tiny-llama":
        recipe = replace(recipe, name="tiny-llama-lora", architecture=architecture_from_dir(path))
    return recipe


def synthetic_samples(num: int, *, max_tokens: int, seed: int = 0) -> list[dict[str, Any]]:
    """Chats with a short prompt and a long answer, ~``max_tokens / 8`` to ~``max_tokens``
    tokens, so packed rows are full and nearly every token is trained."""
    rng = random.Random(seed)
    out = []
    for i in range(num):
        n = rng.randint(max(4, max_tokens // 8), max_tokens)
        answer = " ".join(rng.choice(WORDS) for _ in range(n))
        msgs = [{"role": "user", "content": [{"type": "text", "text": "Say some words."}]},
                {"role": "assistant", "content": [{"type": "text", "text": answer}]}]
        out.append({"sample_id": f"m{seed}-{i:04d}", "messages": msgs, "tools": []})
    return out


def profile_of(samples: list[dict[str, Any]], tokenizer: Any) -> DatasetProfile:
    """The ``dataset_profile`` curation would write for these samples (lengths in tokens)."""
    totals, completions = [], []
    for s in samples:
        ids, labels = encode(s["messages"], s["tools"], tokenizer)
        totals.append(len(ids))
        completions.append(sum(1 for lab in labels if lab != IGNORE_INDEX))
    prompts = [t - c for t, c in zip(totals, completions, strict=True)]

    def q(values: list[int], p: float) -> int:
        v = sorted(values)
        return v[min(len(v) - 1, int(p * len(v)))]

    return DatasetProfile(
        num_samples=len(samples), prompt_tokens_p50=q(prompts, 0.5),
        prompt_tokens_p95=q(prompts, 0.95), prompt_tokens_p99=q(prompts, 0.99),
        prompt_tokens_max=max(prompts), completion_tokens_p50=q(completions, 0.5),
        completion_tokens_p95=q(completions, 0.95), completion_tokens_p99=q(completions, 0.99),
        completion_tokens_max=max(completions), total_tokens_p50=q(totals, 0.5),
        total_tokens_p99=q(totals, 0.99), total_tokens_max=max(totals),
        num_train_tokens=sum(totals))


def plan_for(config: MeasureConfig, recipe: Recipe, profile: DatasetProfile, *,
             time_cache: Path | None = None) -> Plan:
    """The planner's plan for an experiment with ``config``'s overrides (``time_cache``: as
    ``make_plan``'s, this host's calibrated time constants)."""
    overrides: dict[str, Any] = {"micro_batch_size": config.micro_batch_size,
                                 "grad_accum_steps": 1, "num_steps": config.num_steps}
    for key in ("gradient_checkpointing", "precision", "packing", "lora_dropout"):
        value = getattr(config, key)
        if value is not None:
            overrides[key] = value
    raw = {"name": "memory-check", "recipe": "smollm2-135m-lora",
           "data": {"where": "true", "max_tokens": config.seq_len}, "overrides": overrides}
    experiment = parse_experiment(yaml.safe_dump(raw), Path("memory-check.yaml"))
    return make_plan(experiment, profile, recipe=recipe, time_cache=time_cache)


def write_job(plan: Plan, data_file: Path, out_dir: Path) -> Path:
    """The trainer job of ``plan`` (as ``factory.control.jobs.job_from_plan`` builds it), owned
    by this process (``TrainerJob.owner``)."""
    cfg = plan.train_config()
    cfg["eval_every_steps"] = None  # no held-out rows here (as jobs.py without an eval split)
    # Owned by this process: a trainer whose caller is killed (a test run stopped from outside)
    # ends after its step instead of running on alone.
    job = {"run_id": "memory-check", "plan": cfg, "data_files": [str(data_file)],
           "output_dir": str(out_dir / "out"), "tracker": {"backend": "none"},
           "owner": owner_token()}
    path = out_dir / "job.json"
    path.write_text(json.dumps(job, indent=1))
    return path


def run_trainer(job: Path, out_dir: Path, *, threads: int = 2, timeout_s: float = 900
                ) -> dict[str, Any]:
    """Run the job under ``RUNNER``; its report (baseline, peak, RSS samples, times)."""
    report = out_dir / "rss.json"
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", RUNNER, str(report), str(job)], cwd=out_dir,
                          env=env, capture_output=True, text=True, timeout=timeout_s,
                          check=False)
    if proc.returncode != 0 or not report.exists():
        raise FactoryError(f"measuring runner failed ({proc.returncode}): {proc.stderr[-2000:]}")
    out: dict[str, Any] = json.loads(report.read_text())
    if out["code"] != 0:
        raise FactoryError(f"trainer exited {out['code']}: {proc.stderr[-2000:]}")
    out["events"] = [json.loads(line) for line in
                     (out_dir / "out" / "events.jsonl").read_text().splitlines() if line]
    return out


def measure(config: MeasureConfig, *, threads: int = 2, work_dir: Path | None = None,
            model_path: Path | None = None) -> Measurement:
    """Plan ``config``, run the trainer on the planned job, and compare the peaks.

    ``model_path``: an already built model directory (default: built in the models cache).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    # torch (~2 s): only calibration runs need it, not every plan
    from factory.trainer.chat import load_tokenizer

    path = model_path or model_dir(config.model)
    recipe = recipe_for(config.model, path)
    tokenizer = install_chat_template(load_tokenizer(str(path)))
    samples = synthetic_samples(config.num_samples, max_tokens=config.seq_len)
    plan = plan_for(config, recipe, profile_of(samples, tokenizer))
    with tempfile.TemporaryDirectory(prefix="memory-check-", dir=work_dir) as tmp:
        out_dir = Path(tmp)
        data = out_dir / "train.parquet"
        pq.write_table(pa.table({
            "sample_id": [s["sample_id"] for s in samples],
            "messages": [json.dumps(s["messages"]) for s in samples],
            "tools": [json.dumps(s["tools"]) for s in samples]}), data)
        report = run_trainer(write_job(plan, data, out_dir), out_dir, threads=threads)
    started = next(e["time"] for e in report["events"] if e["type"] == "started")
    before = [r for t, r in report["samples"] if t <= started]
    assert plan.memory is not None
    return Measurement(config=config, plan=plan, estimated=plan.memory.total,
                       measured=report["peak"] - report["baseline"],
                       baseline=report["baseline"],
                       load_peak=max(before, default=report["baseline"]) - report["baseline"],
                       wall_s=report["wall_s"], cpu_s=report["cpu_s"])
