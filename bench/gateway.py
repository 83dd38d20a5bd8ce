"""Benchmark of the capture gateway: added latency, streaming TTFB, CPU per request, throughput
with capture on, and captures lost. One run, on 127.0.0.1, against the stand-in upstream.

Direct and gateway batches are interleaved so machine drift cancels; the added latency of a mode
is the gateway percentile minus the direct percentile. The stand-in upstream runs in its own
process (uvicorn + httptools, TCP_NODELAY, backlog 4096), so it is not the bottleneck, and the
client is a raw keep-alive HTTP/1.1 generator (Python HTTP clients would measure themselves).
LiteLLM is not installed in this environment, so it is not run as the peer.

    .venv/bin/python bench/gateway.py --requests 2000 --batches 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import httpx
import orjson
import psutil

from factory.gateway.loadgen import run_load
from factory.gateway.server import bind


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _start(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000, help="requests per batch")
    parser.add_argument("--batches", type=int, default=4, help="interleaved batches per mode")
    args = parser.parse_args()
    home = tempfile.mkdtemp(prefix="factory-bench-gw-")
    env = {**os.environ, "FACTORY_HOME": home}
    upstream = _start(["-m", "factory.gateway.standin", "--port", "0"], env)
    assert upstream.stdout is not None
    up_url = re.search(r"http://\S+", upstream.stdout.readline()).group(0)  # type: ignore[union-attr]
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()
    gw_url = f"http://127.0.0.1:{port}"
    gateway = _start(["-m", "factory.app.cli", "serve", "--port", str(port),
                      "--openai-base-url", up_url], env)
    for _ in range(300):
        try:
            if httpx.get(gw_url + "/healthz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.1)
    proc = psutil.Process(gateway.pid)

    def loop_cpu() -> float:
        """CPU seconds of the gateway's main thread, which runs the event loop."""
        for thread in proc.threads():
            if thread.id == gateway.pid:
                return float(thread.user_time + thread.system_time)
        return 0.0

    body = orjson.dumps({"model": "gpt-4o-mini", "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Summarize the following text. " + "lorem ipsum " * 40}]})
    stream_body = orjson.dumps({**orjson.loads(body), "stream": True})
    report: dict[str, object] = {"requests_per_batch": args.requests, "batches": args.batches,
                                 "litellm": "not installed: peer not run"}
    num_gateway_ok = 0

    def measure(label: str, payload: bytes, concurrency: int) -> None:
        nonlocal num_gateway_ok
        lat: dict[str, list[float]] = {"direct": [], "gateway": []}
        ttfb: dict[str, list[float]] = {"direct": [], "gateway": []}
        cpu = cpu_loop = 0.0
        wall = 0.0
        n_gw = 0
        reqs = [("/v1/chat/completions", payload)] * args.requests
        for _ in range(args.batches):
            for mode, url in (("direct", up_url), ("gateway", gw_url)):
                c0, l0 = proc.cpu_times(), loop_cpu()
                t0 = time.perf_counter()
                results = asyncio.run(run_load(url, reqs, concurrency=concurrency))
                elapsed = time.perf_counter() - t0
                c1, l1 = proc.cpu_times(), loop_cpu()
                assert all(r.status == 200 for r in results), {r.status for r in results}
                lat[mode] += [r.seconds for r in results]
                ttfb[mode] += [r.ttfb_seconds for r in results]
                if mode == "gateway":
                    cpu += (c1.user + c1.system) - (c0.user + c0.system)
                    cpu_loop += l1 - l0
                    wall += elapsed
                    n_gw += len(results)
        num_gateway_ok += n_gw
        row: dict[str, float] = {}
        for q in (0.5, 0.95, 0.99):
            key = f"p{int(q * 100)}"
            row[f"added_{key}_ms"] = round((_pct(lat["gateway"], q) - _pct(lat["direct"], q))
                                           * 1e3, 3)
            row[f"direct_{key}_ms"] = round(_pct(lat["direct"], q) * 1e3, 3)
        if payload is stream_body:
            for q in (0.5, 0.95, 0.99):
                row[f"added_ttfb_p{int(q * 100)}_ms"] = round(
                    (_pct(ttfb["gateway"], q) - _pct(ttfb["direct"], q)) * 1e3, 3)
        row["gateway_cpu_ms_per_request"] = round(cpu / n_gw * 1e3, 3)
        # The event loop's share (the request path); the rest is the flusher thread's lake
        # commits and normalization (and the spool's fsync thread), off the request path.
        row["event_loop_cpu_ms_per_request"] = round(cpu_loop / n_gw * 1e3, 3)
        row["gateway_requests_per_s"] = round(n_gw / wall, 1)
        report[label] = row
        print(label, json.dumps(row), flush=True)

    measure("sequential", body, 1)
    measure("concurrent_16", body, 16)
    measure("concurrent_64", body, 64)
    measure("streaming_sequential", stream_body, 1)
    drain_started = time.perf_counter()
    while httpx.get(gw_url + "/healthz").json()["spool_depth"] > 0:
        time.sleep(0.5)
    report["drain_after_load_s"] = round(time.perf_counter() - drain_started, 1)
    report["gateway_rss_mb"] = round(proc.memory_info().rss / 2**20, 1)
    metrics = httpx.get(gw_url + "/metrics").text
    dropped = re.search(r"^factory_gateway_captures_dropped_total (\S+)", metrics, re.M)
    gateway.terminate()
    gateway.wait(60)
    upstream.terminate()
    from factory.lake import Lake
    from factory.settings import get_settings

    os.environ["FACTORY_HOME"] = home
    captured = Lake(get_settings()).read("raw_traces", columns=["raw_trace_id"]).num_rows
    report["captures_dropped_metric"] = float(dropped.group(1)) if dropped else None
    report["captures_lost"] = num_gateway_ok - captured
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
