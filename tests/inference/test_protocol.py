"""OpenAI requests render as the trainer renders the canonical sample; generated text comes back
as OpenAI tool calls, streamed deltas accumulating (by the ``openai`` SDK) into the same reply."""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from factory.inference.protocol import FIRST_DELTA, ReplyStream, reply_message
from factory.normalize import NormalizeError
from factory.normalize.openai import normalize
from factory.normalize.request import as_trained, canonical_request, chat_template_input
from factory.trainer.chat import install_chat_template, load_tokenizer, parse_assistant, render

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}

# An agent's second request, as OpenAI clients send it: a developer message, content as parts,
# arguments and a tool result as JSON with spaces and unsorted keys, a tool without description
# and with ``strict``.
OPENAI_REQUEST: dict[str, Any] = {
    "messages": [
        {"role": "developer", "content": "You are a weather bot."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Zürich"},
                                     {"type": "text", "text": "and Paris?"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_abc", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"unit": "C", "city": "Zürich"}'}},
            {"id": "call_def", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call_abc", "content": '{"temp_c": 21, "sky": "sunny"}'},
        {"role": "tool", "tool_call_id": "call_def",
         "content": [{"type": "text", "text": '{"sky": "rain", "temp_c": 12}'}]},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_ghi", "type": "function",
             "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_ghi", "content": "13:05"},
    ],
    "tools": [
        {"type": "function", "function": {"name": "get_weather",
                                          "description": "Weather for a city",
                                          "parameters": SCHEMA}},
        {"type": "function", "function": {"name": "get_time", "strict": True}},
    ],
}


def _t(text: str) -> list[dict[str, str]]:
    return [{"type": "text", "text": text}]


# The same conversation as a canonical sample (shared/docs/canonical-sample.md).
CANONICAL: dict[str, Any] = {
    "messages": [
        {"role": "system", "content": _t("You are a weather bot.")},
        {"role": "user", "content": [*_t("Weather in Zürich"), *_t("and Paris?")]},
        {"role": "assistant", "content": [], "tool_calls": [
            {"id": "call_0", "name": "get_weather", "arguments": '{"city":"Zürich","unit":"C"}'},
            {"id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris","unit":"C"}'}]},
        {"role": "tool", "tool_call_id": "call_0", "content": _t('{"sky":"sunny","temp_c":21}')},
        {"role": "tool", "tool_call_id": "call_1", "content": _t('{"sky":"rain","temp_c":12}')},
        {"role": "assistant", "content": [], "tool_calls": [
            {"id": "call_2", "name": "get_time", "arguments": "{}"}]},
        {"role": "tool", "tool_call_id": "call_2", "content": _t("13:05")},
    ],
    "tools": [{"name": "get_weather", "description": "Weather for a city", "parameters": SCHEMA},
              {"name": "get_time", "description": "", "parameters": {}}],
}


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Any:
    return install_chat_template(load_tokenizer(str(tiny_model_dir)))


def _served_prompt(tok: Any, messages: Any, tools: Any) -> str:
    """What the server renders for a request (``server._prompt``, without an engine)."""
    msgs, tls = chat_template_input(*canonical_request(messages, tools))
    return str(tok.apply_chat_template(msgs, tools=tls, tokenize=False,
                                       add_generation_prompt=True))


def test_an_openai_request_is_the_canonical_sample() -> None:
    messages, tools = canonical_request(OPENAI_REQUEST["messages"], OPENAI_REQUEST["tools"])
    assert {"messages": messages, "tools": tools} == CANONICAL
    # ... exactly as ingest reads the same conversation logged with its answer.
    logged = {**OPENAI_REQUEST,
              "messages": [*OPENAI_REQUEST["messages"], {"role": "assistant", "content": "ok"}]}
    sample = normalize(logged)[0]
    assert sample["messages"][:-1] == messages and sample["tools"] == tools


def test_served_prompt_is_byte_equal_to_the_trainers_rendering(tok: Any) -> None:
    messages = OPENAI_REQUEST["messages"]
    for n in range(1, len(messages) + 1):
        prefix = CANONICAL["messages"][:n]
        expected = render(prefix, CANONICAL["tools"], add_generation_prompt=True)
        assert _served_prompt(tok, messages[:n], OPENAI_REQUEST["tools"]) == expected
    # The template given the raw OpenAI request would not be: it prints arguments and tool
    # results as sent, the tool as sent (with ``strict``, without a description) and the
    # developer role as a role of its own.
    raw = tok.apply_chat_template(messages, tools=OPENAI_REQUEST["tools"], tokenize=False,
                                  add_generation_prompt=True)
    assert raw != render(CANONICAL["messages"], CANONICAL["tools"], add_generation_prompt=True)
    assert '"unit": "C", "city": "Zürich"' in raw and '"strict": true' in raw
    assert "<|im_start|>developer" in raw


def test_the_gateway_sends_a_deployment_what_its_template_renders_as_the_trainer(tok: Any
                                                                                ) -> None:
    """A request on a route to a factory deployment goes out as ``as_trained`` writes it: the
    template given that, as vLLM applies it to what it is sent, renders the trainer's prompt."""
    sent = as_trained(OPENAI_REQUEST)
    assert sent is not None
    served = tok.apply_chat_template(sent["messages"], tools=sent["tools"], tokenize=False,
                                     add_generation_prompt=True)
    assert served == render(CANONICAL["messages"], CANONICAL["tools"], add_generation_prompt=True)
    assert as_trained({"messages": OPENAI_REQUEST["messages"]}) == {
        "messages": sent["messages"]}  # no tools sent, none added
    # What cannot be read as a conversation goes as it is (the server says why), and so does a
    # request holding an image (its pixels travel only in its own parts).
    assert as_trained({"messages": "hello"}) is None
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk"
               "+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="}}]}
    assert as_trained({"messages": [image]}) is None


def test_canonical_messages_from_the_evals_render_unchanged(tok: Any) -> None:
    """The evals send canonical parts (reasoning, images by hash) and flat calls."""
    messages = [
        {"role": "user", "content": [*_t("What is this?"),
                                     {"type": "image", "media_type": "image/png",
                                      "sha256": "ab" * 32}]},
        {"role": "assistant", "content": [{"type": "reasoning", "text": "A cat?"}, *_t("")],
         "tool_calls": [{"id": "call_0", "name": "lookup", "arguments": '{"q": "cat"}'}]},
        {"role": "tool", "tool_call_id": "call_0", "content": _t('{"b": 1, "a": 2}')},
    ]
    tools = [{"name": "lookup", "description": "", "parameters": {}}]
    canonical = [messages[0],
                 {"role": "assistant", "content": [{"type": "reasoning", "text": "A cat?"}],
                  "tool_calls": [{"id": "call_0", "name": "lookup",
                                  "arguments": '{"q":"cat"}'}]},
                 {"role": "tool", "tool_call_id": "call_0", "content": _t('{"a":2,"b":1}')}]
    assert canonical_request(messages, tools) == (canonical, tools)
    assert _served_prompt(tok, messages, tools) == render(canonical, tools,
                                                          add_generation_prompt=True)


@pytest.mark.parametrize(("messages", "tools", "error"), [
    ([], None, "messages: must be a non-empty list"),
    ("hi", None, "messages: expected an array"),
    ([{"role": "robot", "content": "hi"}], None, r"messages\[0\].role: unknown role"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"arguments": "{}"}}]}], None,
     r"messages\[1\].tool_calls\[0\].function.name"),
    ([{"role": "user", "content": "hi"}], [{"type": "function", "function": {}}],
     r"request.tools\[0\].function.name"),
])
def test_a_bad_request_names_the_field(messages: Any, tools: Any, error: str) -> None:
    with pytest.raises(NormalizeError, match=error):
        canonical_request(messages, tools)


CALL = '<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'
PARIS = CALL.format(name="get_weather", args='{"city": "Paris"}')
ZURICH = CALL.format(name="get_weather", args='{"unit": "C", "city": "Zürich ☀ 東京"}')

# (generated text, engine finish reason, content, [(name, arguments)], finish reason)
REPLIES: list[tuple[str, str, str | None, list[tuple[str, str]], str]] = [
    (PARIS, "stop", None, [("get_weather", '{"city":"Paris"}')], "tool_calls"),
    (PARIS + "\n" + ZURICH, "stop", None,
     [("get_weather", '{"city":"Paris"}'), ("get_weather", '{"city":"Zürich ☀ 東京","unit":"C"}')],
     "tool_calls"),
    ("Checking.\n" + PARIS, "stop", "Checking.", [("get_weather", '{"city":"Paris"}')],
     "tool_calls"),
    (PARIS + "\n\n", "stop", None, [("get_weather", '{"city":"Paris"}')], "tool_calls"),
    (PARIS + " Then more.", "stop", " Then more.", [("get_weather", '{"city":"Paris"}')],
     "tool_calls"),
    ('<tool_call>\n{"name": "get_weather", "arguments": {city: Paris}}\n</tool_call>', "stop",
     '<tool_call>\n{"name": "get_weather", "arguments": {city: Paris}}\n</tool_call>', [],
     "stop"),
    ('<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>', "stop",
     '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>', [], "stop"),
    ('<tool_call>\n{"name": 7}\n</tool_call>', "stop", '<tool_call>\n{"name": 7}\n</tool_call>',
     [], "stop"),
    ('<tool_call>\n{"name": "get_weather", "argu', "length",
     '<tool_call>\n{"name": "get_weather", "argu', [], "length"),
    (PARIS + '\n<tool_call>\n{"na', "length", '\n<tool_call>\n{"na',
     [("get_weather", '{"city":"Paris"}')], "length"),
    ("<tool_call>\nnot json\n</tool_call>\n" + PARIS, "stop", "<tool_call>\nnot json\n</tool_call>",
     [("get_weather", '{"city":"Paris"}')], "tool_calls"),
    ("<tool_call><tool_call>" + PARIS[len("<tool_call>"):], "stop",
     "<tool_call><tool_call>" + PARIS[len("<tool_call>"):], [], "stop"),
    ("a < b and <tool but no call <", "stop", "a < b and <tool but no call <", [], "stop"),
    ("<think>\nmaybe " + PARIS + "\n</think>\nNo call.", "stop",
     "<think>\nmaybe " + PARIS + "\n</think>\nNo call.", [], "stop"),
    ("<think>\nshort\n</think>\n" + PARIS, "stop", "<think>\nshort\n</think>",
     [("get_weather", '{"city":"Paris"}')], "tool_calls"),
    ("  Plain text with trailing space  ", "stop", "  Plain text with trailing space  ", [],
     "stop"),
    ("", "stop", "", [], "stop"),
    ("", "length", "", [], "length"),
]


def _ids() -> Callable[[], str]:
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def _sdk_accumulate(deltas: list[dict[str, Any]], finish: str) -> Any:
    """The message and finish reason the openai SDK assembles from the chunks of ``deltas``."""
    state: ChatCompletionStreamState[Any] = ChatCompletionStreamState()
    for i, delta in enumerate([dict(FIRST_DELTA), *deltas, {}]):
        last = i == len(deltas) + 1
        state.handle_chunk(ChatCompletionChunk.model_validate({
            "id": "chatcmpl-test", "object": "chat.completion.chunk", "created": 0,
            "model": "m", "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                       "finish_reason": finish if last else None}]}))
    # The snapshot, not get_final_completion(): that one refuses a reply cut by the length limit.
    choice = state.current_completion_snapshot.choices[0]
    return choice.message, choice.finish_reason


def _pieces(text: str, sizes: list[int]) -> list[str]:
    out, pos = [], 0
    for size in itertools.cycle(sizes):
        if pos >= len(text):
            return out
        out.append(text[pos:pos + size])
        pos += size
    return out


@pytest.mark.parametrize("case", range(len(REPLIES)))
def test_reply_to_tool_calls_streamed_and_not(case: int) -> None:
    text, engine_finish, content, calls, finish = REPLIES[case]
    message, reason = reply_message(text, engine_finish, _ids())
    assert reason == finish
    assert message["content"] == content
    got = [(c["function"]["name"], c["function"]["arguments"])
           for c in message.get("tool_calls", [])]
    assert got == calls
    assert [c["id"] for c in message.get("tool_calls", [])] == [f"call_{i}"
                                                               for i in range(len(calls))]
    assert all(c["type"] == "function" for c in message.get("tool_calls", []))
    # What counts as a call is what the trainer's parser reads back.
    assert got == [(c["name"], c["arguments"])
                   for c in parse_assistant(text).get("tool_calls", [])]
    # Streamed in any pieces (one character, a few, all at once), the SDK assembles the same.
    for sizes in ([1], [3, 1, 7], [len(text) or 1]):
        stream = ReplyStream(_ids())
        deltas = [d for piece in _pieces(text, sizes) for d in stream.feed(piece)]
        last, streamed_finish = stream.close(engine_finish)
        assert streamed_finish == finish
        assert stream.message() == message
        sdk_message, sdk_finish = _sdk_accumulate(deltas + last, streamed_finish)
        assert sdk_finish == finish
        assert sdk_message.content == content
        assert [(c.id, c.function.name, c.function.arguments)
                for c in sdk_message.tool_calls or []] == \
            [(c["id"], c["function"]["name"], c["function"]["arguments"])
             for c in message.get("tool_calls", [])]


def test_tool_call_deltas_are_shaped_as_openai_streams_them() -> None:
    stream = ReplyStream(_ids())
    deltas = []
    for piece in _pieces("Checking.\n" + PARIS + "\n" + ZURICH, [2]):
        deltas += stream.feed(piece)
    last, finish = stream.close("stop")
    deltas += last
    assert finish == "tool_calls"
    assert "".join(d.get("content", "") for d in deltas) == "Checking."
    calls = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert calls == [
        [{"index": 0, "id": "call_0", "type": "function",
          "function": {"name": "get_weather", "arguments": ""}}],
        [{"index": 0, "function": {"arguments": '{"city":"Paris"}'}}],
        [{"index": 1, "id": "call_1", "type": "function",
          "function": {"name": "get_weather", "arguments": ""}}],
        [{"index": 1, "function": {"arguments": '{"city":"Zürich ☀ 東京","unit":"C"}'}}],
    ]
    # Content is sent before the call it precedes, never after the call is recognised.
    first_call = next(i for i, d in enumerate(deltas) if "tool_calls" in d)
    assert all("content" in d for d in deltas[:first_call])


def test_content_streams_at_once_until_a_call_may_start() -> None:
    stream = ReplyStream(_ids())
    assert stream.feed("Hello") == [{"content": "Hello"}]
    assert stream.feed(" wor") == [{"content": " wor"}]
    assert stream.feed("ld <tool") == [{"content": "ld"}]  # " <tool" may open a call
    assert stream.feed("_call>\n{\"name\"") == []  # a call: held until it closes
    assert stream.feed(': "f", "arguments": {}}\n</tool_call>') == [
        {"tool_calls": [{"index": 0, "id": "call_0", "type": "function",
                         "function": {"name": "f", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}]
    assert stream.close("stop") == ([], "tool_calls")
    assert stream.message()["content"] == "Hello world"


def test_the_rendered_calls_are_what_vllms_hermes_parser_reads() -> None:
    """vLLM's ``hermes`` parser takes the JSON between ``<tool_call>`` and ``</tool_call>``
    and reads ``name`` and ``arguments`` from it; the trainer renders calls that way."""
    text = render([{"role": "user", "content": _t("hi")},
                   {"role": "assistant", "content": _t("Sure."), "tool_calls": [
                       {"id": "call_0", "name": "get_weather",
                        "arguments": '{"city":"Zürich"}'}]}])
    body = text.split("<|im_start|>assistant\n", 1)[1]
    found = [json.loads(m) for m in re.findall(r"<tool_call>(.*?)</tool_call>", body, re.S)]
    assert found == [{"name": "get_weather", "arguments": {"city": "Zürich"}}]
