"""Decontamination by how much of an eval sample a train sample holds: templated traffic keeps
every clean sample, a paraphrase and a paste of an eval sample are dropped."""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
import pytest

from factory.curation import neardup
from factory.curation.config import CurationConfig
from factory.curation.decide import (
    BOILERPLATE_DF,
    TRAIN,
    RowFacts,
    SampleFacts,
    decide,
    ngram_weight,
    overlap_share,
    split_side,
)
from factory.curation.pipeline import curate, weighted_overlaps
from factory.curation.text import prompt_text
from factory.tasks.planted import templated
from tests.curation.conftest import CONFIG


def test_templated_traffic_keeps_every_clean_sample(counter: Any) -> None:
    data = templated(600, seed=0, config=CONFIG)
    tickets = [r for r in data.rows if r["sample_id"] not in data.expected]
    assert len(tickets) == 600 and len({r["sample_id"] for r in tickets}) == 600
    # The set is templated: a rule dropping a train sample for one 13-word phrase shared with
    # an eval sample would drop 100+ of these clean tickets.
    prompts = [prompt_text(orjson.loads(r["messages"])) for r in tickets]
    flat, offs = neardup.flat_words(prompts)
    vals, voffs = neardup.ngram_hashes(flat, offs, CONFIG.decontam_ngram)
    train = [split_side(r["sample_id"], CONFIG) == TRAIN for r in tickets]
    eval_grams = {g for i, t in enumerate(train) if not t
                  for g in vals[voffs[i]:voffs[i + 1]].tolist()}
    sharing = sum(1 for i, t in enumerate(train)
                  if t and eval_grams & set(vals[voffs[i]:voffs[i + 1]].tolist()))
    assert sharing >= 100

    result = curate(data.table(), CONFIG, counter)
    assert {(d["sample_id"], d["reason"]) for d in result.drops} == set(data.expected.items())
    assert sorted(data.expected.values()) == ["eval_conversation_overlap", "eval_ngram_overlap"]
    kept = set(result.train.column("sample_id").to_pylist()) | set(
        result.eval.column("sample_id").to_pylist())
    assert {r["sample_id"] for r in tickets} <= kept
    details = {d["reason"]: d["detail"] for d in result.drops}
    assert "prompt 13-grams" in details["eval_ngram_overlap"]
    assert "conversation 3-grams" in details["eval_conversation_overlap"]
    assert result.num_clean == 602
    assert result.clean_loss_by_reason() == {"eval_conversation_overlap": round(1 / 602, 6),
                                            "eval_ngram_overlap": round(1 / 602, 6)}
    assert "## Clean samples lost" in result.report
    assert "| eval_ngram_overlap | 1 | 0.17% |" in result.report


def test_thresholds_decide_and_only_the_final_eval_set_counts() -> None:
    def facts(sid: str) -> SampleFacts:
        return SampleFacts(sample_id=sid, empty_reason=None, num_tokens=10, flags={},
                           prefix_key=sid, prompt_key=sid, trace_ids=())

    config = CurationConfig(eval_fraction=0.5)
    ids = [f"{c}{i}" for c in "ab" for i in range(40)]
    side = {s: split_side(s, config) for s in ids}
    tr = [s for s in ids if side[s] == TRAIN]
    ev = [s for s in ids if side[s] != TRAIN]
    overlaps = {
        tr[0]: [("eval_ngram_overlap", ev[0], 0.899999)],           # under 0.9: kept
        tr[1]: [("eval_ngram_overlap", ev[0], 0.9)],                # at 0.9: dropped
        tr[2]: [("eval_conversation_overlap", ev[0], 0.599999)],    # under 0.6: kept
        tr[3]: [("eval_conversation_overlap", ev[1], 0.6),
                ("eval_ngram_overlap", ev[1], 0.95)],                # the prompt view names it
        tr[4]: [("eval_prompt_match", ev[2], 1.0),
                ("eval_conversation_overlap", ev[2], 0.99)],         # the same prompt first
    }
    d = decide(facts=[facts(s) for s in ids],
               rows=[RowFacts(row_key=f"{s}:0", sample_id=s, rank=0, raw_trace_id=None)
                     for s in ids], near_edges=[], overlaps=overlaps, config=config)
    assert {x["sample_id"]: x["reason"] for x in d.drops} == {
        tr[1]: "eval_ngram_overlap", tr[3]: "eval_ngram_overlap", tr[4]: "eval_prompt_match"}
    assert d.num_clean == len(ids)
    assert d.clean_lost == {"eval_ngram_overlap": 2, "eval_prompt_match": 1}


def _reference_shares(sets: list[set[int]], is_eval: np.ndarray) -> dict[tuple[int, int],
                                                                              float]:
    """The definition, pair by pair: the eval sample's weighted n-grams the train one has."""
    df: dict[int, int] = {}
    for s in sets:
        for g in s:
            df[g] = df.get(g, 0) + 1
    out = {}
    for t in np.flatnonzero(~is_eval).tolist():
        for e in np.flatnonzero(is_eval).tolist():
            shared = sum(ngram_weight(df[g]) for g in sets[t] & sets[e])
            if shared > 0:
                total = sum(ngram_weight(df[g]) for g in sets[e])
                out[(t, e)] = overlap_share(shared, total)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_weighted_overlaps_match_the_definition(seed: int) -> None:
    rng = np.random.default_rng(seed)
    num = 120
    template = set(range(10_000, 10_040))  # in every sample: past BOILERPLATE_DF, weight 0
    sets = [template | set(rng.integers(0, 400, size=rng.integers(0, 30)).tolist())
            for _ in range(num)]
    sets[7] = set()
    is_eval = rng.random(num) < 0.2
    lens = np.array([0] + [len(s) for s in sets])
    values = np.concatenate([np.array(sorted(s), dtype=np.int64) for s in sets])
    train, ev, shared, total = weighted_overlaps(values, np.cumsum(lens), is_eval)
    got = {(t, e): overlap_share(s, w) for t, e, s, w in
           zip(train.tolist(), ev.tolist(), shared.tolist(), total.tolist(), strict=True)}
    assert got == _reference_shares(sets, is_eval)
    assert num > BOILERPLATE_DF and len(got) > 50


def test_thresholds_are_checked() -> None:
    with pytest.raises(ValueError, match="decontam_threshold"):
        CurationConfig(decontam_threshold=0)
    with pytest.raises(ValueError, match="decontam_paraphrase_threshold"):
        CurationConfig(decontam_paraphrase_threshold=1.5)
