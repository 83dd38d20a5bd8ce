"""Curation counts a sample's tokens exactly as the trainer tokenizes it (one rendering)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest

from factory.tasks.planted import Planted
from factory.trainer.chat import IGNORE_INDEX, encode

TOOLS = [{"name": "cancel_order", "description": "Cancel an order.",
          "parameters": {"type": "object", "required": ["order_id", "reason"], "properties": {
              "order_id": {"type": "string"},
              "reason": {"type": "string", "enum": ["changed_mind", "late", "damaged"]}}}},
         {"name": "update_address", "description": "Change where an order ships.",
          "parameters": {"type": "object", "properties": {"address": {
              "type": "object", "properties": {"city": {"type": "string"},
                                               "country": {"type": "string"}}}}}}]


def _text(t: str) -> list[dict[str, str]]:
    return [{"type": "text", "text": t}]


def agent_conversations() -> list[tuple[list[dict[str, Any]], list[dict[str, Any]]]]:
    """Tool calls, tool results, final answers, reasoning, images, no system prompt, no tools."""
    call = {"id": "call_0", "name": "cancel_order",
            "arguments": '{"order_id":"A-17","reason":"late"}'}
    return [
        ([{"role": "system", "content": _text("You help with orders.")},
          {"role": "user", "content": _text("Cancel A-17, it is late.")},
          {"role": "assistant", "content": [], "tool_calls": [call]}], TOOLS),
        ([{"role": "system", "content": _text("You help with orders.")},
          {"role": "user", "content": _text("Storniere bitte A-17, sie kommt zu spät.")},
          {"role": "assistant", "content": [], "tool_calls": [call]},
          {"role": "tool", "tool_call_id": "call_0", "content": _text('{"ok":true}')},
          {"role": "assistant", "content": _text("Erledigt: A-17 ist storniert.")}], TOOLS),
        ([{"role": "user", "content": _text("Ship it to Lyon, France instead.")},
          {"role": "assistant", "content": [{"type": "reasoning", "text": "Address change."}],
           "tool_calls": [{"id": "call_0", "name": "update_address",
                           "arguments": '{"address":{"city":"Lyon","country":"FR"}}'}]}],
         TOOLS),
        ([{"role": "user", "content": [*_text("What is this?"),
                                       {"type": "image", "media_type": "image/png",
                                        "sha256": "ab" * 32}]},
          {"role": "assistant", "content": _text("A parcel label.")}], []),
        ([{"role": "user", "content": _text("Hi")}], TOOLS),  # no assistant turn
    ]


@pytest.fixture(scope="module")
def trainer_tokenizer(smollm2_dir: Path) -> Any:
    from factory.trainer.chat import load_tokenizer

    return load_tokenizer(str(smollm2_dir))


@pytest.mark.slow
def test_counts_equal_the_trainers_encoding(counter: Any, trainer_tokenizer: Any,
                                            planted_data: Planted) -> None:
    convs = [(orjson.loads(r["messages"]), orjson.loads(r["tools"] or "[]"))
             for r in planted_data.rows[:40] + planted_data.rows[-12:]] + agent_conversations()
    counts = counter.count([m for m, _ in convs], [t for _, t in convs])
    for (messages, tools), got in zip(convs, counts, strict=True):
        ids, labels = encode(messages, tools, trainer_tokenizer)
        assert got is not None
        total, prompt = got
        assert total == len(ids)
        # the same ids from curation's tokenizer as from the trainer's
        assert encode(messages, tools, counter.tokenizer) == (ids, labels)
        trained = [i for i, lab in enumerate(labels) if lab != IGNORE_INDEX]
        if any(m["role"] == "assistant" for m in messages):
            # the prompt ends where the last assistant turn's trained tokens begin
            assert trained and prompt <= trained[-1]
            assert labels[prompt] != IGNORE_INDEX and all(
                lab == IGNORE_INDEX for lab in labels[max(0, prompt - 3):prompt])
        else:
            assert not trained and prompt == total


def test_tools_are_counted(counter: Any) -> None:
    """The tools block sits in the system turn: it is most of an agent sample's length."""
    messages, tools = agent_conversations()[0]
    with_tools, without = counter.count([messages, messages], [tools, []])
    assert with_tools is not None and without is not None
    assert with_tools[0] > without[0] + 100
    assert with_tools[0] - with_tools[1] == without[0] - without[1]  # same completion


def test_unrenderable_sample_is_none(counter: Any) -> None:
    bad = [{"role": "narrator", "content": _text("x")},
           {"role": "assistant", "content": _text("y")}]
    weird = [{"role": "user", "content": [{"type": "video"}]},
             {"role": "assistant", "content": _text("y")}]
    good = agent_conversations()[3][0]
    assert counter.count([bad, weird, good])[:2] == [None, None]
    assert counter.count([good])[0] is not None


def test_counter_pickles_as_its_folder(counter: Any) -> None:
    import pickle

    again = pickle.loads(pickle.dumps(counter))
    assert again.tokenizer_dir == counter.tokenizer_dir
    messages, tools = agent_conversations()[1]
    assert again.count([messages], [tools]) == counter.count([messages], [tools])
    assert json.loads(json.dumps(again.count([messages], [tools])))  # plain ints


def test_shared_prefix_is_what_the_trainer_computes_once(counter: Any,
                                                          trainer_tokenizer: Any) -> None:
    from factory.curation.tokens import shared_prefix_tokens
    from factory.trainer.chat import install_chat_template
    from factory.trainer.data import Example, shared_prefix_length

    system = ("You triage support tickets for a desk shop. Route each ticket to one team: "
              "billing, bug or shipping. Answer with the label only.")
    tickets = [f"ticket {i}: {w}" for i, w in enumerate(["refund", "crash", "late"] * 8)]

    def convo(sys_text: str, ticket: str, label: str) -> list[dict[str, Any]]:
        return [{"role": "system", "content": _text(sys_text)},
                {"role": "user", "content": _text(ticket)},
                {"role": "assistant", "content": _text(label)}]

    same = [convo(system, t, "bug") for t in tickets]
    n = shared_prefix_tokens(counter, same)
    tok = install_chat_template(trainer_tokenizer)
    examples = []
    for m in same:
        ids, labels = encode(m, None, tok)
        examples.append(Example(sample_id="x", input_ids=ids, labels=labels))
    # The trainer's own measure on a group of 8 (every group here shares the same prefix).
    assert n == shared_prefix_length(examples[:8]) > 20
    # One sample of each group with its own system prompt: little in common.
    mixed = [convo("Be brief." if i % 8 == 0 else system, t, "bug")
             for i, t in enumerate(tickets)]
    assert shared_prefix_tokens(counter, mixed) < 8
    # Samples that differ only in their answers share everything up to the answer, and the
    # prefix still ends before the first trained token.
    answers = [convo(system, "same ticket", label) for label in ("bug", "billing") * 4]
    first_trained = next(i for i, lab in enumerate(encode(answers[0], None, tok)[1])
                         if i and lab != IGNORE_INDEX)
    assert shared_prefix_tokens(counter, answers) == first_trained - 1
