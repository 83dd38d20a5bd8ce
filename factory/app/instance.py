"""The Dagster instance of the embedded default, and its daemon.

The instance lives in ``$FACTORY_HOME/dagster`` (``$DAGSTER_HOME`` wins when set). Its
``dagster.yaml`` is written once, when missing: runs queue and the daemon launches them, one
``checkpoint_evals`` at a time (each boots an inference server; two on 2 cores slow each other
and the training run), checked every second so a chain's steps follow each other quickly.

``ensure_daemon`` is what ``factory run`` and ``factory demo`` call: a daemon already working
for the instance (``factory ui``'s, or a deployment's ``dagster-daemon``) is used as it is;
with none, one is started (``dagster-daemon run`` on the factory's code location) and stopped
again when the caller is done.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from factory.errors import FactoryError
from factory.settings import get_settings

CODE_LOCATION = "factory.definitions"
"""The module ``workspace.yaml``, ``factory ui`` and the daemon load the definitions from."""
DAEMON_STALE_S = 60.0
"""A daemon whose sensor and run-queue heartbeats are older than this is not running."""
DAEMON_START_S = 180.0
"""How long a started daemon gets to send its first heartbeats."""

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


def dagster_home() -> Path:
    settings = get_settings().ensure()
    os.environ.setdefault("DAGSTER_HOME", str(settings.dagster_home))
    home = Path(os.environ["DAGSTER_HOME"])
    config = home / "dagster.yaml"
    if home == settings.dagster_home and not config.exists():
        config.write_text(INSTANCE_CONFIG)
    return home


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


def daemon_command() -> list[str]:
    return [sys.executable, "-m", "dagster._daemon", "run", "-m", CODE_LOCATION]


@contextmanager
def ensure_daemon(inst: Any, progress: Any = None) -> Iterator[int | None]:
    """A daemon for ``inst`` while the block runs: yields None when one was already running,
    else the pid of the one started here (stopped when the block ends)."""
    if daemon_running(inst):
        yield None
        return
    settings = get_settings().ensure()
    log = settings.home / "logs" / "daemon.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "DAGSTER_HOME": str(dagster_home()), "FACTORY_HOME": str(settings.home)}
    if progress:
        progress(f"  starting the Dagster daemon (log {log})")
    with open(log, "ab") as out:
        # Its own session: Ctrl-C in the terminal reaches the caller, which stops it in order.
        proc = subprocess.Popen(daemon_command(), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True,
                                cwd=Path(__file__).resolve().parents[2])
    try:
        deadline = time.monotonic() + DAEMON_START_S
        while not daemon_running(inst):
            if proc.poll() is not None:
                tail = log.read_bytes()[-1500:].decode("utf-8", "replace")
                raise FactoryError(f"the Dagster daemon exited ({proc.returncode}); "
                                   f"log {log}:\n{tail}")
            if time.monotonic() > deadline:
                raise FactoryError(f"the Dagster daemon sent no heartbeat in "
                                   f"{DAEMON_START_S:.0f} s; log {log}")
            time.sleep(0.5)
        yield proc.pid
    finally:
        stop_daemon(proc)


def stop_daemon(proc: subprocess.Popen[bytes]) -> None:
    """SIGINT (the daemon stops its threads and code server), then SIGKILL of its group."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    # The code server it started runs in the same session; nothing of it may outlive it.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
