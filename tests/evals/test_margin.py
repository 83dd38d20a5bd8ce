"""The must-hold: on the embedded extraction task, a short CPU LoRA run of SmolLM2-135M beats the
base model's mean rubric score by a clear margin.

End to end on the real pieces: the task generator's data, ``python -m factory.trainer`` (LoRA on every
linear layer), the CPU inference server serving base + checkpoints, the rubric inferred from the
references, the embedded judge, and ``select_best``. The margin and the timings are printed (run
with ``-s`` to see them) and asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from factory.evals import (
    EmbeddedJudge,
    build_rubric,
    generate_answers,
    items_from_samples,
    select_best,
    summarize,
)
from factory.evals.selection import CLEAR_MARGIN
from factory.inference import InferenceServer
from factory.tasks import field_accuracy, generate_conversations

MARGIN = CLEAR_MARGIN
# Measured here: step 4 scored 0.479 (field accuracy 0.458) against the base model's ~0 on 12
# eval samples: the JSON rubric scores the share of the reference's fields matched exactly.
NUM_STEPS = 4
CHECKPOINT_EVERY = 2


@dataclass(kw_only=True)
class Outcome:
    """What one measured run gave."""

    base: float
    by_step: dict[int, float]
    best_step: int
    best: float
    ci: tuple[float, float]
    base_ci: tuple[float, float]
    base_fields: float
    best_fields: float
    train_s: float
    eval_s: float


def _canonical(convs: list[dict[str, Any]], prefix: str) -> list[dict[str, Any]]:
    return [{"sample_id": f"{prefix}-{i:04d}", "tools": "[]",
             "messages": json.dumps([{"role": m["role"],
                                      "content": [{"type": "text", "text": m["content"]}]}
                                     for m in c["messages"]])}
            for i, c in enumerate(convs)]


def train(base_model: Path, work: Path, *, num_steps: int, checkpoint_every: int,
          learning_rate: float, num_train: int = 256, micro_batch_size: int = 2,
          max_seq_len: int = 384, lora_rank: int = 8) -> tuple[list[tuple[int, Path]], float]:
    """``python -m factory.trainer`` on the task's data: (step, checkpoint dir) pairs and seconds."""
    data = work / "train.parquet"
    pq.write_table(pa.Table.from_pylist(_canonical(generate_conversations(num_train, seed=11),
                                                   "train")), data)
    out = work / "run"
    job = {"run_id": "margin", "output_dir": str(out), "data_files": [str(data)],
           "tracker": {"backend": "none"},
           "plan": {"base_model": str(base_model), "max_seq_len": max_seq_len, "packing": True,
                    "micro_batch_size": micro_batch_size, "grad_accum_steps": 1,
                    "learning_rate": learning_rate, "lr_schedule": "cosine",
                    "warmup_steps": 2, "num_steps": num_steps, "lora_rank": lora_rank,
                    "lora_alpha": 2.0 * lora_rank, "lora_dropout": 0.0,
                    "lora_target_modules": ["all-linear"], "precision": "bf16-autocast",
                    "checkpoint_every_steps": checkpoint_every, "seed": 0}}
    job_file = work / "job.json"
    job_file.write_text(json.dumps(job))
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "factory.trainer", "--job", str(job_file)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpts = sorted((int(p.name.split("-")[1]), p) for p in (out / "checkpoints").glob("step-*"))
    assert ckpts and ckpts[-1][0] == num_steps
    return ckpts, time.monotonic() - t0


def score(base_model: Path, ckpts: list[tuple[int, Path]], *, num_eval: int = 12,
          max_tokens: int = 48) -> Outcome:
    """Base model (step 0) and every checkpoint answer the held-out set; the embedded judge
    scores each answer against the rubric inferred from the references."""
    items = items_from_samples(_canonical(generate_conversations(num_eval, seed=12), "eval"))
    rubric = build_rubric(items)
    judge = EmbeddedJudge()
    t0 = time.monotonic()
    adapters = {f"step-{s}": str(p) for s, p in ckpts}
    scores: dict[int, list[float | None]] = {}
    fields: dict[int, float] = {}
    # One intra-op thread: on a shared, loaded 2-core machine two spinning OpenMP threads lose
    # more than they gain (base + 1 checkpoint: 16 samples x 64 tokens took 20 min with two;
    # 12 x 48 took 3 min with one).
    with InferenceServer(base_model, adapters=adapters, served_model_name="base",
                         startup_timeout_s=300, threads=1) as server:
        client = server.client()
        for step, model in [(0, "base"), *((s, f"step-{s}") for s, _ in ckpts)]:
            answers = generate_answers(client, model, items, max_tokens=max_tokens,
                                       concurrency=8)
            rows = judge.score(rubric, items, [a.answer for a in answers])
            scores[step] = [r.score for r in rows]
            fields[step] = sum(field_accuracy(a.answer.text, i.reference.text)
                               for a, i in zip(answers, items, strict=True)) / len(items)
    base = summarize(0, scores[0])
    best = select_best({s: v for s, v in scores.items() if s > 0})
    return Outcome(base=base.mean, by_step={s: summarize(s, v).mean for s, v in scores.items()},
                   best_step=best.step, best=best.mean, ci=(best.ci_low, best.ci_high),
                   base_ci=(base.ci_low, base.ci_high), base_fields=fields[0],
                   best_fields=fields[best.step], train_s=0.0,
                   eval_s=time.monotonic() - t0)


@pytest.mark.slow
# About 2-3 min on a quiet machine; the cap leaves room for a machine shared with other jobs
# (measured 10+ min at load 8 on 2 cores).
@pytest.mark.timeout(1500)
def test_short_lora_run_beats_the_base_model(smollm2_dir: Path, tmp_path: Path) -> None:
    t0 = time.monotonic()
    ckpts, train_s = train(smollm2_dir, tmp_path, num_steps=NUM_STEPS,
                           checkpoint_every=CHECKPOINT_EVERY, learning_rate=2e-3)
    o = score(smollm2_dir, ckpts)
    o.train_s = train_s
    print(f"\nmargin: best step {o.best_step} mean rubric score {o.best:.3f} "
          f"[{o.ci[0]:.3f}, {o.ci[1]:.3f}] vs base {o.base:.3f} "
          f"[{o.base_ci[0]:.3f}, {o.base_ci[1]:.3f}] -> +{o.best - o.base:.3f}; "
          f"field accuracy {o.base_fields:.3f} -> {o.best_fields:.3f}; per step "
          f"{ {s: round(v, 3) for s, v in o.by_step.items()} }; train {o.train_s:.0f} s, "
          f"eval {o.eval_s:.0f} s, total {time.monotonic() - t0:.0f} s")
    assert o.best - o.base >= MARGIN
    # a clear margin: the intervals do not overlap
    assert o.ci[0] > o.base_ci[1]
    assert o.best_fields > o.base_fields
