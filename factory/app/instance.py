"""The Dagster instance of the embedded default, and its daemon.

The instance lives in ``$FACTORY_HOME/dagster`` (``$DAGSTER_HOME`` wins when set). Its
``dagster.yaml`` is written once, when missing: runs queue and the daemon launches them, one
``checkpoint_evals`` at a time (each boots an inference server; two on 2 cores slow each other
and the training run), checked every second so a chain's steps follow each other quickly.
With ``FACTORY_DATABASE_URL`` set, it also puts the run, event-log and schedule storage in that
PostgreSQL database (``dagster-postgres``, the URL read from the variable, never written to the
file), so a daemon, a webserver and run workers on different nodes share one instance; compute
logs stay in the node's Dagster home. A ``dagster.yaml`` whose storage disagrees with the setting
is an error, not rewritten: the runs it recorded would vanish from view.

``ensure_daemon`` is what ``factory run`` and ``factory demo`` call: a daemon already working
for the instance (``factory ui``'s, or a deployment's ``dagster-daemon``) is used as it is;
with none, one is started for the block and stopped when it ends. It is two processes: a code
server for the factory's code location (``dagster api grpc -m factory.definitions`` on a free
local port, ``code_server``) and ``dagster-daemon run`` on a workspace file
(``$FACTORY_HOME/daemon-workspace.yaml``) whose ``grpc_server`` entry points at it. A daemon given the module itself starts its own code
server and replaces it at every workspace refresh (every 60 s), re-importing the definitions
each time (~8 CPU-s on a 2-core machine, taken from the training run); with a ``grpc_server``
entry a refresh only fetches the snapshot again. The daemon launches runs through that server
(``DefaultRunLauncher``), so each ``factory run`` runs the code as it is when it starts.

``dagster api grpc`` cannot bind port 0 and report the port (``--port 0`` is refused), so it gets
a port free now and is started again on a fresh one when another process took that port first:
its bind fails (``Failed to bind to address``), or, since gRPC servers set ``SO_REUSEPORT``,
another gRPC server listens on the same port beside it and would answer half of the daemon's
calls, which ``/proc/net`` shows (``listening_sockets``). Dagster starts its own code servers the
same way (``_open_server_process_on_dynamic_port``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from factory.errors import FactoryError
from factory.lifeline import guard, on_death, release
from factory.process import LISTEN, sigint_default, stop_group, tcp_sockets
from factory.settings import Settings, get_settings

CODE_LOCATION = "factory.definitions"
"""The module ``workspace.yaml``, ``factory ui`` and the daemon load the definitions from."""
DAEMON_STALE_S = 60.0
"""A daemon whose sensor and run-queue heartbeats are older than this is not running."""
DAEMON_START_S = 180.0
"""How long a started daemon gets to send its first heartbeats, and a started code server to
answer (it imports the definitions first: ~8 s on an idle 2-core machine)."""
STOP_GRACE_S = 30.0
"""How long a stopped process gets after SIGINT before its process group is killed."""
RECONCILE = [sys.executable, "-m", "factory.app.reconcile"]
"""What the lifeline of ``factory run`` or ``factory ui`` runs once it stopped their processes."""
WORKSPACE_FILE = "daemon-workspace.yaml"
"""In ``$FACTORY_HOME``: the workspace of the daemon ``ensure_daemon`` starts."""
ROOT = Path(__file__).resolve().parents[2]
"""The working directory of the started processes (the checkout, for an editable install)."""

INSTANCE_CONFIG = """\
# Written by the factory when the instance was created; edit freely.
run_coordinator:
  module: dagster.core.run_coordinator
  class: QueuedRunCoordinator
  config:
    dequeue_interval_seconds: 1
    tag_concurrency_limits:
      - key: factory/eval
        limit: 1
telemetry:
  enabled: false
"""

POSTGRES_STORAGE = """storage:
  postgres:
    postgres_url:
      env: FACTORY_DATABASE_URL
"""
"""Run, event-log and schedule storage in ``FACTORY_DATABASE_URL`` (read when the instance
loads, in every process of it)."""


def instance_config(settings: Settings) -> str:
    """The ``dagster.yaml`` the factory writes for ``settings``."""
    return INSTANCE_CONFIG + (POSTGRES_STORAGE if settings.database_url else "")


def storage_in_database(config: Path) -> bool | None:
    """Whether ``config`` keeps storage in ``FACTORY_DATABASE_URL`` (True), in SQLite under the
    Dagster home (False), or somewhere of its own choosing (None: another database or URL)."""
    storage = (yaml.safe_load(config.read_text()) or {}).get("storage")
    if storage is None:
        return False
    url = storage.get("postgres", {}).get("postgres_url") if isinstance(storage, dict) else None
    if url == {"env": "FACTORY_DATABASE_URL"}:
        return True
    return None


def dagster_home() -> Path:
    settings = get_settings().ensure()
    os.environ.setdefault("DAGSTER_HOME", str(settings.dagster_home))
    home = Path(os.environ["DAGSTER_HOME"])
    config = home / "dagster.yaml"
    if home == settings.dagster_home:
        if not config.exists():
            config.write_text(instance_config(settings))
        else:
            check_storage(config, settings)
    return home


def check_storage(config: Path, settings: Settings) -> None:
    """A ``FactoryError`` when ``config`` and ``FACTORY_DATABASE_URL`` disagree on where
    Dagster's storage is."""
    shared = storage_in_database(config)
    if settings.database_url and shared is False:
        raise FactoryError(
            f"FACTORY_DATABASE_URL is set, but {config} keeps Dagster's runs in SQLite under "
            f"{config.parent}; they are not moved silently. Add to it:\n{POSTGRES_STORAGE}"
            f"or remove it to have it written with that storage (the SQLite history stays "
            f"where it is, out of view), or unset FACTORY_DATABASE_URL")
    if not settings.database_url and shared is True:
        raise FactoryError(
            f"{config} keeps Dagster's storage in the database named by FACTORY_DATABASE_URL, "
            f"which is not set: set it, or remove the file for an embedded SQLite instance")


def instance() -> Any:
    """The Dagster instance of this factory home."""
    import dagster as dg

    dagster_home()
    return dg.DagsterInstance.get()


def daemon_running(inst: Any, *, now: float | None = None) -> bool:
    """Whether a daemon is working for ``inst``: fresh sensor and run-queue heartbeats."""
    beats = inst.get_daemon_heartbeats()
    now = time.time() if now is None else now
    return all(kind in beats and now - beats[kind].timestamp < DAEMON_STALE_S
               for kind in ("SENSOR", "QUEUED_RUN_COORDINATOR"))


@dataclass(frozen=True, kw_only=True)
class StartedDaemon:
    """The processes ``ensure_daemon`` started."""

    pid: int
    """The daemon's."""
    code_server_pid: int
    """The code server's, which the daemon's workspace points at."""
    port: int
    """The code server's port on 127.0.0.1."""
    workspace: Path
    """The daemon's workspace file."""


def code_server_command(port: int) -> list[str]:
    return [sys.executable, "-m", "dagster", "api", "grpc", "-m", CODE_LOCATION,
            "-d", str(ROOT), "--location-name", CODE_LOCATION, "--host", "127.0.0.1",
            "--port", str(port), "--log-level", "warning"]


def workspace_yaml(port: int) -> str:
    """A workspace of one code location, served by the code server on ``port``."""
    return ("# Written by factory run for the daemon it starts; rewritten at each start.\n"
            "load_from:\n"
            "  - grpc_server:\n"
            "      host: 127.0.0.1\n"
            f"      port: {port}\n"
            f"      location_name: {CODE_LOCATION}\n")


def daemon_command(workspace: Path) -> list[str]:
    return [sys.executable, "-m", "dagster._daemon", "run", "-w", str(workspace)]


@contextmanager
def ensure_daemon(inst: Any, progress: Any = None, *,
                  before_daemon: Callable[[], object] | None = None
                  ) -> Iterator[StartedDaemon | None]:
    """A daemon for ``inst`` while the block runs: yields None when one was already running,
    else the processes started here (stopped when the block ends, also on an error).

    ``before_daemon`` is called once before the block, after the code server started (while it
    booted, the caller's work in another thread could go on) and before the daemon does, whose
    sensors then see what it did: ``factory run`` queues its chain's first run there."""
    if daemon_running(inst):
        if before_daemon is not None:
            before_daemon()
        yield None
        return
    settings = get_settings().ensure()
    logs = settings.home / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "DAGSTER_HOME": str(dagster_home()), "FACTORY_HOME": str(settings.home)}
    server_log, daemon_log = logs / "code-server.log", logs / "daemon.log"
    if progress:
        progress(f"  starting the Dagster daemon (logs {daemon_log}, {server_log})")
    try:
        with _daemon(inst, env, server_log, daemon_log, before_daemon) as started:
            yield started
    finally:
        # The stopped daemon's sensors no longer observe the control plane: a run whose step
        # died under it (its trainer ends it, or is stopped here) is ended now, not when some
        # later daemon looks.
        _end_ownerless_runs()


def _end_ownerless_runs() -> None:
    # the control plane and the lake (torch, pyiceberg: seconds), for a stopping daemon only
    from factory.control.plane import observe_once, ownerless_runs
    from factory.lake import Lake

    try:
        if ownerless_runs(Lake()):
            observe_once(control_plane())
    except Exception as exc:  # noqa: BLE001 - the block's own outcome must stand
        print(f"factory: ending ownerless training runs failed: {exc}", file=sys.stderr)


@contextmanager
def _daemon(inst: Any, env: dict[str, str], server_log: Path, daemon_log: Path,
            before_daemon: Callable[[], object] | None = None) -> Iterator[StartedDaemon]:
    settings = get_settings().ensure()
    with ExitStack() as stack:
        # Stopped in reverse: the daemon first (no run is launched through a stopped server).
        server, port = stack.enter_context(code_server(server_log, env))
        if before_daemon is not None:
            before_daemon()
        workspace = settings.home / WORKSPACE_FILE
        workspace.write_text(workspace_yaml(port))
        daemon = stack.enter_context(_process(daemon_command(workspace), daemon_log, env))
        # Killed outright, this process leaves both to its lifeline, and what they were running
        # to the reconcile after it.
        on_death(RECONCILE)
        deadline = time.monotonic() + DAEMON_START_S
        while not daemon_running(inst):
            _check_started(daemon, "daemon", daemon_log, deadline)
            _check_started(server, "code server", server_log, deadline)
            time.sleep(0.5)
        yield StartedDaemon(pid=daemon.pid, code_server_pid=server.pid, port=port,
                            workspace=workspace)


@contextmanager
def code_server(log: Path, env: dict[str, str], *, ports: Iterable[int] | None = None
                ) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """The code server answering on a port of its own while the block runs: (process, port).
    A start whose port another process holds is stopped and made again on a fresh port
    (``on_free_port``; ``ports``: the ports to try, default fresh free ones)."""
    # the launcher loads httpx and rich (0.3 s); the CLI imports this module
    from factory.inference.launcher import PortInUseError, bind_failed, on_free_port

    with ExitStack() as outer:
        def start(port: int) -> tuple[subprocess.Popen[bytes], int]:
            offset = log.stat().st_size if log.exists() else 0
            with ExitStack() as attempt:
                proc = attempt.enter_context(_process(code_server_command(port), log, env))
                deadline = time.monotonic() + DAEMON_START_S
                while True:
                    # The ping first: once it answers, the code server listens, so the count
                    # after it sees any listener beside it (counted first, a server that bound
                    # between the count and the ping passed as alone).
                    answers = code_server_answers(port)
                    if (listening_sockets(port) or 0) > 1:
                        raise PortInUseError(f"another server listens on 127.0.0.1:{port} "
                                             "beside the code server (SO_REUSEPORT)")
                    if answers:
                        break
                    if proc.poll() is not None:
                        with open(log, "rb") as f:
                            f.seek(offset)
                            if bind_failed(f.read().decode("utf-8", "replace")):
                                raise PortInUseError(f"the code server could not bind "
                                                     f"127.0.0.1:{port}")
                    _check_started(proc, "code server", log, deadline)
                    time.sleep(0.5)
                outer.enter_context(attempt.pop_all())
                return proc, port

        yield on_free_port(start, ports=ports)


def listening_sockets(port: int) -> int | None:
    """How many sockets listen on TCP ``port`` of this machine's network namespace (IPv4 and
    IPv6, from ``/proc/net``); None where ``/proc`` cannot say."""
    sockets = tcp_sockets()
    if sockets is None:
        return None
    return sum(1 for local, state, _ in sockets if state == LISTEN and local == port)


@contextmanager
def _process(cmd: list[str], log: Path, env: dict[str, str]) -> Iterator[subprocess.Popen[bytes]]:
    """``cmd`` running in a session of its own, output appended to ``log``, while the block runs;
    stopped with its whole process group when it ends, or by this process's lifeline when it
    dies first (``factory.lifeline``). SIGINT has its default action in it even where this
    process ignores it (``sigint_default``), so that the SIGINT stopping it is not ignored."""
    with open(log, "ab") as out:
        # Its own session: Ctrl-C in the terminal reaches the caller, which stops it in order.
        proc = subprocess.Popen(sigint_default(cmd), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True,
                                cwd=ROOT)
    guard(proc.pid)
    try:
        yield proc
    finally:
        if stop_group(proc.pid, first=signal.SIGINT, timeout_s=STOP_GRACE_S) == "gone":
            # the leader died before: its group's stragglers (the unreaped child holds the id)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=STOP_GRACE_S)
        release(proc.pid)


def control_plane() -> Any:
    """The control plane of the code location's ``provider`` resource, on this node's lake:
    the one the daemon's sensors tick."""
    # the definitions and the lake (torch, Dagster, pyiceberg: seconds), for callers of the plane
    from factory.definitions import defs
    from factory.lake import Lake

    return (defs.resources or {})["provider"].plane(Lake())


def code_server_answers(port: int) -> bool:
    """Whether a Dagster code server answers a ping on ``port`` of this host."""
    from dagster._core.errors import DagsterUserCodeUnreachableError
    from dagster._grpc.client import DagsterGrpcClient

    try:
        DagsterGrpcClient(port=port, host="127.0.0.1").ping("factory")
    except DagsterUserCodeUnreachableError:
        return False
    return True


def _check_started(proc: subprocess.Popen[bytes], what: str, log: Path,
                   deadline: float) -> None:
    if proc.poll() is not None:
        tail = log.read_bytes()[-1500:].decode("utf-8", "replace")
        raise FactoryError(f"the Dagster {what} exited ({proc.returncode}); log {log}:\n{tail}")
    if time.monotonic() > deadline:
        raise FactoryError(f"the Dagster {what} did not start in {DAEMON_START_S:.0f} s; "
                           f"log {log}")

