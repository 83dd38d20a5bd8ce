"""Benchmark: the trainer's step time under fp32 and under bf16 autocast on this machine's CPU.

bf16 autocast is fast only where the CPU computes bf16 natively (AVX512-BF16 or AMX on x86, the
BF16 extension on Arm); elsewhere (AVX2) oneDNN emulates it and a step takes several times as
long as in fp32. The trainer resolves ``bf16-autocast`` to fp32 on such a CPU
(``factory.trainer.precision``); this bench measures what that is worth here: the same job
(SmolLM2-135M, LoRA r=16 on every linear layer, triage conversations in unpacked rows of 128,
micro-batch 4) run once per precision, the resolution bypassed with ``FACTORY_CPU_BF16=native``
so that the emulated path really runs, and the median seconds per step after the first.

    FACTORY_MODELS_DIR=.cache/test-models .venv/bin/python bench/cpu_precision.py --steps 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _train import lora_plan, start, train, write_triage  # noqa: E402 - bench/ is the script's folder


def run(work: Path, base: str, precision: str, steps: int, threads: int | None) -> dict:
    """One trainer run of ``steps`` steps at ``precision``: its wall time and the median
    seconds between the steps' metrics after the first."""
    plan = {**lora_plan(base, steps=steps, lr=5e-4, seq_len=128, seed=0), "packing": False,
            "micro_batch_size": 4, "grad_accum_steps": 1, "precision": precision}
    name = precision.replace("-", "_")
    began = time.perf_counter()
    train(name, work, {"data_files": [str(work / "triage.parquet")]}, plan, threads)
    wall = time.perf_counter() - began
    rows = [json.loads(x) for x in (work / name / "metrics.jsonl").read_text().splitlines()
            if x.strip()]
    times = [r["time"] for r in rows if r.get("kind") == "metrics"]
    per_step = [b - a for a, b in zip(times, times[1:], strict=False)]
    return {"precision": precision, "wall_s": round(wall, 1),
            "median_step_s": round(statistics.median(per_step), 2) if per_step else None,
            "steps_timed": len(per_step)}


def main() -> int:
    from factory.trainer.precision import cpu_bf16

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--threads", type=int, help="OMP threads (default: one per core)")
    args, base = start(p)
    native, what = cpu_bf16()
    print(json.dumps({"cpu_bf16_native": native, "cpu": what}), flush=True)
    os.environ["FACTORY_CPU_BF16"] = "native"  # the trainers run bf16 autocast as asked
    with tempfile.TemporaryDirectory(prefix="bench-precision-") as tmp:
        work = Path(tmp)
        write_triage(work / "triage.parquet", 64, 0)
        out = {}
        for precision in ("fp32", "bf16-autocast"):
            out[precision] = run(work, base, precision, args.steps, args.threads)
            print(json.dumps(out[precision]), flush=True)
    fp32, bf16 = out["fp32"]["median_step_s"], out["bf16-autocast"]["median_step_s"]
    if fp32 and bf16:
        print(json.dumps({"bf16_autocast_over_fp32_step_time": round(bf16 / fp32, 2),
                          "loadavg_after": [round(x, 2) for x in os.getloadavg()]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
