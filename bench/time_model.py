"""Check the planner's time model on this host: plan a job, run ``python -m factory.trainer``, compare.

Synthetic chats are profiled with SmolLM2-135M's tokenizer and planned three ways: with the
reference constants (``timing.MEASURED``, no ``time_cache``), and calibrated on this host
(``factory.planner.host``) by each method, ``model`` and ``matmul``, each in a fresh cache so
that it measures (its seconds are printed). The plan's job then runs once, a short real training
run, and every prediction is compared with it:

- seconds per step: the plan's ``step_seconds`` against the trainer's steps (the first left
  out: it holds oneDNN's first-call kernel creation);
- the steps' total: ``num_steps x step_seconds`` against the trainer's ``started`` to
  ``finished``;
- the pace correction (``factory.planner.pace``) after ``MIN_STEPS`` steps, as a running
  plan shows it.

It prints the command, the CPU's flags and the load before and after the run, a Markdown table
and one JSON line; it exits 1 if the best calibrated plan's steps' total is off by over 25%.

``--runs HOME...``: no new run; each HOME is the factory home of a finished ``factory run``
(``bench/calibration.py``'s ``TASK-sSEED`` folders, ``bench/loop.py``'s ``--home``): its latest
``dataset_profile`` is planned again with its experiment file (``HOME/experiments``) and this
host's constants, calibrated now in a fresh cache (no pace correction: today's model alone),
and the plan's seconds a step are compared with that run's (the median step, held-out passes
left out) and with what its own plan predicted then:

    .venv/bin/python bench/time_model.py --runs /tmp/calib/clinc150-s0 /tmp/calib/agent-s0

    .venv/bin/python bench/time_model.py       # 10 steps of 4 x 256, 2 threads (~2 min idle)
    OMP_NUM_THREADS=1 .venv/bin/python bench/time_model.py --steps 6 --micro-batch 2 \
        --seq-len 128 --threads 1          # a shared host: ~2.5 min at load 9
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# The repository root, not bench/ (whose kernels.py would shadow the ``kernels`` package that
# transformers probes for).
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]

from factory.planner.calibration import (  # noqa: E402
    MeasureConfig,
    model_dir,
    plan_for,
    profile_of,
    recipe_for,
    run_trainer,
    synthetic_samples,
    write_job,
)
from factory.planner.hardware import HARDWARE  # noqa: E402
from factory.planner.host import host_constants, host_key  # noqa: E402
from factory.planner.pace import MIN_STEPS, corrected, observed_step_seconds, pace_line  # noqa: E402
from factory.planner.plan import Plan  # noqa: E402
from factory.recipes import load_recipe  # noqa: E402


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f} (1/5/15 min) on {os.cpu_count()} cores"


def _latest(home: Path, table: str) -> dict[str, Any]:
    import duckdb

    files = str(home / "warehouse" / "factory" / table / "data" / "*.parquet")
    rows = duckdb.connect().execute(f"SELECT * FROM read_parquet('{files}') ORDER BY "
                                    "created_at DESC LIMIT 1").fetchdf().to_dict("records")
    assert rows, f"{home}: no {table}"
    return rows[0]


def _run_steps(home: Path) -> tuple[str, float, int]:
    """(run id, median seconds a step, steps) of the home's training run, steps that ran the
    held-out pass left out."""
    import statistics

    (events,) = sorted(home.glob("checkpoints/*/events/metrics.jsonl"))[-1:]
    rows = [json.loads(line) for line in events.read_text().splitlines() if line.strip()]
    steps = [r for r in rows if r.get("kind") == "metrics"]
    gaps = [b["time"] - a["time"] for a, b in zip(steps, steps[1:], strict=False)
            if "eval_loss" not in b["metrics"]][1:]
    return events.parent.parent.name, statistics.median(gaps), len(steps)


def replan_runs(homes: list[Path]) -> int:
    """``--runs``: each finished run's data planned with this host's constants of today."""
    from factory.experiments import parse_experiment
    from factory.planner import DatasetProfile, make_plan

    recipe = recipe_for("smollm2-135m", model_dir("smollm2-135m"))
    with tempfile.TemporaryDirectory(prefix="time-model-") as tmp:
        t0 = time.perf_counter()
        host_constants(recipe, HARDWARE["CPU"], cache=Path(tmp), precision="bf16-autocast")
        print(f"calibrated in {time.perf_counter() - t0:.0f} s; load {load()}")
        print("| run | shared prefix / p50 tokens | step then predicted | step now predicted | "
              "step measured (median) | now / measured |")
        print("|---|---|---|---|---|---|")
        out = []
        for home in homes:
            profile = DatasetProfile.from_row(_latest(home, "dataset_profile"))
            then = json.loads(_latest(home, "training_plans")["plan"])["estimates"]
            (path,) = sorted((home / "experiments").glob("*.yaml"))[:1]
            experiment = parse_experiment(path.read_text(), path)
            plan = make_plan(experiment, profile, recipe=load_recipe(experiment.recipe),
                             time_cache=Path(tmp))
            run_id, measured, n = _run_steps(home)
            now = plan.estimates["step_seconds"]
            out.append({"home": str(home), "run_id": run_id, "steps": n,
                        "then": then["step_seconds"], "now": now, "measured": round(measured, 3),
                        "ratio": round(now / measured, 3), "reason": plan.decisions[
                            "time_model"].reason})
            print(f"| {home.name} ({run_id}, {n} steps) | {profile.shared_prefix_tokens} / "
                  f"{profile.total_tokens_p50} | {then['step_seconds']:.2f} s | {now:.2f} s | "
                  f"{measured:.2f} s | {now / measured:.2f} |")
        print(f"- time model: {out[0]['reason']}" if out else "")
        print(json.dumps({"host": host_key().label, "runs": out}))
    return 0 if all(abs(r["ratio"] - 1) <= 0.25 for r in out) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, nargs="+", default=None,
                        help="factory homes of finished runs: plan their data again and "
                             "compare with their steps (no new run)")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps of the run")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per packed row")
    parser.add_argument("--micro-batch", type=int, default=4, help="rows per step")
    parser.add_argument("--threads", type=int, default=2, help="OMP threads of the trainer")
    args = parser.parse_args()
    key = host_key()
    print(f"command: {shlex.join([sys.executable, *sys.argv])}")
    print(f"host: {key.label}")
    if args.runs:
        return replan_runs(args.runs)
    from factory.trainer.precision import cpu_bf16

    print(f"bf16: {cpu_bf16()}")
    print(f"load before planning: {load()}", flush=True)

    from factory.trainer.chat import install_chat_template, load_tokenizer

    config = MeasureConfig(model="smollm2-135m", seq_len=args.seq_len,
                           micro_batch_size=args.micro_batch, packing=True,
                           num_steps=args.steps, num_samples=args.steps * args.micro_batch * 2)
    path = model_dir(config.model)
    recipe = recipe_for(config.model, path)
    tokenizer = install_chat_template(load_tokenizer(str(path)))
    samples = synthetic_samples(config.num_samples, max_tokens=config.seq_len)
    profile = profile_of(samples, tokenizer)
    plans: dict[str, Plan] = {"reference": plan_for(config, recipe, profile)}
    calibration_s: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="time-model-") as tmp:
        for method in ("model", "matmul"):
            # Each method calibrates into a cache of its own, which its plan then reads.
            home = Path(tmp) / method
            t0 = time.perf_counter()
            host_constants(recipe, HARDWARE["CPU"], cache=home, precision="bf16-autocast",
                           method=method)
            calibration_s[method] = time.perf_counter() - t0
            plans[method] = plan_for(config, recipe, profile, time_cache=home)
        for name, plan in plans.items():
            print(f"- {name}: time_model {plan['time_model']}: "
                  f"{plan.decisions['time_model'].reason}")
        print(f"load before the run: {load()}", flush=True)
        out_dir = Path(tmp) / "run"
        out_dir.mkdir()
        import pyarrow as pa
        import pyarrow.parquet as pq

        data = out_dir / "train.parquet"
        pq.write_table(pa.table({
            "sample_id": [s["sample_id"] for s in samples],
            "messages": [json.dumps(s["messages"]) for s in samples],
            "tools": [json.dumps(s["tools"]) for s in samples]}), data)
        report = run_trainer(write_job(plans["reference"], data, out_dir), out_dir,
                             threads=args.threads)
    print(f"load after the run: {load()}")
    events: list[dict[str, Any]] = report["events"]
    started = next(e for e in events if e["type"] == "started")
    finished = next(e for e in events if e["type"] == "finished")
    seen = observed_step_seconds(events)
    assert seen is not None
    actual_step = seen[1]
    actual_steps_s = finished["time"] - started["time"]
    early = [e for e in events if e["type"] != "progress" or e["step"] <= MIN_STEPS + 1]
    rows = []
    print(f"\nreal run: {args.steps} steps of {args.micro_batch} x {args.seq_len} "
          f"({started.get('precision')}), trainer wall {report['wall_s']:.1f} s, CPU "
          f"{report['cpu_s']:.1f} s\n")
    print("| constants | calibration s | step predicted | step actual | ratio | steps' total "
          f"predicted | actual | ratio | after {MIN_STEPS} steps |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, plan in plans.items():
        e = plan.estimates
        total = e["steps"] * e["step_seconds"]
        # The run's estimates without evals or held-out passes (the bench runs neither).
        bare = {**e, "train_seconds": total, "evals_seconds": 0.0, "wall_seconds": total}
        pace = corrected(bare, early, evals_share_devices=True)
        row = {"constants": name, "time_model": plan["time_model"],
               "calibration_s": round(calibration_s.get(name, 0.0), 1),
               "step_predicted": e["step_seconds"], "step_actual": round(actual_step, 3),
               "step_ratio": round(e["step_seconds"] / actual_step, 3),
               "total_predicted": round(total, 1), "total_actual": round(actual_steps_s, 1),
               "total_ratio": round(total / actual_steps_s, 3),
               "paced_total": round(pace.wall_s, 1) if pace else None,
               "paced_ratio": round(pace.wall_s / actual_steps_s, 3) if pace else None}
        rows.append(row)
        print(f"| {name} | {row['calibration_s']} | {row['step_predicted']:.3g} s | "
              f"{actual_step:.3g} s | {row['step_ratio']:.2f} | {total:.1f} s | "
              f"{actual_steps_s:.1f} s | {row['total_ratio']:.2f} | "
              + (f"{pace.wall_s:.1f} s ({row['paced_ratio']:.2f})" if pace else "-") + " |")
        if pace and name == "reference":
            print(f"  - {pace_line(pace)}")
    print(json.dumps({"host": key.label, "load": os.getloadavg(), "rows": rows}))
    best = min(abs(r["total_ratio"] - 1) for r in rows if r["constants"] != "reference")
    paced = [r["paced_ratio"] for r in rows if r["paced_ratio"] is not None][:1]
    print(f"best calibrated plan within 25%: {'yes' if best <= 0.25 else 'no'} (off by "
          f"{best:.0%}); corrected after {MIN_STEPS} steps: "
          + (f"x{paced[0]:.2f}" if paced else "too few steps"))
    return 0 if best <= 0.25 else 1


if __name__ == "__main__":
    sys.exit(main())
