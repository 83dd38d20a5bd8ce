"""``DeployerResource`` (key ``deployer``): how the ``deployment`` asset runs servers.

One class per backend and place, chosen per deployment in ``factory/definitions.py``:
``CPUDeployerResource`` (the factory's CPU server as a process on this machine, the embedded
default), ``VLLMDeployerResource`` (``vllm serve`` processes on this GPU machine), and
``KubernetesCPUDeployerResource`` / ``KubernetesVLLMDeployerResource`` (either server as a
Kubernetes Deployment and Service; the cluster settings are the fields of
``factory.deploy.kubernetes.KubernetesHost``, made into config by ``factory.resources.config``).
The asset types against ``DeployerResource``. A server is sized like the checkpoint's evals
were: by the eval serving size of its run's plan, each size field set here overriding it
(``factory.resources.server``).
"""

from typing import Any

import dagster as dg

from factory.deploy import DeployConfig, Deployer
from factory.deploy.hosts import ServerHost
from factory.deploy.kubernetes import KubernetesHost
from factory.lake import LakeSession
from factory.resources.config import config_class, from_config
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

    def host(self) -> ServerHost | None:
        """Where the servers run; None: detached processes on this machine."""
        return None

    def deployer(self, session: LakeSession) -> Deployer:
        """A deployer whose lake writes are stamped by ``session`` (run id, asset, reads)."""
        return Deployer(config=self.config(), session=session, host=self.host())


class CPUDeployerResource(CPUServer, DeployerResource):
    """Deployments on the factory's CPU server (transformers)."""


class VLLMDeployerResource(VLLMServer, DeployerResource):
    """Deployments on ``vllm serve``."""


_KubernetesHostFields: Any = config_class(KubernetesHost, base=dg.ConfigurableResource)


class KubernetesDeployerResource(_KubernetesHostFields, DeployerResource):
    """Deployments on Kubernetes: one Deployment and Service per base model, each version an
    adapter of it (``share``; a Deployment and Service per version without it), with the
    fields of ``KubernetesHost``: API server and login, image, namespace, node pool, shared
    volume, secrets; the server is a subclass's."""

    def host(self) -> ServerHost:
        return from_config(KubernetesHost, self)


class KubernetesCPUDeployerResource(CPUServer, KubernetesDeployerResource):
    """The factory's CPU server in pods of the factory image."""


class KubernetesVLLMDeployerResource(VLLMServer, KubernetesDeployerResource):
    """``vllm serve`` in pods of a vLLM image, on the GPU pool."""
