"""Where a deployed version's server runs: the interface the deployer starts, waits on and stops
servers through, and its local implementation.

``Deployer`` decides which versions exist, when the gateway route moves and what the
``deployments`` table says; a ``ServerHost`` only runs one version's server. ``ProcessHost``
runs it as a detached process on this machine (the embedded default);
``factory.deploy.kubernetes.KubernetesHost`` runs it as a Kubernetes Deployment and Service
(one per base model, each version an adapter of it, by default).
Each version's row names where it runs (``placement_of``), so a version is always stopped by a
host of its own kind.

``ProcessHost`` never probes a free port for a server to bind later, when another process could
take it first. The factory's CPU server binds port 0 and reports the port the kernel gave it
through a pipe (``--port-fd``), before it loads anything. ``vllm serve`` can only bind the port
it is told: it gets one free now, and ``start`` waits until it holds it (it binds after its
imports, before it loads the model); when another process took the port first (its bind fails,
or another server listens there, beside which vLLM's ``SO_REUSEPORT`` bind would succeed and
share the port), it is stopped and started again on a fresh port (``on_free_port``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from factory.errors import FactoryError
from factory.inference import InferenceServer, ServeSizing
from factory.inference.client import InferenceClient, InferenceClientError
from factory.inference.launcher import PortInUseError, bind_failed, on_free_port
from factory.inference.vllm import VLLM_ENV, adapter_problem, install_problem
from factory.process import (
    LISTEN,
    ProcessError,
    is_alive,
    port_sockets,
    port_taken,
    read_report,
    socket_inodes,
    spawn_detached,
    stop_group,
)

if TYPE_CHECKING:
    from factory.deploy.deployer import Deployment

PROCESS = "process"
KUBERNETES = "kubernetes"
KUBERNETES_SCHEME = "kubernetes://"
"""``log_path`` of a version served on Kubernetes: ``kubernetes://<namespace>/<object name>``
(its logs are its pods'; ``kubectl -n <namespace> logs deploy/<object name>``)."""


class HostError(FactoryError):
    """A server could not be started, did not become ready, or cannot be reached to stop."""


def engine_key(base_model: str, backend: str) -> str:
    """The engine every version of ``base_model`` on ``backend`` shares on this machine:
    ``<backend>-<base folder name>-<digest of the base's path>``. A local base is named by its
    real path: adapters naming one folder through different links share its engine."""
    if Path(base_model).exists():
        base_model = os.path.realpath(base_model)
    digest = hashlib.sha256(f"{backend}\0{base_model}".encode()).hexdigest()[:10]
    return f"{backend}-{Path(base_model).name[:40]}-{digest}"


def base_name(server: str) -> str:
    """The name a server serves its base model under (``<deployment>-base``, or
    ``<engine>-base`` for a shared engine): every other model it lists is an adapter."""
    return f"{server}-base"


def served_adapters(endpoint: str, base: str, timeout_s: float = 5.0) -> list[str] | None:
    """The adapters the server at ``endpoint`` (``.../v1``) lists beside its base model
    ``base``; None when it does not answer."""
    client = InferenceClient(endpoint, timeout_s=timeout_s)
    try:
        listed = client.models()
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None
    finally:
        client.close()
    return [m for m in listed if m != base]


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
    engine: str | None = None
    """The shared engine (``engine_key``) the version is an adapter of; None: a server of its
    own."""
    join: Placement | None = None
    """The shared engine already serving the base model, which the adapter is loaded into;
    None: a new server is started (with this adapter)."""

    def server(self, *, host: str, port: int, with_adapter: bool = True) -> InferenceServer:
        """The ``InferenceServer`` whose ``command()`` is this version's argv (without its
        adapter: the engine's, which learns its adapters at run time)."""
        return InferenceServer(self.base_model,
                               adapters={self.adapter: self.checkpoint} if with_adapter else {},
                               served_model_name=base_name(self.engine or self.name),
                               backend=self.backend, sizing=self.sizing, host=host, port=port,
                               threads=self.threads)

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
    engine: str | None = None
    """The shared engine (``engine_key``) it is, when it is one."""


class ServerHost(ABC):
    """Runs deployed versions' servers somewhere: start one, wait until it serves, stop it."""

    kind: str
    """``process`` or ``kubernetes``: the ``placement_of`` the rows of its versions have."""
    shares_engines: bool = False
    """Whether the versions of one base model it runs share one server (a shared engine, each
    version an adapter of it: ``ServerSpec.engine``/``join``)."""

    def lock_dir(self, home: Path) -> Path:
        """Folder of the per-name locks that serialize deploys (``home`` is the factory's)."""
        return home / "deployments"

    @abstractmethod
    def start(self, spec: ServerSpec) -> Placement:
        """Start ``spec``'s server and return once its place is known, before it is ready;
        ``HostError`` if it cannot start."""

    @abstractmethod
    def wait_ready(self, dep: Deployment, timeout_s: float) -> None:
        """Return once ``dep``'s server serves its adapter; ``HostError`` (saying why) if it
        stops or is not ready within ``timeout_s``."""

    @abstractmethod
    def running(self, dep: Deployment) -> bool:
        """True while ``dep``'s server (or what runs it) exists."""

    def engine_running(self, dep: Deployment) -> bool:
        """True while the shared engine ``dep`` is a version of still runs, whichever adapters
        it serves: a version joining it is loaded into it."""
        return dep.server_alive

    @abstractmethod
    def stop(self, dep: Deployment, *, timeout_s: float, last: bool = False) -> None:
        """Stop ``dep``'s server (in-flight requests get ``timeout_s``) and remove what ran it;
        nothing to stop is not an error. A version of a shared engine: its adapter is unloaded,
        and the engine stopped once it serves no adapter. ``last``: no other active version
        names the engine (the ``deployments`` rows say so), so an engine that cannot say what
        it serves is stopped too."""


class ProcessHost(ServerHost):
    """Servers as detached processes on this machine, listening on ``listen`` at a port of
    their own; each one's output in ``<log_root>/<name>/<version>-<time>.log``, a shared
    engine's in ``<log_root>/<engine>/<time>-<name>-<version>.log`` of the version that started
    it (a vLLM start that lost its port to another process and was made again: each attempt's,
    in turn).

    With ``share`` (the default) the versions of one base model, of every deployment, are
    adapters of one engine: the first one's server, which the next ones' adapters are loaded
    into (``/v1/load_lora_adapter``) and unloaded from when they retire; the engine stops with
    its last adapter. The base is in memory once, a new version is an adapter load."""

    kind = PROCESS

    def __init__(self, *, listen: str = "127.0.0.1", log_root: Path, poll_s: float = 0.25,
                 report_timeout_s: float = 60.0, bind_timeout_s: float = 300.0,
                 ports: Iterable[int] | None = None, share: bool = True) -> None:
        """``report_timeout_s``: longest wait for the CPU server's port (it reports it before
        importing torch: 0.2-0.3 s here, so only a hung start waits this long).
        ``bind_timeout_s``: longest wait for vLLM to bind its port, which it does after its
        imports and before it loads the model; past it, ``wait_ready`` watches the server and
        a bind failure is no longer retried. ``ports``: the ports a vLLM start tries, in order
        (default: a fresh free one each time). ``share``: shared engines (above); False, a
        server per version."""
        self.listen = listen
        self.log_root = log_root
        self.poll_s = poll_s
        self.report_timeout_s = report_timeout_s
        self.bind_timeout_s = bind_timeout_s
        self.ports = ports
        self.shares_engines = share

    def start(self, spec: ServerSpec) -> Placement:
        unservable = adapter_problem(spec.checkpoint) if spec.backend == "vllm" else None
        if unservable:
            raise HostError(f"cannot serve {spec.name} {spec.version} on vllm: {unservable}")
        if spec.join is not None:
            return self._load_into(spec, spec.join)
        stamp = spec.started_at.strftime("%Y%m%dT%H%M%S")
        log = (self.log_root / spec.engine / f"{stamp}-{spec.name}-{spec.version}.log"
               if spec.engine else self.log_root / spec.name / f"{spec.version}-{stamp}.log")
        if spec.backend != "vllm":
            return self._start_reporting(spec, log)
        problem = install_problem(spec.server(host=self.listen, port=0).vllm)
        if problem:
            raise HostError(f"cannot start the vllm server: {problem}")
        try:
            return on_free_port(lambda port: self._start_binding(spec, log, port),
                                host=self.listen, ports=self.ports)
        except PortInUseError as exc:
            raise HostError(str(exc)) from None

    def _spawn(self, spec: ServerSpec, argv: list[str], log: Path,
               pass_fds: tuple[int, ...] = ()) -> int:
        try:
            return spawn_detached(argv, log_path=log, env={**os.environ, **spec.env()},
                                  pass_fds=pass_fds)
        except ProcessError as exc:
            hint = " (is vLLM installed on this machine?)" if spec.backend == "vllm" else ""
            raise HostError(f"{exc}{hint}") from None

    def _placement(self, port: int, log: Path, pid: int, engine: str | None) -> Placement:
        return Placement(endpoint=f"http://{self.listen}:{port}/v1", port=port,
                         log_path=str(log), pid=pid, engine=engine)

    def _load_into(self, spec: ServerSpec, engine: Placement) -> Placement:
        """Load ``spec``'s adapter into the running shared engine ``engine``. One the engine
        still lists under that name (a retired version whose unload failed, and whose tag a
        rollback reuses) is unloaded first: the name serves the checkpoint asked for."""
        where = f"the shared {spec.backend} engine at {engine.endpoint} (pid {engine.pid})"
        listed = served_adapters(engine.endpoint, base_name(engine.engine or spec.name))
        client = InferenceClient(engine.endpoint, timeout_s=300.0)
        try:
            if listed and spec.adapter in listed:
                with contextlib.suppress(InferenceClientError, httpx.HTTPError):
                    client.unload_adapter(spec.adapter)
            client.load_adapter(spec.adapter, spec.checkpoint)
        except InferenceClientError as exc:
            raise HostError(f"{where} refused adapter {spec.adapter} from {spec.checkpoint}: "
                            f"{exc}") from None
        except httpx.HTTPError as exc:
            raise HostError(f"{where} did not take adapter {spec.adapter}: {exc}") from None
        finally:
            client.close()
        return engine

    def _start_reporting(self, spec: ServerSpec, log: Path) -> Placement:
        """The CPU server on port 0: it writes the port it bound to a pipe."""
        read_fd, write_fd = os.pipe()
        try:
            argv = spec.server(host=self.listen, port=0).command(port_fd=write_fd)
            pid = self._spawn(spec, argv, log, pass_fds=(write_fd,))
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)  # the server holds the only write end left: EOF once it exits
        try:
            report = read_report(read_fd, self.report_timeout_s)
        except TimeoutError:
            stop_group(pid, timeout_s=10)
            raise HostError(f"the {spec.backend} server for {spec.name} {spec.version} did not "
                            f"report its port within {self.report_timeout_s:.0f} s; log tail:\n"
                            f"{_tail(str(log))}") from None
        if report is None or not report.isdigit():
            stop_group(pid, timeout_s=10)
            said = "exited before it bound a port" if report is None \
                else f"reported {report!r}, not a port"
            raise HostError(f"the {spec.backend} server for {spec.name} {spec.version} {said};"
                            f" log tail:\n{_tail(str(log))}")
        return self._placement(int(report), log, pid, spec.engine)

    def _start_binding(self, spec: ServerSpec, log: Path, port: int) -> Placement:
        """vLLM on ``port``, placed once it holds the port; ``PortInUseError`` (the server
        stopped) when another process has it. A server that exits for another reason is placed
        too: ``wait_ready`` says why it failed, and the deployer records it."""
        offset = log.stat().st_size if log.exists() else 0
        server = spec.server(host=self.listen, port=port)
        pid = self._spawn(spec, server.command(), log)
        # vLLM cannot claim cores per request itself: a claim that counts while its /metrics
        # report requests (the CPU server claims while it has requests in flight).
        server.claim_cores(pid)
        deadline = time.monotonic() + self.bind_timeout_s
        while True:
            if not is_alive(pid):
                with open(log, "rb") as f:
                    f.seek(offset)
                    output = f.read().decode("utf-8", "replace")
                if bind_failed(output):
                    raise PortInUseError(f"the {spec.backend} server for {spec.name} "
                                         f"{spec.version} could not bind {self.listen}:{port}")
                return self._placement(port, log, pid, spec.engine)
            try:
                held = self._holds(pid, port)
            except PortInUseError:
                stop_group(pid, timeout_s=10)
                raise
            if held or time.monotonic() > deadline:
                return self._placement(port, log, pid, spec.engine)
            time.sleep(self.poll_s)

    def _holds(self, pid: int, port: int) -> bool:
        """Whether server ``pid`` holds ``port``; ``PortInUseError`` when another server
        listens on it, which the server's bind would fail on or, both setting ``SO_REUSEPORT``
        as vLLM does, share the port's connections with."""
        sockets = port_sockets(port)
        if sockets is None:  # no /proc: the server's own bind is all there is to go on
            return True
        mine = socket_inodes(pid)
        if any(state == LISTEN and inode not in mine for state, inode in sockets):
            raise PortInUseError(f"another server listens on {self.listen}:{port}")
        if any(inode in mine for _, inode in sockets):
            return True  # it listens (or has connections) on the port
        # vLLM binds before it loads the model and listens after, and /proc/net does not show
        # a socket that is only bound. With nothing else on the port, a port taken by a socket
        # that set SO_REUSEPORT is vLLM's; one that did not is another process's, on which
        # vLLM's bind fails (it exits, and is started again). A server binding without
        # SO_REUSEPORT is placed once it listens, or after ``bind_timeout_s``.
        return (not sockets and port_taken(self.listen, port)
                and not port_taken(self.listen, port, reuse_port=True))

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

    def stop(self, dep: Deployment, *, timeout_s: float, last: bool = False) -> None:
        if not dep.server_alive:
            return
        if dep.engine:
            client = InferenceClient(dep.endpoint, timeout_s=timeout_s)
            with contextlib.suppress(InferenceClientError, httpx.HTTPError):  # not loaded
                client.unload_adapter(dep.adapter)
            client.close()
            left = served_adapters(dep.endpoint, base_name(dep.engine))
            if left or (left is None and not last):
                # Other versions' adapters serve on it; or it cannot say, and other versions'
                # rows name it: kept. An engine no version names is stopped even when hung.
                return
        stop_group(int(dep.pid or 0), timeout_s=timeout_s)


def _tail(path: str, num_bytes: int = 3000) -> str:
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return "(no log)"
    return data[-num_bytes:].decode("utf-8", "replace")
