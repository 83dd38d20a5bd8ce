"""Benchmark: the factory's CPU server and vLLM's CPU build side by side, same base, same adapter,
same prompts, in one run. BENCHMARKS.md, "Serving", has the figures.

Each engine serves SmolLM2-135M-Instruct with the trained tool-calling LoRA adapter the vLLM tests
use (``.cache/test-models/smollm2-tool-caller-lora-v1``, built by them or here) and answers the
agent task's requests (``factory.tasks.agent_orders``: a ~600-token shared system prompt and tools
block, a short user turn, a tool call or a short answer back):

- start-up: seconds from the process start to its first answer;
- latency at 1 client: p50 and p95 seconds per request over ``--requests`` requests, greedy,
  at most ``--max-tokens`` tokens (the first two not timed);
- throughput at ``--clients`` concurrent clients: generated tokens per second over the same
  requests;
- peak memory: the server's process group's peak RSS (``/proc``, sampled every 0.2 s).

Engines and settings (``--engines``): ``ours`` (the factory's server, its defaults; ``ours:ARG=VALUE``
for its own flags, e.g. ``ours:--dtype=bfloat16``, or ``ours:--no-merge-adapters``: the adapter
computed through its LoRA layers instead of merged into the base), ``vllm``
(the factory's vLLM command: float32, ``VLLM_CPU_KVCACHE_SPACE=1``, one unbound OpenMP thread per
``--threads``), and vLLM variants given as ``vllm:ARG=VALUE,...`` (extra server arguments, e.g.
``vllm:--no-enable-prefix-caching`` or ``vllm:--max-num-batched-tokens=512``) or ``vllm:env.NAME=
VALUE`` (environment, e.g. ``vllm:env.VLLM_CPU_OMP_THREADS_BIND=all``). The first engine is the
baseline the others' ratios are to. Prints the command, the CPU flags and the load before the run.

    FACTORY_MODELS_DIR=.cache/test-models .venv/bin/python bench/serving.py
    .venv/bin/python bench/serving.py --engines ours vllm vllm:--no-enable-prefix-caching
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
# Run as a script, bench/ comes first on the path, and its kernels.py would shadow the
# `kernels` package transformers imports: the repository root instead.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from factory.inference import InferenceServer, ServeSizing  # noqa: E402
from factory.process import group_rss  # noqa: E402
from factory.tasks.agent_orders import TOOLS, exact_tool_call, generate_heldout  # noqa: E402

MODELS = ROOT / ".cache" / "test-models"
ADAPTER = "smollm2-tool-caller-lora-v1"


def tool_adapter(base: Path) -> Path:
    """The tool-calling adapter of the benches (trained once into the test-model cache)."""
    from tests.inference.conftest import train_adapter
    from tests.inference.test_vllm_gate import _tool_sample

    return train_adapter(base, MODELS / ADAPTER, _tool_sample(), name=ADAPTER)


class _Peak:
    def __init__(self, pgid: int) -> None:
        self.pgid, self.peak, self._stop = pgid, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self.peak = max(self.peak, group_rss(self.pgid))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def ask(url: str, model: str, messages: list[dict[str, Any]], max_tokens: int,
        usage: str = "completion_tokens") -> tuple[float, int, dict[str, Any]]:
    """Seconds of one greedy tool-calling request, its ``usage[usage]`` count and its
    message."""
    body = {"model": model, "messages": messages, "tools": TOOLS, "temperature": 0,
            "max_tokens": max_tokens}
    t = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    reply = r.json()
    return time.perf_counter() - t, int(reply["usage"][usage]), reply["choices"][0]["message"]


def _server(spec: str, base: Path, adapter: Path, threads: int) -> InferenceServer:
    backend = "transformers" if spec.split(":", 1)[0] == "ours" else "vllm"
    env: dict[str, str] = {}
    extra: list[str] = []
    if ":" in spec:
        for item in spec.split(":", 1)[1].split(","):
            if item.startswith("env."):
                k, v = item[4:].split("=", 1)
                env[k] = v
            elif item:
                extra += item.split("=", 1)
    server = InferenceServer(base, adapters={"caller": str(adapter)}, served_model_name="base",
                             backend=backend, threads=threads, startup_timeout_s=900,
                             sizing=ServeSizing(max_num_seqs=8, max_model_len=2048,
                                                max_lora_rank=8, max_loras=2), env=env)
    if extra:
        command = server.command

        def with_extra(*args: Any, **kwargs: Any) -> list[str]:
            return [*command(*args, **kwargs), *extra]

        server.command = with_extra  # type: ignore[method-assign]
    return server


def measure(spec: str, base: Path, adapter: Path, requests: list[dict[str, Any]], *,
            clients: int, max_tokens: int, threads: int) -> dict[str, Any]:
    server = _server(spec, base, adapter, threads)
    t0 = time.perf_counter()
    server.start()
    assert server.proc is not None
    peak = _Peak(server.proc.pid)
    try:
        ask(server.url, "caller", requests[0]["messages"], max_tokens)
        startup = time.perf_counter() - t0
        ask(server.url, "caller", requests[1]["messages"], max_tokens)
        answered = [ask(server.url, "caller", r["messages"], max_tokens) for r in requests]
        single = [seconds for seconds, _, _ in answered]
        t = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            done = list(pool.map(lambda r: ask(server.url, "caller", r["messages"],
                                                max_tokens)[:2], requests))
        wall = time.perf_counter() - t
    finally:
        rss = peak.stop()
        server.stop()
    q = statistics.quantiles(single, n=20)
    return {"engine": spec, "startup_s": round(startup, 1),
            "p50_s": round(statistics.median(single), 3), "p95_s": round(q[18], 3),
            "tokens_per_s": round(sum(n for _, n in done) / wall, 1),
            "answers_per_s": round(len(done) / wall, 2), "peak_rss_gib": round(rss / 2**30, 2),
            "exact": round(sum(exact_tool_call(r["expected"], m)
                               for r, (_, _, m) in zip(requests, answered, strict=True))
                           / len(requests), 3),
            "answers": [_shown(m) for _, _, m in answered]}


def _shown(message: dict[str, Any]) -> str:
    """A reply as text to compare engines by: its tool calls, else its content."""
    calls = message.get("tool_calls") or []
    if calls:
        return "; ".join(f"{c['function']['name']}({c['function']['arguments']})" for c in calls)
    return "text: " + (message.get("content") or "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", nargs="+", default=["ours", "vllm"])
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--adapter", type=Path, default=None,
                    help="a trained adapter directory to serve (default: the tool-calling LoRA "
                         "of the vLLM tests, trained on one sample: its exact rate means nothing)")
    args = ap.parse_args()
    flags = sorted({f for f in Path("/proc/cpuinfo").read_text().split()
                    if f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16")})
    print(f"command: {' '.join(sys.argv)}\ncpu flags: {' '.join(flags)}; cores: "
          f"{os.cpu_count()}; load before: {os.getloadavg()[0]:.2f}", flush=True)
    base = MODELS / "smollm2-135m-instruct"
    adapter = args.adapter or tool_adapter(base)
    requests = generate_heldout(args.requests, seed=7)
    rows = []
    for spec in args.engines:
        row = measure(spec, base, adapter, requests, clients=args.clients,
                      max_tokens=args.max_tokens, threads=args.threads)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "answers"}), flush=True)
    first = rows[0]
    print(f"\n| engine | start-up s | p50 s | p95 s | tokens/s at {args.clients} | peak RSS GiB |"
          f" p50 vs {first['engine']} | tokens/s vs {first['engine']} | exact calls | "
          f"answers as {first['engine']}'s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        same = sum(a == b for a, b in zip(r["answers"], first["answers"], strict=True))
        print(f"| {r['engine']} | {r['startup_s']} | {r['p50_s']} | {r['p95_s']} | "
              f"{r['tokens_per_s']} | {r['peak_rss_gib']} | {r['p50_s'] / first['p50_s']:.2f}x | "
              f"{r['tokens_per_s'] / first['tokens_per_s']:.2f}x | {r['exact']:.1%} | "
              f"{same} of {len(r['answers'])} |")
    print(f"load after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
