"""Benchmark: the CPU an instance's own processes take while nothing runs (issue 46 item 1).

In the loop a trainer shares the cores with the Dagster daemon, the code location's server (it
evaluates every sensor tick) and ``factory run`` following the chain; what they take comes off
the trainer's steps. This starts ``factory daemon`` (the daemon and its code server) on a fresh
``$FACTORY_HOME`` from two trees in turn, the baseline (``--baseline REV``, checked out as a git
worktree; default ``HEAD~1``) and this working tree, waits ``--settle`` seconds, then reads each
process's CPU seconds from ``/proc`` over ``--seconds`` seconds and prints them per 30 s, with
the ratio to the baseline: what an idle instance costs. (``factory run``'s own looks at a
chain are not in it; ``tests/app/test_follow.py`` pins how often they happen.)

    .venv/bin/python bench/idle_cpu.py --baseline b441634
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._worktree import baseline_tree  # noqa: E402
from bench.agent import cpu, loadavg  # noqa: E402
from factory.process import stop_group  # noqa: E402

KINDS = {"daemon": "dagster._daemon", "code server": "dagster api grpc"}
"""Each measured process kind and what its command line contains."""


def _home_cpu(home: Path) -> dict[str, float]:
    """CPU seconds (user + system) of the processes running with ``FACTORY_HOME=home``, by
    kind (the daemon starts its code server in a session of its own)."""
    marker_env = f"FACTORY_HOME={home}".encode()
    out = dict.fromkeys(KINDS, 0.0)
    tick = os.sysconf("SC_CLK_TCK")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if marker_env not in environ:
            continue
        for kind, marker in KINDS.items():
            if marker in cmd:
                out[kind] += (int(stat[11]) + int(stat[12])) / tick
    return out


def measure(tree: Path, *, settle_s: float, seconds: float) -> dict[str, Any]:
    home = Path(tempfile.mkdtemp(prefix="factory-bench-idle-"))
    env = {**os.environ, "FACTORY_HOME": str(home), "PYTHONPATH": str(tree)}
    proc = subprocess.Popen([sys.executable, "-m", "factory.app.cli", "daemon"], cwd=tree,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        time.sleep(settle_s)
        if proc.poll() is not None:
            raise SystemExit(f"factory daemon from {tree} exited with {proc.returncode}")
        before, t0 = _home_cpu(home), time.monotonic()
        time.sleep(seconds)
        after, t1 = _home_cpu(home), time.monotonic()
    finally:
        stop_group(proc.pid, timeout_s=30)
        proc.wait()
        shutil.rmtree(home, ignore_errors=True)
    per30 = {k: round((after[k] - before[k]) * 30 / (t1 - t0), 2) for k in KINDS}
    return {"tree": str(tree), "cpu_s_per_30s": per30, "total": round(sum(per30.values()), 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--baseline", default="HEAD~1", help="git revision of the baseline")
    parser.add_argument("--settle", type=float, default=75.0,
                        help="seconds from the start to the measurement (default 75)")
    parser.add_argument("--seconds", type=float, default=90.0,
                        help="seconds measured (default 90)")
    args = parser.parse_args(argv)
    print(json.dumps({"command": " ".join([sys.executable, *sys.argv]), "cpu": cpu(),
                      "loadavg_before": loadavg()}), flush=True)
    with baseline_tree(args.baseline) as worktree:
        base = measure(worktree, settle_s=args.settle, seconds=args.seconds)
        base["rev"] = args.baseline
        print(json.dumps({"baseline": base}), flush=True)
        this = measure(ROOT, settle_s=args.settle, seconds=args.seconds)
    ratios = {k: round(this["cpu_s_per_30s"][k] / base["cpu_s_per_30s"][k], 2)
              for k in KINDS if base["cpu_s_per_30s"][k]}
    print(json.dumps({"this_tree": this, "ratio_to_baseline": ratios,
                      "total_ratio": round(this["total"] / base["total"], 2) if base["total"]
                      else None, "loadavg_after": loadavg()}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
