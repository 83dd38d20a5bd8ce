"""Benchmark: the factory's CPU server with its prefix cache reused and not, in one server, one run.

The server serves SmolLM2-135M-Instruct with the trained tool-calling LoRA adapter of the vLLM
tests (``.cache/test-models/smollm2-tool-caller-lora-v1``, built by them or here; the base model
alone when it does not load) and answers the agent task's held-out requests
(``factory.tasks.agent_orders``: the ~600-token system prompt and tools block every request
shares, a short user turn, a tool call or a short answer back), greedy, at most
``--max-tokens`` tokens, one client.

Each of ``--requests`` pairs: ``POST /reset_prefix_cache``, request i timed (cache off: the
whole prompt prefilled), then request i + 1 timed (cache on: only what follows the prefix it
shares with request i). Every request is timed once each way and the two sides alternate, so
the machine's load weighs on both alike. Reported: p50 and p95 seconds per request of each
side, their ratio, and the server's ``/metrics`` counters over the timed requests (requests
that hit, prompt tokens reused). Prints the command, the CPU flags and the load before the run.

    .venv/bin/python bench/prefix_cache.py
    .venv/bin/python bench/prefix_cache.py --requests 8 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
# Run as a script, bench/ comes first on the path, and its kernels.py would shadow the
# `kernels` package transformers imports: the repository root instead.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.serving import MODELS, ask, tool_adapter  # noqa: E402
from factory.inference import InferenceServer, InferenceServerError  # noqa: E402
from factory.tasks.agent_orders import generate_heldout  # noqa: E402


def _counters(url: str, model: str) -> dict[str, float]:
    """The server's prefix-cache counters of ``model``."""
    text = httpx.get(url + "/metrics", timeout=60).text

    def value(name: str, labels: str) -> float:
        m = re.search(rf"^{re.escape(name)}\{{{re.escape(labels)}\}} (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    return {"hit_requests": value("factory:prefix_cache_requests_total",
                                  f'model_name="{model}",result="hit"'),
            "miss_requests": value("factory:prefix_cache_requests_total",
                                   f'model_name="{model}",result="miss"'),
            "tokens_looked_up": value("vllm:prefix_cache_queries_total",
                                      f'model_name="{model}"'),
            "tokens_reused": value("vllm:prefix_cache_hits_total", f'model_name="{model}"')}


def _side(times: list[float]) -> dict[str, float]:
    q = statistics.quantiles(times, n=20) if len(times) > 1 else times * 19
    return {"p50_s": round(statistics.median(times), 3), "p95_s": round(q[18], 3),
            "mean_s": round(statistics.fmean(times), 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=16, help="pairs timed (each way once)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    if args.requests < 2:
        ap.error("--requests: at least 2")
    flags = sorted({f for f in Path("/proc/cpuinfo").read_text().split()
                    if f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16")})
    print(f"command: {' '.join(sys.argv)}\ncpu flags: {' '.join(flags)}; cores: "
          f"{os.cpu_count()}; load before: {os.getloadavg()[0]:.2f}", flush=True)
    base = MODELS / "smollm2-135m-instruct"
    adapter = tool_adapter(base)
    requests = generate_heldout(args.requests + 2, seed=7)
    warm, timed = requests[:2], requests[2:]
    server = InferenceServer(base, adapters={"caller": str(adapter)}, served_model_name="base",
                             threads=args.threads, startup_timeout_s=900)
    model = "caller"
    try:
        server.start()
    except InferenceServerError as e:
        print(f"the adapter does not load ({e}); the base model alone", flush=True)
        server = InferenceServer(base, served_model_name="base", threads=args.threads,
                                 startup_timeout_s=900)
        server.start()
        model = "base"
    off: list[float] = []
    on: list[float] = []
    prompt_tokens: list[int] = []
    try:
        for r in warm:
            ask(server.url, model, r["messages"], args.max_tokens)
        before = _counters(server.url, model)
        for i, r in enumerate(timed):
            httpx.post(server.url + "/reset_prefix_cache", timeout=60).raise_for_status()
            seconds, n, _ = ask(server.url, model, r["messages"], args.max_tokens,
                             usage="prompt_tokens")
            off.append(seconds)
            prompt_tokens.append(n)
            nxt = timed[(i + 1) % len(timed)]
            on.append(ask(server.url, model, nxt["messages"], args.max_tokens)[0])
        after = _counters(server.url, model)
    finally:
        server.stop()
    counts = {k: int(after[k] - before[k]) for k in after}
    row = {"model": model, "requests": len(timed), "max_tokens": args.max_tokens,
           "threads": args.threads, "prompt_tokens_p50": int(statistics.median(prompt_tokens)),
           "off": _side(off), "on": _side(on),
           "p50_on_over_off": round(statistics.median(on) / statistics.median(off), 3),
           **counts,
           "tokens_reused_per_hit": round(counts["tokens_reused"]
                                          / max(1, counts["hit_requests"]), 1)}
    print(json.dumps(row), flush=True)
    print("\n| prefix cache | p50 s | p95 s | mean s |\n|---|---|---|---|")
    for side in ("off", "on"):
        s = row[side]
        print(f"| {side} | {s['p50_s']} | {s['p95_s']} | {s['mean_s']} |")
    print(f"\np50 on / off: {row['p50_on_over_off']:.2f}x; {counts['hit_requests']} hits, "
          f"{counts['miss_requests']} misses, {row['tokens_reused_per_hit']} of "
          f"~{row['prompt_tokens_p50']} prompt tokens reused per hit")
    print(f"load after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
