"""Adapters resolved by name from a folder (``factory.inference.resolver``): the layout the
deployer publishes (links to the checkpoint's files, a config naming the engine's served base),
and the CPU server loading a published adapter on the first request that names it, by vLLM's
filesystem resolver's rule (the base named as the server's ``--model`` names it). tests/inference/test_vllm_gate.py checks vLLM reads the same layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from factory.inference import InferenceServer
from factory.inference.resolver import find, publish, published, resolver_env, withdraw
from tests.inference.conftest import make_adapter

MSGS = [{"role": "user", "content": "Hello!"}]


def _checkpoint(path: Path, base: str = "/models/base") -> Path:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 8, "base_model_name_or_path": base}))
    (path / "adapter_model.safetensors").write_bytes(b"weights")
    return path


def test_publish_links_the_files_and_names_the_engines_base(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path / "runs" / "step-4")
    folder = tmp_path / "engine"
    target = publish(folder, "exp-v1", ckpt, "/shared/models/smollm2")
    assert (target / "adapter_model.safetensors").is_symlink()
    assert (target / "adapter_model.safetensors").read_bytes() == b"weights"
    assert json.loads((target / "adapter_config.json").read_text())[
        "base_model_name_or_path"] == "/shared/models/smollm2"
    # The checkpoint's own config is untouched: the trainer's record of its base stays.
    assert json.loads((ckpt / "adapter_config.json").read_text())[
        "base_model_name_or_path"] == "/models/base"
    assert find(folder, "exp-v1", "/shared/models/smollm2") == target
    assert find(folder, "exp-v1", "another-base") is None  # vLLM's rule: the base must match
    assert find(folder, "exp-v2", "/shared/models/smollm2") is None
    assert find(folder, "../runs", "/shared/models/smollm2") is None
    assert published(folder) == ["exp-v1"]

    other = _checkpoint(tmp_path / "runs" / "step-8")
    (other / "adapter_model.safetensors").write_bytes(b"newer")
    publish(folder, "exp-v1", other, "/shared/models/smollm2")  # a name published again: replaced
    assert (folder / "exp-v1" / "adapter_model.safetensors").read_bytes() == b"newer"
    assert published(folder) == ["exp-v1"]

    withdraw(folder, "exp-v1")
    withdraw(folder, "exp-v1")  # nothing there: nothing to do
    assert published(folder) == [] and list(folder.iterdir()) == []
    assert (other / "adapter_model.safetensors").read_bytes() == b"newer"  # only links went


def test_a_checkpoint_without_an_adapter_config_is_refused(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="adapter_config.json"):
        publish(tmp_path / "engine", "x", tmp_path / "empty", "base")
    assert published(tmp_path / "engine") == []


def test_the_cpu_server_loads_a_published_adapter_on_its_first_request(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "adapters"
    folder.mkdir()
    adapter = make_adapter(tiny_model_dir, tmp_path / "ckpt", seed=1)
    with InferenceServer(tiny_model_dir, served_model_name="engine-base", threads=1,
                         log_path=tmp_path / "server.log", startup_timeout_s=240,
                         env=resolver_env(folder)) as server:
        client = server.client()
        url = server.base_url + "/chat/completions"
        body = {"model": "exp-v1", "messages": MSGS, "max_tokens": 6}
        assert httpx.post(url, json=body, timeout=60).status_code == 404  # not published yet

        publish(folder, "exp-v1", adapter, str(tiny_model_dir))  # as its --model names it
        resolved = httpx.post(url, json=body, timeout=60)
        assert resolved.status_code == 200, resolved.text
        assert client.models() == ["engine-base", "exp-v1"]

        # The same weights loaded by hand answer the same: the links carry the checkpoint.
        client.load_adapter("by-hand", str(adapter))
        by_hand = client.chat("by-hand", MSGS, max_tokens=6)
        assert resolved.json()["choices"][0]["message"]["content"] == \
            by_hand["choices"][0]["message"]["content"]

        # An adapter of another base in the folder is not this server's.
        publish(folder, "stranger", adapter, "some-other-base")
        stranger = httpx.post(url, json={**body, "model": "stranger"}, timeout=60)
        assert stranger.status_code == 404
        assert "stranger" not in client.models()
