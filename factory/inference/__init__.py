"""Inference for evals and deploys: one protocol, the part of vLLM's OpenAI-compatible server
the factory uses (docs/serving-protocol.md, ``contract``), two servers (vLLM on GPUs, the
factory's transformers server on CPU), one launcher."""

from factory.inference.client import InferenceClient, InferenceClientError
from factory.inference.launcher import (
    InferenceServer,
    InferenceServerError,
    cpu_serve_command,
    free_port,
)
from factory.inference.vllm import ServeSizing, lora_rank_bucket, vllm_serve_command

__all__ = ["InferenceClient", "InferenceClientError", "InferenceServer", "InferenceServerError",
           "ServeSizing", "cpu_serve_command", "free_port", "lora_rank_bucket",
           "vllm_serve_command"]
