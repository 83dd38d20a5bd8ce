"""Benchmark: our trainer vs HF Trainer + PEFT with pad-to-longest batches, same everything else.

Same model (SmolLM2-135M by default), same LoRA (r=8, all linear layers), same samples (a
realistic length mix: 70% short 40-150 tokens, 25% medium 200-600, 5% long 800-1500), the same
assistant-only labels, one pass over the data each, same precision, same thread count. Each side
runs in its own subprocess (one after the other, never together) so peak RSS is its own. Reports
real (non-padding) tokens per wall second and per CPU second of the process, peak RSS and ratios.

    .venv/bin/python bench/trainer.py                        # full size (slow on CPU; ~18 GB)
    .venv/bin/python bench/trainer.py --num-samples 48 --length-scale 0.5 --max-len 768 --threads 1
    .venv/bin/python bench/trainer.py --precision fp32

On a shared, loaded CPU, wall-clock rates follow the load more than the code: ``--threads 1``
avoids OpenMP threads spin-waiting for a descheduled sibling (5x the CPU time at 2 threads
under a load of 8 on 2 cores), and tokens per CPU second is the steadier figure; ``--repeats``
alternates the sides and reports medians.

Goal on CPU: >= 2x the baseline's real tokens/s at <= half its peak memory.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MIX = ((0.70, 40, 150), (0.25, 200, 600), (0.05, 800, 1500))
WORDS = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "paper", "orange",
         "window", "seven", "blue", "quiet", "market", "signal", "garden", "copper", "winter"]


def make_samples(tokenizer: Any, num: int, *, seed: int, scale: float) -> list[dict[str, Any]]:
    """Conversations whose rendered length follows MIX (times ``scale``)."""
    from factory.trainer.chat import render

    rng = random.Random(seed)
    out = []
    for i in range(num):
        r = rng.random()
        acc = 0.0
        lo, hi = MIX[-1][1:]
        for p, a, b in MIX:
            acc += p
            if r < acc:
                lo, hi = a, b
                break
        target = max(24, int(rng.randint(lo, hi) * scale))
        user = " ".join(rng.choice(WORDS) for _ in range(max(1, target // 6)))
        words = []
        msgs: list[dict[str, Any]] = []
        while True:
            words.append(rng.choice(WORDS))
            msgs = [{"role": "user", "content": [{"type": "text", "text": user}]},
                    {"role": "assistant", "content": [{"type": "text", "text": " ".join(words)}]}]
            if len(words) % 8 == 0 and len(tokenizer(render(msgs, []),
                                                     add_special_tokens=False)["input_ids"]) \
                    >= target:
                break
        out.append({"sample_id": f"b{i}", "messages": msgs, "tools": []})
    return out


def _rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2


def _cpu_s() -> float:
    """CPU seconds (user + system) this process has used so far, all its threads."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _rates(real: float, seconds: float, cpu: float) -> dict[str, Any]:
    return {"real_tokens": real, "seconds": seconds, "cpu_seconds": cpu,
            "tokens_per_s": real / seconds, "tokens_per_cpu_s": real / cpu,
            "peak_rss_gb": _rss_gb(), "loadavg_1m_end": os.getloadavg()[0]}


def run_ours(args: argparse.Namespace, data: Path) -> dict[str, Any]:
    import torch

    from factory.trainer.config import TrainerJob
    from factory.trainer.train import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        body = {"run_id": "bench", "data_files": [str(data)], "output_dir": tmp,
                "tracker": {"backend": "none"},
                "plan": {"base_model": args.model, "max_seq_len": args.max_len, "packing": True,
                         "micro_batch_size": 1, "grad_accum_steps": 1, "learning_rate": 2e-4,
                         "num_epochs": 1.0, "lora_rank": 8, "lora_alpha": 16,
                         "precision": args.precision, "checkpoint_every_steps": 10**6,
                         "gradient_checkpointing": args.gradient_checkpointing}}
        job = TrainerJob.from_dict(body)
        trainer = Trainer(job)
        trainer.setup()
        trainer.model.train()
        real = 0.0
        c0, t0 = _cpu_s(), time.perf_counter()
        for step in range(1, trainer.num_steps + 1):
            out = trainer.train_step(step, inject_nan=False)
            real += out["real_tokens"]
        elapsed, cpu = time.perf_counter() - t0, _cpu_s() - c0
        rows = trainer.num_steps
        attention = trainer.model.config._attn_implementation
    return {**_rates(real, elapsed, cpu), "steps": rows, "threads": torch.get_num_threads(),
            "attention": attention}


def run_hf(args: argparse.Namespace, data: Path) -> dict[str, Any]:
    import pyarrow.parquet as pq
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import (
        AutoModelForCausalLM,
        DataCollatorForSeq2Seq,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    from factory.trainer.chat import encode, load_tokenizer

    tok = load_tokenizer(args.model)
    rows = pq.read_table(data).to_pylist()
    feats = []
    real = 0
    for r in rows:
        ids, labels = encode(r["messages"], r["tools"], tok)
        ids, labels = ids[:args.max_len], labels[:args.max_len]
        labels = [-100] + labels[1:]
        feats.append({"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels})
        real += len(ids)
    base = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model: Any = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear",
                                             task_type="CAUSAL_LM"))
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    timing: dict[str, float] = {}

    class Clock(TrainerCallback):
        def on_train_begin(self, *a: Any, **k: Any) -> None:
            timing["c0"], timing["t0"] = _cpu_s(), time.perf_counter()

        def on_train_end(self, *a: Any, **k: Any) -> None:
            timing["c1"], timing["t1"] = _cpu_s(), time.perf_counter()

    with tempfile.TemporaryDirectory() as tmp:
        targs = TrainingArguments(
            output_dir=tmp, per_device_train_batch_size=args.hf_batch, num_train_epochs=1,
            learning_rate=2e-4, bf16=args.precision == "bf16-autocast", use_cpu=True,
            report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True,
            dataloader_num_workers=0, remove_unused_columns=False, seed=0)
        trainer = Trainer(model=model, args=targs, train_dataset=feats,
                          data_collator=DataCollatorForSeq2Seq(tok, padding="longest"),
                          callbacks=[Clock()])
        trainer.train()
    elapsed, cpu = timing["t1"] - timing["t0"], timing["c1"] - timing["c0"]
    # Trainer shuffles; padding measured over batches in file order is an estimate of it.
    batches = [feats[i:i + args.hf_batch] for i in range(0, len(feats), args.hf_batch)]
    padded = sum(len(b) * max(len(f["input_ids"]) for f in b) for b in batches)
    return {**_rates(real, elapsed, cpu), "padded_tokens": padded,
            "steps": math.ceil(len(feats) / args.hf_batch), "threads": torch.get_num_threads(),
            "attention": model.config._attn_implementation}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="HF dir (default: the embedded SmolLM2-135M, built once)")
    p.add_argument("--num-samples", type=int, default=64)
    p.add_argument("--length-scale", type=float, default=1.0,
                   help="scale the length mix (0.25 for a quick run)")
    p.add_argument("--max-len", type=int, default=1536)
    p.add_argument("--hf-batch", type=int, default=4)
    p.add_argument("--precision", choices=("fp32", "bf16-autocast"), default="bf16-autocast")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--threads", type=int,
                   help="torch/OpenMP threads for both sides (default: torch's, one per core)")
    p.add_argument("--repeats", type=int, default=1,
                   help="run the sides alternately this many times; medians are reported")
    p.add_argument("--side", choices=("both", "ours", "hf"), default="both")
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    if args.model is None:
        from factory.trainer.base_models import SMOLLM2_NAME, build_smollm2

        cache = Path(os.environ.get("FACTORY_TEST_MODELS") or ROOT / ".cache" / "test-models")
        args.model = str(build_smollm2(cache / SMOLLM2_NAME))
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be >= 1")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.side != "both":
        if args.threads is not None:
            import torch

            torch.set_num_threads(args.threads)
        result = (run_ours if args.side == "ours" else run_hf)(args, Path(args.data))
        print("RESULT " + json.dumps(result))
        return 0

    import pyarrow as pa
    import pyarrow.parquet as pq

    from factory.trainer.chat import load_tokenizer

    tok = load_tokenizer(args.model)
    samples = make_samples(tok, args.num_samples, seed=0, scale=args.length_scale)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "bench.parquet"
        pq.write_table(pa.table({"sample_id": [s["sample_id"] for s in samples],
                                 "messages": [json.dumps(s["messages"]) for s in samples],
                                 "tools": [json.dumps(s["tools"]) for s in samples]}), data)
        env = dict(os.environ)
        if args.threads is not None:  # also the OpenMP pool torch may start before main()
            env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(args.threads)
        runs: dict[str, list[dict[str, Any]]] = {"hf": [], "ours": []}
        for _ in range(args.repeats):
            for side in ("hf", "ours"):
                cmd = [sys.executable, __file__, "--side", side, "--data", str(data),
                       *sum(([f"--{k.replace('_', '-')}", str(v)] for k, v in vars(args).items()
                             if k in ("model", "num_samples", "length_scale", "max_len",
                                      "hf_batch", "precision", "threads") and v is not None),
                            [])]
                if args.gradient_checkpointing:
                    cmd.append("--gradient-checkpointing")
                load = os.getloadavg()[0]
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
                line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
                if proc.returncode or not line:
                    print(proc.stderr[-3000:], file=sys.stderr)
                    return 1
                runs[side].append({**json.loads(line[-1][len("RESULT "):]),
                                   "loadavg_1m_start": load})
    hf, ours = (_median_run(runs["hf"]), _median_run(runs["ours"]))
    if hf["real_tokens"] != ours["real_tokens"]:
        print(f"error: the sides trained on different real tokens: hf {hf['real_tokens']}, "
              f"ours {ours['real_tokens']}", file=sys.stderr)
        return 1
    summary = {"precision": args.precision, "num_samples": args.num_samples,
               "length_scale": args.length_scale, "max_len": args.max_len,
               "hf_batch": args.hf_batch, "threads": hf["threads"], "repeats": args.repeats,
               "hf": hf, "ours": ours,
               "hf_padding_fraction_est": 1 - hf["real_tokens"] / hf["padded_tokens"],
               "speedup": ours["tokens_per_s"] / hf["tokens_per_s"],
               "speedup_cpu_time": ours["tokens_per_cpu_s"] / hf["tokens_per_cpu_s"],
               "memory_ratio": ours["peak_rss_gb"] / hf["peak_rss_gb"]}
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of the rates over repeats; the largest peak RSS; every run kept under ``runs``."""
    import statistics

    out = dict(runs[0])
    for key in ("seconds", "cpu_seconds", "tokens_per_s", "tokens_per_cpu_s"):
        out[key] = statistics.median(r[key] for r in runs)
    out["peak_rss_gb"] = max(r["peak_rss_gb"] for r in runs)
    if len(runs) > 1:
        out["runs"] = [{k: r[k] for k in ("tokens_per_s", "tokens_per_cpu_s", "peak_rss_gb",
                                          "loadavg_1m_start", "loadavg_1m_end")} for r in runs]
    return out


if __name__ == "__main__":
    sys.exit(main())
