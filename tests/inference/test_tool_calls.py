"""Tool calls end to end through the CPU server and the official ``openai`` SDK.

A random model cannot be made to call a tool, so one is trained to: the tiny test model,
fine-tuned (all weights, a few hundred CPU steps, cached with the test models) on one agent
conversation until greedy decoding writes its reply, a text and two calls, in the trainer's
format. That is what the factory does to a base model, in miniature.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI
from openai.lib.streaming.chat import ChatCompletionStreamState

from factory.inference import InferenceServer
from factory.normalize.request import canonical_request
from factory.trainer.chat import encode, install_chat_template, render
from tests.conftest import _models_cache

CALLER_NAME = "tiny-tool-caller-v1"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS: list[Any] = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city", "parameters": SCHEMA}}]
QUESTION: list[Any] = [{"role": "user", "content": "Weather in Zürich and Paris?"}]
CALLS = [("get_weather", {"city": "Zürich"}), ("get_weather", {"city": "Paris"})]
# The trained reply, as the trainer renders it.
REPLY = ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city":"Zürich"}}\n'
         '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n'
         "</tool_call>")


def _train_caller(base: Path, dest: Path) -> Path:
    """The tiny model trained until greedy decoding answers QUESTION with REPLY."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from factory.trainer.base_models import _atomic_save, is_built

    if is_built(dest):
        return dest
    messages, tools = canonical_request(QUESTION, TOOLS)
    sample = [*messages, {"role": "assistant", "content": [{"type": "text", "text": "Checking."}],
                          "tool_calls": [{"id": f"call_{i}", "name": name,
                                          "arguments": json.dumps(args, ensure_ascii=False,
                                                                  separators=(",", ":"))}
                                         for i, (name, args) in enumerate(CALLS)]}]

    def save(tmp: Path) -> dict[str, object]:
        tok = install_chat_template(AutoTokenizer.from_pretrained(str(base)))
        ids, labels = encode(sample, tools, tok)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
        inputs = torch.tensor([ids])
        # Position i predicts token i + 1: keep only the logits of trained targets.
        keep = torch.tensor([i - 1 for i, lab in enumerate(labels) if lab != -100])
        targets = inputs[0, keep + 1]
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        # Until every target has probability over 0.95: each is then the argmax, so greedy
        # decoding follows the sample token by token. (A mean loss bound does not say that: at
        # a mean of 0.02 one target of an AVX2 CPU's run was still second, 159 steps in.)
        steps, worst = 0, float("inf")
        while worst >= 0.05 and steps < 600:
            logits = model(input_ids=inputs, logits_to_keep=keep).logits[0]
            per_token = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
            opt.zero_grad()
            per_token.mean().backward()
            opt.step()
            steps, worst = steps + 1, per_token.max().item()
        model.eval()
        prompt = tok(render(messages, tools, add_generation_prompt=True),
                     add_special_tokens=False, return_tensors="pt")["input_ids"]
        out = model.generate(prompt, max_new_tokens=80, do_sample=False)
        said = tok.decode(out[0, prompt.shape[1]:], skip_special_tokens=False)
        assert said == REPLY + "<|im_end|>", f"not learned after {steps} steps: {said!r}"
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        return {"name": CALLER_NAME, "source": str(base), "steps": steps}

    return _atomic_save(dest, save)


@pytest.fixture(scope="module")
def caller_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[InferenceServer]:
    model = _train_caller(tiny_model_dir, _models_cache() / CALLER_NAME)
    log = tmp_path_factory.mktemp("caller") / "server.log"
    with InferenceServer(model, served_model_name="caller", log_path=log,
                         startup_timeout_s=240, threads=1) as server:
        yield server


def _sdk(server: InferenceServer) -> OpenAI:
    return OpenAI(base_url=server.base_url, api_key="unused")


def _stream(server: InferenceServer, **request: Any) -> tuple[list[Any], Any]:
    """The chunks of a streamed request and the choice the SDK assembles from them."""
    state: ChatCompletionStreamState[Any] = ChatCompletionStreamState()
    chunks = list(_sdk(server).chat.completions.create(stream=True, **request))
    for chunk in chunks:
        state.handle_chunk(chunk)
    return chunks, state.current_completion_snapshot.choices[0]


def _calls(message: Any) -> list[tuple[str, Any]]:
    return [(c.function.name, json.loads(c.function.arguments))
            for c in message.tool_calls or []]


@pytest.mark.slow
def test_a_trained_tool_call_comes_back_as_openai_tool_calls(
        caller_server: InferenceServer) -> None:
    request = {"model": "caller", "messages": QUESTION, "tools": TOOLS, "max_tokens": 80}
    full = _sdk(caller_server).chat.completions.create(**request)
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    assert _calls(choice.message) == CALLS
    calls = choice.message.tool_calls or []
    assert [c.function.arguments for c in calls] == ['{"city":"Zürich"}', '{"city":"Paris"}']
    ids = [c.id for c in calls]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)

    chunks, streamed = _stream(caller_server, **request,
                               stream_options={"include_usage": True})
    assert streamed.finish_reason == "tool_calls"
    assert streamed.message.content == "Checking."
    assert _calls(streamed.message) == CALLS
    first = chunks[0].choices[0].delta
    assert first.role == "assistant" and first.content is None
    heads = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []
             if tc.id is not None]
    assert [(h.index, h.type, h.function.name, h.function.arguments) for h in heads] == \
        [(0, "function", "get_weather", ""), (1, "function", "get_weather", "")]
    assert [h.id for h in heads] == [c.id for c in streamed.message.tool_calls or []]
    assert chunks[-1].usage is not None and full.usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


@pytest.mark.slow
def test_a_call_cut_by_max_tokens_or_not_asked_for_is_content(
        caller_server: InferenceServer) -> None:
    cut = {"model": "caller", "messages": QUESTION, "tools": TOOLS, "max_tokens": 12}
    full = _sdk(caller_server).chat.completions.create(**cut).choices[0]
    assert full.finish_reason == "length" and not full.message.tool_calls
    assert full.message.content is not None
    assert full.message.content.startswith("Checking.\n<tool_call>")
    assert REPLY.startswith(full.message.content)
    _, streamed = _stream(caller_server, **cut)
    assert streamed.finish_reason == "length" and not streamed.message.tool_calls
    assert streamed.message.content == full.message.content

    # tool_choice "none": the model's text is returned as it is.
    plain = {"model": "caller", "messages": QUESTION, "tools": TOOLS, "max_tokens": 80,
             "tool_choice": "none"}
    full = _sdk(caller_server).chat.completions.create(**plain).choices[0]
    assert (full.finish_reason, full.message.content, full.message.tool_calls) == \
        ("stop", REPLY, None)
    _, streamed = _stream(caller_server, **plain)
    assert (streamed.finish_reason, streamed.message.content) == ("stop", REPLY)


AGENT_TURN: list[Any] = [
    *QUESTION,
    {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "call_x1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}},
        {"id": "call_x2", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_x1", "content": '{"temp_c": 21, "sky": "sunny"}'},
    {"role": "tool", "tool_call_id": "call_x2", "content": '{"temp_c": 12, "sky": "rain"}'},
]


def test_a_multi_turn_request_renders_as_in_training(cpu_server: InferenceServer,
                                                     tiny_model_dir: Path) -> None:
    from factory.trainer.chat import load_tokenizer

    messages, tools = canonical_request(AGENT_TURN, TOOLS)
    assert messages[1]["tool_calls"][0]["arguments"] == '{"city":"Zürich"}'
    assert messages[2]["content"][0]["text"] == '{"sky":"sunny","temp_c":21}'
    tok = load_tokenizer(str(tiny_model_dir))
    # Without the generation prompt the server renders the conversation as the trainer does ...
    rendered = cpu_server.client().rendered_ids("base", AGENT_TURN, TOOLS)
    assert rendered == tok(render(messages, tools), add_special_tokens=False)["input_ids"]
    # ... and the chat prompt is the trainer's rendering with the generation prompt.
    prompt = tok(render(messages, tools, add_generation_prompt=True),
                 add_special_tokens=False)["input_ids"]
    full = _sdk(cpu_server).chat.completions.create(model="base", messages=AGENT_TURN,
                                                    tools=TOOLS, max_tokens=2)
    assert full.usage is not None and full.usage.prompt_tokens == len(prompt)


def test_any_reply_to_a_request_with_tools_is_well_formed(cpu_server: InferenceServer) -> None:
    """The random base model writes anything; streamed or not, the reply keeps OpenAI's shape."""
    for messages in (QUESTION, AGENT_TURN):
        request = {"model": "base", "messages": messages, "tools": TOOLS, "max_tokens": 24}
        full = _sdk(cpu_server).chat.completions.create(**request).choices[0]
        _, streamed = _stream(cpu_server, **request)
        for choice in (full, streamed):
            content, calls = choice.message.content, choice.message.tool_calls
            assert content is None or isinstance(content, str)
            if calls:
                assert choice.finish_reason in ("tool_calls", "length")
                assert all(isinstance(c.function.arguments, str) for c in calls)
            else:
                assert choice.finish_reason in ("stop", "length")
                assert isinstance(content, str)
        # Greedy decoding: the stream assembles into the same reply.
        assert streamed.message.content == full.message.content
        assert _calls(streamed.message) == _calls(full.message)
        assert streamed.finish_reason == full.finish_reason
    bad = httpx.post(cpu_server.base_url + "/chat/completions", json={
        "model": "base", "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"description": "no name"}}]})
    assert bad.status_code == 400
    assert "request.tools[0].function.name" in bad.json()["error"]["message"]
