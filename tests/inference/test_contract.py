"""The CPU server against the serving protocol (``factory.inference.contract``): every request
here is one of the contract's, and every answer has the contract's shape and means what vLLM's
does (the prompt's token ids, their log-probs, the echoed tokens)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from factory.inference import InferenceServer
from factory.inference.contract import SCHEMAS, ContractError, check
from factory.normalize.request import wire_messages, wire_tools
from factory.trainer.chat import load_tokenizer, render

MESSAGES: list[Any] = [{"role": "system", "content": "Reply briefly."},
                       {"role": "user", "content": "Hello!"},
                       {"role": "assistant", "content": "Hi. How can I help?"}]


def _post(server: InferenceServer, endpoint: str, body: dict[str, Any],
          status: int = 200) -> Any:
    """POST a contract request to ``/v1/<path>``; the answer, checked against the contract."""
    path = {"chat": "chat/completions", "completion": "completions"}.get(endpoint, endpoint)
    check(f"{endpoint}.request", body)
    r = httpx.post(f"{server.base_url}/{path}", json=body, timeout=120)
    assert r.status_code == status, r.text
    if status != 200:
        return check("error", r.json())
    name = f"{endpoint}.response"
    return check(name, r.json()) if name in SCHEMAS else r.text


def _ids(tiny_model_dir: Path, text: str) -> list[int]:
    tok = load_tokenizer(str(tiny_model_dir))
    return list(tok(text, add_special_tokens=False)["input_ids"])


def _reference_logprobs(tiny_model_dir: Path, ids: list[int]) -> list[float]:
    """log p(ids[i + 1] | ids[:i + 1]) from the base model, computed here with transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
    lsm = torch.log_softmax(logits, dim=-1)
    return [float(lsm[i, ids[i + 1]]) for i in range(len(ids) - 1)]


def test_health_models_and_adapters(cpu_server: InferenceServer,
                                    adapter_dirs: dict[str, Path]) -> None:
    health = httpx.get(cpu_server.url + "/health")
    assert (health.status_code, health.content) == (200, b"")
    # Nothing outside the contract is served (vLLM has no such endpoint).
    assert httpx.post(cpu_server.base_url + "/score", json={}).status_code == 404
    _post(cpu_server, "load_lora_adapter",
          {"lora_name": "c", "lora_path": str(adapter_dirs["good"])})
    try:
        models = check("models.response", httpx.get(cpu_server.base_url + "/models").json())
        assert [m["id"] for m in models["data"]] == ["base", "c"]
    finally:
        text = _post(cpu_server, "unload_lora_adapter", {"lora_name": "c"})
    assert text == "Success: LoRA adapter 'c' removed successfully."


def test_a_chat_without_generation_prompt_returns_the_rendered_token_ids(
        cpu_server: InferenceServer, tiny_model_dir: Path) -> None:
    """What the equivalence gate reads: the conversation rendered as the trainer renders it."""
    out = _post(cpu_server, "chat", {"model": "base", "messages": MESSAGES, "max_tokens": 1,
                                     "add_generation_prompt": False, "return_token_ids": True,
                                     "prompt_logprobs": 2, "logprobs": True, "top_logprobs": 2})
    ids = _ids(tiny_model_dir, render(MESSAGES))
    assert out["prompt_token_ids"] == ids
    assert out["usage"]["prompt_tokens"] == len(ids)
    assert out["choices"][0]["token_ids"] and len(out["choices"][0]["logprobs"]["content"]) == 1
    # prompt_logprobs: null, then each prompt token first with its log-prob, then the top 2.
    plp = out["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    assert [next(iter(d)) for d in plp[1:]] == [str(t) for t in ids[1:]]
    assert all(2 <= len(d) <= 3 for d in plp[1:])
    reference = _reference_logprobs(tiny_model_dir, ids)
    got = [d[str(t)]["logprob"] for d, t in zip(plp[1:], ids[1:], strict=True)]
    # fp32 on both sides; only the summation order differs (~1e-6 here).
    assert got == pytest.approx(reference, abs=1e-4)
    # The default adds the generation prompt, as vLLM's does.
    default = _post(cpu_server, "chat", {"model": "base", "messages": MESSAGES[:2],
                                         "max_tokens": 1, "return_token_ids": True})
    assert default["prompt_token_ids"] == _ids(
        tiny_model_dir, render(MESSAGES[:2], add_generation_prompt=True))


def test_canonical_messages_go_as_text_and_render_as_trained(cpu_server: InferenceServer,
                                                             tiny_model_dir: Path) -> None:
    """Reasoning and image parts (which vLLM refuses) travel as the text the trainer renders
    for them, flat calls and tools nested: the same prompt, token for token."""
    canonical: list[Any] = [
        {"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                     {"type": "image", "media_type": "image/png",
                                      "sha256": "ab" * 32}]},
        {"role": "assistant", "content": [{"type": "reasoning", "text": "A cat?"}],
         "tool_calls": [{"id": "call_0", "name": "lookup", "arguments": '{"q":"cat"}'}]},
        {"role": "tool", "tool_call_id": "call_0", "content": [{"type": "text",
                                                                "text": '{"a":2}'}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]}]
    tools = [{"name": "lookup", "description": "", "parameters": {}}]
    wire = wire_messages(canonical)
    body = {"model": "base", "messages": wire, "tools": wire_tools(tools), "max_tokens": 1,
            "add_generation_prompt": False, "return_token_ids": True}
    assert wire[0]["content"] == "What is this?\n[image]"
    assert wire[1]["content"] == "<think>\nA cat?\n</think>"
    out = _post(cpu_server, "chat", body)
    assert out["prompt_token_ids"] == _ids(tiny_model_dir, render(canonical, tools))
    assert cpu_server.client().rendered_ids("base", canonical, tools) == out["prompt_token_ids"]


def test_a_streamed_chat_sends_the_prompt_token_ids_first(cpu_server: InferenceServer,
                                                          tiny_model_dir: Path) -> None:
    body = {"model": "base", "messages": MESSAGES[:2], "max_tokens": 3, "stream": True,
            "return_token_ids": True, "stream_options": {"include_usage": True}}
    check("chat.request", body)
    with httpx.stream("POST", cpu_server.base_url + "/chat/completions", json=body,
                      timeout=120) as r:
        lines = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [check("chat.chunk", json.loads(line)) for line in lines[:-1]]
    assert chunks[0]["prompt_token_ids"] == _ids(
        tiny_model_dir, render(MESSAGES[:2], add_generation_prompt=True))
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert chunks[-1]["usage"]["completion_tokens"] >= 1


def test_echo_with_logprobs_scores_the_prompts_token_ids(cpu_server: InferenceServer,
                                                         tiny_model_dir: Path) -> None:
    """What the equivalence gate reads: the log-prob of each token of a prompt given as ids."""
    ids = _ids(tiny_model_dir, render(MESSAGES))
    out = _post(cpu_server, "completion", {
        "model": "base", "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1,
        "return_tokens_as_token_ids": True})
    choice = out["choices"][0]
    lp = choice["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx(_reference_logprobs(tiny_model_dir, ids),
                                                     abs=1e-4)
    # top_logprobs: the token itself and the most likely one (one entry when they coincide).
    assert all(f"token_id:{t}" in top and 1 <= len(top) <= 2
               for t, top in zip(ids[1:], lp["top_logprobs"][1:], strict=True))
    assert lp["text_offset"][:2] == [0, len(lp["tokens"][0])]
    assert out["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0,
                            "total_tokens": len(ids)}
    # vLLM also returns the prompt log-probs it computed for echo, in its own shape.
    assert [next(iter(d)) for d in choice["prompt_logprobs"][1:]] == [str(t) for t in ids[1:]]


def test_text_completions_generate_and_echo(cpu_server: InferenceServer,
                                            tiny_model_dir: Path) -> None:
    prompt = render(MESSAGES[:2], add_generation_prompt=True)
    ids = _ids(tiny_model_dir, prompt)
    by_text = _post(cpu_server, "completion", {"model": "base", "prompt": prompt,
                                               "max_tokens": 4, "return_token_ids": True})
    by_ids = _post(cpu_server, "completion", {"model": "base", "prompt": ids, "max_tokens": 4})
    text = by_text["choices"][0]["text"]
    assert text == by_ids["choices"][0]["text"]  # greedy: the same completion
    assert by_text["choices"][0]["prompt_token_ids"] == ids
    generated = by_text["choices"][0]["token_ids"]
    assert 1 <= len(generated) <= 4 and by_text["usage"]["completion_tokens"] == len(generated)

    echoed = _post(cpu_server, "completion", {"model": "base", "prompt": prompt,
                                              "max_tokens": 4, "echo": True, "logprobs": 2})
    choice = echoed["choices"][0]
    assert choice["text"] == prompt + text
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(ids) + len(generated)
    assert all(v is not None and v <= 0 for v in lp["token_logprobs"][1:])
    assert all(2 <= len(top) <= 3 for top in lp["top_logprobs"][1:])

    plain = _post(cpu_server, "completion", {"model": "base", "prompt": ids, "max_tokens": 4,
                                             "logprobs": 0})
    assert len(plain["choices"][0]["logprobs"]["tokens"]) == len(generated)


@pytest.mark.parametrize(("body", "status", "message"), [
    ({"model": "base", "prompt": [1, 2], "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "base", "prompt": [1, 10**7], "max_tokens": 1}, 400, "not in the vocabulary"),
    ({"model": "nope", "prompt": "hi", "max_tokens": 1}, 404, "does not exist"),
])
def test_bad_completion_requests_get_contract_errors(cpu_server: InferenceServer,
                                                    body: dict[str, Any], status: int,
                                                    message: str) -> None:
    err = _post(cpu_server, "completion", body, status=status)
    assert message in err["error"]["message"]


def test_requests_outside_the_contract_are_named() -> None:
    with pytest.raises(ContractError, match=r"completion.request: \$: Additional properties"):
        check("completion.request", {"model": "m", "prompt": "x", "suffix": "y"})
    with pytest.raises(ContractError, match=r"\$\.prompt"):
        check("completion.request", {"model": "m", "prompt": [[1, 2], [3]]})
