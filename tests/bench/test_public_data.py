"""The committed public datasets (``bench/public_data.py``): the published split sizes and label
sets, BIO decoding, deterministic balanced sampling, records in the OpenAI shape that ingest
reads, gold answers that score, wrong ones that do not."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from bench import public_data as pd
from factory.ingest import ingest_paths
from factory.lake import Lake
from factory.normalize.detect import detect_format

SIZES = {("snips", False): (13_084, 700, 700),
         ("clinc150", False): (15_000, 3_000, 4_500),
         ("clinc150", True): (15_100, 3_100, 5_500)}
"""Goo et al. 2018 / JointBERT's SNIPS split; CLINC150's in-scope 100/20/30 per intent and
out-of-scope 100/100/1,000 (Larson et al. 2019)."""


@pytest.mark.parametrize(("name", "oos"), list(SIZES))
def test_split_sizes_are_the_published_ones(name: str, oos: bool) -> None:
    splits = [pd.load(name, s, include_oos=oos) for s in pd.SPLITS]
    assert tuple(len(s) for s in splits) == SIZES[name, oos]
    for examples in splits:
        assert all(isinstance(e["text"], str) and e["text"] == e["text"].strip() and e["text"]
                   for e in examples)
        assert set(Counter(e["label"] for e in examples)) <= {*pd.labels(name), pd.OOS}


def test_label_sets() -> None:
    assert pd.labels("snips") == ["AddToPlaylist", "BookRestaurant", "GetWeather", "PlayMusic",
                                  "RateBook", "SearchCreativeWork", "SearchScreeningEvent"]
    clinc = pd.labels("clinc150")
    assert len(clinc) == 150 and clinc == sorted(clinc) and pd.OOS not in clinc
    for split, per_label in (("train", 100), ("dev", 20), ("test", 30)):
        counts = Counter(e["label"] for e in pd.load("clinc150", split))
        assert set(counts) == set(clinc) and set(counts.values()) == {per_label}
        oos = [e for e in pd.load("clinc150", split, include_oos=True) if e["label"] == pd.OOS]
        assert len(oos) == {"train": 100, "dev": 100, "test": 1000}[split]
    names = pd.slot_names()
    assert len(names) == 39 and names == sorted(names)
    for split in pd.SPLITS:
        examples = pd.load("snips", split)
        assert {e["label"] for e in examples} == set(pd.labels("snips"))
        assert {s for e in examples for s in e["slots"]} <= set(names)


def test_snips_slots_are_decoded_from_bio() -> None:
    first = pd.load("snips", "train")[0]
    assert first == {"text": "listen to westbam alumb allergic on google music",
                     "label": "PlayMusic",
                     "slots": {"artist": "westbam", "album": "allergic",
                               "service": "google music"}}
    tokens = ["what", "is", "the", "7", "day", "for", "cheat", "canyon"]
    tags = ["O", "O", "O", "B-timeRange", "B-timeRange", "O", "B-poi", "I-poi"]
    assert pd.decode_bio(tokens, tags) == {"timeRange": "7 day", "poi": "cheat canyon"}
    assert pd.decode_bio(["a", "b", "c"], ["B-x", "O", "B-x"]) == {"x": "a c"}
    assert pd.decode_bio(["a", "b"], ["B-x", "I-y"]) == {"x": "a", "y": "b"}
    with pytest.raises(ValueError, match="tags"):
        pd.decode_bio(["a"], ["B-x", "O"])
    with pytest.raises(ValueError, match="neither"):
        pd.decode_bio(["a"], ["U-x"])


def test_load_returns_fresh_examples_and_rejects_bad_arguments() -> None:
    first = pd.load("snips", "dev")
    first[0]["slots"]["year"] = "changed"
    first[0]["label"] = "changed"
    again = pd.load("snips", "dev")
    assert "year" not in again[0]["slots"] and again[0]["label"] != "changed"
    with pytest.raises(ValueError, match="name"):
        pd.load("atis", "train")
    with pytest.raises(ValueError, match="split"):
        pd.load("snips", "valid")
    with pytest.raises(ValueError, match="include_oos"):
        pd.load("snips", "train", include_oos=True)


@pytest.mark.parametrize("name", pd.NAMES)
def test_sample_per_class_is_balanced_deterministic_and_nested(name: str) -> None:
    examples = pd.load(name, "train")
    sample = pd.sample_per_class(examples, 5, seed=3)
    assert Counter(e["label"] for e in sample) == {label: 5 for label in pd.labels(name)}
    assert sample == pd.sample_per_class(examples, 5, seed=3)
    assert sample != pd.sample_per_class(examples, 5, seed=4)
    order = {id(e): i for i, e in enumerate(examples)}
    assert [order[id(e)] for e in sample] == sorted(order[id(e)] for e in sample)
    bigger = {id(e) for e in pd.sample_per_class(examples, 8, seed=3)}
    assert {id(e) for e in sample} <= bigger
    assert pd.sample_per_class(examples, None, 0) == examples
    assert pd.sample_per_class(examples, "full", 0) == examples


def test_sample_per_class_keeps_all_of_a_thin_label_and_rejects_bad_k() -> None:
    test = pd.load("snips", "test")
    thinnest = min(Counter(e["label"] for e in test).values())
    assert thinnest == 80  # RateBook: SNIPS's test split is not balanced
    assert len(pd.sample_per_class(test, 100, seed=0)) == sum(
        min(n, 100) for n in Counter(e["label"] for e in test).values())
    for bad in (0, -1, True, 2.5, "all"):
        with pytest.raises(ValueError, match="k"):
            pd.sample_per_class(test, bad, 0)  # type: ignore[arg-type]


def test_system_prompts_name_the_labels() -> None:
    clinc = pd.system_prompt("clinc150")
    assert all(label in clinc for label in pd.labels("clinc150"))
    assert "answer oos" in clinc and "label only" in clinc
    snips = pd.system_prompt("snips")
    assert all(x in snips for x in pd.labels("snips") + pd.slot_names())
    assert '{"intent":"GetWeather","slots":{"city":"paris","timeRange":"tomorrow"}}' in snips


def test_gold_answers_are_pinned() -> None:
    example = {"text": "x", "label": "PlayMusic",
               "slots": {"service": "google music", "artist": "westbam", "album": "clásicos"}}
    assert pd.gold_answer("snips", example) == (
        '{"intent":"PlayMusic","slots":{"album":"clásicos","artist":"westbam",'
        '"service":"google music"}}')
    assert pd.gold_answer("snips", {**example, "slots": {}}) == '{"intent":"PlayMusic","slots":{}}'
    assert pd.gold_answer("clinc150", {"text": "x", "label": "translate"}) == "translate"


@pytest.mark.parametrize(("name", "oos"), [("snips", False), ("clinc150", True)])
def test_records_are_openai_calls_whose_answers_score(name: str, oos: bool) -> None:
    examples = pd.sample_per_class(pd.load(name, "test", include_oos=oos), 3, seed=0)
    recs = pd.records(name, examples, seed=1)
    assert len(recs) == len(examples)
    assert len({r["response"]["id"] for r in recs}) == len(recs)
    assert recs == pd.records(name, examples, seed=1)
    assert [r["response"]["id"] for r in recs] != [
        r["response"]["id"] for r in pd.records(name, examples, seed=2)]
    for rec, example in zip(recs, examples, strict=True):
        rec = json.loads(json.dumps(rec))  # what a JSONL line reads back as
        assert detect_format(rec) == "openai"
        assert rec["request"]["model"] == rec["response"]["model"] == pd.REFERENCE_MODEL
        assert rec["request"]["messages"] == [
            {"role": "system", "content": pd.system_prompt(name)},
            {"role": "user", "content": example["text"]}]
        choice = rec["response"]["choices"][0]
        assert choice["finish_reason"] == "stop"
        assert choice["message"] == {"role": "assistant",
                                     "content": pd.gold_answer(name, example)}
        usage = rec["response"]["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert pd.score(name, example, choice["message"]["content"])


def test_clinc150_score() -> None:
    example = {"text": "how would you say fly in italian", "label": "translate"}
    assert pd.score("clinc150", example, "translate")
    assert pd.score("clinc150", example, "  Translate\n")
    assert not pd.score("clinc150", example, "translate.")
    assert not pd.score("clinc150", example, "timezone")
    assert not pd.score("clinc150", example, None)
    assert pd.score("clinc150", {"text": "x", "label": pd.OOS}, "OOS")


def test_snips_score_and_slot_f1() -> None:
    example = pd.load("snips", "train")[0]
    gold = pd.gold_answer("snips", example)
    assert pd.score("snips", example, gold)
    spaced = json.dumps({"slots": {"service": "Google  Music", "album": "allergic",
                                   "artist": "westbam"}, "intent": "PlayMusic"}, indent=2)
    assert pd.score("snips", example, f"\n{spaced}\n")  # formatting and case are not content
    wrong_intent = gold.replace("PlayMusic", "AddToPlaylist")
    missing = json.dumps({"intent": "PlayMusic", "slots": {"artist": "westbam",
                                                           "album": "allergic"}})
    extra = json.dumps({"intent": "PlayMusic", "slots": {**example["slots"], "year": "1999"}})
    wrong_value = gold.replace("westbam", "westbam alumb")
    for answer in (wrong_intent, missing, extra, wrong_value, gold + "x", "PlayMusic", None,
                   json.dumps({"intent": "PlayMusic", "slots": example["slots"], "why": "."}),
                   json.dumps({"intent": "PlayMusic", "slots": {"artist": ["westbam"]}})):
        assert not pd.score("snips", example, answer), answer

    assert pd.slot_f1([(example, gold)]) == 1.0
    assert pd.slot_f1([(example, missing)]) == pytest.approx(2 * 2 / (2 * 2 + 0 + 1))
    assert pd.slot_f1([(example, extra)]) == pytest.approx(2 * 3 / (2 * 3 + 1 + 0))
    assert pd.slot_f1([(example, wrong_intent)]) == 1.0  # intent is not a slot
    assert pd.slot_f1([(example, "not json"), (example, gold)]) == pytest.approx(6 / 9)
    assert pd.slot_f1([]) == 1.0


def test_main_writes_records_that_ingest(factory_home: Path, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """The file ``factory ingest FILE --tag project=...`` reads: every record ingested."""
    out = tmp_path / "snips.jsonl"
    assert pd.main(["--dataset", "snips", "--split", "dev", "--per-class", "2", "--seed", "5",
                    "--out", str(out)]) == 0
    lines = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    expected = pd.records("snips", pd.sample_per_class(pd.load("snips", "dev"), 2, 5), 5)
    assert lines == expected and len(lines) == 14
    assert "14 records" in capsys.readouterr().out

    lake = Lake()
    summary = ingest_paths(lake, [out], tags={"project": "public-snips"}, workers=1)
    assert summary.as_dict() == {"read": 14, "ingested": 14, "rejected": 0, "duplicates": 0}
    rows = lake.sql("SELECT messages FROM samples WHERE tags['project'] = 'public-snips'"
                    ).to_pylist()
    answers = sorted(json.loads(r["messages"])[2]["content"][0]["text"] for r in rows)
    assert answers == sorted(r["response"]["choices"][0]["message"]["content"] for r in lines)


def test_main_prints_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    assert pd.main([]) == 0
    out = capsys.readouterr().out
    assert "snips: train 13084, dev 700, test 700; labels 7; slot names 39" in out
    assert ("clinc150: train 15000, dev 3000, test 4500; labels 150; "
            "oos train 100, dev 100, test 1000") in out
