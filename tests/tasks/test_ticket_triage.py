"""The triage task's generator: deterministic, balanced, varied, ingestible, a held-out set whose
phrasings the training data never used, a held-out set of fresh tickets with none near a
training one, and an exact-label scorer."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest

from factory.curation import detectors
from factory.curation.config import CurationConfig
from factory.ingest import ingest_paths
from factory.lake import Lake
from factory.normalize.detect import detect_format
from factory.tasks import ticket_triage as task
from factory.tasks.agent_orders import template_pattern


def test_same_seed_same_data_other_seed_other_data() -> None:
    assert task.generate_records(40, seed=3) == task.generate_records(40, seed=3)
    assert task.generate_records(40, seed=3) != task.generate_records(40, seed=4)
    assert task.generate_heldout(40, seed=3) == task.generate_heldout(40, seed=3)
    assert task.generate_heldout(40, seed=3) != task.generate_heldout(40, seed=4)
    task.generate_records(7, seed=9)  # nothing carries over from one call to the next
    assert task.generate_records(40, seed=3) == task.generate_records(40, seed=3)


@pytest.mark.parametrize("n", [0, 1, 7, 200, 500])
def test_labels_are_balanced_in_every_batch(n: int) -> None:
    for convs in (task.generate_conversations(n, seed=n), task.generate_heldout(n, seed=n)):
        counts = Counter(c["label"] for c in convs)
        assert sum(counts.values()) == n
        assert set(counts) <= set(task.LABELS)
        sizes = [counts[label] for label in task.LABELS]
        assert max(sizes) - min(sizes) <= 1, counts
    # shuffled, not in blocks
    labels = [c["label"] for c in task.generate_conversations(50, seed=0)]
    assert labels[:10] != sorted(labels[:10])


def test_labels_are_single_lowercase_tokens_named_by_the_system_prompt() -> None:
    assert len(task.LABELS) == len(set(task.LABELS)) == 5
    for label in task.LABELS:
        assert label == label.lower() and label.isidentifier()
        assert label in task.SYSTEM_PROMPT
    assert "label only" in task.SYSTEM_PROMPT


def test_phrasing_varies() -> None:
    convs = task.generate_conversations(500, seed=0)
    texts = [c["messages"][1]["content"] for c in convs]
    # Exact repeats would be dropped by curation's dedupe and teach nothing new.
    assert len(set(texts)) >= 0.99 * len(texts)
    for split in ("train", "heldout"):
        cores = task.TEMPLATES[split]["core"]
        assert set(cores) == set(task.LABELS)
        assert all(len(cores[label]) >= (15 if split == "train" else 8) for label in cores)
    assert len({c["template"] for c in convs}) == sum(
        len(v) for v in task.TEMPLATES["train"]["core"].values())
    styles = Counter(c["style"] for c in convs)
    assert all(styles[s] >= 0.25 * len(convs) for s in task.STYLE_SHARES), styles
    lengths = sorted(len(t.split()) for t in texts)
    assert lengths[0] <= 8 and lengths[-1] >= 35
    assert sum("\n" in t for t in texts) >= 20  # multi-line tickets
    noise = Counter(c["noise"] for c in convs)
    assert noise["none"] < 0.8 * len(convs)
    for kind in ("lower", "upper", "none+typo"):
        assert noise[kind] > 0, noise
    asides = [c for c in convs if "aside" in c["frames"]]
    assert len(asides) >= 0.2 * len(convs)


def test_asides_name_other_teams_words_as_distractors() -> None:
    words = {"billing": ("invoice", "paid", "pay", "billing", "subscription", "plan"),
             "bug": ("bug", "crash", "works", "runs"),
             "account_access": ("log in", "logging in", "sign in", "account"),
             "shipping": ("delivery", "delivered", "shipped", "shipping", "arrived", "order"),
             "feature_request": ("feature",)}
    for split in ("train", "heldout"):
        for label, frames in task.TEMPLATES[split]["aside"].items():
            for frame in frames:
                others = [other for other, ws in words.items() if other != label
                          and any(w in frame.lower() for w in ws)]
                assert others, (split, label, frame)


def test_heldout_frames_are_disjoint_from_training_ones() -> None:
    train, heldout = task.TEMPLATES["train"], task.TEMPLATES["heldout"]
    for part in ("core", "detail", "aside"):
        assert set(train[part]) == set(heldout[part]) == set(task.LABELS)
        train_frames = {f for fs in train[part].values() for f in fs}
        heldout_frames = {f for fs in heldout[part].values() for f in fs}
        assert not train_frames & heldout_frames, part
    core_patterns = [template_pattern(f) for fs in train["core"].values() for f in fs]
    every_pattern = [template_pattern(f) for part in train.values() for fs in part.values()
                     for f in fs]
    requests = task.generate_heldout(500, seed=5)
    cores = {f for fs in heldout["core"].values() for f in fs}
    assert {r["template"] for r in requests} == cores
    for request in requests:
        assert not any(p.fullmatch(request["core"]) for p in core_patterns), request["core"]
        assert all(f in heldout[part][request["label"]]
                   for part, f in request["frames"].items())
        if request["noise"] == "none":
            text = request["messages"][-1]["content"]
            assert not any(p.search(text) for p in every_pattern), text
    # and the patterns do find the training texts of their own frames
    own = task.generate_conversations(300, seed=5)
    for conv in own:
        assert template_pattern(conv["template"]).fullmatch(conv["core"])
        if conv["noise"] == "none":
            text = conv["messages"][1]["content"]
            assert all(template_pattern(f).search(text) for f in conv["frames"].values())
    training_texts = {c["messages"][1]["content"] for c in task.generate_conversations(2000)}
    assert not training_texts & {r["messages"][-1]["content"] for r in requests}


def test_new_requests_hold_out_the_core_only() -> None:
    """``held=("core",)``: every ticket asks with a held-out core frame, in the training detail
    and aside sentences; a part that does not exist is refused by name."""
    train, heldout = task.TEMPLATES["train"], task.TEMPLATES["heldout"]
    requests = task.generate_heldout(300, seed=7, held=("core",))
    assert {r["template"] for r in requests} == {f for fs in heldout["core"].values() for f in fs}
    parts = set()
    for request in requests:
        for part, frame in request["frames"].items():
            parts.add(part)
            assert frame in (heldout if part == "core" else train)[part][request["label"]]
    assert parts == {"core", "detail", "aside"}
    assert task.generate_heldout(50, seed=7) == task.generate_heldout(
        50, seed=7, held=("core", "detail", "aside"))
    with pytest.raises(ValueError, match="unknown parts \\['cores'\\]"):
        task.generate_heldout(5, held=("cores",))


def test_conversation_and_heldout_shapes() -> None:
    for conv in task.generate_conversations(60, seed=1):
        assert [m["role"] for m in conv["messages"]] == ["system", "user", "assistant"]
        assert conv["messages"][0]["content"] == task.SYSTEM_PROMPT
        assert conv["messages"][2]["content"] == conv["label"]
    for request in task.generate_heldout(60, seed=1):
        assert [m["role"] for m in request["messages"]] == ["system", "user"]
        assert request["label"] in task.LABELS


def test_records_are_openai_calls_answered_with_the_label() -> None:
    convs = task.generate_conversations(30, seed=1)
    for rec, conv in zip(task.generate_records(30, seed=1), convs, strict=True):
        assert detect_format(rec) == "openai"
        assert rec["request"]["messages"] == conv["messages"][:2]
        choice = rec["response"]["choices"][0]
        assert choice["message"] == {"role": "assistant", "content": conv["label"]}
        assert choice["finish_reason"] == "stop"
    ids = {r["response"]["id"] for r in task.generate_records(200, seed=1)}
    assert len(ids) == 200


def test_records_ingest_into_samples_that_curation_keeps(factory_home: Path,
                                                          tmp_path: Path) -> None:
    """The file ingest that ``factory ingest FILE --tag project=ticket-triage`` runs, then the
    selection an experiment on the task makes (``WHERE``)."""
    n = 40
    convs = task.generate_conversations(n, seed=7)
    path = tmp_path / "triage.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n"
                            for r in task.generate_records(n, seed=7)), encoding="utf-8")
    lake = Lake()
    summary = ingest_paths(lake, [path], tags=task.TAGS, workers=1)
    assert summary.as_dict() == {"read": n, "ingested": n, "rejected": 0, "duplicates": 0}

    rows = lake.sql(f"SELECT messages FROM samples WHERE {task.WHERE}").to_pylist()
    assert len(rows) == n
    by_user = {c["messages"][1]["content"]: c for c in convs}
    labels: Counter[str] = Counter()
    for row in rows:
        messages = json.loads(row["messages"])
        assert [m["role"] for m in messages] == ["system", "user", "assistant"]
        conv = by_user[messages[1]["content"][0]["text"]]
        assert messages[2]["content"] == [{"type": "text", "text": conv["label"]}]
        labels[conv["label"]] += 1
        assert detectors.refusal(messages) is None
        assert detectors.truncated(messages, None) is None
    assert labels == Counter(c["label"] for c in convs)


def test_exact_label() -> None:
    assert task.exact_label("billing", "billing")
    assert task.exact_label("billing", "  Billing\n")
    assert task.exact_label("account_access", "ACCOUNT_ACCESS")
    assert not task.exact_label("billing", "billing.")
    assert not task.exact_label("billing", "The label is billing")
    assert not task.exact_label("billing", "bug")
    assert not task.exact_label("account_access", "account access")
    assert not task.exact_label("billing", "")
    assert not task.exact_label("billing", None)


def _grams(text: str) -> set[tuple[str, ...]]:
    ws = re.findall(r"\w+", text.lower())
    return set(zip(ws, ws[1:], ws[2:], strict=False)) or {tuple(ws)}


def _nearest(text: str, training: list[set[tuple[str, ...]]]) -> float:
    mine = _grams(text)
    return max(len(mine & other) / len(mine | other) for other in training)


def test_unseen_tickets_are_the_trainings_kind_but_none_is_near_a_training_one() -> None:
    training = task.generate_conversations(500, seed=0)
    texts = {c["messages"][1]["content"] for c in training}
    grams = [_grams(t) for t in texts]
    threshold = CurationConfig().near_dup_threshold  # curation's own near-duplicate bar
    unseen = task.generate_unseen(200, 2, training)
    assert unseen == task.generate_unseen(200, 2, training)
    assert Counter(c["label"] for c in unseen) == {label: 40 for label in task.LABELS}
    train_cores = {f for frames in task.TEMPLATES["train"]["core"].values() for f in frames}
    assert {c["template"] for c in unseen} <= train_cores
    assert len({c["template"] for c in unseen}) >= 60  # most of the 77 frames, not a few
    assert [m["role"] for m in unseen[0]["messages"]] == ["system", "user"]
    for conv in unseen:
        text = conv["messages"][1]["content"]
        assert text not in texts
        near = _nearest(text, grams)
        assert near < threshold, text
        assert conv["nearest"] == round(near, 3)
    assert len({c["messages"][1]["content"] for c in unseen}) == 200
    # The filter is what keeps them apart: plain fresh draws of the same frames hold tickets
    # within the threshold of a training one.
    fresh = task.generate_conversations(200, seed=2)
    assert any(_nearest(c["messages"][1]["content"], grams) >= threshold
               for c in fresh)


def test_bad_n() -> None:
    for bad in (-1, 2.0, True):
        with pytest.raises(ValueError, match="n: must be"):
            task.generate_conversations(bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="n: must be"):
            task.generate_heldout(bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="n: must be"):
            task.generate_unseen(bad, 0, [])  # type: ignore[arg-type]
