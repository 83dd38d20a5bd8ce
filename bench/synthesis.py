"""Benchmark: synthetic samples from a teacher lift a thin intent's held-out accuracy.

Staged (no frontier model is reachable here). The task is ``factory.tasks.ticket_triage`` (a
ticket in, one of five team labels out).

- **The teacher** stands in for the frontier model: SmolLM2-135M-Instruct with a LoRA adapter
  trained on the full traffic (every label) plus request-writing calls of the kind synthesis
  makes (``synthesis.request_prompt`` over three tickets of a label, answered with
  ``<request>`` + a new ticket of that label ``</request>``; the frontier, used as a teacher,
  would write such requests). It is served by the factory's CPU server
  (``python -m factory.inference``), an OpenAI-compatible endpoint on 127.0.0.1. Its
  checkpoint is written under the work folder and its path printed in the teacher's line;
  ``--teacher-checkpoint`` reuses such a folder (kept with ``--work``) instead of training one.
- **The student's traffic** is the same generated traffic with the thin label cut to
  ``--keep`` tickets. It is curated by the real pipeline (``factory.curation.pipeline.curate``:
  split, cleaning, decontamination), so the profile's slices show the label thin.
- **Synthesis** is the library's own (``factory.curation.synthesis``): slices of the curated
  train split, attempts planned for the thin slice (seeds from the train split only;
  ``--attempts-per-sample`` per sample the slice lacks, at most ``--max-per-slice`` samples),
  both calls to the teacher, drops by reason, the slice stopped once it holds its target.
  The synthetic rows then go through ``curate`` with the traffic again (train side only,
  deduplicated, decontaminated against the eval split). Rejection sampling by a judge is not
  applied here: the LLM judge needs a frontier model. The answer calls ask for logprobs, so
  each synthetic sample has the probability the teacher gave its answer. Without
  ``--synthesis-min-confidence`` no answer is dropped for it (a bar of 1e-300); with it, the
  bar is ``data.synthesize.min_confidence``: unsure answers are ``low_confidence`` drops
  during synthesis and, with more than one attempt per sample, the slice fills with sure ones.
- **Student runs**, the same trainer and plan (SmolLM2-135M-Instruct, LoRA r=16 on every
  linear layer, bf16 autocast, packed rows of 256 tokens, ``--student-steps`` of 8 rows): on
  the curated traffic alone, on the curated traffic plus every synthetic sample, and, per
  ``--min-confidence`` bar, plus the synthetic samples the teacher gave at least that
  probability. These bars apply after synthesis to its one pool of samples (what
  ``min_confidence`` would keep of it, the slice left short); ``--synthesis-min-confidence``
  is the bar that refills the slice.
- **Scored** teacher-forced on ``--heldout`` tickets per label phrased with held-out templates
  (``generate_heldout``): the label of highest likelihood among the five, per label.

    FACTORY_MODELS_DIR=.cache/test-models .venv/bin/python bench/synthesis.py
    # a bar of 0.9 in synthesis, the slice filled with sure samples (no post-hoc bar: every
    # synthetic sample already clears it), the teacher of a run kept with --work reused:
    FACTORY_MODELS_DIR=.cache/test-models .venv/bin/python bench/synthesis.py \
        --synthesis-min-confidence 0.9 --attempts-per-sample 4 --min-confidence \
        --teacher-checkpoint <work>/teacher/checkpoints/step-00000040 --work <work-0.9>
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _train import canonical, load_for_scoring, lora_plan, start, train  # noqa: E402 - bench/ is the script's folder


def _traffic_rows(convs: list[dict[str, Any]], keep: dict[str, int]) -> list[dict[str, Any]]:
    """``samples`` rows of triage conversations; label ``l`` cut to ``keep[l]`` when given."""
    from factory.normalize.canon import canonical_json, sample_id

    out, seen = [], Counter[str]()
    for i, conv in enumerate(convs):
        seen[conv["label"]] += 1
        if seen[conv["label"]] > keep.get(conv["label"], len(convs)):
            continue
        messages = canonical(conv["messages"])
        out.append({"sample_id": sample_id(messages, []), "raw_trace_id": f"r{i}",
                    "source": "upload", "provider": "openai", "model": "gpt-4o-mini",
                    "messages": canonical_json(messages), "tools": "[]", "num_turns": 1,
                    "has_images": False, "has_tool_calls": False, "created_at": None,
                    "project": "ticket-triage", "tags": [("project", "ticket-triage")]})
    return out


def _write_parquet(path: Path, ids: list[str], messages: list[str]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"sample_id": ids, "messages": messages,
                             "tools": ["[]"] * len(ids)}), path)
    return path


def _request_writing(convs: list[dict[str, Any]], fresh: list[dict[str, Any]], per_label: int,
                     seed: int) -> list[tuple[str, str]]:
    """(sample id, canonical messages JSON) of request-writing calls: per label, the prompt
    synthesis sends (three tickets of the label) answered with a new ticket of the label."""
    from factory.curation import synthesis
    from factory.curation.slices import Slice
    from factory.normalize.canon import canonical_json, sample_id
    from factory.tasks.ticket_triage import LABELS

    rng = random.Random(seed)
    out = []
    for label in LABELS:
        pool = [c for c in convs if c["label"] == label]
        new = [c for c in fresh if c["label"] == label][:per_label]
        s = Slice(dimension="label", value=label, num_traffic=len(pool), num_synthetic=0,
                  thin=True, even=len(pool))
        for i, target in enumerate(new):
            seeds = tuple({"sample_id": f"{label}-{j}",
                           "messages": canonical_json(canonical(c["messages"])), "tools": "[]"}
                          for j, c in enumerate(rng.sample(pool, synthesis.NUM_SEEDS)))
            attempt = synthesis.Attempt(experiment="teacher", slice=s, attempt=i, seeds=seeds)
            messages = canonical([*synthesis.request_prompt(attempt),
                                   {"role": "assistant", "content":
                                    f"<request>{target['messages'][1]['content']}</request>"}])
            out.append((sample_id(messages, []), canonical_json(messages)))
    return out


def _train(name: str, work: Path, files: list[Path], plan: dict[str, Any],
           threads: int | None) -> tuple[Path, dict[str, Any]]:
    """One trainer run on ``files``: (the final checkpoint's directory, run facts)."""
    t = time.perf_counter()
    ckpt, events = train(name, work, {"data_files": [str(f) for f in files]}, plan, threads)
    loss = [e["loss"] for e in events if e["type"] == "progress" and "loss" in e]
    return ckpt, {"train_s": round(time.perf_counter() - t, 1),
                  "final_loss": round(loss[-1], 4), "steps": plan["num_steps"]}


def score(base_model: str, adapter: Path | None, heldout: list[dict[str, Any]]
          ) -> dict[str, Any]:
    """Teacher-forced accuracy per label: the label the model gives the highest
    log-likelihood among the five."""
    import torch

    from factory.tasks.ticket_triage import LABELS
    from factory.trainer.chat import IGNORE_INDEX, encode

    tok, model = load_for_scoring(base_model, adapter)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    right: Counter[str] = Counter()
    total: Counter[str] = Counter()
    for t in heldout:
        rows = [encode(canonical([*t["messages"], {"role": "assistant", "content": label}]),
                       None, tok) for label in LABELS]
        width = max(len(ids) for ids, _ in rows)
        x = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in rows])
        y = torch.tensor([lab + [IGNORE_INDEX] * (width - len(lab)) for _, lab in rows])[:, 1:]
        att = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in rows])
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=x, attention_mask=att).logits[:, :-1].float()
        mask = y != IGNORE_INDEX
        logp = torch.log_softmax(logits, -1).gather(-1, y.clamp(min=0)[..., None])[..., 0]
        scores = (logp * mask).sum(-1).tolist()
        best = LABELS[max(range(len(LABELS)), key=scores.__getitem__)]
        total[t["label"]] += 1
        right[t["label"]] += best == t["label"]
    return {"accuracy": round(sum(right.values()) / max(1, sum(total.values())), 3),
            "by_label": {k: round(right[k] / total[k], 3) for k in LABELS}}


def _quantiles(values: list[float]) -> dict[str, float]:
    """min, quartiles and max of ``values`` (4 places)."""
    if not values:
        return {}
    v = sorted(values)
    at = {"min": 0.0, "q1": 0.25, "median": 0.5, "q3": 0.75, "max": 1.0}
    return {k: round(v[round(q * (len(v) - 1))], 4) for k, q in at.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--records", type=int, default=500, help="traffic records (all labels)")
    p.add_argument("--thin", default="shipping", help="the label the student's traffic lacks")
    p.add_argument("--keep", type=int, default=3, help="tickets of --thin the student keeps")
    p.add_argument("--request-calls", type=int, default=24,
                   help="request-writing calls per label in the teacher's traffic")
    p.add_argument("--teacher-steps", type=int, default=40)
    p.add_argument("--student-steps", type=int, default=24)
    p.add_argument("--teacher-lr", type=float, default=1e-3)
    p.add_argument("--lr", type=float, default=5e-4, help="the students' learning rate")
    p.add_argument("--max-per-slice", type=int, default=100,
                   help="most samples a thin slice is filled with")
    p.add_argument("--attempts-per-sample", type=float, default=1.0,
                   help="attempts planned per sample a thin slice lacks (>= 1); the slice "
                        "stops once it holds its target")
    p.add_argument("--synthesis-min-confidence", type=float,
                   help="data.synthesize.min_confidence during synthesis: answers the teacher "
                        "gives less probability are low_confidence drops (default: none)")
    p.add_argument("--min-confidence", type=float, nargs="*", default=[0.9],
                   help="confidence bars applied after synthesis: one student each, trained "
                        "on the synthetic samples the teacher gave at least this probability")
    p.add_argument("--teacher-checkpoint",
                   help="a teacher checkpoint folder (the path in an earlier run's teacher "
                        "line, kept with --work): scored, not trained")
    p.add_argument("--heldout", type=int, default=40, help="held-out tickets per label")
    p.add_argument("--threads", type=int, help="OMP threads (default: one per core)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", help="keep the work folder here (default: a temp folder)")
    args, base = start(p)
    import pyarrow as pa

    from factory.curation import synthesis
    from factory.curation.config import CurationConfig
    from factory.curation.decide import SYNTHETIC
    from factory.curation.pipeline import curate
    from factory.curation.slices import final_turn, fit_labeler, profile_slices
    from factory.curation.text import message_text
    from factory.curation.tokens import RenderCounter
    from factory.inference.launcher import InferenceServer
    from factory.tables import TABLES
    from factory.tasks import ticket_triage
    from factory.tasks.ticket_triage import LABELS

    if args.thin not in LABELS:
        p.error(f"--thin: one of {', '.join(LABELS)}")
    if not args.attempts_per_sample >= 1:
        p.error(f"--attempts-per-sample: got {args.attempts_per_sample}; allowed: >= 1")
    synthesis_bar = args.synthesis_min_confidence
    if synthesis_bar is not None and not 0 < synthesis_bar <= 1:
        p.error(f"--synthesis-min-confidence: got {synthesis_bar}; allowed: a probability in "
                "(0, 1]")
    if args.teacher_checkpoint and not Path(args.teacher_checkpoint).is_dir():
        p.error(f"--teacher-checkpoint: no folder {args.teacher_checkpoint}")
    t_start = time.perf_counter()
    convs = ticket_triage.generate_conversations(args.records, args.seed)
    fresh = ticket_triage.generate_conversations(args.records, args.seed + 7)
    heldout = ticket_triage.generate_heldout(args.heldout * len(LABELS), seed=args.seed + 1)
    config, counter = CurationConfig(max_tokens=1024), RenderCounter(base)
    schema = TABLES["samples"]
    results: dict[str, Any] = {}
    tmp = tempfile.TemporaryDirectory(prefix="bench-synthesis-")
    work = Path(args.work) if args.work else Path(tmp.name)
    work.mkdir(parents=True, exist_ok=True)
    try:
        # -- the teacher: full traffic plus request-writing calls ---------------------------
        if args.teacher_checkpoint:
            teacher_ckpt = Path(args.teacher_checkpoint).resolve()
            facts: dict[str, Any] = {"reused": True}
        else:
            full = curate(pa.Table.from_pylist(_traffic_rows(convs, {}), schema=schema), config,
                          counter)
            writing = _request_writing(convs, fresh, args.request_calls, args.seed)
            # One file, rows in a seeded order (the order these figures were measured with;
            # the trainer mixes a source's files too).
            rows = [*zip(full.train.column("sample_id").to_pylist(),
                         full.train.column("messages").to_pylist(), strict=True), *writing]
            random.Random(args.seed).shuffle(rows)
            teacher_files = [_write_parquet(work / "teacher.parquet", [r[0] for r in rows],
                                            [r[1] for r in rows])]
            teacher_ckpt, facts = _train("teacher", work, teacher_files,
                                        lora_plan(base, steps=args.teacher_steps,
                                                  lr=args.teacher_lr, seq_len=512,
                                                  seed=args.seed), args.threads)
            facts["train_samples"] = full.train.num_rows + len(writing)
        results["teacher"] = {**facts, "checkpoint": str(teacher_ckpt),
                              **score(base, teacher_ckpt, heldout)}
        print(json.dumps({"side": "teacher", **results["teacher"]}), flush=True)

        # -- the student's traffic: the thin label cut ----------------------------------------
        traffic = pa.Table.from_pylist(_traffic_rows(convs, {args.thin: args.keep}),
                                       schema=schema)
        alone = curate(traffic, config, counter)
        slices = profile_slices(alone.train)
        thin = [s.key for s in slices if s.thin]
        print(json.dumps({"student_traffic": traffic.num_rows,
                          "train": alone.train.num_rows, "eval": alone.eval.num_rows,
                          "thin_slices": thin}), flush=True)

        # -- synthesis through the teacher ----------------------------------------------------
        with InferenceServer(base, adapters={"teacher": str(teacher_ckpt)},
                             threads=args.threads, max_batch_size=4,
                             log_path=work / "teacher-server.log") as server:
            # without --synthesis-min-confidence, a bar no answer misses: logprobs asked, every
            # sample kept with its probability
            teacher = synthesis.Teacher(base_url=server.base_url, model="teacher", timeout_s=180,
                                        max_tokens=16, experiment="bench",
                                        min_confidence=1e-300 if synthesis_bar is None
                                        else synthesis_bar)
            labeler = fit_labeler(alone.train)
            attempts = synthesis.plan_attempts("bench", slices,
                                               synthesis.slice_members(alone.train, labeler),
                                               max_per_slice=args.max_per_slice, seed=args.seed,
                                               attempts_per_sample=args.attempts_per_sample)
            written: list[dict[str, Any]] = []
            drop_rows: list[dict[str, Any]] = []

            def write(rows: list[dict[str, Any]], drops: list[dict[str, Any]]) -> None:
                written.extend(rows)
                drop_rows.extend(drops)
                print(json.dumps({"synthesis_batch": len(rows), "drops": dict(Counter(
                    d["reason"] for d in drops))}), flush=True)

            t = time.perf_counter()
            outcome = synthesis.synthesize(attempts, teacher, labeler, recorded=(),
                                           known_ids=traffic.column("sample_id").to_pylist(),
                                           write=write, concurrency=4)
            synth_s = time.perf_counter() - t
            teacher.close()
        (work / "synthetic.jsonl").write_text("".join(json.dumps(r, default=str) + "\n"
                                                      for r in written + drop_rows))
        synthetic = pa.Table.from_pylist([{f.name: r.get(f.name) for f in schema}
                                          for r in written], schema=schema)
        both = curate(pa.concat_tables([
            traffic.append_column("origin", pa.array(["traffic"] * traffic.num_rows)),
            synthetic.append_column("origin", pa.array([SYNTHETIC] * synthetic.num_rows))]),
            config, counter)
        confidence = {r["sample_id"]: r["confidence"] for r in written}
        origin = both.train.column("origin").to_pylist()
        kept_synth = [m for m, o in zip(both.train.column("messages").to_pylist(), origin,
                                        strict=True) if o == SYNTHETIC]
        synth_labels = Counter(labeler.label(final_turn(json.loads(m))[0]) if labeler else None
                               for m in kept_synth)
        results["synthesis"] = {
            "targets": {a.slice.key: a.target for a in attempts},
            "attempts": outcome.num_planned, "not_needed": outcome.num_not_needed,
            "written": outcome.num_written, "drops": outcome.drops,
            "min_confidence": synthesis_bar, "seconds": round(synth_s, 1),
            "kept_after_curation": len(kept_synth),
            "curation_drops_of_synthetic": dict(Counter(
                d["reason"] for d in both.drops
                if d["sample_id"] in set(synthetic.column("sample_id").to_pylist()))),
            "kept_labels": {str(k): v for k, v in synth_labels.items()},
            "confidence_quantiles": _quantiles([confidence[s] for s, o in zip(
                both.train.column("sample_id").to_pylist(), origin, strict=True)
                if o == SYNTHETIC]),
            "same_eval_split": sorted(both.eval.column("sample_id").to_pylist())
            == sorted(alone.eval.column("sample_id").to_pylist()),
            "examples": [message_text(json.loads(r["messages"])[1])[:160] for r in written[:3]]}
        print(json.dumps({"side": "synthesis", **results["synthesis"]}), flush=True)

        # -- two students, one plan -------------------------------------------------------------
        plan = lora_plan(base, steps=args.student_steps, lr=args.lr, seq_len=256, seed=args.seed)
        sides = [("without", alone.train), ("with", both.train)]
        for bar in args.min_confidence:
            ids = both.train.column("sample_id").to_pylist()
            keep = [o != SYNTHETIC or confidence[s] >= bar
                    for s, o in zip(ids, origin, strict=True)]
            sides.append((f"with_confidence_{bar:g}", both.train.filter(pa.array(keep))))
        for name, table in sides:
            f = _write_parquet(work / f"student-{name}.parquet",
                               table.column("sample_id").to_pylist(),
                               table.column("messages").to_pylist())
            ckpt, facts = _train(f"student-{name}", work, [f], plan, args.threads)
            num_synthetic = sum(o == SYNTHETIC for o in table.column("origin").to_pylist())
            results[f"student_{name}"] = {**facts, "train_samples": table.num_rows,
                                          "synthetic_samples": num_synthetic,
                                          **score(base, ckpt, heldout)}
            print(json.dumps({"side": f"student_{name}", **results[f"student_{name}"]}),
                  flush=True)
        results["base"] = score(base, None, heldout)
        print(json.dumps({"side": "base", **results["base"]}), flush=True)
    finally:
        if not args.work:
            tmp.cleanup()
    print(json.dumps({"loadavg_after": [round(x, 2) for x in os.getloadavg()],
                      "wall_s": round(time.perf_counter() - t_start, 1),
                      "thin": args.thin, "heldout_per_label": args.heldout,
                      **{k: v for k, v in results.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
