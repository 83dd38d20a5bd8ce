"""Benchmark: what shadow mode adds to the client's call. Sequential added latency and gateway CPU
per request with shadowing off and on, in one run, against the same stand-in frontier.

Two gateway processes (``factory serve``), each with its own ``FACTORY_HOME``: one without a
shadow rule, one whose rule sends every ``gpt-4o-mini`` call (share 1.0) to a stand-in candidate
that answers at once (a model generating on the same 2 cores would measure CPU contention, not
the gateway). Direct, shadow-off and shadow-on batches are interleaved so machine drift cancels;
a mode's added latency is its percentile minus the direct percentile. At the end every shadowed
call must be a row of ``shadow_pairs`` and no candidate answer a capture.

    .venv/bin/python bench/shadow.py --requests 1000 --batches 3
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gateway import _pct, _start  # noqa: E402  (bench/gateway.py, beside this script)

ROUTE = "gpt-4o-mini"


def _standin(env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    proc = _start(["-m", "factory.gateway.standin", "--port", "0"], env)
    assert proc.stdout is not None
    url = re.search(r"http://\S+", proc.stdout.readline()).group(0)  # type: ignore[union-attr]
    return proc, url


def _gateway(home: str, upstream: str) -> tuple[subprocess.Popen, str]:
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()
    env = {**os.environ, "FACTORY_HOME": home}
    proc = _start(["-m", "factory.app.cli", "serve", "--port", str(port),
                   "--openai-base-url", upstream], env)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError(f"gateway on {url} did not start")


def _metric(url: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", httpx.get(url + "/metrics").text, flags=re.M)
    return float(match.group(1)) if match else float("nan")


def _lake(home: str):  # type: ignore[no-untyped-def]
    from factory.lake import Lake
    from factory.settings import get_settings

    os.environ["FACTORY_HOME"] = home
    return Lake(get_settings())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000, help="requests per batch")
    parser.add_argument("--batches", type=int, default=3, help="interleaved batches per mode")
    parser.add_argument("--share", type=float, default=1.0,
                        help="share of the calls the rule shadows (0 < share <= 1)")
    args = parser.parse_args()
    from factory.gateway.shadow import ShadowRule, register_shadow

    home_off = tempfile.mkdtemp(prefix="factory-bench-shadow-off-")
    home_on = tempfile.mkdtemp(prefix="factory-bench-shadow-on-")
    frontier, up_url = _standin(dict(os.environ))
    candidate, cand_url = _standin(dict(os.environ))
    register_shadow(ShadowRule(route=ROUTE, experiment="bench", version="v1",
                               base_url=cand_url + "/v1", deployment="bench-v1", share=args.share),
                    lake=_lake(home_on))
    gw_off, off_url = _gateway(home_off, up_url)
    gw_on, on_url = _gateway(home_on, up_url)
    procs = {"shadow_off": psutil.Process(gw_off.pid), "shadow_on": psutil.Process(gw_on.pid)}
    # The rule is read at start and then every routes poll: wait until calls are shadowed.
    probe = orjson.dumps({"model": ROUTE, "messages": [{"role": "user", "content": "probe"}]})
    num_probes = 0
    for _ in range(600):
        httpx.post(on_url + "/v1/chat/completions", content=probe,
                   headers={"content-type": "application/json"})
        num_probes += 1
        if _metric(on_url, "factory_gateway_shadow_offered_total") > 0:
            break
        time.sleep(0.1)
    offered_before = _metric(on_url, "factory_gateway_shadow_offered_total")
    body = orjson.dumps({"model": ROUTE, "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Summarize the following text. " + "lorem ipsum " * 40}]})
    reqs = [("/v1/chat/completions", body)] * args.requests
    start_cpu = {mode: proc.cpu_times() for mode, proc in procs.items()}
    lat: dict[str, list[float]] = {"direct": [], "shadow_off": [], "shadow_on": []}
    cpu = {"shadow_off": 0.0, "shadow_on": 0.0}
    loop = {"shadow_off": 0.0, "shadow_on": 0.0}

    def loop_cpu(proc: psutil.Process) -> float:
        """CPU seconds of the gateway's main thread, which runs the event loop."""
        return next((float(t.user_time + t.system_time) for t in proc.threads()
                     if t.id == proc.pid), 0.0)

    for _ in range(args.batches):
        for mode, url in (("direct", up_url), ("shadow_off", off_url), ("shadow_on", on_url)):
            proc = procs.get(mode)
            c0 = proc.cpu_times() if proc else None
            l0 = loop_cpu(proc) if proc else 0.0
            results = asyncio.run(run_load(url, reqs, concurrency=1))
            assert all(r.status == 200 for r in results), {r.status for r in results}
            lat[mode] += [r.seconds for r in results]
            if proc is not None and c0 is not None:
                c1 = proc.cpu_times()
                cpu[mode] += (c1.user + c1.system) - (c0.user + c0.system)
                loop[mode] += loop_cpu(proc) - l0
    n = args.requests * args.batches
    report: dict[str, object] = {"requests_per_batch": args.requests, "batches": args.batches,
                                 "share": args.share, "loadavg": os.getloadavg()}
    for mode in ("shadow_off", "shadow_on"):
        row = {f"added_p{int(q * 100)}_ms": round((_pct(lat[mode], q) - _pct(lat["direct"], q))
                                                  * 1e3, 3) for q in (0.5, 0.95, 0.99)}
        row["gateway_cpu_ms_per_request"] = round(cpu[mode] / n * 1e3, 3)
        # The event loop's share (the request path and the shadow calls); the rest is the
        # flusher thread's commits of captures and pairs.
        row["event_loop_cpu_ms_per_request"] = round(loop[mode] / n * 1e3, 3)
        report[mode] = row
        print(mode, json.dumps(row), flush=True)
    off, on = report["shadow_off"], report["shadow_on"]
    assert isinstance(off, dict) and isinstance(on, dict)
    report["shadow_on_minus_off_added_p50_ms"] = round(on["added_p50_ms"] - off["added_p50_ms"], 3)
    report["shadow_on_over_off_cpu"] = round(on["gateway_cpu_ms_per_request"]
                                             / off["gateway_cpu_ms_per_request"], 2)
    # Every shadowed call becomes a pair; the candidate's answers never become captures.
    shadowed = _metric(on_url, "factory_gateway_shadow_offered_total") - offered_before
    dropped = _metric(on_url, "factory_gateway_shadow_dropped_total")
    report["shadow_skipped"] = _metric(on_url, "factory_gateway_shadow_skipped_total")
    for mode, gw, url in (("shadow_off", gw_off, off_url), ("shadow_on", gw_on, on_url)):
        while True:
            health = httpx.get(url + "/healthz").json()
            if health["spool_depth"] == 0 and health["shadow_pairs_pending"] == 0:
                break
            time.sleep(0.5)
        # All the process's CPU from the first bench call until its last capture and pair is
        # committed (the other gateway's batches are in the span too: both idle alike then).
        c0, c1 = start_cpu[mode], procs[mode].cpu_times()
        row = report[mode]
        assert isinstance(row, dict)
        row["cpu_ms_per_request_to_commit"] = round(
            ((c1.user + c1.system) - (c0.user + c0.system)) / n * 1e3, 3)
        gw.terminate()
        gw.wait(60)
    frontier.terminate()
    candidate.terminate()
    lake_on = _lake(home_on)
    pairs = lake_on.read("shadow_pairs", columns=["pair_id"]).num_rows
    captures = lake_on.read("raw_traces", columns=["raw_trace_id"]).num_rows
    report["shadowed_calls"] = int(shadowed)
    report["shadow_dropped"] = dropped
    report["pairs_stored"] = pairs
    report["pairs_expected"] = int(shadowed + offered_before - dropped)
    report["captures_on_shadowed_gateway"] = captures
    report["captures_expected"] = n + num_probes  # the bench's calls and the probes
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
