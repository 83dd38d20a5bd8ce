"""Check the planner's memory estimate against the peak RSS of real ``python -m factory.trainer`` runs.

For each configuration (``CONFIGS``): synthetic chats are profiled with the model's tokenizer,
the planner plans an experiment on that profile (the configuration's values are the
experiment's overrides: micro-batch, precision, checkpointing, packing, dropout; two steps, no
accumulation), the plan's ``train_config()`` is written as a trainer job, and the trainer runs
it in a fresh process. Measured: the process's peak RSS minus its RSS after importing
torch/transformers/peft and the trainer (see ``factory/planner/calibration.py`` for why);
estimated: ``plan.memory.total``. Prints a Markdown table and one JSON line; exits 1 if any
configuration is off by more than 25%.

    .venv/bin/python bench/memory_model.py                 # every configuration (~5-10 min)
    .venv/bin/python bench/memory_model.py --only tiny     # labels containing "tiny"
    .venv/bin/python bench/memory_model.py --threads 1

Peak memory does not depend on the machine's load, so the table is valid on a busy machine;
the wall and CPU seconds are there only to size the bench.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from factory.planner.calibration import MeasureConfig, measure  # noqa: E402

CONFIGS = [
    MeasureConfig(model="tiny-llama", seq_len=256, micro_batch_size=4, packing=True,
                  precision="fp32"),
    MeasureConfig(model="tiny-llama", seq_len=512, micro_batch_size=8, packing=True),
    MeasureConfig(model="tiny-llama", seq_len=1024, micro_batch_size=4, packing=True,
                  precision="fp32", gradient_checkpointing=True),
    MeasureConfig(model="smollm2-135m", seq_len=1024, micro_batch_size=2, packing=True),
    MeasureConfig(model="smollm2-135m", seq_len=1024, micro_batch_size=4, packing=True,
                  gradient_checkpointing=True),
    MeasureConfig(model="smollm2-135m", seq_len=1024, micro_batch_size=1, packing=True,
                  precision="fp32", lora_dropout=0.0),
    MeasureConfig(model="smollm2-135m", seq_len=512, micro_batch_size=2, packing=False),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="run configurations whose label contains this")
    parser.add_argument("--threads", type=int, default=2, help="OMP threads of each trainer run")
    args = parser.parse_args()
    rows = []
    print("| configuration | precision | packing | dropout | checkpointing | estimated GiB "
          "| measured GiB | error | load peak GiB | wall s | CPU s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for config in CONFIGS:
        if args.only not in config.label:
            continue
        row = measure(config, threads=args.threads).row()
        rows.append(row)
        print(f"| {row['config']} | {row['precision']} | {row['packing']} "
              f"| {row['lora_dropout']} | {row['gradient_checkpointing']} "
              f"| {row['estimated_gib']:.3f} | {row['measured_gib']:.3f} | {row['error']:+.1%} "
              f"| {row['load_peak_gib']:.3f} | {row['wall_s']:.0f} | {row['cpu_s']:.0f} |",
              flush=True)
    print(json.dumps(rows))
    return 0 if all(abs(float(r["error"])) <= 0.25 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
