"""Choose a demo's training settings on dev requests, never on the demo's own fresh ones.

The demo (``factory demo [--experiment E]``) prints how many of 20 fresh requests
(``generate_records(21, seed + FRESH_SEED_OFFSET)``) its deployed model answers with every field
right. Those are its test: this script trains the experiment's plan on the demo's traffic
(``generate_records(records, data_seed)``, less the eval fraction, as the dataset asset splits
it) with the trainer alone, then serves the checkpoint in the factory's CPU engine and answers
``--dev`` requests drawn at ``--dev-seed`` (777, which no demo uses) greedily, as the demo asks
its deployed model (96 tokens, temperature 0).

    FACTORY_MODELS_DIR=.cache/test-models .venv/bin/python bench/demo_dev.py \\
        --plan-from H/runs/<run>/job.json --set num_steps=36 --set learning_rate=3e-3 \\
        --data-seeds 0 1 --work /tmp/demo-dev

``--plan-from``: a trainer job file of a demo run (its ``plan``: the planner's choices for that
experiment with its overrides), so the settings tried differ from the demo's in the ``--set``
keys only. Prints, per data seed, the steps' wall time, every-field-right out of ``--dev``, how
many answers ended with the end-of-turn token and the wrong answers; then the mean and spread.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# Run as a script, this file's folder is first on sys.path and its kernels.py would shadow the
# ``kernels`` package transformers imports: put the checkout root there instead.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

from bench._train import train  # noqa: E402


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def write_demo_data(path: Path, records: list[dict[str, Any]]) -> Path:
    """The records' conversations (request messages + the reference answer) as a trainer data
    file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def canonical(m: dict[str, Any]) -> dict[str, Any]:
        return {"role": m["role"], "content": [{"type": "text", "text": m["content"]}]}

    convs = [[canonical(m) for m in r["request"]["messages"]]
             + [canonical(r["response"]["choices"][0]["message"])] for r in records]
    pq.write_table(pa.table({"sample_id": [f"d{i:05d}" for i in range(len(convs))],
                             "messages": [json.dumps(c) for c in convs],
                             "tools": ["[]"] * len(convs)}), path)
    return path


def answer_all(base: str, adapter: Path, records: list[dict[str, Any]]
               ) -> list[tuple[str, str]]:
    """(the adapter's greedy answer, its finish reason) to each record's request."""
    from factory.inference.engine import Engine, GenerationRequest

    engine = Engine(base)
    engine.load_adapter("dev", adapter)
    out = []
    for r in records:
        text = engine.render("dev", r["request"]["messages"])
        ids = engine.encode("dev", text)
        res = engine.generate([GenerationRequest(model="dev", prompt_ids=ids, max_tokens=96)])[0]
        out.append((res.text, res.finish_reason))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan-from", type=Path, required=True,
                        help="a demo run's trainer job file (its plan is the starting point)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a plan key to change (JSON value), repeatable")
    parser.add_argument("--records", type=int, default=480, help="the demo's traffic")
    parser.add_argument("--eval-fraction", type=float, default=0.1)
    parser.add_argument("--data-seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--dev", type=int, default=40)
    parser.add_argument("--dev-seed", type=int, default=777)
    parser.add_argument("--work", type=Path, required=True)
    args = parser.parse_args()

    from factory.app.demo import same_answer
    from factory.tasks import generate_records
    from factory.trainer.checkpoint import latest_checkpoint

    job = json.loads(args.plan_from.read_text())
    plan = dict(job["plan"])
    for item in args.set:
        key, _, value = item.partition("=")
        plan[key] = _value(value)
    print(json.dumps({"cpus": os.cpu_count(), "loadavg_before": [round(x, 2) for x in
                                                                 os.getloadavg()],
                      "plan_from": str(args.plan_from), "set": args.set,
                      "data_seeds": args.data_seeds, "dev": args.dev,
                      "dev_seed": args.dev_seed}), flush=True)
    args.work.mkdir(parents=True, exist_ok=True)
    dev = generate_records(args.dev, args.dev_seed)
    rights = []
    for seed in args.data_seeds:
        records = generate_records(args.records, seed)
        keep = records[:round(len(records) * (1 - args.eval_fraction))]
        tag = re.sub(r"[^A-Za-z0-9._-]+", "", "-".join(s.replace("=", "") for s in args.set))
        name = f"dev-s{seed}-{tag}"[:120]
        data = write_demo_data(args.work / f"{name}.parquet", keep)
        started = time.monotonic()
        done = latest_checkpoint(str(args.work / name))
        if done is not None and done.step == plan["num_steps"]:
            ckpt, train_s = Path(done.path), None  # trained by an earlier call: its answers only
        else:
            ckpt, _ = train(name, args.work, {"data_files": [str(data)]},
                            {**plan, "seed": seed}, None)
            train_s = round(time.monotonic() - started, 1)
        answers = answer_all(plan["base_model"], ckpt, dev)
        right = [same_answer(a, r) for (a, _), r in zip(answers, dev, strict=True)]
        rights.append(sum(right))
        stopped = sum(f == "stop" for _, f in answers)
        print(json.dumps({"data_seed": seed, "train_s": train_s,
                          "right": sum(right), "of": len(dev), "ended_turn": stopped}),
              flush=True)
        for (a, f), r, ok in zip(answers, dev, right, strict=True):
            if not ok:
                print(f"  wrong ({f}): {a[:140]!r}\n    expected {r['response']['choices'][0]['message']['content']}")
    mean = statistics.mean(rights)
    spread = statistics.stdev(rights) if len(rights) > 1 else 0.0
    print(json.dumps({"right_mean": mean, "right_sd": round(spread, 2), "of": args.dev,
                      "per_seed": rights}), flush=True)


if __name__ == "__main__":
    main()
