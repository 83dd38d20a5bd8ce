"""The CPU server against the official ``openai`` SDK, with adapters hot-loaded and unloaded."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from openai import NotFoundError, OpenAI

from factory.inference import InferenceServer

MSGS = [{"role": "system", "content": "Reply briefly."}, {"role": "user", "content": "Hello!"}]


def test_openai_sdk_stream_and_not_with_hot_loaded_adapter(
        cpu_server: InferenceServer, adapter_dirs: dict[str, Path]) -> None:
    c = cpu_server.client()
    c.load_adapter("good", str(adapter_dirs["good"]))
    try:
        sdk = OpenAI(base_url=cpu_server.base_url, api_key="unused")
        assert {m.id for m in sdk.models.list().data} == {"base", "good"}
        full = sdk.chat.completions.create(model="good", messages=MSGS,  # type: ignore[arg-type]
                                           max_tokens=12, logprobs=True, top_logprobs=2)
        choice = full.choices[0]
        assert choice.finish_reason in ("stop", "length")
        assert full.usage is not None and full.usage.completion_tokens == 12 \
            or choice.finish_reason == "stop"
        assert choice.logprobs is not None and choice.logprobs.content
        assert all(lp.logprob <= 0 for lp in choice.logprobs.content)
        stream = sdk.chat.completions.create(model="good", messages=MSGS,  # type: ignore[arg-type]
                                             max_tokens=12, stream=True,
                                             stream_options={"include_usage": True})
        chunks = list(stream)
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert text == choice.message.content  # greedy: streaming gives the same text
        assert chunks[-1].usage is not None
        base = sdk.chat.completions.create(model="base", messages=MSGS,  # type: ignore[arg-type]
                                           max_tokens=12)
        assert base.choices[0].message.content != choice.message.content  # the adapter acts
    finally:
        c.unload_adapter("good")
    assert c.models() == ["base"]
    with pytest.raises(NotFoundError):
        OpenAI(base_url=cpu_server.base_url, api_key="x").chat.completions.create(
            model="good", messages=MSGS, max_tokens=4)  # type: ignore[arg-type]


def test_batched_requests_equal_single_ones_and_adapters_stay_apart(
        cpu_server: InferenceServer, adapter_dirs: dict[str, Path]) -> None:
    c = cpu_server.client()
    c.load_adapter("a", str(adapter_dirs["good"]))
    # a sweep point's run id has dots (learning_rate=0.001), which PEFT refuses in its names
    dotted = "sweep-learning_rate-0.001-abc-step-2"
    c.load_adapter(dotted, str(adapter_dirs["other"]))
    try:
        prompts = [{"messages": [{"role": "user", "content": f"Count to {i}" + "!" * i}]}
                   for i in range(4)]
        single = [c.chat("a", p["messages"], max_tokens=6)["choices"][0]["message"]["content"]
                  for p in prompts]
        batched = [r["choices"][0]["message"]["content"]
                   for r in c.chat_many("a", prompts, max_tokens=6, concurrency=4)]
        assert batched == single  # left padding does not change greedy answers
        other = c.chat(dotted, prompts[0]["messages"], max_tokens=6)
        assert other["choices"][0]["message"]["content"] != single[0]
        assert c.chat("a", prompts[0]["messages"], max_tokens=6)["choices"][0]["message"][
            "content"] == single[0]
    finally:
        c.unload_adapter("a")
        c.unload_adapter(dotted)


def test_adapter_endpoints_speak_vllms_protocol(cpu_server: InferenceServer,
                                               adapter_dirs: dict[str, Path],
                                               tmp_path: Path) -> None:
    url = cpu_server.base_url
    r = httpx.post(url + "/load_lora_adapter",
                   json={"lora_name": "x", "lora_path": str(adapter_dirs["good"])})
    assert r.status_code == 200 and "added successfully" in r.text
    again = httpx.post(url + "/load_lora_adapter",
                       json={"lora_name": "x", "lora_path": str(adapter_dirs["good"])})
    assert again.status_code == 400 and "already been loaded" in again.text
    bad = httpx.post(url + "/load_lora_adapter", json={"lora_name": "y", "lora_path": str(tmp_path)})
    assert bad.status_code == 400 and "adapter_config.json" in bad.text
    assert httpx.post(url + "/unload_lora_adapter", json={"lora_name": "x"}).status_code == 200
    gone = httpx.post(url + "/unload_lora_adapter", json={"lora_name": "x"})
    assert gone.status_code == 404
    assert httpx.post(url + "/chat/completions", content=b"{not json").status_code == 400
    health = httpx.get(cpu_server.url + "/health")
    assert (health.status_code, health.content) == (200, b"")  # as vLLM answers


def test_a_server_that_cannot_start_reports_its_log(tmp_path: Path) -> None:
    from factory.inference import InferenceServerError

    with pytest.raises(InferenceServerError, match="exited with code"):
        InferenceServer(tmp_path / "no-model", startup_timeout_s=120).start()
