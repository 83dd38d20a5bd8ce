"""Benchmark: a trainer sharing the CPU cores with an eval server: each with a thread per core
and OpenMP threads spinning (GNU OpenMP's default: the baseline), sleeping
(``OMP_WAIT_POLICY=PASSIVE``) or spinning briefly (``GOMP_SPINCOUNT``), a fixed thread count
each (``OMP_NUM_THREADS``), or the cores split while both run (``share``:
``factory/trainer/cores.py``, what the factory does). BENCHMARKS.md, "CPU sharing", has the
figures.

On a CPU machine the loop trains and evaluates at once: a checkpoint's evals run on the CPU
inference server while the trainer goes on. Both are torch processes with a thread per core.
Two sides per OpenMP setting of ``--policies``, each ``--steps`` steps of the same trainer and plan (SmolLM2-135M-Instruct, LoRA
r=16 on every linear layer, packed rows of 256 tokens, 8 rows a step, bf16 autocast; triage
conversations) in a subprocess (``python -m factory.trainer``), the first ``--warmup`` steps
not timed:

- ``alone``: the trainer only; with ``ACTIVE`` (GNU OpenMP's spinning, what it does unless
  told) this is the baseline;
- ``beside``: ``python -m factory.inference`` on SmolLM2 answering ``--clients`` concurrent
  triage requests back to back for the whole run, the server and the trainer with the same
  setting.

Reported per side: seconds per training step and the server's answers per second over the same
window; per setting, its ratios to ``ACTIVE`` alone and beside.

    FACTORY_MODELS_DIR=.cache/test-models .venv/bin/python bench/cpu_sharing.py
    FACTORY_MODELS_DIR=.cache/test-models .venv/bin/python bench/cpu_sharing.py \
        --policies ACTIVE spin=10000 spin=1000
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _train import lora_plan, start, train, write_triage  # noqa: E402 - bench/ is the script's folder


def _step_seconds(events: list[dict[str, Any]], warmup: int) -> tuple[float, float, float]:
    """(median seconds per step after ``warmup`` steps, the first timed step's start, the last
    step's end), from the trainer's progress events."""
    times = [(e["step"], e["time"]) for e in events if e["type"] == "progress"]
    timed = [(s, t) for s, t in times if s >= warmup]
    deltas = [b[1] - a[1] for a, b in zip(timed, timed[1:], strict=False)]
    return statistics.median(deltas), timed[0][1], timed[-1][1]


class _Clients:
    """``n`` threads sending triage requests to ``url`` back to back; answer times kept."""

    def __init__(self, url: str, n: int) -> None:
        from factory.tasks.ticket_triage import generate_heldout

        self.url = url
        self.tickets = [t["messages"] for t in generate_heldout(64, 1)]
        self.done: list[float] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                        for i in range(n)]

    def _run(self, i: int) -> None:
        import httpx

        with httpx.Client(timeout=600) as client:
            k = i
            while not self.stop.is_set():
                body = {"model": "base", "messages": self.tickets[k % len(self.tickets)],
                        "max_tokens": 8, "temperature": 0}
                r = client.post(self.url + "/v1/chat/completions", json=body)
                r.raise_for_status()
                self.done.append(time.time())
                k += len(self.threads)

    def __enter__(self) -> _Clients:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=600)

    def rate(self, t0: float, t1: float) -> float:
        return sum(t0 <= t <= t1 for t in self.done) / (t1 - t0)


def _policy_env(policy: str, work: Path) -> dict[str, str]:
    """``share``: the factory's core sharing (claims in a folder of this run), OpenMP at its
    defaults. Every other setting with sharing off: ``ACTIVE``/``PASSIVE``:
    ``OMP_WAIT_POLICY``; ``spin=N``: ``GOMP_SPINCOUNT=N`` alone; ``threads=N``:
    ``OMP_NUM_THREADS=N`` (torch's thread count) for the trainer and the server."""
    from factory.trainer.cores import ENV_FOLDER, ENV_SWITCH

    if policy == "share":
        return {ENV_SWITCH: "1", ENV_FOLDER: str(work / "cores")}
    off = {ENV_SWITCH: "0"}
    if policy.startswith("spin="):
        return {**off, "GOMP_SPINCOUNT": policy.removeprefix("spin=")}
    if policy.startswith("threads="):
        return {**off, "OMP_NUM_THREADS": policy.removeprefix("threads=")}
    return {**off, "OMP_WAIT_POLICY": policy}


def _side(name: str, work: Path, base: str, data: dict[str, Any], args: argparse.Namespace,
          policy: str, beside: bool) -> dict[str, Any]:
    from factory.inference.launcher import InferenceServer

    plan = lora_plan(base, steps=args.steps, lr=2e-4, seq_len=256, seed=0)
    env = _policy_env(policy, work)
    for var in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS",  # the trainer's env
                "FACTORY_CORE_SHARE", "FACTORY_CORE_SHARES"):
        os.environ.pop(var, None)
    os.environ.update(env)
    if not beside:
        _, events = train(name, work, data, plan, None)
        per_step, _, _ = _step_seconds(events, args.warmup)
        return {"side": name, "s_per_step": round(per_step, 3)}
    with InferenceServer(base, served_model_name="base", env=env, max_batch_size=8,
                         log_path=work / f"{name}-server.log") as server, \
            _Clients(server.url, args.clients) as clients:
        while len(clients.done) < 2 * args.clients:  # the server is answering
            time.sleep(0.5)
        _, events = train(name, work, data, plan, None)
        per_step, t0, t1 = _step_seconds(events, args.warmup)
        rate = clients.rate(t0, t1)
    return {"side": name, "s_per_step": round(per_step, 3), "answers_per_s": round(rate, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=14, help="training steps per side")
    parser.add_argument("--warmup", type=int, default=3, help="first steps not timed")
    parser.add_argument("--clients", type=int, default=4, help="requests in flight")
    parser.add_argument("--samples", type=int, default=400, help="triage conversations")
    parser.add_argument("--policies", nargs="+", default=["ACTIVE", "share"],
                        help="settings to compare: ACTIVE (OpenMP's default, no sharing: the "
                             "baseline, always run), PASSIVE, spin=N (GOMP_SPINCOUNT=N), "
                             "threads=N (OMP_NUM_THREADS), share (the factory's core sharing)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads of this process (it only sends requests)")
    args, base = start(parser)
    args.policies = ["ACTIVE", *(p for p in args.policies if p != "ACTIVE")]
    with tempfile.TemporaryDirectory(prefix="cpu-sharing-") as tmp:
        work = Path(tmp)
        data = {"data_files": [str(write_triage(work / "triage.parquet", args.samples, 0))]}
        rows: dict[tuple[str, bool], dict[str, Any]] = {}
        for beside in (False, True):
            for policy in args.policies:
                name = f"{'beside' if beside else 'alone'}-{policy.replace('=', '')}"
                rows[policy, beside] = _side(name, work, base, data, args, policy, beside)
                print(json.dumps(rows[policy, beside]), flush=True)
    baseline, beside_baseline = rows["ACTIVE", False], rows["ACTIVE", True]
    print(json.dumps({policy: {
        "alone_step_vs_active": round(rows[policy, False]["s_per_step"]
                                      / baseline["s_per_step"], 2),
        "beside_step_vs_active_alone": round(rows[policy, True]["s_per_step"]
                                             / baseline["s_per_step"], 2),
        "beside_trainer_speedup_vs_active": round(beside_baseline["s_per_step"]
                                                  / rows[policy, True]["s_per_step"], 2),
        "beside_server_answers_vs_active": round(rows[policy, True]["answers_per_s"]
                                                 / beside_baseline["answers_per_s"], 2)}
        for policy in args.policies}), flush=True)


if __name__ == "__main__":
    main()
