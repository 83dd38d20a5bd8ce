"""``DeployerResource`` (key ``deployer``): how the ``deployment`` asset runs servers.

One class per backend, chosen per deployment in ``factory/definitions.py``:
``CPUDeployerResource`` (the factory's CPU server, the embedded default) and
``VLLMDeployerResource`` (``vllm serve`` on GPU machines). The asset types against
``DeployerResource``. A server is sized like the checkpoint's evals were: by the eval serving size
of its run's plan, each size field set here overriding it (``factory.resources.server``).
"""

from factory.deploy import DeployConfig, Deployer
from factory.lake import LakeSession
from factory.resources.server import CPUServer, ServerResource, VLLMServer


class DeployerResource(ServerResource):
    """Startup limit, how a replaced version is drained, and size overrides. ``drain_s`` should
    cover a few ``routes_poll_s`` of the running gateways (2 s by default)."""

    drain_s: float = 10.0
    """How long a replaced version keeps serving after the route moved."""
    stop_timeout_s: float = 120.0
    """After the drain, how long a server gets to finish in-flight requests on SIGTERM."""

    def config(self) -> DeployConfig:
        return DeployConfig(
            backend=self.backend, threads=self.server_threads(),
            startup_timeout_s=self.startup_timeout_s, drain_s=self.drain_s,
            stop_timeout_s=self.stop_timeout_s, overrides=self.overrides())

    def deployer(self, session: LakeSession) -> Deployer:
        """A deployer whose lake writes are stamped by ``session`` (run id, asset, reads)."""
        return Deployer(config=self.config(), session=session)


class CPUDeployerResource(CPUServer, DeployerResource):
    """Deployments on the factory's CPU server (transformers)."""


class VLLMDeployerResource(VLLMServer, DeployerResource):
    """Deployments on ``vllm serve``."""
