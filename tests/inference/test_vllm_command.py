"""The ``vllm serve`` argv, exactly."""

from __future__ import annotations

from pathlib import Path

import pytest

from factory.inference import (
    InferenceServer,
    ServeSizing,
    cpu_serve_command,
    lora_rank_bucket,
    vllm_serve_command,
)
from factory.trainer.chat import CHAT_TEMPLATE


def test_vllm_serve_argv() -> None:
    sizing = ServeSizing(gpu_memory_utilization=0.85, max_num_seqs=32, tensor_parallel_size=2,
                         max_model_len=2048, max_lora_rank=16, max_loras=2)
    cmd = vllm_serve_command(sizing, "/models/smollm2", {"demo-step-40": "/ckpt/step-40"},
                             chat_template="/t.jinja", served_model_name="base", host="0.0.0.0",
                             port=8123)
    assert cmd == ["vllm", "serve", "/models/smollm2", "--host", "0.0.0.0", "--port", "8123",
                   "--served-model-name", "base", "--chat-template", "/t.jinja",
                   "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                   "--dtype", "auto", "--max-model-len", "2048",
                   "--gpu-memory-utilization", "0.85", "--max-num-seqs", "32",
                   "--enable-prefix-caching",
                   "--tensor-parallel-size", "2", "--enable-lora", "--max-lora-rank", "16",
                   "--max-loras", "2", "--lora-modules", "demo-step-40=/ckpt/step-40"]


def test_no_adapters_and_the_chat_template_is_required() -> None:
    cmd = vllm_serve_command(ServeSizing(), "m", chat_template="/t.jinja")
    assert "--lora-modules" not in cmd
    assert "--enable-lora" in cmd  # adapters can still be hot-loaded later
    assert cmd[cmd.index("--served-model-name") + 1] == "m"
    with pytest.raises(ValueError, match="chat_template"):
        vllm_serve_command(ServeSizing(), "m", chat_template="")


def test_the_launcher_serves_vllm_with_the_trainers_chat_template(factory_home: Path) -> None:
    server = InferenceServer("/models/smollm2", adapters={"a": "/ckpt/a"}, backend="vllm",
                             port=8123)
    cmd = server.command()
    path = Path(cmd[cmd.index("--chat-template") + 1])
    assert path.parent == factory_home / "inference"
    assert path.read_text(encoding="utf-8") == CHAT_TEMPLATE
    assert cmd[cmd.index("--tool-call-parser") + 1] == "hermes"
    assert "--enable-auto-tool-choice" in cmd
    # The same command every time (a failed start's metadata shows the argv that ran), and the
    # file outlives the launcher (a deployment runs detached from it).
    server.stop()
    assert server.command() == cmd and path.is_file()


def test_a_gemma_base_is_served_with_the_gemma_template(factory_home: Path,
                                                        tiny_gemma3_dir: Path) -> None:
    from factory.trainer.chat import GEMMA, chat_template

    cmd = InferenceServer(tiny_gemma3_dir, backend="vllm", port=8123).command()
    path = Path(cmd[cmd.index("--chat-template") + 1])
    assert path.read_text(encoding="utf-8") == chat_template(GEMMA)


@pytest.mark.parametrize(("field", "value"), [("gpu_memory_utilization", 1.5),
                                              ("max_num_seqs", 0), ("max_lora_rank", 12)])
def test_bad_sizing_is_refused(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        vllm_serve_command(ServeSizing(**{field: value}), "m",  # type: ignore[arg-type]
                           chat_template="/t.jinja")


def test_rank_bucket_and_cpu_argv() -> None:
    assert [lora_rank_bucket(r) for r in (4, 8, 9, 64)] == [8, 8, 16, 64]
    cmd = cpu_serve_command("m", {"a": "/p"}, served_model_name="base", port=9)
    assert cmd[1:4] == ["-m", "factory.inference", "m"]
    assert cmd[-2:] == ["--lora-modules", "a=/p"]


def test_an_adapter_with_trained_token_rows_is_refused_for_vllm(tmp_path: Path) -> None:
    """vLLM's LoRA loading reads no trained embedding rows: an adapter that has them (the
    Gemma base's turn tokens) is refused by name, with the backend that serves it, instead of
    being served without them; the hosts refuse it before starting or joining an engine."""
    import json
    from datetime import UTC, datetime

    from factory.deploy.hosts import HostError, ProcessHost, ServerSpec
    from factory.inference.vllm import adapter_problem

    rows, plain = tmp_path / "rows", tmp_path / "plain"
    for folder, config in ((rows, {"r": 16, "trainable_token_indices": [105, 106]}),
                           (plain, {"r": 16})):
        folder.mkdir()
        (folder / "adapter_config.json").write_text(json.dumps(config))
    assert adapter_problem(plain) is None
    assert adapter_problem(tmp_path / "elsewhere") is None
    problem = adapter_problem(rows)
    assert problem is not None and "[105, 106]" in problem and "transformers backend" in problem
    vllm_serve_command(ServeSizing(), "m", {"a": str(plain)}, chat_template="/t.jinja")
    with pytest.raises(ValueError, match="transformers backend"):
        vllm_serve_command(ServeSizing(), "m", {"a": str(rows)}, chat_template="/t.jinja")
    spec = ServerSpec(name="demo", version="v1", adapter="demo-v1", checkpoint=str(rows),
                      base_model="m", backend="vllm", sizing=ServeSizing(),
                      started_at=datetime.now(UTC))
    with pytest.raises(HostError, match="transformers backend"):
        ProcessHost(log_root=tmp_path / "logs").start(spec)
    assert not (tmp_path / "logs").exists()  # refused before any server started
