"""The exact ``vllm serve`` command line for a model and its LoRA adapters.

vLLM runs where a GPU exists (it is not installed on CPU machines), so this module only builds
the argv; ``InferenceServer`` runs it the same way it runs the CPU server, and both speak the
same API (docs/serving-protocol.md: the OpenAI-compatible chat and text completions, ``/v1/models``,
``/health``, ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``; the latter two need
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` in the environment, see ``VLLM_ENV``).

Tool calls are served as the CPU server serves them: ``--enable-auto-tool-choice`` with vLLM's
``hermes`` parser, which reads exactly the trainer's call format (``<tool_call>``, a JSON object
with ``name`` and ``arguments``, ``</tool_call>``; ``factory.trainer.chat``), and ``--chat-template``
names a file holding the trainer's template of the base model's chat format (``InferenceServer``
writes it), so requests render as in training for the base model and every adapter alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

VLLM_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
"""Environment the vLLM server needs for runtime adapter loading."""
TOOL_CALL_PARSER = "hermes"
"""vLLM's parser for ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, the format
``factory.trainer.chat`` renders calls in (vLLM's tool-calling docs list it for Hermes 2 Pro and later;
its ``Hermes2ProToolParser`` reads the JSON between those tags)."""


@dataclass(frozen=True, kw_only=True)
class ServeSizing:
    """How big the server is and how the engine uses it (the plan fills this in)."""

    gpu_memory_utilization: float = 0.9
    """Share of each GPU's memory vLLM may take for weights, activations and KV cache."""
    max_num_seqs: int = 64
    """Most sequences decoded at once."""
    tensor_parallel_size: int = 1
    """GPUs the model is sharded over."""
    max_model_len: int = 4096
    """Longest prompt + completion in tokens (bounds the KV cache per sequence)."""
    max_lora_rank: int = 16
    """Largest LoRA rank an adapter may have (vLLM preallocates for it)."""
    max_loras: int = 4
    """Adapters resident on the GPU at once."""
    dtype: str = "auto"
    """Weight dtype (``auto`` keeps the checkpoint's)."""

    def validate(self) -> None:
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization: must be in (0, 1], got "
                             f"{self.gpu_memory_utilization!r}")
        for name in ("max_num_seqs", "tensor_parallel_size", "max_model_len", "max_lora_rank",
                     "max_loras"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}: must be an integer >= 1, got {v!r}")
        if self.max_lora_rank not in (8, 16, 32, 64, 128, 256, 320, 512):
            # vLLM only accepts these ranks for its punica kernels.
            raise ValueError("max_lora_rank: vLLM supports 8, 16, 32, 64, 128, 256, 320, 512; "
                             f"got {self.max_lora_rank}")


def lora_rank_bucket(rank: int) -> int:
    """The smallest rank vLLM accepts for ``--max-lora-rank`` that fits an adapter of ``rank``."""
    for r in (8, 16, 32, 64, 128, 256, 320, 512):
        if rank <= r:
            return r
    raise ValueError(f"lora rank {rank} is above vLLM's largest (512)")


def vllm_serve_command(sizing: ServeSizing, model: str, adapters: Mapping[str, str] | None = None,
                       *, chat_template: str, served_model_name: str | None = None,
                       host: str = "127.0.0.1", port: int = 8000,
                       executable: str = "vllm") -> list[str]:
    """``vllm serve MODEL ...`` as argv: the name clients ask for (``--served-model-name``,
    default ``model``), ``--chat-template`` (a file holding the template the model was trained
    with: without it vLLM renders with the tokenizer's own, which for SmolLM2 knows no tools),
    tool calls parsed by ``TOOL_CALL_PARSER``, LoRA enabled (adapters also hot-loadable later),
    the sizing's limits, and the adapters as ``--lora-modules name=path``."""
    sizing.validate()
    if not chat_template:
        raise ValueError("chat_template: the file of the template the model was trained with "
                         "is required")
    cmd = [executable, "serve", model,
           "--host", host, "--port", str(port),
           "--served-model-name", served_model_name or model,
           "--chat-template", chat_template,
           "--enable-auto-tool-choice", "--tool-call-parser", TOOL_CALL_PARSER,
           "--dtype", sizing.dtype,
           "--max-model-len", str(sizing.max_model_len),
           "--gpu-memory-utilization", str(sizing.gpu_memory_utilization),
           "--max-num-seqs", str(sizing.max_num_seqs),
           "--tensor-parallel-size", str(sizing.tensor_parallel_size),
           "--enable-lora",
           "--max-lora-rank", str(sizing.max_lora_rank),
           "--max-loras", str(sizing.max_loras)]
    if adapters:
        cmd.append("--lora-modules")
        cmd += [f"{name}={path}" for name, path in adapters.items()]
    return cmd
