"""What the ``inference`` and ``deployer`` resources share: which server runs, and its size.

A server is sized by the eval serving size of the checkpoint's run plan
(``factory.inference.sizing``); each size field set on the resource overrides the plan's
(recorded as ``override`` in the run's metadata), unset ones leave it to the plan. The fields are
declared once, in ``ServerResource``; the backend is a class: ``CPUServer`` (the factory's
transformers server, the embedded default) or ``VLLMServer`` (``vllm serve`` on GPU machines),
mixed into each resource (``CPUInferenceResource``, ``VLLMDeployerResource``...).
"""

from abc import abstractmethod
from typing import Any

import dagster as dg

from factory.inference.sizing import FIELDS


class ServerResource(dg.ConfigurableResource):  # type: ignore[type-arg]
    """Startup limit and size overrides of an inference server; the backend is a subclass."""

    startup_timeout_s: float = 600.0
    """Longest wait for the server to answer its health check."""
    gpu_memory_utilization: float | None = None
    """Override of the plan's ``gpu_memory_utilization`` (vLLM)."""
    max_num_seqs: int | None = None
    """Override of the plan's ``max_num_seqs`` (vLLM; also the CPU server's largest batch)."""
    tensor_parallel_size: int | None = None
    """Override of the plan's ``devices`` (vLLM tensor parallelism)."""
    max_model_len: int | None = None
    """Override of the plan's max model length (max_seq_len + new tokens)."""
    max_lora_rank: int | None = None
    """Override of the rank bucket derived from the plan's ``lora_rank`` (vLLM)."""

    @property
    @abstractmethod
    def backend(self) -> str:
        """The server that runs: ``transformers`` or ``vllm`` (``factory.inference.launcher``)."""

    def server_threads(self) -> int | None:
        """torch intra-op threads of the CPU server (None: torch decides)."""
        return None

    def overrides(self) -> dict[str, Any]:
        """The serving size fields (``factory.inference.sizing.FIELDS``) set on this resource."""
        return {name: getattr(self, name) for name in FIELDS
                if name in type(self).model_fields and getattr(self, name) is not None}


class CPUServer(ServerResource):
    """The factory's CPU server (``python -m factory.inference``, transformers)."""

    threads: int | None = None
    """torch intra-op threads of the server; None lets torch decide."""

    @property
    def backend(self) -> str:
        return "transformers"

    def server_threads(self) -> int | None:
        return self.threads


class VLLMServer(ServerResource):
    """``vllm serve`` on this machine's GPUs."""

    @property
    def backend(self) -> str:
        return "vllm"
