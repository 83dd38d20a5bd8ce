"""The agent task's generator: deterministic, in its shares, exact, ingestible, and a held-out
set whose phrasings the training data never used."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from factory.curation import detectors
from factory.experiments import load_experiment
from factory.ingest import ingest_paths
from factory.lake import Lake
from factory.normalize.detect import detect_format
from factory.tasks import agent_orders as task

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENT = ROOT / "experiments" / "agent-orders.yaml"


def _calls(conv: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for m in conv["messages"] for c in m.get("tool_calls") or []]


def test_same_seed_same_data_other_seed_other_data() -> None:
    assert task.generate_records(40, seed=3) == task.generate_records(40, seed=3)
    assert task.generate_records(40, seed=3) != task.generate_records(40, seed=4)
    assert task.generate_heldout(40, seed=3) == task.generate_heldout(40, seed=3)
    assert task.generate_heldout(40, seed=3) != task.generate_heldout(40, seed=4)
    # A batch is not a prefix of a larger one (the shares are scheduled per batch), but it is
    # the same whatever ran before it in the process.
    task.generate_records(7, seed=9)
    assert task.generate_records(40, seed=3) == task.generate_records(40, seed=3)


@pytest.mark.parametrize("n", [20, 200, 600])
def test_shares_hold_in_every_batch(n: int) -> None:
    for convs in (task.generate_conversations(n, seed=n), task.generate_heldout(n, seed=n)):
        kinds = Counter(c["kind"] for c in convs)
        languages = Counter(c["language"] for c in convs)
        assert kinds["none"] >= 0.15 * n
        assert n - languages["en"] >= 0.15 * n
        assert set(languages) == set(task.LANGUAGES)
    kinds = Counter(c["kind"] for c in task.generate_conversations(n, seed=n))
    assert kinds["result"] >= 0.15 * n and kinds["call"] >= 0.5 * n


def test_every_tool_and_topic_appears_with_enum_and_nested_arguments() -> None:
    convs = task.generate_conversations(600, seed=0)
    intents = Counter(c["intent"] for c in convs)
    assert set(intents) == set(task.TOOL_NAMES) | set(task.TOPICS)
    seen: dict[str, set[str]] = {"cancel": set(), "refund": set(), "country": set()}
    for conv in convs:
        for call in _calls(conv):
            fn = call["function"]
            args = json.loads(fn["arguments"])
            assert fn["name"] == conv["intent"]
            assert fn["arguments"] == json.dumps(args, separators=(",", ":"), sort_keys=True,
                                                 ensure_ascii=False)
            assert args["order_id"] in conv["messages"][1]["content"]
            if fn["name"] == "cancel_order":
                seen["cancel"].add(args["reason"])
            elif fn["name"] == "issue_refund":
                seen["refund"].add(args["reason"])
                assert isinstance(args["amount"], int | float) and args["amount"] > 0
            elif fn["name"] == "update_shipping_address":
                address = args["address"]
                assert set(address) == {"street", "city", "postal_code", "country"}
                seen["country"].add(address["country"])
                for key in ("street", "city", "postal_code"):
                    assert address[key] in conv["messages"][1]["content"], (key, conv)
    assert seen == {"cancel": set(task.CANCEL_REASONS), "refund": set(task.REFUND_REASONS),
                    "country": set(task.COUNTRIES)}


def test_conversation_shapes() -> None:
    for conv in task.generate_conversations(120, seed=1):
        roles = [m["role"] for m in conv["messages"]]
        last = conv["messages"][-1]
        if conv["kind"] == "call":
            assert roles == ["system", "user", "assistant"]
            assert last["content"] is None and len(last["tool_calls"]) == 1
        elif conv["kind"] == "result":
            assert roles == ["system", "user", "assistant", "tool", "assistant"]
            call, result = conv["messages"][2], conv["messages"][3]
            assert result["tool_call_id"] == call["tool_calls"][0]["id"]
            assert json.loads(result["content"])["order_id"] in last["content"]
        else:
            assert roles == ["system", "user", "assistant"] and "tool_calls" not in last
        if conv["kind"] != "call":
            assert isinstance(last["content"], str) and last["content"].rstrip()[-1] in ".!?"


def test_no_tool_answers_follow_the_facts() -> None:
    answers: dict[str, list[tuple[str, str]]] = {t: [] for t in task.TOPICS}
    for c in task.generate_conversations(600, seed=2):
        if c["language"] == "en" and c["kind"] == "none":
            answers[c["intent"]].append((c["messages"][1]["content"],
                                         c["messages"][2]["content"]))
    assert all(answers.values())
    for question, answer in answers["shipping"]:
        match = re.search(r"€(\d+)\.(\d\d)", question)
        assert match is not None, question
        free = int(match[1]) >= task.FREE_SHIPPING_FROM
        assert answer.startswith("Yes") == free, question
    for question, answer in answers["returns"]:
        match = re.search(r"(\d+) days", question)
        assert match is not None, question
        assert answer.startswith("Yes") == (int(match[1]) <= task.RETURN_DAYS), question
    for question, answer in answers["payment"]:
        assert answer.startswith("Yes") == any(m in question for m in ("Visa", "Mastercard",
                                                                       "PayPal", "Klarna"))


def test_heldout_templates_are_disjoint_from_training_ones() -> None:
    train = {f for lang in task.TEMPLATES["train"].values() for fs in lang.values() for f in fs}
    heldout = {f for lang in task.TEMPLATES["heldout"].values() for fs in lang.values()
               for f in fs}
    assert not train & heldout
    for split, least in (("train", 2), ("heldout", 1)):
        for lang in task.LANGUAGES:
            frames = task.TEMPLATES[split][lang]
            assert set(frames) == set(task.TOOL_NAMES) | set(task.TOPICS)
            assert all(len(fs) >= least for fs in frames.values()), (split, lang)
    patterns = [task.template_pattern(f) for f in train]
    requests = task.generate_heldout(600, seed=5)
    assert {r["template"] for r in requests} <= heldout
    for request in requests:
        text = request["messages"][-1]["content"]
        assert not any(p.fullmatch(text) for p in patterns), text
    # and the patterns do match the texts of their own frames
    own = task.generate_conversations(200, seed=5)
    assert all(task.template_pattern(c["template"]).fullmatch(c["messages"][1]["content"])
               for c in own)
    training_texts = {c["messages"][1]["content"] for c in task.generate_conversations(600)}
    assert not training_texts & {r["messages"][-1]["content"] for r in requests}


def test_heldout_expectations_are_the_requests() -> None:
    for request in task.generate_heldout(200, seed=6):
        expected, text = request["expected"], request["messages"][-1]["content"]
        assert [m["role"] for m in request["messages"]] == ["system", "user"]
        if request["kind"] == "none":
            assert expected == {"name": None, "arguments": None}
            assert request["reference"]
        else:
            assert expected["name"] == request["intent"] in task.TOOL_NAMES
            assert expected["arguments"]["order_id"] in text


def test_records_are_openai_calls_with_tools() -> None:
    records = task.generate_records(30, seed=1)
    tool_names = [t["function"]["name"] for t in task.TOOLS]
    assert tool_names == list(task.TOOL_NAMES)
    for rec in records:
        assert detect_format(rec) == "openai"
        assert [t["function"]["name"] for t in rec["request"]["tools"]] == tool_names
        choice = rec["response"]["choices"][0]
        assert choice["finish_reason"] == ("tool_calls" if choice["message"].get("tool_calls")
                                           else "stop")


def test_records_ingest_into_canonical_samples_that_curation_keeps(
        factory_home: Path, tmp_path: Path) -> None:
    """The file ingest that ``factory ingest FILE --tag project=agent-orders`` runs, then the
    experiment's selection."""
    n = 60
    convs = task.generate_conversations(n, seed=7)
    path = tmp_path / "agent.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n"
                            for r in task.generate_records(n, seed=7)), encoding="utf-8")
    lake = Lake()
    summary = ingest_paths(lake, [path], tags=task.TAGS, workers=1)
    assert summary.as_dict() == {"read": n, "ingested": n, "rejected": 0, "duplicates": 0}

    where = load_experiment(EXPERIMENT).data.where
    rows = lake.sql(f"SELECT messages, tools, tags FROM samples WHERE {where}").to_pylist()
    assert len(rows) == n
    by_user = {c["messages"][1]["content"]: c for c in convs}
    kinds: Counter[str] = Counter()
    for row in rows:
        messages, tools = json.loads(row["messages"]), json.loads(row["tools"])
        assert [t["name"] for t in tools] == list(task.TOOL_NAMES)
        assert tools[2]["parameters"]["properties"]["address"]["properties"]["country"][
            "enum"] == list(task.COUNTRIES)
        conv = by_user[messages[1]["content"][0]["text"]]
        kinds[conv["kind"]] += 1
        assert [m["role"] for m in messages] == [m["role"] for m in conv["messages"]]
        for got, want in zip(messages, conv["messages"], strict=True):
            if want.get("tool_calls"):
                fn = want["tool_calls"][0]["function"]
                assert got["tool_calls"] == [{"id": "call_0", "name": fn["name"],
                                              "arguments": fn["arguments"]}]
            if want["role"] == "tool":
                assert got["tool_call_id"] == "call_0"
        # nothing that curation's detectors would drop
        assert detectors.refusal(messages) is None
        assert detectors.truncated(messages, None) is None
        assert detectors.tool_schema(messages, tools) is None
        assert detectors.agent_loop(messages) is None
    assert kinds == Counter(c["kind"] for c in convs)


def test_exact_tool_call() -> None:
    want = {"name": "issue_refund", "arguments": {"order_id": "123456", "amount": 24.5,
                                                  "reason": "damaged"}}

    def message(*calls: tuple[str, Any]) -> dict[str, Any]:
        return {"role": "assistant", "content": None, "tool_calls": [
            {"id": f"c{i}", "type": "function", "function": {"name": name, "arguments": args}}
            for i, (name, args) in enumerate(calls)]}

    good = '{"reason": "damaged", "amount": 24.50, "order_id": "123456"}'
    assert task.exact_tool_call(want, message(("issue_refund", good)))
    assert task.exact_tool_call(want, message(("issue_refund", json.loads(good))))
    assert not task.exact_tool_call(want, message(("cancel_order", good)))
    assert not task.exact_tool_call(want, message(("issue_refund", good), ("issue_refund", good)))
    assert not task.exact_tool_call(want, message(("issue_refund", good[:-1])))
    assert not task.exact_tool_call(want, message(
        ("issue_refund", '{"reason": "damaged", "amount": "24.50", "order_id": "123456"}')))
    assert not task.exact_tool_call(want, message(
        ("issue_refund", '{"reason": "damaged", "amount": 24.5, "order_id": 123456}')))
    assert not task.exact_tool_call(want, message(
        ("issue_refund", '{"reason": "damaged", "amount": 24.5, "order_id": "123456", "x": 1}')))
    assert not task.exact_tool_call(want, {"role": "assistant", "content": "Refunded!"})
    whole = {"name": "issue_refund", "arguments": {"order_id": "1", "amount": 80,
                                                   "reason": "late_delivery"}}
    assert task.exact_tool_call(whole, message(
        ("issue_refund", '{"order_id": "1", "amount": 80.0, "reason": "late_delivery"}')))
    assert not task.exact_tool_call({"name": "f", "arguments": {"ok": True}},
                                    message(("f", '{"ok": 1}')))
    nested = {"name": "update_shipping_address", "arguments": {"order_id": "1", "address": {
        "street": "Via Roma 2", "city": "Roma", "postal_code": "00100", "country": "IT"}}}
    moved = json.loads(json.dumps(nested["arguments"]))
    assert task.exact_tool_call(nested, message(("update_shipping_address", moved)))
    moved["address"]["country"] = "it"
    assert not task.exact_tool_call(nested, message(("update_shipping_address", moved)))

    none = {"name": None, "arguments": None}
    assert task.exact_tool_call(none, {"role": "assistant", "content": "Hello Maria!"})
    assert task.exact_tool_call(none, {"role": "assistant", "content": "Hi", "tool_calls": []})
    assert not task.exact_tool_call(none, message(("get_order_status", '{"order_id":"1"}')))

    class Obj:  # the SDK's message objects: attributes, not keys
        def __init__(self, **kw: Any) -> None:
            self.__dict__.update(kw)

    sdk = Obj(content=None, tool_calls=[Obj(id="c0", type="function", function=Obj(
        name="issue_refund", arguments=good))])
    assert task.exact_tool_call(want, sdk)
    assert task.exact_tool_call(none, Obj(content="Hi", tool_calls=None))


def test_bad_n() -> None:
    for bad in (-1, 2.0, True):
        with pytest.raises(ValueError, match="n: must be"):
            task.generate_conversations(bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="n: must be"):
            task.generate_heldout(bad)  # type: ignore[arg-type]
