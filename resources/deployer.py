"""``DeployerResource`` (key ``deployer``): how the ``deployment`` asset runs servers.

The embedded default runs the factory's CPU server (transformers); on GPU machines set
``backend="vllm"``. The server is sized like the checkpoint's evals were: by the eval serving size of
its run's plan; a sizing field set here overrides the plan (they become ``vllm serve`` flags).
"""

from typing import Any

import dagster as dg

from factory.deploy import DeployConfig, Deployer
from factory.lake import LakeSession


class DeployerResource(dg.ConfigurableResource):  # type: ignore[type-arg]
    """Server backend, startup limit, how a replaced version is drained, and sizing overrides.
    ``drain_s`` should cover a few ``routes_poll_s`` of the running gateways (2 s by default)."""

    backend: str = "transformers"
    threads: int | None = None
    startup_timeout_s: float = 600.0
    drain_s: float = 10.0
    stop_timeout_s: float = 120.0
    gpu_memory_utilization: float | None = None
    """Override of the plan's eval ``gpu_memory_utilization``."""
    max_num_seqs: int | None = None
    """Override of the plan's eval ``max_num_seqs`` (also the CPU server's largest batch)."""
    tensor_parallel_size: int | None = None
    """Override of the plan's eval ``devices``."""
    max_model_len: int | None = None
    """Override of the plan's max model length (max_seq_len + new tokens)."""
    max_lora_rank: int | None = None
    """Override of the rank bucket derived from the plan's ``lora_rank``."""

    def config(self) -> DeployConfig:
        overrides: dict[str, Any] = {k: v for k, v in {
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "max_num_seqs": self.max_num_seqs, "tensor_parallel_size": self.tensor_parallel_size,
            "max_model_len": self.max_model_len, "max_lora_rank": self.max_lora_rank,
        }.items() if v is not None}
        return DeployConfig(
            backend=self.backend, threads=self.threads,
            startup_timeout_s=self.startup_timeout_s, drain_s=self.drain_s,
            stop_timeout_s=self.stop_timeout_s, overrides=overrides)

    def deployer(self, session: LakeSession) -> Deployer:
        """A deployer whose lake writes are stamped by ``session`` (run id, asset, reads)."""
        return Deployer(config=self.config(), session=session)
