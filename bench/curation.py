"""Benchmark: curate N generated samples with the planted mix on the embedded engine.

    .venv/bin/python bench/curation.py --num-samples 100000

Reports wall time and peak RSS of ``curate`` and, on a 5,000-sample subset, the near-duplicate
step (MinHash/LSH + exact verification) against brute-force pairwise Jaccard: same pairs, and
the speed ratio. Mix (shares of the clean count): 10% exact dups, 5% near-dups, 2% eval
overlap, 1% refusals, 1% broken JSON. Goal: 1M samples in < 10 min on 2 cores, < 8 GiB.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import numpy as np
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from factory.curation import neardup  # noqa: E402
from factory.curation.config import CurationConfig  # noqa: E402
from factory.curation.pipeline import curate  # noqa: E402
from factory.curation.synthetic import planted  # noqa: E402
from factory.curation.text import conversation_text  # noqa: E402
from factory.curation.tokens import ChatTemplateCounter  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-samples", type=int, default=1_000_000,
                    help="clean samples to generate (planted problems come on top)")
    ap.add_argument("--subset", type=int, default=5000, help="brute-force comparison size")
    ap.add_argument("--tokenizer", default=None, help="tokenizer dir (default: SmolLM2-135M)")
    args = ap.parse_args()
    if args.tokenizer:
        tok = args.tokenizer
    else:
        from factory.base_model import ensure_smollm2

        tok = str(ensure_smollm2()[0])
    config = CurationConfig(max_tokens=2048)

    t0 = time.perf_counter()
    data = planted(args.num_samples, config=config, seed=0)
    table = data.table()
    gen_s = time.perf_counter() - t0
    # the subset: clean rows plus the near-duplicate copies of those among them
    copies = dict(data.near_pairs)
    head = data.rows[:args.subset - min(len(copies), args.subset // 20)]
    extra_ids = {copies[r["sample_id"]] for r in head if r["sample_id"] in copies}
    sub = head + [r for r in data.rows if r["sample_id"] in extra_ids][:args.subset - len(head)]
    del data.rows[:]
    t0 = time.perf_counter()
    result = curate(table, config, ChatTemplateCounter(tok))
    curate_s = time.perf_counter() - t0
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20

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
        "curate_s": round(curate_s, 1), "peak_rss_gib": round(peak_gib, 2),
        "num_train": result.train.num_rows, "num_eval": result.eval.num_rows,
        "drops": result.drops_by_reason(),
        "near_dup_subset": {"n": len(texts), "lsh_pairs": len(lsh), "brute_pairs": len(brute),
                            "same": lsh == brute, "lsh_s": round(lsh_s, 3),
                            "brute_s": round(brute_s, 2),
                            "speedup": round(brute_s / max(lsh_s, 1e-9), 1)},
    }))


if __name__ == "__main__":
    main()
