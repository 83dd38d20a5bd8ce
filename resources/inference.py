"""``InferenceResource`` (key ``inference``): starts the server evals and deploys talk to."""

from collections.abc import Mapping
from typing import Any

import dagster as dg

from factory.inference.launcher import InferenceServer
from factory.inference.sizing import ServingSize, serving_size_for


class InferenceResource(dg.ConfigurableResource):  # type: ignore[type-arg]
    """``backend``: ``transformers`` (the factory's CPU server) or ``vllm`` (GPU machines).

    The server is sized by the eval serving size of the checkpoint's run plan. A sizing field set
    here overrides the plan (recorded as ``override`` in the run's metadata); left unset, the
    plan decides (or a default, for a run without a plan)."""

    backend: str = "transformers"
    startup_timeout_s: float = 600.0
    threads: int | None = None
    max_tokens: int | None = None
    """Override of the plan's ``max_new_tokens`` (tokens per generated answer)."""
    concurrency: int | None = None
    """Override of the plan's ``batch_size`` (requests in flight; the CPU server's batch)."""
    gpu_memory_utilization: float | None = None
    """Override of the plan's ``gpu_memory_utilization`` (vLLM)."""
    max_num_seqs: int | None = None
    """Override of the plan's ``max_num_seqs`` (vLLM)."""
    tensor_parallel_size: int | None = None
    """Override of the plan's ``devices`` (vLLM tensor parallelism)."""
    max_model_len: int | None = None
    """Override of the plan's max model length (max_seq_len + new tokens)."""
    max_lora_rank: int | None = None
    """Override of the rank bucket derived from the plan's ``lora_rank`` (vLLM)."""

    def overrides(self) -> dict[str, Any]:
        """The serving size fields set on this resource."""
        return {k: v for k, v in {
            "max_new_tokens": self.max_tokens, "batch_size": self.concurrency,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "max_num_seqs": self.max_num_seqs, "tensor_parallel_size": self.tensor_parallel_size,
            "max_model_len": self.max_model_len, "max_lora_rank": self.max_lora_rank,
        }.items() if v is not None}

    def serving_size(self, plan: Mapping[str, Any] | None, *,
                no_plan_reason: str = "no plan for this run") -> ServingSize:
        """The eval serving size of a run with ``plan`` (``Plan.to_dict()``; None: no plan)."""
        return serving_size_for(plan, self.overrides(), no_plan_reason=no_plan_reason)

    def server(self, model: str, adapters: Mapping[str, str] | None = None, *,
               size: ServingSize | None = None, served_model_name: str = "base") -> InferenceServer:
        """A server (not started: use ``with``) for ``model`` with ``adapters``, sized by
        ``size`` (default: this resource's overrides over the defaults)."""
        box = size or self.serving_size(None)
        return InferenceServer(model, adapters=adapters, served_model_name=served_model_name,
                               backend=self.backend, sizing=box.sizing,
                               max_batch_size=box.cpu_batch(),
                               startup_timeout_s=self.startup_timeout_s, threads=self.threads)
