"""Public, human-written intent datasets for the benches: SNIPS and CLINC150, loaded and served.

Both are committed under ``bench/data/`` with their licenses and a README naming the source
commit (``bench/data/snips/README.md``, ``bench/data/clinc150/README.md``); nothing here reads
the network. Splits are the published ones:

- **SNIPS** (Coucke et al. 2018; the split of Goo et al. 2018, also JointBERT's): 13,084 train,
  700 dev, 700 test queries, each with one of 7 intents and BIO slot tags over 39 slot names. An
  extraction task: the answer is the intent and the slots as one JSON object.
- **CLINC150** (Larson et al. 2019, ``data_full.json``): 150 intents, 100/20/30 in-scope queries
  per intent in train/dev/test (15,000/3,000/4,500), plus out-of-scope queries (100/100/1,000).
  ``load`` returns the in-scope queries only; ``include_oos=True`` appends the out-of-scope ones
  with the label ``"oos"``. ``labels`` never lists ``"oos"``, but the system prompt always offers
  it (an app routing real requests must have a way out), so in-scope and out-of-scope records
  share one prompt and an in-scope query answered ``oos`` is simply wrong.

An example is ``{"text": str, "label": str}`` plus, for SNIPS, ``"slots": {slot_name: value}``.
SNIPS text is the source tokens joined by one space (the files carry trailing spaces). Its slots
are decoded from the BIO tags: a span is a ``B-x`` and the ``I-x`` after it; when one slot has
several spans in a query (61 train queries, none in dev or test; often two adjacent ``B-``
tags that are one phrase, ``the 7 day`` tagged ``B-timeRange B-timeRange``) their texts are
joined by one space in query order, so a value is always one string.

The SNIPS answer is compact JSON with sorted keys (``json.dumps(..., sort_keys=True,
separators=(",", ":"), ensure_ascii=False)``), so ``intent`` comes before ``slots`` and slot
names are in code-point order: ``{"intent":"PlayMusic","slots":{"artist":"westbam"}}``. The
CLINC150 answer is the label alone.

``records`` turns examples into logged frontier calls (the OpenAI chat-completion
``{"request", "response"}`` shape of ``factory.tasks.ticket_triage.generate_records``) for
``factory ingest FILE --tag project=...``; ``score`` is the exact-match scorer and ``slot_f1``
the SNIPS slot metric.

    .venv/bin/python bench/public_data.py                      # sizes and label counts
    .venv/bin/python bench/public_data.py --dataset snips --split train --per-class 50 \\
        --seed 0 --out /tmp/snips-50.jsonl
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import random
import sys
from collections.abc import Iterable, Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any, Literal

from factory.tasks.sampling import completion

DATA = Path(__file__).resolve().parent / "data"
"""The committed datasets, one folder each."""

NAMES = ("snips", "clinc150")
SPLITS = ("train", "dev", "test")

OOS = "oos"
"""CLINC150's label for an out-of-scope query (never in ``labels("clinc150")``)."""

REFERENCE_MODEL = "gpt-4o-2024-08-06"
"""The model name the records claim answered (the gold answers' author)."""

Example = dict[str, Any]
"""``{"text": str, "label": str}``, plus ``"slots": dict[str, str]`` for SNIPS."""

_CLINC_SPLIT = {"train": "train", "dev": "val", "test": "test"}


def _check(name: str, split: str | None = None) -> None:
    if name not in NAMES:
        raise ValueError(f"name: must be one of {', '.join(NAMES)}, got {name!r}")
    if split is not None and split not in SPLITS:
        raise ValueError(f"split: must be one of {', '.join(SPLITS)}, got {split!r}")


def decode_bio(tokens: Sequence[str], tags: Sequence[str]) -> dict[str, str]:
    """Slot values from BIO ``tags`` over ``tokens``: each span's tokens joined by one space,
    several spans of one slot joined by one space in order. An ``I-x`` that does not continue
    an ``x`` span starts one (the committed data has none)."""
    if len(tokens) != len(tags):
        raise ValueError(f"tags: {len(tags)} for {len(tokens)} tokens")
    spans: list[tuple[str, list[str]]] = []
    current: str | None = None
    for token, tag in zip(tokens, tags, strict=True):
        if tag == "O":
            current = None
        elif tag.startswith("I-") and current == tag[2:]:
            spans[-1][1].append(token)
        elif tag.startswith(("B-", "I-")):
            current = tag[2:]
            spans.append((current, [token]))
        else:
            raise ValueError(f"tags: {tag!r} is neither O, B-x nor I-x")
    slots: dict[str, str] = {}
    for slot, words in spans:
        text = " ".join(words)
        slots[slot] = f"{slots[slot]} {text}" if slot in slots else text
    return slots


@cache
def _snips(split: str) -> tuple[tuple[str, str, tuple[tuple[str, str], ...]], ...]:
    folder = DATA / "snips" / split
    lines = [(folder / f).read_text(encoding="utf-8").split("\n")
             for f in ("seq.in", "seq.out", "label")]
    # Each file ends with a newline: the last piece is empty.
    texts, tags, labels = (part[:-1] if part and part[-1] == "" else part for part in lines)
    if not len(texts) == len(tags) == len(labels):
        raise ValueError(f"{folder}: {len(texts)} queries, {len(tags)} tag lines, "
                         f"{len(labels)} labels")
    out = []
    for text, tag_line, label in zip(texts, tags, labels, strict=True):
        tokens = text.split()
        slots = decode_bio(tokens, tag_line.split())
        out.append((" ".join(tokens), label.strip(), tuple(slots.items())))
    return tuple(out)


@cache
def _clinc() -> dict[str, tuple[tuple[str, str], ...]]:
    with gzip.open(DATA / "clinc150" / "data_full.json.gz", "rt", encoding="utf-8") as f:
        raw = json.load(f)
    return {key: tuple((str(text), str(label)) for text, label in rows)
            for key, rows in raw.items()}


def load(name: str, split: str, *, include_oos: bool = False) -> list[Example]:
    """The examples of ``split`` (``train``, ``dev`` or ``test``) of dataset ``name`` in file
    order, fresh dicts on every call. CLINC150: in-scope only unless ``include_oos``, which
    appends the split's out-of-scope queries labelled ``"oos"`` (SNIPS has none: ValueError)."""
    _check(name, split)
    if name == "snips":
        if include_oos:
            raise ValueError("include_oos: SNIPS has no out-of-scope queries")
        return [{"text": text, "label": label, "slots": dict(slots)}
                for text, label, slots in _snips(split)]
    data = _clinc()
    rows = list(data[_CLINC_SPLIT[split]])
    if include_oos:
        rows += data[f"oos_{_CLINC_SPLIT[split]}"]
    return [{"text": text, "label": label} for text, label in rows]


def labels(name: str) -> list[str]:
    """The sorted label set: SNIPS's 7 intents, CLINC150's 150 in-scope intents (no ``oos``)."""
    _check(name)
    if name == "snips":
        return sorted({label for _, label, _ in _snips("train")})
    return sorted({label for _, label in _clinc()["train"]})


def slot_names() -> list[str]:
    """SNIPS's 39 slot names, sorted (every dev and test slot occurs in train)."""
    return sorted({slot for _, _, slots in _snips("train") for slot, _ in slots})


def sample_per_class(examples: Sequence[Example], k: int | Literal["full"] | None,
                     seed: int = 0) -> list[Example]:
    """``k`` examples of each label (all of a label that has fewer), in the order of
    ``examples``; ``None`` or ``"full"``: all of them. Each label's examples are shuffled by a
    ``random.Random`` seeded with ``f"{seed}:{label}"`` and the first ``k`` kept, so a sample is
    a pure function of ``(examples, k, seed)`` and the sample for ``k`` holds the one for any
    smaller ``k``."""
    if k is None or k == "full":
        return list(examples)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k: must be an integer >= 1, 'full' or None, got {k!r}")
    by_label: dict[str, list[int]] = {}
    for i, example in enumerate(examples):
        by_label.setdefault(example["label"], []).append(i)
    keep: list[int] = []
    for label, indices in by_label.items():
        shuffled = list(indices)
        random.Random(f"{seed}:{label}").shuffle(shuffled)
        keep += shuffled[:k]
    return [examples[i] for i in sorted(keep)]


def system_prompt(name: str) -> str:
    """The system prompt a team's app would send with each query."""
    _check(name)
    if name == "clinc150":
        return ("Classify the user's request to a virtual assistant (banking, travel, home, work, "
                "small talk and more) into exactly one of these intents: "
                + ", ".join(labels(name)) + f". If the request fits none of them, answer {OOS}. "
                "Answer with the intent label only.")
    example = json.dumps({"intent": "GetWeather", "slots": {"city": "paris",
                                                             "timeRange": "tomorrow"}},
                         separators=(",", ":"))
    return ("Parse the user's request to a voice assistant. Reply with one line of compact JSON "
            'with exactly the keys "intent" and "slots", keys sorted, no spaces outside values, '
            f"for example {example}. intent is one of: " + ", ".join(labels(name)) + ". slots "
            "maps each slot the request fills to its words as they appear in the request, in "
            "lower case ({} when it fills none); a slot mentioned twice gets both parts joined "
            "by one space. Slot names: " + ", ".join(slot_names()) + ".")


def gold_answer(name: str, example: Mapping[str, Any]) -> str:
    """The exact assistant answer for ``example``: its label, or SNIPS's compact JSON."""
    _check(name)
    if name == "clinc150":
        return str(example["label"])
    return json.dumps({"intent": example["label"], "slots": dict(example["slots"])},
                      sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def records(name: str, examples: Iterable[Mapping[str, Any]], seed: int = 0
            ) -> list[dict[str, Any]]:
    """One logged frontier call per example as an OpenAI ``{"request": chat.completions body,
    "response": completion}`` record, the gold answer as the frontier's answer; write them as
    JSONL and ``factory ingest FILE --tag project=...``. ``seed`` goes into the ids only."""
    system = system_prompt(name)
    out = []
    for i, example in enumerate(examples):
        prompt = [{"role": "system", "content": system},
                  {"role": "user", "content": example["text"]}]
        request: dict[str, Any] = {"model": REFERENCE_MODEL, "messages": prompt,
                                   "temperature": 0}
        if name == "clinc150":
            request["max_tokens"] = 16  # the longest label, "what_can_i_ask_you", is ~8 tokens
        content = gold_answer(name, example)
        digest = hashlib.sha256(f"{name}:{seed}:{i}:{example['text']}".encode()).hexdigest()[:24]
        # Token counts at ~4 characters a token: plausible usage, not a tokenizer's.
        response = completion(content, model=REFERENCE_MODEL, index=i, digest=digest,
                              prompt_tokens=sum(len(m["content"]) for m in prompt) // 4 + 8,
                              completion_tokens=len(content) // 4 + 1)
        out.append({"request": request, "response": response})
    return out


def _norm(value: str) -> str:
    return " ".join(value.split()).lower()


def parse_snips(answer: str | None) -> tuple[str, dict[str, str]] | None:
    """``(intent, slots)`` from a SNIPS answer, slot values with runs of whitespace made one
    space and lower-cased; None unless it is a JSON object with exactly the keys ``intent`` (a
    string) and ``slots`` (an object of strings)."""
    if not isinstance(answer, str):
        return None
    try:
        got = json.loads(answer.strip())
    except json.JSONDecodeError:
        return None
    if not isinstance(got, dict) or set(got) != {"intent", "slots"}:
        return None
    intent, slots = got["intent"], got["slots"]
    if not isinstance(intent, str) or not isinstance(slots, dict):
        return None
    if not all(isinstance(v, str) for v in slots.values()):
        return None
    return intent.strip(), {str(k): _norm(v) for k, v in slots.items()}


def score(name: str, example: Mapping[str, Any], answer: str | None) -> bool:
    """Exact match. CLINC150: the answer, stripped and lower-cased, is the label. SNIPS: the
    answer parses (``parse_snips``), its intent is the label and its slots equal the gold slots
    (values compared with whitespace collapsed and lower-cased)."""
    _check(name)
    if name == "clinc150":
        return isinstance(answer, str) and answer.strip().lower() == example["label"]
    parsed = parse_snips(answer)
    if parsed is None:
        return False
    intent, slots = parsed
    return intent == example["label"] and slots == {k: _norm(v)
                                                    for k, v in example["slots"].items()}


def slot_f1(pairs: Iterable[tuple[Mapping[str, Any], str | None]]) -> float:
    """SNIPS slot F1 over ``(example, answer)`` pairs: micro-averaged over ``(slot, value)``
    pairs (values normalized as in ``score``; an answer that does not parse predicts no slot).
    It matches by value, not token position, so it can differ from conlleval's span F1 only
    where one value occurs twice in a query; 1.0 when nothing is gold or predicted."""
    tp = fp = fn = 0
    for example, answer in pairs:
        gold = {(k, _norm(v)) for k, v in example["slots"].items()}
        parsed = parse_snips(answer)
        predicted = set(parsed[1].items()) if parsed else set()
        tp += len(gold & predicted)
        fp += len(predicted - gold)
        fn += len(gold - predicted)
    return 1.0 if tp + fp + fn == 0 else 2 * tp / (2 * tp + fp + fn)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--dataset", choices=NAMES, help="write records of this dataset")
    p.add_argument("--split", choices=SPLITS, default="train")
    p.add_argument("--per-class", default="full", help="examples per label, or 'full'")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--include-oos", action="store_true", help="CLINC150: add out-of-scope")
    p.add_argument("--out", type=Path, help="the JSONL file the records go to")
    args = p.parse_args(argv)
    if args.dataset is None:
        for name in NAMES:
            sizes = ", ".join(f"{s} {len(load(name, s))}" for s in SPLITS)
            extra = (f"; slot names {len(slot_names())}" if name == "snips" else
                     "; oos " + ", ".join(f"{s} {len(_clinc()['oos_' + _CLINC_SPLIT[s]])}"
                                          for s in SPLITS))
            print(f"{name}: {sizes}; labels {len(labels(name))}{extra}")
        return 0
    if args.out is None:
        p.error("--out is required with --dataset")
    k = None if args.per_class == "full" else int(args.per_class)
    examples = sample_per_class(load(args.dataset, args.split, include_oos=args.include_oos),
                                k, args.seed)
    with args.out.open("w", encoding="utf-8") as f:
        for record in records(args.dataset, examples, args.seed):
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    print(f"{len(examples)} records -> {args.out}; ingest with: factory ingest {args.out} "
          f"--tag project={args.dataset}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
