"""``InferenceResource`` (key ``inference``): starts the server evals talk to.

One class per backend, chosen per deployment in ``factory/definitions.py``:
``CPUInferenceResource`` (the factory's CPU server, the embedded default) and
``VLLMInferenceResource`` (``vllm serve`` on GPU machines). The assets type against
``InferenceResource``. Size overrides: ``factory.resources.server``.
"""

from collections.abc import Mapping
from typing import Any

from factory.inference.launcher import InferenceServer
from factory.inference.sizing import ServingSize, serving_size_for
from factory.resources.server import CPUServer, ServerResource, VLLMServer


class InferenceResource(ServerResource):
    """The eval server: sized by the eval serving size of the checkpoint's run plan, each size
    field set here overriding the plan's; left unset, the plan decides (or a default, for a run
    without a plan)."""

    max_tokens: int | None = None
    """Override of the plan's ``max_new_tokens`` (tokens per generated answer)."""
    concurrency: int | None = None
    """Override of the plan's ``batch_size`` (requests in flight; the CPU server's batch)."""

    def overrides(self) -> dict[str, Any]:
        """The serving size fields set on this resource."""
        generation = {"max_new_tokens": self.max_tokens, "batch_size": self.concurrency}
        return {**{k: v for k, v in generation.items() if v is not None}, **super().overrides()}

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
                               startup_timeout_s=self.startup_timeout_s,
                               threads=self.server_threads())


class CPUInferenceResource(CPUServer, InferenceResource):
    """Evals on the factory's CPU server (transformers)."""


class VLLMInferenceResource(VLLMServer, InferenceResource):
    """Evals on ``vllm serve``."""
