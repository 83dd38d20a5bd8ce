"""Benchmark: the CPU of one capture-table commit as the table's snapshot history grows.

Every gateway flush is an Iceberg commit, and a commit rewrites the table's metadata, which
lists every snapshot. Three arms, each on a fresh embedded lake, each appending the same
300-row batch to ``raw_traces`` ``--commits`` times through ``Lake.append``:

- ``pyiceberg``: pyiceberg 0.12 as it is (its ``Transaction.table_metadata`` deep-copies the
  whole metadata on every read; the baseline);
- ``cached``: the lake's cache of that property (``factory.lake._cache_transaction_metadata``);
- ``cached+expiry``: also ``Lake.expire_snapshots`` every ``--expire-every`` commits (what the
  gateway's flusher does on a timer), keeping the last 20.

Printed: CPU ms per commit over each window of ``--window`` commits, and each arm's last window
against the baseline's.

    .venv/bin/python bench/commit_growth.py --commits 300
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def arm(name: str, args: argparse.Namespace) -> list[float]:
    from pyiceberg.table import Transaction

    import factory.lake as lake_module
    from factory.settings import get_settings

    cached = Transaction.__dict__["table_metadata"]
    if name == "pyiceberg":
        Transaction.table_metadata = cached.fget.uncached  # type: ignore[method-assign]
    os.environ["FACTORY_HOME"] = tempfile.mkdtemp(prefix=f"bench-commits-{name}-")
    lake = lake_module.Lake(get_settings())
    rows = [{"raw_trace_id": f"r{i}", "source": "proxy", "format": "openai",
             "payload": "x" * 500, "tags": {}} for i in range(300)]
    out: list[float] = []
    try:
        start = time.process_time()
        for i in range(1, args.commits + 1):
            lake.append("raw_traces", rows)
            if name == "cached+expiry" and i % args.expire_every == 0:
                lake.expire_snapshots(["raw_traces"], retain_s=0, keep_last=20)
            if i % args.window == 0:
                now = time.process_time()
                out.append(round((now - start) / args.window * 1e3, 1))
                start = now
                print(json.dumps({"arm": name, "commits": i, "cpu_ms_per_commit": out[-1],
                                  "snapshots": len(lake.table("raw_traces").snapshots())}),
                      flush=True)
    finally:
        Transaction.table_metadata = cached  # type: ignore[method-assign]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--commits", type=int, default=300)
    p.add_argument("--window", type=int, default=50)
    p.add_argument("--expire-every", type=int, default=25)
    args = p.parse_args()
    print(json.dumps({"cpus": os.cpu_count(), "loadavg_before": [round(x, 2) for x in
                                                                 os.getloadavg()],
                      **vars(args)}), flush=True)
    results = {name: arm(name, args) for name in ("pyiceberg", "cached", "cached+expiry")}
    base = results["pyiceberg"][-1]
    print(json.dumps({"last_window_ms": {k: v[-1] for k, v in results.items()},
                      "vs_pyiceberg": {k: round(v[-1] / base, 3) for k, v in results.items()},
                      "loadavg_after": [round(x, 2) for x in os.getloadavg()]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
