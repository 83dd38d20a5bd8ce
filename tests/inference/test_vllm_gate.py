"""On a machine with a CUDA GPU and vLLM: ``vllm serve`` started with the factory's argv serves
SmolLM2-135M-Instruct and a LoRA checkpoint hot-loaded through the runtime LoRA API; its answers
have the contract's shapes, and the equivalence gate passes it with the tolerance the eval
asset uses for vLLM (0.1 nats: bf16 against the trainer's fp32). Skipped elsewhere."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from factory.evals import check_equivalence
from factory.inference import InferenceServer, ServeSizing
from factory.inference.contract import check
from factory.tasks import generate_conversations
from tests.inference.conftest import make_adapter


def _gpu_and_vllm() -> bool:
    import torch

    return torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _gpu_and_vllm(), reason="needs a CUDA GPU and vLLM")]


def test_vllm_serve_speaks_the_contract_and_passes_the_gate(
        smollm2_dir: Path, tmp_path: Path, factory_home: Path) -> None:
    checkpoint = make_adapter(smollm2_dir, tmp_path / "step-1", seed=1)
    samples = [{"messages": [{"role": m["role"], "content": [{"type": "text",
                                                              "text": m["content"]}]}
                             for m in c["messages"]], "tools": []}
               for c in generate_conversations(4, seed=5)]
    sizing = ServeSizing(gpu_memory_utilization=0.3, max_num_seqs=8, max_model_len=2048,
                         max_lora_rank=8, max_loras=2)
    with InferenceServer(smollm2_dir, served_model_name="base", backend="vllm", sizing=sizing,
                         startup_timeout_s=600, log_path=tmp_path / "vllm.log") as server:
        client = server.client()
        client.load_adapter("step-1", str(checkpoint))
        assert set(client.models()) == {"base", "step-1"}
        conv = samples[0]["messages"][:-1]
        check("chat.response", client.chat("step-1", conv, max_tokens=8, logprobs=True,
                                           top_logprobs=2, return_token_ids=True))
        ids = client.rendered_ids("step-1", samples[0]["messages"])
        check("completion.response", client.complete(
            "step-1", ids, max_tokens=0, echo=True, logprobs=1,
            return_tokens_as_token_ids=True, prompt_logprobs=1))
        result = check_equivalence(client, "step-1", str(checkpoint), samples,
                                   base_model=str(smollm2_dir), atol=0.1)
        assert result.passed, (result.problems, server.log_tail())
        assert result.num_tokens > 20
