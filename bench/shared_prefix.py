"""Benchmark: a micro-batch's shared system prompt computed once (``share_prefix``) vs not.

The same trainer, plan and samples on both sides: SmolLM2-135M, the planner's plan of the
triage task (``factory.tasks.ticket_triage``: a ~45-word system prompt, a short ticket, a label
answer), unpacked micro-batches of 8, LoRA r=16 on every linear layer, bf16 autocast. The
baseline trains each micro-batch as 8 padded rows; ``share_prefix`` trains it as one row, the
shared prefix once and then each sample's rest. Each side runs ``python -m trainer`` in its own
subprocess for ``--steps`` steps, the sides alternating ``--repeats`` times; the first
``--warmup`` steps of each run are not timed. Reported per side: seconds per step, samples'
tokens per wall second and per CPU second (the child's user + system time over its whole run),
and the speedup of ``share_prefix`` over the baseline.

    FACTORY_MODELS_DIR=.cache/test-models .venv/bin/python bench/shared_prefix.py
    FACTORY_MODELS_DIR=.cache/test-models .venv/bin/python bench/shared_prefix.py --threads 1

The tokens a step computes are printed too (the trainer's own ``shared_prefix`` summary of the
first epoch): the ratio the time model predicts from.

``--task clinc150``: the plan of CLINC150 at 10 queries an intent (``bench/public_data.py``: a
~650-token system prompt listing 150 intents, a short query, a label: ~850 tokens a step shared,
no LoRA dropout, as the planner plans it). ``--baseline REV``: both sides share the prefix, the
baseline's trainer from a git worktree of ``REV`` (a change to the shared-prefix step against
the step before it, e.g. the rests' attention in one call against a call a rest):

    FACTORY_MODELS_DIR=.cache/test-models .venv/bin/python bench/shared_prefix.py \
        --task clinc150 --baseline 360c9d0
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _train import canonical, write_triage  # noqa: E402 - bench/ is the script's folder
from _worktree import baseline_tree  # noqa: E402


def write_clinc(path: Path, seed: int) -> Path:
    """CLINC150's official training queries, 10 an intent (``seed``), as the logged calls
    ``bench/public_data.py`` makes of them, as a trainer data file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from bench import public_data

    examples = public_data.sample_per_class(public_data.load("clinc150", "train"), 10, seed)
    system = public_data.system_prompt("clinc150")
    pq.write_table(pa.table({
        "sample_id": [f"c{i:05d}" for i in range(len(examples))],
        "messages": [json.dumps(canonical([
            {"role": "system", "content": system}, {"role": "user", "content": e["text"]},
            {"role": "assistant", "content": public_data.gold_answer("clinc150", e)}]))
            for e in examples],
        "tools": ["[]"] * len(examples)}), path)
    return path


TASKS = {"triage": (128, 0.1), "clinc150": (768, 0.0)}
"""Task: (the plan's max_seq_len, its LoRA dropout), as the planner chose them (triage's from
before LoRA dropout went off on CPU, as this bench's figures were taken)."""


def _plan(base_model: str, steps: int, share: bool, task: str = "triage") -> dict[str, Any]:
    """The planner's choices for the 500-call triage task or CLINC150 at 10 an intent
    (``factory plan``), for ``steps``."""
    seq_len, dropout = TASKS[task]
    return {"base_model": base_model, "max_seq_len": seq_len, "packing": False,
            "share_prefix": share, "micro_batch_size": 8, "grad_accum_steps": 1,
            "learning_rate": 1.41e-4, "lr_schedule": "cosine", "warmup_steps": 0,
            "num_steps": steps, "num_epochs": None, "lora_rank": 16, "lora_alpha": 32.0,
            "lora_dropout": dropout,
            "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                    "up_proj", "down_proj"],
            "precision": "bf16-autocast", "checkpoint_every_steps": 10_000, "seed": 0}


def run_side(args: argparse.Namespace, work: Path, data: Path, base_model: str, share: bool,
             k: int, tree: Path = ROOT, side: str | None = None) -> dict[str, Any]:
    name = f"{side or ('shared' if share else 'baseline')}-{k}"
    job = {"run_id": name, "output_dir": str(work / name), "data_files": [str(data)],
           "events_file": str(work / f"{name}.jsonl"),
           "plan": _plan(base_model, args.steps, share, args.task)}
    (work / f"{name}.json").write_text(json.dumps(job))
    env = {**os.environ, "PYTHONPATH": str(tree)}
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(work / f"{name}.log", "w") as log:
        subprocess.run([sys.executable, "-m", "factory.trainer", "--job",
                        str(work / f"{name}.json")], env=env, check=True, cwd=tree,
                       stdout=subprocess.DEVNULL, stderr=log)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    lines = (work / f"{name}.jsonl").read_text().splitlines()
    events = [json.loads(line) for line in lines if line.strip()]
    started = next(e for e in events if e["type"] == "started")
    progress = [e for e in events if e["type"] == "progress" and "loss" in e]
    timed = progress[args.warmup:]
    span = timed[-1]["time"] - progress[args.warmup - 1]["time"]
    summary = started["shared_prefix"]
    tokens_per_step = summary["tokens"] / summary["of"]
    return {"share_prefix": share, "seconds_per_step": span / len(timed),
            "tokens_per_s": tokens_per_step * len(timed) / span,
            "tokens_per_cpu_s": tokens_per_step * len(progress) / cpu, "cpu_s": cpu,
            "computed_share": summary["tokens_computed"] / summary["tokens"],
            "final_loss": progress[-1]["loss"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=24, help="steps per run (default 24)")
    p.add_argument("--warmup", type=int, default=3, help="untimed first steps (default 3)")
    p.add_argument("--repeats", type=int, default=2, help="runs per side, alternating")
    p.add_argument("--threads", type=int, help="OMP threads (default: one per core)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--task", choices=sorted(TASKS), default="triage",
                   help="whose plan and samples (default triage)")
    p.add_argument("--samples", type=int, default=432,
                   help="triage conversations (default 432; clinc150: its 1,500)")
    p.add_argument("--baseline", default=None,
                   help="a git revision: both sides share the prefix, the baseline's trainer "
                        "from that revision's tree (default: the baseline does not share)")
    args = p.parse_args()
    if args.steps <= args.warmup:
        p.error("--steps must exceed --warmup")
    from factory.base_model import smollm2_dir

    base = smollm2_dir()
    if not (base / "config.json").is_file():
        p.error(f"no SmolLM2 at {base}: run `factory base-model` (or set FACTORY_MODELS_DIR)")
    print(json.dumps({"cpus": os.cpu_count(), "loadavg_before": [round(x, 2) for x in
                                                                 os.getloadavg()],
                      "task": args.task, "samples": args.samples, "steps": args.steps,
                      "threads": args.threads, "baseline": args.baseline}))
    with tempfile.TemporaryDirectory(prefix="bench-shared-") as tmp, \
            (baseline_tree(args.baseline, prefix="bench-shared-baseline-") if args.baseline
             else contextlib.nullcontext()) as old:
        work = Path(tmp)
        data = work / "train.parquet"
        if args.task == "clinc150":
            write_clinc(data, args.seed)
        else:
            write_triage(data, args.samples, args.seed)
        runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
        for k in range(args.repeats):
            for new in (False, True):
                # Without --baseline the baseline does not share; with it, it shares too, in
                # the baseline revision's tree.
                r = run_side(args, work, data, str(base), new or old is not None, k,
                             tree=old if old is not None and not new else ROOT,
                             side=None if old is None else ("this-tree" if new else "baseline"))
                runs[new].append(r)
                print(json.dumps({"side": "this tree" if new else "baseline",
                                  **{k2: round(v, 4) if isinstance(v, float) else v
                                     for k2, v in r.items()}}), flush=True)
    med = {share: {key: statistics.median(r[key] for r in rs)
                   for key in ("seconds_per_step", "tokens_per_s", "tokens_per_cpu_s",
                               "computed_share")} for share, rs in runs.items()}
    result = {
        "baseline_s_per_step": round(med[False]["seconds_per_step"], 3),
        "shared_s_per_step": round(med[True]["seconds_per_step"], 3),
        "speedup_wall": round(med[False]["seconds_per_step"] / med[True]["seconds_per_step"], 2),
        "speedup_cpu": round(med[True]["tokens_per_cpu_s"] / med[False]["tokens_per_cpu_s"], 2),
        "tokens_computed_share": round(med[True]["computed_share"], 3),
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
