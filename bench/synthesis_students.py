"""Benchmark: the students of a kept ``bench/synthesis.py`` run, trained again with other plans.

``bench/synthesis.py --work DIR`` keeps each student's training file (``student-without.parquet``:
the curated traffic; ``student-with.parquet``: the traffic plus the synthetic samples curation
kept). This trains a student per ``NAME:STEPS:SHARE`` arm on one of them, with the bench's own
trainer run and plan (``_train.lora_plan``: LoRA r=16 on every linear layer, packed rows of 256,
8 rows a step) and scores it as the bench does (teacher-forced, ``--heldout`` held-out tickets
per label): SHARE 0 is the traffic alone, 1 every synthetic sample, a share in between that
share of the synthetic samples (a seeded draw). The synthesis itself (teacher calls, ~20 minutes
here) is not repeated.

    FACTORY_MODELS_DIR=.cache/test-models .venv/bin/python bench/synthesis_students.py \\
        --work /tmp/synth-work without48:48:0 with48:48:1
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _train import lora_plan, start, train  # noqa: E402 - bench/ is the script's folder
from synthesis import _write_parquet, score  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("arms", nargs="+", metavar="NAME:STEPS:SHARE")
    p.add_argument("--work", required=True, help="the --work folder of a bench/synthesis.py run")
    p.add_argument("--lr", type=float, default=5e-4, help="the students' learning rate")
    p.add_argument("--heldout", type=int, default=40, help="held-out tickets per label")
    p.add_argument("--threads", type=int, help="OMP threads (default: one per core)")
    p.add_argument("--seed", type=int, default=0, help="the synthesis run's --seed")
    args, base = start(p)
    import pyarrow.parquet as pq

    from factory.tasks import ticket_triage
    from factory.tasks.ticket_triage import LABELS

    work = Path(args.work)
    alone = pq.read_table(work / "student-without.parquet")
    both = pq.read_table(work / "student-with.parquet")
    traffic = set(alone.column("sample_id").to_pylist())
    heldout = ticket_triage.generate_heldout(args.heldout * len(LABELS), seed=args.seed + 1)
    for arm in args.arms:
        try:
            name, steps_text, share_text = arm.split(":")
            steps, share = int(steps_text), float(share_text)
        except ValueError:
            p.error(f"{arm!r}: NAME:STEPS:SHARE, e.g. with48:48:1")
        if not 0 <= share <= 1:
            p.error(f"{arm!r}: SHARE is in [0, 1]")
        table = alone if share == 0 else both
        if 0 < share < 1:
            ids = table.column("sample_id").to_pylist()
            synthetic = [i for i in ids if i not in traffic]
            keep = set(random.Random(args.seed).sample(synthetic, round(share * len(synthetic))))
            table = table.take([k for k, i in enumerate(ids) if i in traffic or i in keep])
        f = _write_parquet(work / f"arm-{name}.parquet", table.column("sample_id").to_pylist(),
                           table.column("messages").to_pylist())
        t = time.perf_counter()
        ckpt, _ = train(f"arm-{name}", work, {"data_files": [str(f)]},
                        lora_plan(base, steps=steps, lr=args.lr, seq_len=256, seed=args.seed),
                        args.threads)
        print(json.dumps({"arm": name, "steps": steps,
                          "synthetic_samples": table.num_rows - len(traffic),
                          "train_samples": table.num_rows,
                          "train_s": round(time.perf_counter() - t, 1),
                          **score(base, ckpt, heldout)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
