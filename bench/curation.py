"""Benchmark: curate N generated samples with the planted mix on the embedded engine.

    .venv/bin/python bench/curation.py --num-samples 1000000

The samples are generated in a child process and handed over as Parquet. Reports, for
``curate``: wall time, CPU time (this process and its feature workers), the load average before
and after, and peak RSS (this process alone, and sampled together with its live workers); and,
on a 5,000-sample subset, the near-duplicate step (MinHash/LSH + exact verification) against
brute-force pairwise Jaccard: same pairs, and the speed ratio. Mix (shares of the clean count): 10% exact dups, 5% near-dups, 2% eval
overlap, 1% refusals, 1% broken JSON. Goal: 1M samples in < 10 min on 2 cores, < 8 GiB.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from factory.curation import neardup  # noqa: E402
from factory.curation.config import CurationConfig  # noqa: E402
from factory.curation.pipeline import curate, default_workers  # noqa: E402
from factory.curation.text import conversation_text  # noqa: E402
from factory.curation.tokens import RenderCounter  # noqa: E402
from factory.tasks.planted import planted  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-samples", type=int, default=1_000_000,
                    help="clean samples to generate (planted problems come on top)")
    ap.add_argument("--subset", type=int, default=5000, help="brute-force comparison size")
    ap.add_argument("--tokenizer", default=None, help="tokenizer dir (default: SmolLM2-135M)")
    ap.add_argument("--workers", type=int, default=0,
                    help="feature worker processes (0: one per core)")
    ap.add_argument("--generate-to", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.generate_to:
        _generate(args.num_samples, args.subset, Path(args.generate_to))
        return
    if args.tokenizer:
        tok = args.tokenizer
    else:
        from factory.base_model import ensure_smollm2

        tok = str(ensure_smollm2()[0])
    config = CurationConfig(max_tokens=2048)

    with tempfile.TemporaryDirectory() as tmp:
        # Generate in a child process: the generator's millions of Python dicts would otherwise
        # sit in this process's peak RSS, which is meant to measure curation.
        t0 = time.perf_counter()
        gen = subprocess.run([sys.executable, __file__, "--generate-to", tmp, "--num-samples",
                              str(args.num_samples), "--subset", str(args.subset)],
                             check=True, capture_output=True, text=True)
        gen_s = time.perf_counter() - t0
        table = pq.read_table(Path(tmp) / "samples.parquet")
        sub = pq.read_table(Path(tmp) / "subset.parquet").to_pylist()
    workers = args.workers or default_workers()
    sampler = _RssSampler()
    sampler.start()
    load_before = os.getloadavg()
    cpu0 = _cpu()
    t0 = time.perf_counter()
    result = curate(table, config, RenderCounter(tok), num_workers=workers)
    curate_s = time.perf_counter() - t0
    curate_cpu = _cpu() - cpu0
    load_after = os.getloadavg()
    sampler.stop()
    peak_gib = _rss(resource.RUSAGE_SELF)

    texts = [conversation_text(orjson.loads(r["messages"])) for r in sub]
    t0 = time.perf_counter()
    flat, offs = neardup.flat_words(texts)
    vals, voffs = neardup.ngram_hashes(flat, offs, config.shingle_words)
    sets = [vals[voffs[i]:voffs[i + 1]] for i in range(len(texts))]
    sig = neardup.minhash(vals, voffs, config.num_perm, config.seed)
    keys = neardup.band_keys(sig, config.num_bands, config.rows_per_band, np.diff(voffs) == 0)
    lsh = {(i, j) for i, j in neardup.candidate_pairs(keys.tolist())
           if neardup.jaccard(sets[i], sets[j]) >= config.near_dup_threshold}
    lsh_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    brute = neardup.brute_force_pairs(sets, config.near_dup_threshold)
    brute_s = time.perf_counter() - t0
    print(json.dumps({
        "num_rows": table.num_rows, "generate_s": round(gen_s, 1),
        "generator_peak_rss_gib": json.loads(gen.stdout)["peak_rss_gib"],
        "workers": workers, "cores": os.cpu_count(),
        "curate_s": round(curate_s, 1), "curate_cpu_s": round(curate_cpu, 1),
        "loadavg_1m_before_after": [round(load_before[0], 2), round(load_after[0], 2)],
        "peak_rss_gib": round(peak_gib, 2),
        "peak_rss_with_workers_gib": round(sampler.peak / 2**30, 2),
        "num_train": result.train.num_rows, "num_eval": result.eval.num_rows,
        "drops": result.drops_by_reason(),
        "near_dup_subset": {"n": len(texts), "lsh_pairs": len(lsh), "brute_pairs": len(brute),
                            "same": lsh == brute, "lsh_s": round(lsh_s, 3),
                            "brute_s": round(brute_s, 2),
                            "speedup": round(brute_s / max(lsh_s, 1e-9), 1)},
    }))


def _generate(num_samples: int, subset: int, out: Path) -> None:
    """Write the planted samples and the brute-force subset as Parquet (child process)."""
    data = planted(num_samples, config=CurationConfig(max_tokens=2048), seed=0)
    pq.write_table(data.table(), out / "samples.parquet")
    # the subset: clean rows plus the near-duplicate copies of those among them
    copies = dict(data.near_pairs)
    head = data.rows[:subset - min(len(copies), subset // 20)]
    extra_ids = {copies[r["sample_id"]] for r in head if r["sample_id"] in copies}
    sub = head + [r for r in data.rows if r["sample_id"] in extra_ids][:subset - len(head)]
    pq.write_table(pa.Table.from_pylist([{"messages": r["messages"]} for r in sub]),
                   out / "subset.parquet")
    print(json.dumps({"peak_rss_gib": round(_rss(resource.RUSAGE_SELF), 2)}))


class _RssSampler(threading.Thread):
    """Samples the RSS of this process plus its live children (the feature workers)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = 0
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(0.2):
            self.peak = max(self.peak, sum(_proc_rss(p) for p in _family(os.getpid())))

    def stop(self) -> None:
        self._done.set()
        self.join()


def _family(pid: int) -> list[int]:
    out = [pid]
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def _proc_rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _cpu() -> float:
    """User + system CPU seconds of this process and its finished children (the workers)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(
        resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _rss(who: int) -> float:
    return resource.getrusage(who).ru_maxrss / 2**20


if __name__ == "__main__":
    main()
