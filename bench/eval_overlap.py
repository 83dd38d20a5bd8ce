"""Benchmark: a checkpoint's eval beside its training run on the CPU, against one after the other.

On a CPU machine the loop's checkpoint evals run on the CPU inference server while the trainer
goes on, each a torch process with a thread per core, sharing the cores by claims
(``factory/trainer/cores.py``). An eval arrives mid-step. Three ways, same trainer and plan
(SmolLM2-135M-Instruct, LoRA r=16 on every linear layer, packed rows of 256, 8 rows a step,
bf16 autocast, ``--steps`` steps; triage conversations) and the same eval (``--requests``
triage requests, ``--clients`` in flight, ``--max-tokens`` each, to a server started before and
idle until then):

- ``sequential`` (the baseline): the trainer alone, then the eval alone; its wall is the sum;
- ``poll`` (the factory's default): the eval sent when the trainer's events show step
  ``--at``; the trainer re-reads the claims within each step (``CoreShare.poll`` from its
  decoder layers), so the cores split within a layer or two;
- ``steps``: the same with the claims read between steps only (``FACTORY_CORE_POLL=0``).

Printed per way: the wall from the trainer's start to the later of the two ends, the trainer's
and the eval's own walls, and the ratio of each wall to the baseline's (under 1: overlapping
pays).

    FACTORY_MODELS_DIR=.cache/test-models .venv/bin/python bench/eval_overlap.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _train import lora_plan, start, write_triage  # noqa: E402 - bench/ is the script's folder


def _eval(url: str, requests: list[list[dict[str, str]]], clients: int,
          max_tokens: int) -> float:
    """Send ``requests`` to the server at ``url``, ``clients`` at a time; the wall seconds."""
    import httpx

    def ask(messages: list[dict[str, str]]) -> None:
        body = {"model": "base", "messages": messages, "max_tokens": max_tokens,
                "temperature": 0}
        with httpx.Client(timeout=600) as client:
            client.post(url + "/v1/chat/completions", json=body).raise_for_status()

    t0 = time.time()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(ask, requests))
    return time.time() - t0


def _steps(events_file: Path) -> int:
    """The last step the trainer's events file reports (0 before the first)."""
    from factory.trainer.webhooks import read_events

    return max((e["step"] for e in read_events(events_file) if e.get("type") == "progress"),
               default=0)


def _run(name: str, work: Path, base: str, data: Path, args: argparse.Namespace,
         url: str, requests: list[list[dict[str, str]]], env: dict[str, str]
         ) -> dict[str, Any]:
    """The trainer in a subprocess; the eval sent at step ``args.at`` (None: no eval)."""
    plan = lora_plan(base, steps=args.steps, lr=2e-4, seq_len=256, seed=0)
    job = {"run_id": name, "output_dir": str(work / name), "plan": plan,
           "data_files": [str(data)]}
    (work / f"{name}.json").write_text(json.dumps(job))
    t0 = time.time()
    with open(work / f"{name}.log", "w") as log:
        trainer = subprocess.Popen([sys.executable, "-m", "factory.trainer", "--job",
                                    str(work / f"{name}.json")], env={**os.environ, **env},
                                   stdout=subprocess.DEVNULL, stderr=log)
        eval_s = eval_end = None
        try:
            if args.at is not None and requests:
                events = work / name / "events.jsonl"
                while _steps(events) < args.at and trainer.poll() is None:
                    time.sleep(0.05)
                eval_s = _eval(url, requests, args.clients, args.max_tokens)
                eval_end = time.time()
            if trainer.wait() != 0:
                raise SystemExit(f"{name}: the trainer failed; see {work / name}.log")
        finally:  # an interrupted bench leaves no trainer behind
            if trainer.poll() is None:
                trainer.kill()
                trainer.wait()
    train_end = time.time()
    return {"way": name, "train_s": round(train_end - t0, 1),
            "eval_s": None if eval_s is None else round(eval_s, 1),
            "wall_s": round(max(train_end, eval_end or 0) - t0, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="training steps per run")
    parser.add_argument("--at", type=int, default=6, help="the step the eval arrives after")
    parser.add_argument("--requests", type=int, default=24, help="eval requests")
    parser.add_argument("--clients", type=int, default=4, help="eval requests in flight")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per answer")
    parser.add_argument("--samples", type=int, default=400, help="triage conversations")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads of this process (it only sends requests)")
    args, base = start(parser)
    from factory.inference.launcher import InferenceServer
    from factory.tasks.ticket_triage import generate_heldout
    from factory.trainer.cores import ENV_FOLDER, ENV_POLL, ENV_SWITCH

    requests = [t["messages"] for t in generate_heldout(args.requests, 1)]
    with tempfile.TemporaryDirectory(prefix="eval-overlap-") as tmp:
        work = Path(tmp)
        data = write_triage(work / "triage.parquet", args.samples, 0)
        share = {ENV_SWITCH: "1", ENV_FOLDER: str(work / "cores")}
        os.environ.update(share)
        rows = []
        with InferenceServer(base, served_model_name="base", env=share, max_batch_size=8,
                             log_path=work / "server.log") as server:
            _eval(server.url, requests[:2], 2, args.max_tokens)  # warm: first-call kernels
            alone = _run("train-alone", work, base, data, args, server.url, [], {})
            eval_alone = _eval(server.url, requests, args.clients, args.max_tokens)
            rows.append({"way": "sequential", "train_s": alone["train_s"],
                         "eval_s": round(eval_alone, 1),
                         "wall_s": round(alone["train_s"] + eval_alone, 1)})
            print(json.dumps(rows[-1]), flush=True)
            for way, env in (("poll", {ENV_POLL: "1"}), ("steps", {ENV_POLL: "0"})):
                rows.append(_run(way, work, base, data, args, server.url, requests, env))
                print(json.dumps(rows[-1]), flush=True)
    baseline = rows[0]["wall_s"]
    print(json.dumps({r["way"]: round(r["wall_s"] / baseline, 3) for r in rows}
                     | {"loadavg_after": [round(x, 2) for x in os.getloadavg()]}), flush=True)


if __name__ == "__main__":
    main()
