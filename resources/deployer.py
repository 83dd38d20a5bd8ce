"""``DeployerResource`` (key ``deployer``): how the ``deployment`` asset runs servers.

The embedded default runs the factory's CPU server (transformers); on GPU machines set
``backend="vllm"`` and the sizing fields (they become ``vllm serve`` flags).
"""

import dagster as dg

from factory.deploy import DeployConfig, Deployer
from factory.inference import ServeSizing
from factory.lake import LakeSession


class DeployerResource(dg.ConfigurableResource):  # type: ignore[type-arg]
    """Server backend and sizing, startup limit, and how a replaced version is drained.
    ``drain_s`` should cover a few ``routes_poll_s`` of the running gateways (2 s by default)."""

    backend: str = "transformers"
    threads: int | None = None
    startup_timeout_s: float = 600.0
    drain_s: float = 10.0
    stop_timeout_s: float = 120.0
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 8
    tensor_parallel_size: int = 1
    max_model_len: int = 4096
    max_lora_rank: int = 64

    def config(self) -> DeployConfig:
        return DeployConfig(
            backend=self.backend, threads=self.threads,
            startup_timeout_s=self.startup_timeout_s, drain_s=self.drain_s,
            stop_timeout_s=self.stop_timeout_s,
            sizing=ServeSizing(gpu_memory_utilization=self.gpu_memory_utilization,
                               max_num_seqs=self.max_num_seqs,
                               tensor_parallel_size=self.tensor_parallel_size,
                               max_model_len=self.max_model_len,
                               max_lora_rank=self.max_lora_rank))

    def deployer(self, session: LakeSession) -> Deployer:
        """A deployer whose lake writes are stamped by ``session`` (run id, asset, reads)."""
        return Deployer(config=self.config(), session=session)
