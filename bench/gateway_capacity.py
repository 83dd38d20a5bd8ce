"""Benchmark of one gateway node's capacity, all its CPU included: a mixed load (a quarter of
the calls streamed) for a fixed time, then every capture committed to the lake.

The gateway (``factory serve``, capture on, embedded lake) proxies to the stand-in upstream
(its own process, ~85 chunks per streamed answer). A keep-alive load generator
(``factory.gateway.loadgen``) keeps ``--concurrency`` calls in flight for ``--seconds``, three
plain calls to one streamed. The gateway process's CPU (every thread: the event loop, the
spool's fsync thread, the flusher that normalizes and commits) is counted from the first call
until the last capture is committed (``/healthz`` spool depth 0 and every answered call in
``raw_traces``), so work that finishes after the load is in the figure.

Printed: CPU per captured call (the issue's goal: at most 1 ms), the load's rate, the rate the
node captures end to end (calls / (load + drain)), the drain time and captures lost.

    .venv/bin/python bench/gateway_capacity.py --seconds 60 --concurrency 16
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
from typing import Any

import httpx
import orjson
import psutil

from factory.gateway.loadgen import Connection, build_request
from factory.gateway.server import bind


def _start(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)


def _wait_healthy(url: str, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the gateway exited ({proc.returncode}) before it was healthy")
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise SystemExit("the gateway was not healthy within 120 s")


async def _load(url: str, bodies: list[bytes], seconds: float, concurrency: int
                ) -> tuple[int, int, list[float]]:
    """(calls answered 200, calls failed, latencies): ``concurrency`` connections, each
    sending ``bodies`` round-robin (offset per connection) until ``seconds`` have passed."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    raws = [build_request(host, port, "/v1/chat/completions", b) for b in bodies]
    deadline = time.perf_counter() + seconds
    ok = failed = 0
    latencies: list[float] = []

    async def worker(k: int) -> None:
        nonlocal ok, failed
        conn = Connection(host, port)
        i = k
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            try:
                status, _, _ = await conn.request(raws[i % len(raws)])
            except (OSError, asyncio.IncompleteReadError, ValueError, IndexError):
                await conn.close()
                status = 0
            latencies.append(time.perf_counter() - started)
            if status == 200:
                ok += 1
            else:
                failed += 1
            i += 1
        await conn.close()

    await asyncio.gather(*(worker(k) for k in range(concurrency)))
    return ok, failed, latencies


def _cpu(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return float(t.user + t.system + t.children_user + t.children_system)


def run(args: argparse.Namespace, up_url: str) -> dict[str, Any]:
    home = tempfile.mkdtemp(prefix="factory-bench-cap-")
    env = {**os.environ, "FACTORY_HOME": home}
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()
    url = f"http://127.0.0.1:{port}"
    gateway = _start(["-m", "factory.app.cli", "serve", "--port", str(port),
                      "--openai-base-url", up_url, "--flush-interval", str(args.flush_interval)],
                     env)
    try:
        _wait_healthy(url, gateway)
        proc = psutil.Process(gateway.pid)
        body = {"model": "gpt-4o-mini", "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Summarize the following text. " + "lorem ipsum " * 40}]}
        plain, streamed = orjson.dumps(body), orjson.dumps({**body, "stream": True})
        every = round(1 / args.stream_share)
        bodies = [streamed if i % every == every - 1 else plain for i in range(every * 4)]
        cpu0, t0 = _cpu(proc), time.perf_counter()
        ok, failed, lat = asyncio.run(_load(url, bodies, args.seconds, args.concurrency))
        load_s = time.perf_counter() - t0
        cpu_load = _cpu(proc) - cpu0
        from factory.lake import Lake
        from factory.settings import get_settings

        os.environ["FACTORY_HOME"] = home
        lake = Lake(get_settings())
        committed = 0
        while True:
            depth = httpx.get(url + "/healthz", timeout=10).json()["spool_depth"]
            if depth == 0:
                committed = lake.read("raw_traces", columns=["raw_trace_id"]).num_rows \
                    if lake.exists("raw_traces") else 0
                if committed >= ok:
                    break
            if time.perf_counter() - t0 > load_s + args.max_drain_s:
                break
            time.sleep(0.2)
        drain_s = time.perf_counter() - t0 - load_s
        cpu_all = _cpu(proc) - cpu0
        metrics = httpx.get(url + "/metrics", timeout=10).text
        dropped = re.search(r"^factory_gateway_captures_dropped_total (\S+)", metrics, re.M)
        lat.sort()
        return {
            "calls_ok": ok, "calls_failed": failed,
            "load_s": round(load_s, 1), "load_rate_per_s": round(ok / load_s, 1),
            "p50_ms": round(lat[len(lat) // 2] * 1e3, 2),
            "p99_ms": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1e3, 2),
            "cpu_ms_per_call_during_load": round(cpu_load / max(1, ok) * 1e3, 3),
            "cpu_ms_per_call_end_to_end": round(cpu_all / max(1, ok) * 1e3, 3),
            "gateway_rss_mb": round(proc.memory_info().rss / 2**20, 1),
            "drain_s": round(drain_s, 1), "captured": committed,
            "captures_lost": ok - committed,
            "captures_dropped_metric": float(dropped.group(1)) if dropped else None,
            "end_to_end_rate_per_s": round(committed / (load_s + drain_s), 1)}
    finally:
        gateway.terminate()
        try:
            gateway.wait(60)
        except subprocess.TimeoutExpired:
            gateway.kill()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=60.0, help="how long the load runs")
    p.add_argument("--concurrency", type=int, default=16, help="calls in flight")
    p.add_argument("--stream-share", type=float, default=0.25, help="share of streamed calls")
    p.add_argument("--flush-interval", type=float, default=0.5,
                   help="the gateway's --flush-interval (seconds)")
    p.add_argument("--max-drain-s", type=float, default=600.0,
                   help="longest wait for the captures to be committed after the load")
    args = p.parse_args()
    env = {**os.environ}
    upstream = _start(["-m", "factory.gateway.standin", "--port", "0"], env)
    assert upstream.stdout is not None
    found = re.search(r"http://\S+", upstream.stdout.readline())
    assert found is not None, "the stand-in upstream printed no URL"
    up_url = found.group(0)
    print(json.dumps({"cpus": os.cpu_count(), "loadavg_before": [round(x, 2) for x in
                                                                 os.getloadavg()],
                      **vars(args)}), flush=True)
    try:
        print(json.dumps(run(args, up_url)), flush=True)
    finally:
        upstream.terminate()
    print(json.dumps({"loadavg_after": [round(x, 2) for x in os.getloadavg()]}))


if __name__ == "__main__":
    main()
