"""``InferenceResource`` (key ``inference``): starts the server evals and deploys talk to."""

from collections.abc import Mapping

import dagster as dg

from factory.inference.launcher import InferenceServer
from factory.inference.vllm import ServeSizing


class InferenceResource(dg.ConfigurableResource):  # type: ignore[type-arg]
    """``backend``: ``transformers`` (the factory's CPU server) or ``vllm`` (GPU machines).
    The sizing fields are the eval sandbox's (vLLM flags; the CPU server uses
    ``max_model_len`` and ``max_num_seqs`` as its largest batch)."""

    backend: str = "transformers"
    startup_timeout_s: float = 600.0
    max_tokens: int = 128
    concurrency: int = 8
    threads: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 8
    tensor_parallel_size: int = 1
    max_model_len: int = 4096
    max_lora_rank: int = 64

    def sizing(self) -> ServeSizing:
        return ServeSizing(gpu_memory_utilization=self.gpu_memory_utilization,
                           max_num_seqs=self.max_num_seqs,
                           tensor_parallel_size=self.tensor_parallel_size,
                           max_model_len=self.max_model_len, max_lora_rank=self.max_lora_rank)

    def server(self, model: str, adapters: Mapping[str, str] | None = None, *,
               served_model_name: str = "base") -> InferenceServer:
        """A server (not started: use ``with``) for ``model`` with ``adapters``."""
        return InferenceServer(model, adapters=adapters, served_model_name=served_model_name,
                               backend=self.backend, sizing=self.sizing(),
                               startup_timeout_s=self.startup_timeout_s, threads=self.threads)
