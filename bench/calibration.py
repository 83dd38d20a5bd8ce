"""Benchmark: calibration, the factory's own eval score against accuracy on requests it never saw.

Issue 43 item 3. For each task and seed, in a fresh ``$FACTORY_HOME`` (``--home``/``TASK-sSEED``,
or a temp folder): ``factory base-model``, the task's logged calls written and ingested (``factory
ingest --tag project=...``), an experiment file with **planner defaults** (no ``overrides``; the
data section names only the task's samples and ``data.seed``: the seed), ``factory run`` to the
live endpoint under the daemon it starts (``bench/loop.py``'s path). Then, from the run's lake,
the factory's eval score of the deployed (best) checkpoint with its 95% interval and count
(``best_checkpoints``, ``factory.app.loop.summary``: also the base model's score and the eval
split's kind, ``phrasing`` or ``recall only``), and on the deployment's server (the base model
beside the adapter, ``bench/agent.py``'s ``models_to_score``) the accuracy of the deployment
and of the base model on a test set drawn apart from the training data, each request with the
decoding constraint the deployment's route adds (``route_constraint``: a label task's labels
under ``eval.constrain: auto``), as users get it and as the factory's evals score both
models. The gap is eval score minus test accuracy; the goal: within 5 points, and the test
accuracy inside the eval score's interval, on every task.

    FACTORY_MODELS_DIR=.cache/test-models .venv/bin/python bench/calibration.py \\
        --tasks triage --seeds 0,1,2 --records 300 --home /tmp/calib
    # plumbing (a 4-step plan, 60 records, 20 test requests; NOT a measurement):
    FACTORY_MODELS_DIR=.cache/test-models .venv/bin/python bench/calibration.py \\
        --tasks triage --seeds 0 --plumbing --home /tmp/calib-plumbing

Tasks and their test sets (the ``--seed`` draws the training data; the test set uses other
seeds, so it is a different draw for every run, never a training request):

- ``triage`` (``factory.tasks.ticket_triage``, 500 records as ``bench/loop.py``): ``disjoint``,
  tickets phrased with frames the training data never used (``generate_heldout``, seed + 1: the
  calibration figure), ``unseen``, fresh tickets of the training frames, none a
  near-duplicate of a training one (``generate_unseen``, seed + 2), and ``new-requests``,
  tickets whose core (the request) is a frame the training data never used, in the training
  data's detail and aside sentences (``generate_heldout(held=("core",))``, seed + 3: new
  phrasings of the traffic's requests, what a hold-out of the traffic can measure; the disjoint
  set changes those sentences too); exact label.
- ``agent`` (``factory.tasks.agent_orders``, 600 records as ``bench/agent.py``): ``disjoint``,
  requests phrased with templates the training data never used (``generate_heldout``, seed + 1);
  exact tool name and arguments (``exact_tool_call``), the experiment's tools sent.
- ``extraction`` (``factory.tasks.support_extract``, 500 records: ~50 eval samples at the
  default ``eval_fraction``): ``unseen``, fresh messages (seed + 1), none a near-duplicate of a
  training message by curation's own test (``near_dup_threshold`` on ``shingle_words``-grams).
  The task has no held-out phrasings, so this set shares the training templates: a recall
  figure. Accuracy is the share of the four fields right (``field_accuracy``), the quantity its
  rubric (``json_match``) scores; all four right is reported beside it.
- ``clinc150`` (CLINC150, human-written, ``bench/public_data.py``): ``--per-class`` (10)
  training queries per intent from the official train split (sample seed: the seed), 1,500
  records; ``test``: ``--test`` (300) queries of the official test split, the same number per
  intent (2 at 300: all 150 present), sampled with seed + 1, any text that is also a training
  query left out; exact label. Its system prompt lists the 150 intents: 678 SmolLM2 tokens, a
  sample 697-721 (well under ``data.max_tokens``'s 2048, nothing dropped); every sample begins
  with the same ~680 tokens, as the agent task's ~600-token tools block. ``--test 4500``: the
  whole official test split (30 a intent), issue 45's figure; out-of-scope queries are not
  scored (in-scope accuracy), though the prompt offers ``oos``.
- ``snips`` (SNIPS, human-written, the split of Goo et al. 2018): ``--per-class`` (10; 0: the
  whole train split, 13,084) queries per intent of the official train split, 7 intents;
  ``test``: by default the whole official test split (700). Exact match of the answer's JSON
  (intent and every slot, ``public_data.score``), with intent accuracy and slot F1 beside it
  (in the output and the ledger's note). Its system prompt (intents, 39 slot names, the JSON
  shape) is 280 SmolLM2 tokens; answers 30 tokens median, 81 at most. ``eval.constrain: auto``
  leaves JSON unconstrained, so neither model is.

``--test`` (default 200; 300 for ``clinc150``, 700 for ``snips``) sizes each test set. Every test set is scored once
per run, for the deployment and the base model: nothing is chosen on it. The sets come from the
test split of ``bench/splits.py`` (the seeds above; the public datasets' official test splits) and every
score is appended to its ledger (``--ledger``, default ``bench/test_ledger.jsonl``); ``--split
dev`` draws them from the dev split instead (seeds + ``DEV_OFFSET``; the public datasets' dev splits),
for choosing planner defaults, and records nothing; there ``--overrides`` (plan values as JSON)
and ``--data`` (experiment data settings, e.g. ``{"balance": "language"}``) measure a lever
against the planner's defaults. ``--plumbing`` runs a tiny plan
(``--overrides``, default ``{"num_steps": 4, "eval_every_steps": 2}``) on 60 records and 20 dev
requests by default, to check the path end to end; its figures are not a measurement, and the
output says so.

Prints one JSON line per run, then a table of the runs and one per task (mean and standard
deviation over seeds of eval score, test accuracy and gap), with the commit (``-dirty`` and a
hash of the changes when the tree differs from it: a task's runs share one commit only when the
label is the same), the CPU and its flags, and the load before each run.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Run as a script, this file's folder is first on sys.path and its kernels.py would shadow the
# ``kernels`` package: put the checkout root there instead, and import the benches as ``bench.*``.
_HERE = Path(__file__).resolve().parent
ROOT = _HERE.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(ROOT))

from bench import public_data, splits  # noqa: E402
from bench.agent import (  # noqa: E402
    cpu,
    last_json,
    loadavg,
    models_to_score,
    route_constraint,
    run_cli,
)
from bench.loop import ask_all  # noqa: E402

RECIPE = "smollm2-135m-lora"
GOAL_GAP = 0.05
"""Issue 43 item 3: eval score and test accuracy within 5 points."""
PLUMBING_OVERRIDES = {"num_steps": 4, "eval_every_steps": 2}
PLUMBING_RECORDS = 60
PLUMBING_TEST = 20
Request = dict[str, Any]
Scorer = Callable[[str, str, list[Request], int, dict[str, Any] | None], dict[str, Any]]
"""(base URL, served model, test requests, concurrency, the route's constraint or None) ->
``{"accuracy", "num", ...}``."""


# ---------------------------------------------------------------------------------------------
# Tasks: their training records, test sets and scorers.

@dataclass(frozen=True, kw_only=True)
class Task:
    """One task of the bench."""

    name: str
    """The ``--tasks`` name."""
    experiment: str
    """The experiment's name (and its ``factory/NAME`` model)."""
    project: str
    """The ``project`` tag its records are ingested with (the experiment's ``data.where``)."""
    records: int
    """Default number of training records."""
    description: str
    """The experiment file's description."""
    ledger_task: str
    """The task's name in ``bench/test_ledger.jsonl`` (as bench/loop.py and bench/agent.py
    record theirs)."""


TASKS: dict[str, Task] = {t.name: t for t in (
    Task(name="triage", experiment="ticket-triage", project="ticket-triage", records=500,
         description="Route support tickets to one of five teams (label only).",
         ledger_task="triage"),
    Task(name="agent", experiment="agent-orders", project="agent-orders", records=600,
         description="Order-support agent with four tools.", ledger_task="agent-orders"),
    Task(name="extraction", experiment="support-extract", project="support-extract",
         records=500, description="Extract name, email, company and intent as compact JSON.",
         ledger_task="support-extract"),
    Task(name="clinc150", experiment="clinc150", project="clinc150", records=0,
         description="Classify assistant requests into CLINC150's 150 intents (label only).",
         ledger_task="clinc150"),
    Task(name="snips", experiment="snips", project="snips", records=0,
         description="Parse voice-assistant requests into SNIPS's intent and slots (JSON).",
         ledger_task="snips"),
)}
PRIMARY = {"triage": "disjoint", "agent": "disjoint", "extraction": "unseen",
           "clinc150": "test", "snips": "test"}
"""The test set each task's calibration goal is judged on."""
TEST_SETS = {
    "disjoint": "phrased with frames/templates the training data never used",
    "unseen": "fresh requests of the training frames, no near-duplicate of a training one",
    "new-requests": "requests phrased with frames the training data never used, in its other "
                    "sentences",
    "test": "the official test split, a fixed number per intent",
}


def experiment_yaml(task: Task, seed: int, overrides: dict[str, Any],
                    data: dict[str, Any] | None = None) -> str:
    """The experiment file: the task's samples, ``data.seed``, the SmolLM2 recipe, ``deploy:
    auto``; no overrides and no other ``data`` settings unless plumbing or a dev lever (else
    every plan value the planner's), eval settings the defaults."""
    import yaml

    body: dict[str, Any] = {
        "name": task.experiment,
        "description": task.description,
        "data": {"where": f"tags['project'] = '{task.project}'", "seed": seed, **(data or {})},
        "recipe": RECIPE,
        "deploy": "auto",
    }
    if overrides:
        body["overrides"] = overrides
    head = ("# Written by bench/calibration.py: "
            + ("planner defaults, no overrides.\n" if not overrides and not data
               else "overrides (plumbing, or a lever on the dev split), not a test figure.\n"))
    return head + yaml.safe_dump(body, sort_keys=False, allow_unicode=True)


GENERATED = {"triage": "ticket_triage", "agent": "agent_orders", "extraction": "support_extract"}
"""The generated tasks' modules in ``factory.tasks`` (the rest are the public datasets of
``bench/public_data.py``: ``clinc150``, ``snips``)."""


def _generator(task: str) -> Any:
    return importlib.import_module(f"factory.tasks.{GENERATED[task]}")


def training_examples(task: str, n: int, seed: int, per_class: int) -> list[dict[str, Any]]:
    """The training data's conversations (generated tasks) or examples (a public dataset:
    ``per_class`` queries of each label of its official train split, ``0`` all of them)."""
    if task in GENERATED:
        return _generator(task).generate_conversations(n, seed)  # type: ignore[no-any-return]
    return public_data.sample_per_class(public_data.load(task, "train"), per_class or None, seed)


def training_records(task: str, n: int, seed: int, per_class: int) -> list[dict[str, Any]]:
    """The logged calls to ingest (OpenAI ``{"request", "response"}`` records)."""
    if task in GENERATED:
        return _generator(task).generate_records(n, seed)  # type: ignore[no-any-return]
    return public_data.records(task, training_examples(task, n, seed, per_class), seed)


def _user_text(messages: Sequence[dict[str, Any]]) -> str:
    return next(str(m["content"]) for m in reversed(messages) if m["role"] == "user")


def fresh_extractions(n: int, seed: int, training: list[dict[str, Any]]) -> list[Request]:
    """``n`` extraction requests (system + user) drawn with ``seed``, none a near-duplicate of
    a ``training`` message by curation's own test (Jaccard of ``shingle_words``-grams at least
    ``near_dup_threshold``, the ``CurationConfig`` defaults) nor a repeat of another of the
    ``n``: ``{"messages", "reference"}`` (the reference answer's JSON text)."""
    from factory.curation.config import CurationConfig
    from factory.curation.neardup import flat_words, ngram_hashes
    from factory.tasks import support_extract

    config = CurationConfig()

    def shingles(texts: list[str]) -> list[set[int]]:
        values, offsets = ngram_hashes(*flat_words(texts), config.shingle_words)
        return [set(values[offsets[i]:offsets[i + 1]].tolist()) for i in range(len(texts))]

    seen = shingles([_user_text(c["messages"]) for c in training])
    by_shingle: dict[int, list[int]] = {}
    for i, sh in enumerate(seen):
        for g in sh:
            by_shingle.setdefault(g, []).append(i)

    def near(sh: set[int]) -> bool:
        shared: dict[int, int] = {}
        for g in sh:
            for i in by_shingle.get(g, ()):
                shared[i] = shared.get(i, 0) + 1
        return any(k / (len(sh) + len(seen[i]) - k) >= config.near_dup_threshold
                   for i, k in shared.items())

    # generate_conversations is prefix-stable in n: 20 candidates a request are drawn at once.
    candidates = support_extract.generate_conversations(20 * n, seed)
    texts = [_user_text(c["messages"]) for c in candidates]
    out: list[Request] = []
    taken: set[str] = set()
    for conv, text, sh in zip(candidates, texts, shingles(texts), strict=True):
        if len(out) == n:
            break
        if text in taken or near(sh):
            continue
        taken.add(text)
        out.append({"messages": conv["messages"][:2],
                    "reference": conv["messages"][2]["content"]})
    if len(out) < n:
        raise ValueError(f"only {len(out)} of {20 * n} fresh messages unlike every training "
                         f"message; asked for {n}")
    return out


def public_test(name: str, n: int, seed: int, training: list[dict[str, Any]],
                split: str = "test") -> list[Request]:
    """``n`` queries of public dataset ``name``'s official ``split`` (``test``, or ``dev``:
    its validation split): ``ceil(n / labels)`` per label sampled with ``seed``
    (``sample_per_class``; every label present when ``n`` reaches their number), trimmed to
    ``n`` by a seeded draw when that is more, none whose text is a ``training`` query's:
    ``{"messages", "label"}`` plus SNIPS's ``"slots"``. ``n`` at least the split's size takes
    all of it (CLINC150: 4,500 test queries, SNIPS: 700), in file order."""
    import random

    train_texts = {e["text"].strip().lower() for e in training}
    pool = [e for e in public_data.load(name, split)
            if e["text"].strip().lower() not in train_texts]
    labels = public_data.labels(name)
    picked = (pool if n >= len(pool) else
              public_data.sample_per_class(pool, max(1, math.ceil(n / len(labels))), seed))
    if len(picked) > n:
        keep = set(random.Random(f"{seed}:trim").sample(range(len(picked)), n))
        picked = [e for i, e in enumerate(picked) if i in keep]
    system = public_data.system_prompt(name)
    return [{"messages": [{"role": "system", "content": system},
                          {"role": "user", "content": e["text"]}],
             **{k: v for k, v in e.items() if k != "text"}} for e in picked]


def test_sets(task: str, n: int, seed: int, training: list[dict[str, Any]],
              split: str = "test") -> dict[str, list[Request]]:
    """The task's held-out sets (the primary first) on ``split`` (``bench/splits.py``: the
    generators' seed + 1 to + 3 on test, as bench/loop.py and bench/agent.py draw them, those
    plus ``DEV_OFFSET`` on dev; CLINC150's official test or validation split)."""
    def at(offset: int) -> int:
        return splits.heldout_seed(seed + offset, split)

    if task == "triage":
        from factory.tasks import ticket_triage

        return {"disjoint": ticket_triage.generate_heldout(n, at(1)),
                "unseen": ticket_triage.generate_unseen(n, at(2), training),
                "new-requests": ticket_triage.generate_heldout(n, at(3), held=("core",))}
    if task == "agent":
        from factory.tasks import agent_orders

        return {"disjoint": agent_orders.generate_heldout(n, at(1))}
    if task == "extraction":
        return {"unseen": fresh_extractions(n, at(1), training)}
    return {"test": public_test(task, n, seed + 1, training, split)}


PUBLIC = ("clinc150", "snips")
"""The tasks on public, human-written datasets (``bench/public_data.py``)."""
DEFAULT_TEST = {"clinc150": 300, "snips": 700}
"""``--test`` by default: 200 requests a set, CLINC150 2 a intent, SNIPS its whole test split."""

MAX_TOKENS = {"extraction": 64, "clinc150": 16, "snips": 96}
"""Completion limits of the scorers here: the longest extraction answer of 600 references is
39 SmolLM2 tokens; the longest CLINC150 intent 9 with the end token 10; the longest SNIPS
answer of its 14,484 queries 81 (p99 55). Each lets every right
answer finish and cuts a rambling one short (it is wrong either way). Triage and agent use
bench/loop.py's 8 and bench/agent.py's 96."""


def score_extraction(base_url: str, model: str, requests: list[Request],
                     concurrency: int, constraint: dict[str, Any] | None = None
                     ) -> dict[str, Any]:
    """Share of the four fields right per request (``field_accuracy``), its mean, and the share
    with all four right."""
    from factory.tasks.support_extract import field_accuracy

    answers, secs = ask_all(base_url, model, requests, MAX_TOKENS["extraction"], concurrency,
                            constraint)
    scores = [field_accuracy(a, r["reference"]) for a, r in zip(answers, requests, strict=True)]
    return {"model": model, "scores": scores, "exact": sum(s == 1.0 for s in scores) / len(scores),
            "num": len(scores), "seconds": round(secs, 1), "replies": answers}


def score_clinc(base_url: str, model: str, requests: list[Request],
                concurrency: int, constraint: dict[str, Any] | None = None) -> dict[str, Any]:
    """Exact label (``public_data.score``) per request."""
    answers, secs = ask_all(base_url, model, requests, MAX_TOKENS["clinc150"], concurrency,
                            constraint)
    scores = [float(public_data.score("clinc150", {"label": r["label"]}, a))
              for a, r in zip(answers, requests, strict=True)]
    return {"model": model, "scores": scores, "exact": sum(scores) / len(scores),
            "num": len(scores), "seconds": round(secs, 1), "replies": answers}


def score_snips(base_url: str, model: str, requests: list[Request],
                concurrency: int, constraint: dict[str, Any] | None = None) -> dict[str, Any]:
    """Exact match of the whole JSON answer (``public_data.score``: intent and every slot) per
    request; beside it the intent accuracy (the answer parses and names the gold intent) and
    the slot F1 (``public_data.slot_f1``), the two figures the SNIPS literature reports."""
    answers, secs = ask_all(base_url, model, requests, MAX_TOKENS["snips"], concurrency,
                            constraint)
    pairs = list(zip(requests, answers, strict=True))
    scores = [float(public_data.score("snips", r, a)) for r, a in pairs]
    intents = [float((parsed := public_data.parse_snips(a)) is not None
                     and parsed[0] == r["label"]) for r, a in pairs]
    return {"model": model, "scores": scores, "exact": sum(scores) / len(scores),
            "num": len(scores), "seconds": round(secs, 1), "replies": answers,
            "intent_accuracy": sum(intents) / len(intents),
            "slot_f1": public_data.slot_f1(pairs)}


def scorer(task: str) -> Scorer:
    """The task's test scorer; each returns ``exact`` and ``num`` (and ``scores`` per request
    where a request can score between 0 and 1)."""
    if task == "triage":
        from bench.loop import score

        return score
    if task == "agent":
        from bench.agent import _score
        from factory.tasks.agent_orders import TOOLS

        # a tool task's route adds no constraint (``eval.constrain: auto`` leaves tool calls)
        return lambda url, model, reqs, conc, _constraint: _score(url, model, reqs, TOOLS, conc)
    return {"extraction": score_extraction, "clinc150": score_clinc,
            "snips": score_snips}[task]


def keep_answers(path: Path, requests: list[Request], result: dict[str, Any]
                 ) -> dict[str, Any]:
    """Write each test request's answer and score to ``path`` (JSON lines: the request's
    fields, ``answer``, ``score``), where the scorer returns its answers (``replies``, one per
    request: the public tasks and extraction), for reading the misses after a run; the result
    unchanged."""
    if "replies" in result:
        path.write_text("".join(
            json.dumps({**r, "answer": a, "score": s}, ensure_ascii=False) + "\n"
            for r, a, s in zip(requests, result["replies"], result["scores"], strict=True)),
            encoding="utf-8")
    return result


def accuracy(result: dict[str, Any]) -> dict[str, Any]:
    """A scorer's result as ``{"mean", "low", "high", "num", "exact"}``: the mean per-request
    score with its 95% interval by the formula the factory's evals use (``summarize``: Wilson
    for 0/1 scores)."""
    from factory.evals.selection import summarize

    scores = result.get("scores")
    if scores is None:  # 0/1 scorers that report the rate only
        hits = round(result["exact"] * result["num"])
        scores = [1.0] * hits + [0.0] * (result["num"] - hits)
    s = summarize(0, scores)
    return {"mean": s.mean, "low": s.ci_low, "high": s.ci_high, "num": s.num_samples,
            "exact": result["exact"],
            **{k: result[k] for k in ("intent_accuracy", "slot_f1") if k in result}}


def ledger_note(task: str, by_model: dict[str, dict[str, Any]]) -> str:
    """What a ledger entry's figures are, where exact match is not the whole story."""
    if task == "extraction":
        return "all four fields right"
    if task == "snips":
        return "exact JSON (intent and every slot); " + "; ".join(
            f"{label}: intent accuracy {100 * m['intent_accuracy']:.1f}, slot F1 "
            f"{100 * m['slot_f1']:.1f}" for label, m in by_model.items())
    return ""


# ---------------------------------------------------------------------------------------------
# Where the figures come from: the commit, the CPU.

def _git(*args: str) -> bytes:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, check=True,
                          timeout=60).stdout


def commit() -> str:
    """``git rev-parse --short HEAD``, plus ``-dirty:HASH`` when the tree differs from it (HASH:
    8 hex digits of the tracked changes and the untracked files' paths and contents), so that
    two runs share a label only when they ran the same code. The test ledger is left out: the
    bench appends to it itself, which made every run after a session's first one "dirty"."""
    sha = _git("rev-parse", "--short", "HEAD").decode().strip()
    diff = _git("diff", "HEAD", "--binary", "--", ".", f":(exclude){splits.LEDGER_PATH}")
    untracked = sorted(p for p in _git("ls-files", "--others", "--exclude-standard", "-z")
                       .decode().split("\0") if p)
    if not diff and not untracked:
        return sha
    digest = hashlib.sha256(diff)
    for path in untracked:
        digest.update(path.encode() + b"\0")
        file = ROOT / path
        if file.is_file():
            digest.update(file.read_bytes())
    return f"{sha}-dirty:{digest.hexdigest()[:8]}"


# ---------------------------------------------------------------------------------------------
# One run: ingest, factory run, the lake's scores, the test sets.

def eval_scores(lake: Any, name: str) -> dict[str, Any]:
    """The deployed (best) checkpoint's eval score with its interval, the base model's, and the
    eval split's kind, from ``best_checkpoints`` and ``factory.app.loop.summary``."""
    from factory.app.loop import summary

    out = summary(lake, name)
    row = lake.sql("SELECT mean_score, ci_low, ci_high, num_samples, ci_method, step "
                   "FROM best_checkpoints WHERE experiment = ? ORDER BY selected_at DESC "
                   "LIMIT 1", [name]).to_pylist()[0]
    return {"mean": row["mean_score"], "low": row["ci_low"], "high": row["ci_high"],
            "num": row["num_samples"], "method": row["ci_method"], "step": row["step"],
            "text": out["best_score_interval"], "base": out["base_score"],
            "base_text": out["base_score_interval"], "eval_split": out["eval_split"],
            "eval_split_reason": out["eval_split_reason"], "run_id": out["run_id"]}


def run_one(task: Task, seed: int, args: argparse.Namespace, home: Path) -> dict[str, Any]:
    """One task at one seed in ``home`` (fresh): the run's row (``ok`` false, with ``error``,
    when a step failed)."""
    from bench.loop import _dataset_and_plan, _run
    from factory.lake import Lake

    home.mkdir(parents=True, exist_ok=True)
    if any(home.iterdir()):
        raise SystemExit(f"--home: {home} is not empty (each task/seed needs a fresh folder)")
    experiments = home / "experiments"
    experiments.mkdir()
    os.environ["FACTORY_HOME"] = str(home)
    os.environ.pop("DAGSTER_HOME", None)  # derived from FACTORY_HOME
    os.environ["FACTORY_EXPERIMENTS_DIR"] = str(experiments)
    env = dict(os.environ)
    records = args.records if args.records is not None else (
        PLUMBING_RECORDS if args.plumbing else task.records)
    num_test = args.test if args.test is not None else (
        PLUMBING_TEST if args.plumbing else DEFAULT_TEST.get(task.name, 200))
    row: dict[str, Any] = {"task": task.name, "seed": seed, "home": str(home), "ok": False,
                           "commit": commit(), "loadavg_before": loadavg(),
                           "split": args.split, "plumbing": args.plumbing}
    code, _, _ = run_cli(["base-model"], env)
    if code != 0:
        return {**row, "error": "factory base-model failed"}

    per_class = args.per_class
    training = training_examples(task.name, records, seed, per_class)
    logged = training_records(task.name, records, seed, per_class)
    row["records"] = len(logged)
    tests = {kind: requests
             for kind, requests in test_sets(task.name, num_test, seed, training,
                                             args.split).items()
             if args.sets is None or kind in args.sets or kind == PRIMARY[task.name]}
    row["test_sizes"] = {k: len(v) for k, v in tests.items()}
    path = home / f"{task.experiment}-train.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in logged),
                    encoding="utf-8")
    (experiments / f"{task.experiment}.yaml").write_text(
        experiment_yaml(task, seed, args.overrides, args.data), encoding="utf-8")

    code, out, secs = run_cli(["ingest", str(path), "--tag", f"project={task.project}"], env)
    row["ingest"] = {**last_json(out), "seconds": round(secs, 1)}
    if code != 0:
        return {**row, "error": f"factory ingest failed (exit {code})"}
    lake = Lake()
    run = _run(task.experiment, env, home, deploy=True)
    row["run_s"] = run["seconds"]
    row.update(_dataset_and_plan(lake, task.experiment))
    if run["exit"] != 0 or not run.get("endpoint"):
        return {**row, "error": f"factory run failed (exit {run['exit']})"}
    row["eval"] = eval_scores(lake, task.experiment)

    score = scorer(task.name)
    server = None
    try:
        base_url, models, server = models_to_score(lake, task.experiment, deployed=True,
                                                   home=home, threads=None, recipe=RECIPE)
        constraint = route_constraint(lake, task.experiment)
        row["constraint"] = constraint
        started = time.monotonic()
        row["test"] = {kind: {label: accuracy(keep_answers(
                                  home / f"answers-{kind}-{label}.jsonl", requests,
                                  score(base_url, model, requests, args.concurrency,
                                        constraint)))
                              for label, model in models.items()}
                       for kind, requests in tests.items()}
        row["score_s"] = round(time.monotonic() - started, 1)
    finally:
        if server is not None:
            server.stop()
        run_cli(["undeploy", task.experiment], env)
    row["ok"] = True
    if args.split == "test":
        config: dict[str, Any] = {"overrides": args.overrides, "recipe": RECIPE,
                                  "records": len(logged)}
        if task.name in PUBLIC:
            config["per_class"] = per_class or "full"
        for kind, by_model in row["test"].items():
            splits.record(bench="calibration", task=task.ledger_task, heldout=kind, seed=seed,
                          num=by_model["deployed"]["num"], config=config,
                          deployed=by_model["deployed"]["exact"],
                          base=by_model["base"]["exact"], ledger=args.ledger,
                          note=ledger_note(task.name, by_model))
    return row


# ---------------------------------------------------------------------------------------------
# Tables.

def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def _mean_sd(values: Sequence[float]) -> str:
    if not values:
        return "-"
    sd = statistics.stdev(values) if len(values) > 1 else None
    return f"{100 * statistics.fmean(values):.1f}" + ("" if sd is None else f" ± {100 * sd:.1f}")


def gap(row: dict[str, Any], kind: str) -> float:
    """Eval score minus the deployment's accuracy on test set ``kind``."""
    return float(row["eval"]["mean"] - row["test"][kind]["deployed"]["mean"])


def inside(row: dict[str, Any], kind: str) -> bool:
    """Whether the deployment's accuracy on ``kind`` lies in the eval score's 95% interval."""
    acc = row["test"][kind]["deployed"]["mean"]
    return bool(row["eval"]["low"] <= acc <= row["eval"]["high"])


def runs_table(rows: list[dict[str, Any]]) -> list[str]:
    """One line per run and test set (figures in percent)."""
    out = ["| task | seed | eval split | eval score, deployed [95%] n (step) | base eval | "
           "test set | test acc, deployed [95%] n | test acc, base | gap (points) | "
           "test acc inside eval interval | run s | load before |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if not row["ok"]:
            out.append(f"| {row['task']} | {row['seed']} | FAILED: {row.get('error')} |"
                       + " |" * 9)
            continue
        ev = row["eval"]
        for kind, by_model in row["test"].items():
            dep, base = by_model["deployed"], by_model["base"]
            out.append(
                f"| {row['task']} | {row['seed']} | {ev['eval_split']} | "
                f"{_pct(ev['mean'])} [{_pct(ev['low'])}, {_pct(ev['high'])}] n={ev['num']} "
                f"(step {ev['step']}) | {_pct(ev['base'])} | {kind} | "
                f"{_pct(dep['mean'])} [{_pct(dep['low'])}, {_pct(dep['high'])}] "
                f"n={dep['num']} | {_pct(base['mean'])} | {100 * gap(row, kind):+.1f} | "
                f"{'yes' if inside(row, kind) else 'no'} | {row['run_s']:.0f} | "
                f"{' '.join(f'{x:.2f}' for x in row['loadavg_before'])} |")
    return out


def task_table(rows: list[dict[str, Any]]) -> tuple[list[str], dict[str, bool]]:
    """Per task and test set: mean ± standard deviation over seeds; the goal per task (on its
    primary test set: every seed's |gap| <= 5 points and inside the interval)."""
    out = ["| task | test set | seeds | commit | eval score | test acc, deployed | "
           "test acc, base | gap (points) | max abs gap | inside interval |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    goals: dict[str, bool] = {}
    for name in dict.fromkeys(r["task"] for r in rows):
        done = [r for r in rows if r["task"] == name and r["ok"]]
        if not done:
            out.append(f"| {name} | - | 0 | - | - | - | - | - | - | - |")
            continue
        commits = sorted({r["commit"] for r in done})
        for kind in done[0]["test"]:
            gaps = [gap(r, kind) for r in done]
            ins = [inside(r, kind) for r in done]
            out.append(
                f"| {name} | {kind} | {','.join(str(r['seed']) for r in done)} | "
                f"{' / '.join(commits)} | {_mean_sd([r['eval']['mean'] for r in done])} | "
                f"{_mean_sd([r['test'][kind]['deployed']['mean'] for r in done])} | "
                f"{_mean_sd([r['test'][kind]['base']['mean'] for r in done])} | "
                f"{_mean_sd(gaps)} | "
                f"{100 * max(abs(g) for g in gaps):.1f} | {sum(ins)} of {len(ins)} |")
            if kind == PRIMARY[name]:
                goals[name] = all(abs(g) <= GOAL_GAP for g in gaps) and all(ins)
    return out, goals


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--tasks", default="triage,agent,extraction,clinc150,snips",
                        type=lambda v: [x for x in v.split(",") if x],
                        help=f"comma-separated, of {', '.join(TASKS)} (default: all)")
    parser.add_argument("--seeds", default="0,1,2",
                        type=lambda v: [int(x) for x in v.split(",") if x],
                        help="comma-separated seeds of the training data (default 0,1,2)")
    parser.add_argument("--records", type=int, default=None,
                        help="training records of a generated task (default: triage 500, agent "
                             f"600, extraction 500; --plumbing {PLUMBING_RECORDS})")
    parser.add_argument("--per-class", type=int, default=10,
                        help="clinc150, snips: training queries per intent from the official "
                             "train split (default 10; 0: all of it)")
    parser.add_argument("--test", type=int, default=None,
                        help="requests per test set (default 200, clinc150 300, snips 700: its "
                             "test split; at least the split's size: all of it; --plumbing "
                             f"{PLUMBING_TEST})")
    parser.add_argument("--home", type=Path, default=None,
                        help="a folder per task and seed is made under it (TASK-sSEED, each "
                             "must be new or empty); default: a temp folder")
    parser.add_argument("--plumbing", action="store_true",
                        help="a tiny plan (--overrides) to check the path: NOT a measurement")
    parser.add_argument("--overrides", type=json.loads, default=None,
                        help="plan overrides as JSON, with --plumbing or --split dev (a lever "
                             "measured on dev; default with --plumbing "
                             f"{json.dumps(PLUMBING_OVERRIDES)})")
    parser.add_argument("--data", type=json.loads, default=None,
                        help="experiment data settings as JSON merged into its data section, "
                             "with --plumbing or --split dev (a lever measured on dev, e.g. "
                             "'{\"balance\": \"language\"}')")
    parser.add_argument("--sets", default=None,
                        type=lambda v: [x for x in v.split(",") if x],
                        help="held-out sets to score besides each task's primary one (default: "
                             "all of them; e.g. --sets disjoint scores triage's disjoint set "
                             "only, not unseen)")
    parser.add_argument("--split", choices=splits.SPLITS, default=None,
                        help="held-out requests of the test split (the default; every score "
                             "appended to --ledger) or the dev split (for choosing planner "
                             "defaults; the default with --plumbing, never recorded)")
    parser.add_argument("--ledger", type=Path, default=splits.LEDGER,
                        help="where test-split scores are appended (default "
                             "bench/test_ledger.jsonl)")
    parser.add_argument("--concurrency", type=int, default=1, help="test requests in flight")
    args = parser.parse_args(argv)
    unknown = [t for t in args.tasks if t not in TASKS]
    if unknown:
        parser.error(f"--tasks: unknown {', '.join(unknown)} (known: {', '.join(TASKS)})")
    if args.sets is not None and set(args.sets) - set(TEST_SETS):
        parser.error(f"--sets: unknown {', '.join(sorted(set(args.sets) - set(TEST_SETS)))} "
                     f"(known: {', '.join(TEST_SETS)})")
    if args.split is None:
        args.split = "dev" if args.plumbing else "test"
    for flag, lever in (("--overrides", args.overrides), ("--data", args.data)):
        if lever is not None and not args.plumbing and args.split != "dev":
            parser.error(f"{flag}: only with --plumbing or --split dev (a test score is of "
                         "planner defaults)")
    if args.data is not None and (not isinstance(args.data, dict)
                                  or {"where", "seed"} & set(args.data)):
        parser.error("--data: a JSON object of data settings other than where and seed")
    if args.plumbing:
        args.overrides = PLUMBING_OVERRIDES if args.overrides is None else args.overrides
    elif args.overrides is None:
        args.overrides = {}
    if not isinstance(args.overrides, dict):
        parser.error("--overrides: a JSON object")
    if args.plumbing and args.split == "test":
        parser.error("--split test: not with --plumbing (a plumbing check is no test score)")
    # A SIGTERM (timeout, kill) unwinds like Ctrl-C, so the deployments are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    root = (args.home or Path(tempfile.mkdtemp(prefix="factory-bench-calibration-"))).absolute()
    mode = ("PLUMBING: tiny plan " + json.dumps(args.overrides) + ", NOT a measurement"
            if args.plumbing else
            "DEV: plan overrides " + json.dumps(args.overrides) + ", data "
            + json.dumps(args.data or {}) + " (a lever measured on the dev split; nothing "
            "recorded)" if args.overrides or args.data else
            "planner defaults: no overrides; nothing chosen on the test "
            "sets, each scored once per run for the deployment and the base model")
    header = {"bench": "calibration", "mode": mode, "split": args.split,
              "ledger": str(args.ledger) if args.split == "test" else None,
              "commit": commit(), "cpu": cpu(),
              "loadavg_before": loadavg(), "home": str(root), "tasks": args.tasks,
              "seeds": args.seeds, "records": args.records, "per_class": args.per_class,
              "test": args.test, "recipe": RECIPE}
    print(json.dumps(header), flush=True)

    rows = []
    started = time.monotonic()
    for name in args.tasks:
        for seed in args.seeds:
            t0 = time.monotonic()
            try:
                row = run_one(TASKS[name], seed, args, root / f"{name}-s{seed}")
            except Exception as exc:  # one failed run is a FAILED row; the other runs go on
                traceback.print_exc()
                row = {"task": name, "seed": seed, "ok": False,
                       "error": f"{type(exc).__name__}: {exc}"}
            row["wall_s"] = round(time.monotonic() - t0, 1)
            rows.append(row)
            print(json.dumps(row, default=str), flush=True)

    print()
    if args.plumbing:
        print(f"** {mode} **")
    print(f"Calibration ({mode}); {args.split} split; commit at start {header['commit']}; "
          f"CPU {header['cpu']['model']}"
          f" ({header['cpu']['cpus']} cores, flags {' '.join(header['cpu']['flags'])}; bf16 "
          f"{header['cpu']['bf16']}); load before {header['loadavg_before']}; total "
          f"{time.monotonic() - started:.0f} s.")
    print("Eval score: the factory's judge on its own eval split, the deployed (best) "
          "checkpoint; test: " + "; ".join(f"{k}: {v}" for k, v in TEST_SETS.items())
          + ". Figures in percent; gap = eval score - test accuracy (deployed).")
    print()
    print("\n".join(runs_table(rows)))
    print()
    lines, goals = task_table(rows)
    print("Per task, mean ± standard deviation over seeds:")
    print("\n".join(lines))
    for row in rows:
        for kind, by_model in (row.get("test") or {}).items():
            if row["task"] == "snips":
                print(f"snips seed {row['seed']} {kind}: {ledger_note('snips', by_model)}")
    for name in args.tasks:
        trees = {r["commit"] for r in rows if r["task"] == name and r["ok"]}
        if len(trees) > 1:
            print(f"{name}: its runs ran on {len(trees)} different trees "
                  f"({', '.join(sorted(trees))}): not figures of one commit")
    print()
    print(("(plumbing: goals not judged) " if args.plumbing else "")
          + "goal (|gap| <= 5 points and test accuracy inside the eval interval on every seed, "
          "primary test set): " + (", ".join(
              f"{k} ({PRIMARY[k]}) {'met' if v else 'NOT met'}" for k, v in goals.items())
              or "no finished runs"))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
