"""Where a deployed version's server runs: the interface the deployer starts, waits on and stops
servers through, and its local implementation.

``Deployer`` decides which versions exist, when the gateway route moves and what the
``deployments`` table says; a ``ServerHost`` only runs one version's server. ``ProcessHost``
runs it as a detached process on this machine (the embedded default);
``factory.deploy.kubernetes.KubernetesHost`` runs it as a Kubernetes Deployment and Service.
Each version's row names where it runs (``placement_of``), so a version is always stopped by a
host of its own kind.
"""

from __future__ import annotations

import os
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from factory.deploy.process import ProcessError, is_alive, spawn_detached, stop_group
from factory.errors import FactoryError
from factory.inference import InferenceServer, ServeSizing, free_port
from factory.inference.vllm import VLLM_ENV

if TYPE_CHECKING:
    from factory.deploy.deployer import Deployment

PROCESS = "process"
KUBERNETES = "kubernetes"
KUBERNETES_SCHEME = "kubernetes://"
"""``log_path`` of a version served on Kubernetes: ``kubernetes://<namespace>/<object name>``
(its logs are its pods'; ``kubectl -n <namespace> logs deploy/<object name>``)."""


class HostError(FactoryError):
    """A server could not be started, did not become ready, or cannot be reached to stop."""


def placement_of(dep: Deployment) -> str:
    """Where the version's server runs, read from its row: ``kubernetes`` or ``process``."""
    return KUBERNETES if (dep.log_path or "").startswith(KUBERNETES_SCHEME) else PROCESS


@dataclass(frozen=True, kw_only=True)
class ServerSpec:
    """One version's server, as the deployer asks a host to run it."""

    name: str
    """Deployment name (the experiment)."""
    version: str
    """``v1``, ``v2``...: the version being started."""
    adapter: str
    """The name the server knows the adapter by (``<name>-<version>``)."""
    checkpoint: str
    """Adapter directory to serve."""
    base_model: str
    """Base model the adapter applies to."""
    backend: str
    """``transformers`` (the factory's CPU server) or ``vllm``."""
    sizing: ServeSizing
    """Serving limits of the server."""
    threads: int | None = None
    """torch intra-op threads of the CPU server; None lets torch decide."""
    stop_timeout_s: float = 120.0
    """How long the server gets to finish in-flight requests once told to stop."""
    started_at: datetime
    """When the deployer asked for it (names its log)."""

    def server(self, *, host: str, port: int) -> InferenceServer:
        """The ``InferenceServer`` whose ``command()`` is this version's argv."""
        return InferenceServer(self.base_model, adapters={self.adapter: self.checkpoint},
                               served_model_name=f"{self.name}-base", backend=self.backend,
                               sizing=self.sizing, host=host, port=port, threads=self.threads)

    def env(self) -> dict[str, str]:
        """Environment the server needs beyond its host's (vLLM's runtime adapter loading)."""
        return dict(VLLM_ENV) if self.backend == "vllm" else {}


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where a started server is: what the version's row records."""

    endpoint: str
    """The server's OpenAI base URL (``.../v1``), what the gateway route points at."""
    port: int
    """Port of ``endpoint``."""
    log_path: str
    """Its log file, or ``kubernetes://<namespace>/<object name>``."""
    pid: int | None = None
    """Its process (and process group) id, for a process on this machine."""


class ServerHost(ABC):
    """Runs deployed versions' servers somewhere: start one, wait until it serves, stop it."""

    kind: str
    """``process`` or ``kubernetes``: the ``placement_of`` the rows of its versions have."""

    def lock_dir(self, home: Path) -> Path:
        """Folder of the per-name locks that serialize deploys (``home`` is the factory's)."""
        return home / "deployments"

    @abstractmethod
    def start(self, spec: ServerSpec) -> Placement:
        """Start ``spec``'s server and return at once; ``HostError`` if it cannot start."""

    @abstractmethod
    def wait_ready(self, dep: Deployment, timeout_s: float) -> None:
        """Return once ``dep``'s server serves its adapter; ``HostError`` (saying why) if it
        stops or is not ready within ``timeout_s``."""

    @abstractmethod
    def running(self, dep: Deployment) -> bool:
        """True while ``dep``'s server (or what runs it) exists."""

    @abstractmethod
    def stop(self, dep: Deployment, *, timeout_s: float) -> None:
        """Stop ``dep``'s server (in-flight requests get ``timeout_s``) and remove what ran it;
        nothing to stop is not an error."""


class ProcessHost(ServerHost):
    """Servers as detached processes on this machine, listening on ``listen`` at a free port;
    each one's output in ``<log_root>/<name>/<version>-<time>-<port>.log``."""

    kind = PROCESS

    def __init__(self, *, listen: str = "127.0.0.1", log_root: Path,
                 poll_s: float = 0.25) -> None:
        self.listen = listen
        self.log_root = log_root
        self.poll_s = poll_s

    def start(self, spec: ServerSpec) -> Placement:
        port = free_port(self.listen)
        server = spec.server(host=self.listen, port=port)
        stamp = spec.started_at.strftime("%Y%m%dT%H%M%S")
        log = self.log_root / spec.name / f"{spec.version}-{stamp}-{port}.log"
        try:
            pid = spawn_detached(server.command(), log_path=log,
                                 env={**os.environ, **spec.env()})
        except ProcessError as exc:
            hint = " (is vLLM installed on this machine?)" if spec.backend == "vllm" else ""
            raise HostError(f"{exc}{hint}") from None
        return Placement(endpoint=f"http://{self.listen}:{port}/v1", port=port,
                         log_path=str(log), pid=pid)

    def wait_ready(self, dep: Deployment, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        base = dep.endpoint[:-len("/v1")]
        while True:
            if not is_alive(dep.pid):
                raise HostError(f"the {dep.backend} server for {dep.name} {dep.version} exited "
                                f"before it was healthy; log tail:\n{_tail(dep.log_path)}")
            try:
                if httpx.get(base + "/health", timeout=2.0).status_code == 200:
                    models = httpx.get(base + "/v1/models", timeout=5.0).json()
                    if any(m.get("id") == dep.adapter for m in models.get("data", [])):
                        return
            except (httpx.HTTPError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise HostError(f"the {dep.backend} server for {dep.name} {dep.version} was not "
                                f"healthy after {timeout_s:.0f} s; log tail:\n"
                                f"{_tail(dep.log_path)}")
            time.sleep(self.poll_s)

    def running(self, dep: Deployment) -> bool:
        return dep.alive

    def stop(self, dep: Deployment, *, timeout_s: float) -> None:
        if self.running(dep):
            stop_group(int(dep.pid or 0), timeout_s=timeout_s)


def _tail(path: str, num_bytes: int = 3000) -> str:
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return "(no log)"
    return data[-num_bytes:].decode("utf-8", "replace")
