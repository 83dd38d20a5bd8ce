"""Benchmark: memory and deploy time of N deployed adapters of one base model, on one shared
engine (the deployer's default on this machine) against one server per deployment (the
baseline, ``ProcessHost(share=False)``), in one run. BENCHMARKS.md, "Shared engine", has the
figures.

For each N of ``--adapters`` (default 1, 4, 16), N experiments ``exp-0..`` are each deployed
through ``Deployer`` with their own copy of the tool-calling adapter of SmolLM2-135M-Instruct
(``bench/serving.py``'s), each answers one request, and then:

- memory: the resident bytes of every deployed server's process group together (``/proc``;
  pages two processes share count in each, as the kernel charges them);
- deploy seconds: the mean wall time of a deploy after the first (on a shared engine, an
  adapter load; on the baseline, a server start).

The baseline runs only for the N of ``--separate`` (default 1, 4: sixteen 135M servers on two
cores take minutes to start). Prints the command, the CPU flags and the load before the run,
and the shared/separate ratio where both ran.

    FACTORY_MODELS_DIR=.cache/test-models .venv/bin/python bench/engines.py
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# Run as a script, bench/ comes first on the path, and its kernels.py would shadow the
# `kernels` package transformers imports: the repository root instead.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.serving import MODELS, ask, tool_adapter  # noqa: E402
from factory.process import group_rss  # noqa: E402
from factory.tasks.agent_orders import generate_heldout  # noqa: E402


def _copies(adapter: Path, base: Path, root: Path, count: int) -> list[Path]:
    """``count`` copies of ``adapter``, each naming ``base`` by its absolute path."""
    out = []
    for i in range(count):
        dest = root / f"adapter-{i}"
        shutil.copytree(adapter, dest)
        config = json.loads((dest / "adapter_config.json").read_text())
        config["base_model_name_or_path"] = str(base.absolute())
        (dest / "adapter_config.json").write_text(json.dumps(config))
        out.append(dest)
    return out


def measure(count: int, *, shared: bool, adapters: list[Path], threads: int,
            request: list[dict[str, Any]]) -> dict[str, Any]:
    from factory.deploy import DeployConfig, Deployer
    from factory.deploy.hosts import ProcessHost
    from factory.lake import Lake
    from factory.process import stop_group

    home = Path(tempfile.mkdtemp(prefix="bench-engines-"))
    os.environ["FACTORY_HOME"] = str(home)
    lake = Lake()
    deployer = Deployer(lake, DeployConfig(threads=threads, drain_s=0.0),
                        host=ProcessHost(log_root=home / "deployments", share=shared))
    seconds = []
    try:
        for i in range(count):
            t = time.perf_counter()
            dep = deployer.deploy(f"exp-{i}", str(adapters[i]))
            seconds.append(time.perf_counter() - t)
            ask(dep.endpoint[:-len("/v1")], dep.adapter, request, 16)
        groups = {d.pid for d in deployer.versions() if d.pid}
        rss = sum(group_rss(pid) for pid in groups)
    finally:
        for dep in deployer.versions():
            if dep.server_alive:
                stop_group(int(dep.pid or 0), timeout_s=30)
        shutil.rmtree(home, ignore_errors=True)
    return {"adapters": count, "engine": "shared" if shared else "separate",
            "servers": len(groups), "rss_mib": round(rss / 2**20),
            "first_deploy_s": round(seconds[0], 1),
            "next_deploy_s": round(statistics.mean(seconds[1:]), 2) if count > 1 else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--adapters", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--separate", type=int, nargs="*", default=[1, 4],
                   help="the N the one-server-per-deployment baseline runs for")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    flags = Path("/proc/cpuinfo").read_text().split("flags\t\t: ")[1].split("\n")[0].split()
    print(f"command: {' '.join(sys.argv)}")
    print(f"cpu flags: {' '.join(f for f in flags if f.startswith(('avx', 'amx')))}; "
          f"load before: {os.getloadavg()[0]:.2f}; cores: {os.cpu_count()}")
    base = MODELS / "smollm2-135m-instruct"
    work = Path(tempfile.mkdtemp(prefix="bench-engine-adapters-"))
    try:
        adapters = _copies(tool_adapter(base), base, work, max(args.adapters))
        request = generate_heldout(1, seed=7)[0]["messages"]
        rows = []
        for count in args.adapters:
            for shared in (True, False):
                if shared or count in args.separate:
                    rows.append(measure(count, shared=shared, adapters=adapters,
                                        threads=args.threads, request=request))
                    print(json.dumps(rows[-1]), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\n{'adapters':>8} {'engine':>9} {'servers':>7} {'RSS MiB':>8} {'1st deploy s':>12} "
          f"{'next deploy s':>13} {'RSS separate/shared':>19}")
    for row in rows:
        other = next((r for r in rows if r["adapters"] == row["adapters"]
                      and r["engine"] == "shared"), None)
        ratio = (f"{row['rss_mib'] / other['rss_mib']:.2f}x" if other and row is not other
                 else "")
        print(f"{row['adapters']:>8} {row['engine']:>9} {row['servers']:>7} "
              f"{row['rss_mib']:>8} {row['first_deploy_s']:>12} "
              f"{row['next_deploy_s'] if row['next_deploy_s'] is not None else '-':>13} "
              f"{ratio:>19}")


if __name__ == "__main__":
    main()
