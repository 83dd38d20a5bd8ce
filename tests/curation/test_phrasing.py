"""The phrasing split: skeletons, links, the cluster choice, its fallback, and what it measures."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from factory.curation import phrasing
from factory.curation.config import CurationConfig
from factory.curation.decide import EVAL, TRAIN, split_side
from factory.curation.pipeline import curate
from factory.curation.tokens import RenderCounter
from factory.language import words
from factory.tables import TABLES
from factory.tasks import ticket_triage
from tests.curation.test_synthesis import _rows


def test_skeleton_masks_what_varies_between_fills() -> None:
    a = phrasing.skeleton("Hi, my order BD-48213 for $129.00 never came, write to maria7@gmail.com")
    b = phrasing.skeleton("Hi, my order BD-11111 for €9.50 never came, write to tom@proton.me")
    assert a == b == "hi my order qqnum for qqnum never came write to qqemail"
    # names inside a sentence, quoted values; the sentence's first word and "I" stay
    assert phrasing.skeleton("I keep seeing 'Something went wrong' on Safari since Monday") == \
        "i keep seeing qqquote on qqname since qqname"
    # an apostrophe inside a word is no quote mark: the text between two of them stays
    assert phrasing.skeleton("Merci d'annuler la commande 12, j'ai changé d'avis.") == \
        "merci d annuler la commande qqnum j ai changé d avis"
    assert phrasing.skeleton("It's broken, I'd like a 'refund' today") == \
        "it s broken i d like a qqquote today"


@pytest.mark.parametrize(("messages", "label"), [
    ([{"role": "assistant", "content": [{"type": "text", "text": "Billing"}]}], "billing"),
    ([{"role": "assistant", "content": [{"type": "text", "text": '{"intent": "Refund", "x": 1}'}]}],
     "intent:refund"),
    ([{"role": "assistant", "content": [],
       "tool_calls": [{"name": "b", "arguments": "{}"}, {"name": "a", "arguments": "{}"}]}],
     "tools:a,b"),
    ([{"role": "assistant", "content": [{"type": "text", "text": "a long free answer of many words"}]}],
     None),
    ([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], None),
])
def test_answer_label(messages: list[dict[str, Any]], label: str | None) -> None:
    assert phrasing.answer_label(messages) == label


def _links(texts: list[str], threshold: float = 0.3) -> set[tuple[int, int]]:
    v, o = phrasing.skeleton_ngrams([phrasing.skeleton(t) for t in texts])
    return set(phrasing.linked_pairs(v.view(np.int64), o, threshold))


def test_a_phrasing_inside_a_longer_ticket_links_and_a_shared_greeting_does_not() -> None:
    core = "The invoice for order 123 shows the wrong amount on the total line"
    texts = [core, f"Hello team, {core.lower()}. Regards, Ann",
             "Hello team, the desk makes a grinding noise when it goes up. Regards, Ann",
             "Hello team, please add a dark mode to the planner screen. Regards, Ann"]
    links = _links(texts)
    assert (0, 1) in links
    assert not links & {(1, 2), (1, 3), (2, 3), (0, 2), (0, 3)}


def _assign(texts: list[str], labels: list[str | None], *, seed: int = CurationConfig().seed,
            **kw: Any) -> phrasing.EvalSplit:
    ids = [f"{i:04d}" for i in range(len(texts))]
    config = CurationConfig(seed=seed)
    v, o = phrasing.skeleton_ngrams([phrasing.skeleton(t) for t in texts])
    links = [(ids[i], ids[j]) for i, j in phrasing.linked_pairs(v.view(np.int64), o, 0.3)]
    return phrasing.assign(
        {s: s for s in ids}, {s: split_side(s, config) for s in ids},
        keys={s: phrasing.phrasing_key(phrasing.skeleton(t)) for s, t in zip(ids, texts,
                                                                              strict=True)},
        links=links, labels=dict(zip(ids, labels, strict=True)),
        eval_fraction=config.eval_fraction, seed=config.seed, **kw)


def test_one_phrasing_falls_back_to_recall_only_and_says_why() -> None:
    texts = [f"Where is my order {1000 + i}? It was due on day {i % 28 + 1}." for i in range(60)]
    split = _assign(texts, ["shipping"] * 60)
    assert split.kind == phrasing.RECALL and split.num_clusters == 1
    assert "1 phrasing clusters of 60 samples, fewer than the 20" in split.reason
    assert "recall" in split.reason
    config = CurationConfig()
    assert split.side == {f"{i:04d}": split_side(f"{i:04d}", config) for i in range(60)}


def test_triage_clusters_hold_out_whole_phrasings_with_every_label() -> None:
    convs = ticket_triage.generate_conversations(500, 0)
    texts = [c["messages"][1]["content"] for c in convs]
    split = _assign(texts, [c["label"] for c in convs])
    assert split.kind == phrasing.PHRASING
    ids = [f"{i:04d}" for i in range(len(texts))]
    ev = [split.side[s] == EVAL for s in ids]
    assert 45 <= sum(ev) <= 53  # 10% of 500, 5% over allowed
    assert {c["label"] for c, e in zip(convs, ev, strict=True) if e} == set(ticket_triage.LABELS)
    # no cluster on both sides
    sides: dict[str, set[str]] = {}
    for s in ids:
        sides.setdefault(split.group[s], set()).add(split.side[s])
    assert all(len(v) == 1 for v in sides.values())
    # the frames of the eval set mostly never train: 13-28% of them do in bench/phrasing_split.py
    # (13% here), against every one with the trace/prefix split
    train_frames = {c["template"] for c, e in zip(convs, ev, strict=True) if not e}
    leak = sum(1 for c, e in zip(convs, ev, strict=True) if e and c["template"] in train_frames)
    assert leak / sum(ev) <= 0.3


def _features(text: str) -> set[str]:
    w = words(text)
    return set(w) | {" ".join(w[i:i + 2]) for i in range(len(w) - 1)}


def _memorizer(train: list[tuple[str, str]], test: list[tuple[str, str]]) -> float:
    """Accuracy on ``test`` of a 1-nearest-neighbour classifier over ``train`` (word and
    bigram Jaccard): it recalls every phrasing it has seen and generalizes little."""
    rows = [(_features(t), lbl) for t, lbl in train]

    def nearest(text: str) -> str:
        f = _features(text)
        return max(rows, key=lambda r: len(f & r[0]) / (len(f | r[0]) or 1))[1]

    return sum(nearest(t) == lbl for t, lbl in test) / len(test)


def test_the_phrasing_split_scores_a_memorizer_as_new_requests_do() -> None:
    """Issue 43's check of the split on a templated dataset: triage traffic (500 tickets of 77
    core frames in shared detail, aside, greeting and sign-off sentences), scored by a
    memorizer. The trace/prefix split's eval set scores it 1.0: every eval ticket's frame also
    trains. New requests (``generate_heldout(held=("core",))``: core frames the traffic never
    used, in the traffic's own sentences) score it 0.78; the phrasing split's eval set
    must score within 5 points of that, as a mean over traffic seeds 0-4 and split seeds 0-2
    (0.79; one split holds out ~8 frames: 0.69-0.88 each; links at 0.9 instead of 0.3 give
    0.97). The disjoint set also changes the detail
    and aside sentences, which every traffic frame shares: no hold-out of the traffic reaches
    it (0.55)."""
    recall, by_phrasing, new_requests, disjoint = [], [], [], []
    for seed in range(5):
        convs = ticket_triage.generate_conversations(500, seed)
        texts = [c["messages"][1]["content"] for c in convs]
        labels = [c["label"] for c in convs]
        data = list(zip(texts, labels, strict=True))
        ids = [f"{i:04d}" for i in range(len(texts))]
        for split_seed in range(3):
            config = CurationConfig(seed=split_seed)
            split = _assign(texts, list(labels), seed=split_seed)
            assert split.kind == phrasing.PHRASING
            for sides, out in ((split.side, by_phrasing),
                               ({s: split_side(s, config) for s in ids}, recall)):
                out.append(_memorizer([d for s, d in zip(ids, data, strict=True)
                                       if sides[s] == TRAIN],
                                      [d for s, d in zip(ids, data, strict=True)
                                       if sides[s] == EVAL]))
        for held, out in ((("core",), new_requests), (("core", "detail", "aside"), disjoint)):
            test = ticket_triage.generate_heldout(200, 100 + seed, held=held)
            out.append(_memorizer(data, [(h["messages"][1]["content"], h["label"])
                                         for h in test]))
    mean = statistics.mean
    assert mean(recall) == 1.0 and mean(new_requests) < 0.9
    assert abs(mean(by_phrasing) - mean(new_requests)) <= 0.05, (by_phrasing, new_requests)
    assert mean(disjoint) < mean(new_requests) - 0.1


def test_the_pipeline_records_how_the_eval_set_was_held_out(smollm2_dir: Path) -> None:
    counter = RenderCounter(smollm2_dir)
    traffic = pa.Table.from_pylist(_rows(300, keep_thin=60), schema=TABLES["samples"])
    result = curate(traffic, CurationConfig(max_tokens=1024), counter)
    assert result.profile["eval_split"] == phrasing.PHRASING
    assert result.profile["num_phrasing_clusters"] > 20
    assert result.profile["eval_split_reason"].startswith("held out by phrasing:")
    groups = {g for g in result.eval.column("split_group").to_pylist()}
    assert not groups & set(result.train.column("split_group").to_pylist())
    off = curate(traffic, CurationConfig(max_tokens=1024, phrasing_threshold=None), counter)
    assert off.profile["eval_split"] == phrasing.RECALL
    assert "phrasing split is off" in off.profile["eval_split_reason"]


def test_each_eval_row_carries_its_phrasing_cluster(smollm2_dir: Path) -> None:
    """``split_group`` of a dataset row is the phrasing cluster held out whole: rows of one
    skeleton share it, on one side, and eval clusters hold several samples, which the evals'
    intervals treat as correlated (``selection.summarize``'s ``clusters``)."""
    from factory.curation.text import parse_json
    from factory.evals.selection import summarize

    counter = RenderCounter(smollm2_dir)
    traffic = pa.Table.from_pylist(_rows(300, keep_thin=60), schema=TABLES["samples"])
    result = curate(traffic, CurationConfig(max_tokens=1024), counter)
    assert result.profile["eval_split"] == phrasing.PHRASING
    group_of_key: dict[str, set[str]] = {}
    side_of_group: dict[str, set[str]] = {}
    for table in (result.train, result.eval):
        for row in table.select(["messages", "split_group", "split"]).to_pylist():
            key = phrasing.phrasing_key(phrasing.skeleton(
                phrasing.user_text(parse_json(row["messages"]))))
            group_of_key.setdefault(key, set()).add(row["split_group"])
            side_of_group.setdefault(row["split_group"], set()).add(row["split"])
    assert all(len(g) == 1 for k, g in group_of_key.items() if k)
    assert all(len(s) == 1 for s in side_of_group.values())
    clusters = result.eval.column("split_group").to_pylist()
    held = int(result.profile["eval_split_reason"].split("phrasing: ")[1].split(" of ")[0])
    assert 2 <= len(set(clusters)) <= held and len(set(clusters)) < len(clusters)
    score = summarize(1, [1.0] * len(clusters), clusters=clusters)
    assert score.num_clusters == len(set(clusters)) and score.num_samples == len(clusters)
