"""Benchmark: mixing a general set into a task's training keeps the student's score on the
general set from collapsing while the task score holds.

The task: ``factory.tasks.ticket_triage`` (a ticket in, one of five team labels out). The general
set: ``factory.tasks.support_extract`` conversations (a support message in, its fields as compact
JSON out), which the project generates, written as a JSONL file of OpenAI chat records and
exported as a ``file:`` source of ``data.mix`` is (``factory.control.jobs.export_file_source``:
every line through ``factory.normalize.normalize_record``). Two runs of the same trainer and
plan (SmolLM2-135M-Instruct, LoRA r=16 on every linear layer, bf16 autocast, packed rows of 256
tokens, ``--steps`` steps of 8 rows at ``--lr``): unmixed (the triage samples alone) and mixed
(``traffic: 3, file:general.jsonl: 1``, or ``--traffic-weight``). Scored, greedy, on held-out samples of both sets for
the base model and each run's final adapter: triage exact-label accuracy on held-out phrasings
(``generate_heldout``), the label of highest likelihood among the five, and the support-extract
references' log-likelihood per token on conversations of another seed (teacher-forced: on
these shared CPUs greedy generation of the JSON answers costs more than the training).

    FACTORY_MODELS_DIR=.cache/test-models .venv/bin/python bench/mixing.py --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _train import canonical, load_for_scoring, lora_plan, start, train, write_triage  # noqa: E402 - bench/ is the script's folder


def score(base_model: str, adapter: Path | None, triage: list[dict[str, Any]],
          general: list[dict[str, Any]]) -> dict[str, float]:
    """The base model (with ``adapter``) scored teacher-forced on both held-out sets: triage
    accuracy as the label the model gives the highest log-likelihood among the five, and the
    general set's mean log-likelihood per reference token (nats; higher is better)."""
    import torch

    from factory.tasks.ticket_triage import LABELS
    from factory.trainer.chat import IGNORE_INDEX, encode

    tok, model = load_for_scoring(base_model, adapter)

    def loglik(messages: list[dict[str, str]]) -> tuple[float, int]:
        ids, labels = encode(canonical(messages), None, tok)
        x = torch.tensor([ids])
        y = torch.tensor([labels])[:, 1:]
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=x).logits[:, :-1].float()
        mask = y != IGNORE_INDEX
        logp = torch.log_softmax(logits, -1).gather(-1, y.clamp(min=0)[..., None])[..., 0]
        return float(logp[mask].sum()), int(mask.sum())

    right = 0
    for t in triage:
        scores = [loglik([*t["messages"], {"role": "assistant", "content": label}])[0]
                  for label in LABELS]
        right += LABELS[max(range(len(LABELS)), key=scores.__getitem__)] == t["label"]
    total = count = 0.0
    for c in general:
        lp, n = loglik(c["messages"])
        total, count = total + lp, count + n
    return {"triage_accuracy": round(right / len(triage), 3),
            "general_loglik_per_token": round(total / count, 4)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task-samples", type=int, default=400)
    p.add_argument("--general-samples", type=int, default=400)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--heldout", type=int, default=40, help="held-out samples of each set")
    p.add_argument("--traffic-weight", type=float, default=3.0,
                   help="the task's weight in the mix, against the general set's 1 (default 3)")
    p.add_argument("--sides", default="base,unmixed,mixed",
                   help="what to score, comma-separated (default base,unmixed,mixed)")
    p.add_argument("--threads", type=int, help="OMP threads (default: one per core)")
    p.add_argument("--seed", type=int, default=0)
    args, base = start(p)
    from factory.control.jobs import export_file_source
    from factory.tasks import support_extract, ticket_triage

    triage_heldout = ticket_triage.generate_heldout(args.heldout, seed=args.seed + 1)
    general_heldout = support_extract.generate_conversations(args.heldout, seed=args.seed + 1)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-mixing-") as tmp:
        work = Path(tmp)
        task = write_triage(work / "triage.parquet", args.task_samples, args.seed)
        general_jsonl = work / "general.jsonl"
        general_jsonl.write_text("".join(
            json.dumps({"messages": c["messages"]}) + "\n"
            for c in support_extract.generate_conversations(args.general_samples, args.seed)))
        general, n_general = export_file_source(general_jsonl, work / "exported")
        sides: dict[str, dict[str, Any]] = {
            "unmixed": {"data_files": [str(task)]},
            "mixed": {"mix": [
                {"name": "traffic", "weight": args.traffic_weight, "data_files": [str(task)]},
                {"name": "file:general.jsonl", "weight": 1.0, "data_files": [str(general)]}]},
        }
        wanted = args.sides.split(",")
        if "base" in wanted:
            t = time.perf_counter()
            results["base"] = score(base, None, triage_heldout, general_heldout)
            print(json.dumps({"side": "base", **results["base"],
                              "score_s": round(time.perf_counter() - t, 1)}), flush=True)
        for name, data in sides.items():
            if name not in wanted:
                continue
            t = time.perf_counter()
            ckpt, events = train(name, work, data, lora_plan(base, steps=args.steps, lr=args.lr,
                                                           seq_len=256, seed=args.seed),
                                 args.threads)
            train_s = time.perf_counter() - t
            started = next(e for e in events if e["type"] == "started")
            loss = [e["loss"] for e in events if e["type"] == "progress" and "loss" in e]
            t = time.perf_counter()
            results[name] = score(base, ckpt, triage_heldout, general_heldout)
            print(json.dumps({"side": name, **results[name], "final_loss": round(loss[-1], 4),
                              "drawn": {k: v["drawn"] for k, v in started["mix"].items()},
                              "general_rows": n_general, "train_s": round(train_s, 1),
                              "score_s": round(time.perf_counter() - t, 1)}), flush=True)
    print(json.dumps({"loadavg_after": [round(x, 2) for x in os.getloadavg()], **results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
