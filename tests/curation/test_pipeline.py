"""The embedded engine on a planted dataset: every problem caught, nothing else, deterministic."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pytest

from factory.curation import neardup
from factory.curation.config import CurationConfig, check_experiment_name
from factory.curation.pipeline import curate
from factory.curation.store import empty_assistant_turns, train_eval_overlap
from factory.curation.text import conversation_text
from factory.tasks.planted import Planted, chat, planted
from tests.curation.conftest import CONFIG

pytestmark = pytest.mark.filterwarnings("ignore:Delete operation did not match any records")


def expected_drops(p: Planted) -> set[tuple[str, str]]:
    return set(p.expected.items()) | {(max(a, b), "near_duplicate") for a, b in p.near_pairs}


def test_planted_problems_are_caught_and_nothing_else(planted_data: Planted, counter: Any) -> None:
    result = curate(planted_data.table(), CONFIG, counter)
    got = {(d["sample_id"], d["reason"]) for d in result.drops}
    assert got == expected_drops(planted_data)
    assert len(planted_data.overlaps) >= 2 and len(planted_data.near_pairs) >= 5
    # one drop per extra row of an exact duplicate
    assert sum(d["reason"] == "duplicate" for d in result.drops) == \
        sum(1 for r in planted_data.expected.values() if r == "duplicate")
    kept = result.train.num_rows + result.eval.num_rows
    assert kept + len(result.drops) == len(planted_data.rows)
    assert "| detectors | refusal |" in result.report
    assert result.profile["num_train"] == result.train.num_rows > 0
    assert result.profile["share_with_tool_calls"] > 0
    # clean samples lost, by reason: the planted copies and the too-long samples (duplicate
    # rows remove no sample; refusals, broken JSON and empty samples are not clean)
    assert result.clean_lost == {"near_duplicate": len(planted_data.near_pairs),
                                 "eval_ngram_overlap": len(planted_data.overlaps),
                                 "too_long": 2}
    assert result.clean_loss_by_reason()["too_long"] == round(2 / result.num_clean, 6)


def test_train_and_eval_share_no_sample_and_no_near_duplicate(planted_data: Planted,
                                                               counter: Any) -> None:
    result = curate(planted_data.table(), CONFIG, counter)
    overlap = train_eval_overlap(result.train, result.eval)
    assert overlap == {"sample_id": [], "split_group": []}
    # brute force over the selection: no pair at the threshold straddles the split
    texts = [conversation_text(orjson.loads(m)) for m in
             result.train.column("messages").to_pylist() + result.eval.column("messages")
             .to_pylist()]
    flat, offs = neardup.flat_words(texts)
    vals, voffs = neardup.ngram_hashes(flat, offs, CONFIG.shingle_words)
    sets = [vals[voffs[i]:voffs[i + 1]] for i in range(len(texts))]
    n_train = result.train.num_rows
    cross = [(i, j) for i, j in neardup.brute_force_pairs(sets, CONFIG.near_dup_threshold)
             if (i < n_train) != (j < n_train)]
    assert cross == []
    assert empty_assistant_turns(result.train, result.eval) == []


def test_same_input_same_datasets(planted_data: Planted, counter: Any) -> None:
    a = curate(planted_data.table(), CONFIG, counter)
    shuffled = planted_data.table().take(pa.array(
        np.random.default_rng(0).permutation(len(planted_data.rows))))
    b = curate(shuffled, CONFIG, counter)
    assert a.train.equals(b.train) and a.eval.equals(b.eval)
    assert a.drops == b.drops and a.profile == b.profile


def test_lsh_finds_what_brute_force_finds(planted_data: Planted) -> None:
    texts = [conversation_text(orjson.loads(r["messages"])) for r in planted_data.rows]
    flat, offs = neardup.flat_words(texts)
    vals, voffs = neardup.ngram_hashes(flat, offs, 3)
    sets = [vals[voffs[i]:voffs[i + 1]] for i in range(len(texts))]
    sig = neardup.minhash(vals, voffs, CONFIG.num_perm, 0)
    keys = neardup.band_keys(sig, CONFIG.num_bands, CONFIG.rows_per_band, np.diff(voffs) == 0)
    lsh = {(i, j) for i, j in neardup.candidate_pairs(keys.tolist())
           if neardup.jaccard(sets[i], sets[j]) >= 0.85}
    assert lsh == neardup.brute_force_pairs(sets, 0.85)
    assert len(lsh) >= len(planted_data.near_pairs)


def test_detectors_not_in_the_policy_only_flag(planted_data: Planted, counter: Any) -> None:
    config = replace(CONFIG, drop=("refusal",))
    result = curate(planted_data.table(), config, counter)
    reasons = {d["reason"] for d in result.drops}
    assert "refusal" in reasons
    assert not reasons & {"format", "tool_schema", "truncated", "agent_loop"}
    assert "Flagged but kept by policy" in result.report


class LengthJudge:
    """A deterministic local judge: longer final answers score higher."""

    def score(self, sample: dict[str, Any]) -> float:
        last = sample["messages"][-1]
        return float(sum(len(p.get("text", "")) for p in last.get("content", [])))


def test_judge_rejects_below_threshold(counter: Any) -> None:
    p = planted(60, config=CONFIG, seed=3, dup_share=0, near_share=0, overlap_share=0,
                refusal_share=0, broken_share=0, num_special=0)
    config = replace(CONFIG, judge_threshold=300.0)
    result = curate(p.table(), config, counter, judge=LengthJudge())
    judged = [d for d in result.drops if d["reason"] == "judge_below_threshold"]
    assert judged and len(judged) == len(result.drops)
    for t in (result.train, result.eval):
        for raw in t.column("messages").to_pylist():
            assert LengthJudge().score({"messages": orjson.loads(raw)}) >= 300.0
    with pytest.raises(ValueError, match="no judge"):
        curate(p.table(), config, counter)


def test_multilingual_refusals_and_truncation() -> None:
    from factory.curation import detectors

    for text in ["I'm sorry, but I cannot assist with that.", "Lo siento, pero no puedo.",
                 "Es tut mir leid, aber ich kann dabei nicht helfen.", "抱歉，我无法回答。",
                 "Mi dispiace, ma non posso farlo."]:
        assert detectors.refusal(chat("q", text)), text
    assert detectors.refusal(chat("q", "Sure! Here is why I can't stand rain: it is wet.")) \
        is None
    assert detectors.truncated(chat("q", "```python\nprint(1)\n"), None)
    assert detectors.truncated(chat("q", "All good."), {"finish_reason": "length"})
    assert detectors.truncated(chat("q", "All good."), None) is None


def test_checks_catch_bad_data() -> None:
    bad_msgs = orjson.dumps([{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                             {"role": "assistant", "content": []}]).decode()
    t = pa.table({"sample_id": ["a", "b"], "messages": [bad_msgs, bad_msgs.replace(
        '"content":[]}', '"content":[{"type":"text","text":"ok"}]}')],
        "split_group": ["a", "b"]})
    assert empty_assistant_turns(t) == ["a"]
    ev = pa.table({"sample_id": ["b"], "split_group": ["b"]})
    assert train_eval_overlap(t, ev) == {"sample_id": ["b"], "split_group": ["b"]}


def test_bad_experiment_names_are_refused() -> None:
    assert check_experiment_name("support-v1.2_x") == "support-v1.2_x"
    for bad in ["x' OR '1'='1", "a b", ""]:
        with pytest.raises(ValueError):
            check_experiment_name(bad)
    with pytest.raises(ValueError, match="unknown detector"):
        CurationConfig(drop=("refusals",))


@pytest.mark.slow
def test_worker_processes_give_the_same_result(planted_data: Planted, counter: Any,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from factory.curation import pipeline

    serial = curate(planted_data.table(), CONFIG, counter)
    monkeypatch.setattr(pipeline, "BATCH", 64)  # several batches over two spawned workers
    pools: list[Any] = []
    real_pool = pipeline.ProcessPoolExecutor

    def pool(*args: Any, **kwargs: Any) -> Any:
        pools.append(args)
        return real_pool(*args, **kwargs)

    monkeypatch.setattr(pipeline, "ProcessPoolExecutor", pool)
    parallel = curate(planted_data.table(), CONFIG, counter, num_workers=2)
    assert pools == [(2,)]  # the batches really went through the worker processes
    assert parallel.train.equals(serial.train) and parallel.eval.equals(serial.eval)
    assert parallel.drops == serial.drops and parallel.report == serial.report
