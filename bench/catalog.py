"""Benchmark: the gateway's flush commits on the shared catalog (PostgreSQL) vs the embedded one
(SQLite).

    .venv/bin/python bench/catalog.py --batch 200 --flushes 20 --writers 1,4

For each catalog, in a fresh temp home (PostgreSQL: a throwaway cluster from
``tests/postgres.py`` with fsync on, so commits cost what they cost on a disk; its warehouse a
local folder, as SQLite's): ``--writers`` processes at once, each with its own home as separate
nodes have, commit ``--flushes`` batches of ``--batch`` proxy captures each through
``ingest_records``, the function the gateway's flusher calls (two Iceberg commits per flush,
``raw_traces`` then ``samples``, each retried on conflict). Per flush it records the wall time;
per run the throughput (captures committed per second, first start to last end). Prints a table,
the PostgreSQL / SQLite ratios, and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _records(writer: int, flush: int, batch: int) -> list[Any]:
    from factory.ingest import RawRecord

    now = datetime.now(UTC)
    return [RawRecord(
        payload={"request": {"model": "m", "messages": [
                     {"role": "user", "content": f"writer {writer} flush {flush} call {i}"}]},
                 "response": {"id": f"c{i}", "object": "chat.completion", "created": 1,
                              "model": "m", "choices": [{"index": 0, "finish_reason": "stop",
                                                         "message": {"role": "assistant",
                                                                     "content": "ok"}}]}},
        source="proxy", received_at=now, tags={},
        raw_trace_id=f"bench-{writer}-{flush}-{i}") for i in range(batch)]


def worker(writer: int, batch: int, flushes: int) -> None:
    """One node's flusher: waits for ``go`` on stdin, then commits and prints its timings."""
    from factory.ingest import ingest_records
    from factory.lake import Lake

    lake = Lake()
    lake.table("samples")  # connect and load before the clock starts, as a running gateway has
    batches = [_records(writer, f, batch) for f in range(flushes)]
    print("ready", flush=True)
    sys.stdin.readline()
    started = time.time()
    latencies = []
    for records in batches:
        t = time.perf_counter()
        summary = ingest_records(lake, records)
        latencies.append(time.perf_counter() - t)
        assert summary.ingested == len(records), summary
    print(json.dumps({"start": started, "end": time.time(), "latencies": latencies}), flush=True)


def run(catalog: str, writers: int, batch: int, flushes: int, env: dict[str, str],
        tmp: Path) -> dict[str, Any]:
    homes = [tmp / f"{catalog}-{writers}-{w}" for w in range(writers)]
    if catalog == "sqlite":  # one embedded catalog: the writers share its home
        homes = [tmp / f"sqlite-{writers}"] * writers
    setup = {**env, "FACTORY_HOME": str(homes[0])}
    subprocess.run([sys.executable, "-c", "from factory.lake import Lake; lake = Lake(); "
                    "[lake.table(t) for t in ('raw_traces', 'samples', 'rejected_traces')]"],
                   env=setup, check=True, cwd=ROOT)
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(w), "--batch",
                               str(batch), "--flushes", str(flushes)],
                              env={**env, "FACTORY_HOME": str(home)}, cwd=ROOT,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for w, home in enumerate(homes)]
    for p in procs:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=1800)
        assert p.returncode == 0, f"worker exited {p.returncode}"
        results.append(json.loads(out.strip().splitlines()[-1]))
    latencies = sorted(x for r in results for x in r["latencies"])
    wall = max(r["end"] for r in results) - min(r["start"] for r in results)
    return {"catalog": catalog, "writers": writers, "batch": batch, "flushes": flushes,
            "p50_ms": 1000 * statistics.median(latencies),
            "p95_ms": 1000 * latencies[int(0.95 * (len(latencies) - 1))],
            "captures_per_s": writers * flushes * batch / wall}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=200, help="captures per flush")
    parser.add_argument("--flushes", type=int, default=20, help="flushes per writer")
    parser.add_argument("--writers", default="1,4", help="writer counts to run, comma-separated")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.batch, args.flushes)
        return 0
    sys.path.insert(0, str(ROOT))
    from tests.postgres import Cluster

    counts = [int(n) for n in args.writers.split(",")]
    base = {k: v for k, v in os.environ.items()
            if k not in ("FACTORY_DATABASE_URL", "FACTORY_WAREHOUSE", "FACTORY_CATALOG",
                         "FACTORY_SHARED_DIR", "FACTORY_HOME", "DAGSTER_HOME")}
    rows = []
    cluster = Cluster.start(durable=True)
    try:
        with tempfile.TemporaryDirectory(prefix="factory-bench-catalog-") as tmp:
            for writers in counts:
                rows.append(run("sqlite", writers, args.batch, args.flushes, base, Path(tmp)))
                pg = {**base, "FACTORY_DATABASE_URL": cluster.new_database(),
                      "FACTORY_WAREHOUSE": str(Path(tmp) / f"pg-warehouse-{writers}")}
                rows.append(run("postgres", writers, args.batch, args.flushes, pg, Path(tmp)))
    finally:
        cluster.stop()
    print(f"{'catalog':<9} {'writers':>7} {'batch':>5} {'flush p50':>10} {'flush p95':>10} "
          f"{'captures/s':>11}")
    for r in rows:
        print(f"{r['catalog']:<9} {r['writers']:>7} {r['batch']:>5} {r['p50_ms']:>8.0f} ms "
              f"{r['p95_ms']:>7.0f} ms {r['captures_per_s']:>11.0f}")
    ratios = {}
    for writers in counts:
        lite, pg = (next(r for r in rows if r["catalog"] == c and r["writers"] == writers)
                    for c in ("sqlite", "postgres"))
        ratios[writers] = {"p50": pg["p50_ms"] / lite["p50_ms"],
                           "throughput": pg["captures_per_s"] / lite["captures_per_s"]}
        print(f"{writers} writer(s): PostgreSQL / SQLite flush p50 {ratios[writers]['p50']:.2f}x, "
              f"throughput {ratios[writers]['throughput']:.2f}x")
    print(json.dumps({"rows": rows, "ratios": ratios}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
