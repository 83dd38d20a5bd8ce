"""``ensure_daemon``: the daemon it starts reads a workspace whose one ``grpc_server`` entry is
the code server started beside it (so a workspace refresh never starts a code server of its own),
the control sensors tick through it, an already running daemon is reused, and both processes
are gone once the block ends, also when it ends with an error. The code server, which cannot
bind port 0, is started again on a fresh port when another process holds its port."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
import yaml

from factory.app.instance import (
    CODE_LOCATION,
    code_server,
    code_server_command,
    daemon_running,
    ensure_daemon,
    instance,
    listening_sockets,
)
from factory.dagster_runs import SENSOR_STALE_S, sensors_ticking
from factory.process import LISTEN, is_alive, tcp_sockets
from tests.waiting import wait_until

pytestmark = pytest.mark.slow


class Boom(Exception):
    """Raised inside the block: the processes must be stopped on the way out."""


def _argv(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


def _group(pgid: int) -> list[int]:
    """The live processes of process group ``pgid``."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[2]) == pgid and is_alive(int(entry.name)):
            out.append(int(entry.name))
    return out


def test_the_started_daemon_works_on_the_code_server_started_beside_it(
        factory_home: Path) -> None:
    inst = instance()
    assert not sensors_ticking(inst)
    # What `factory run` queues before the daemon starts: called once the code server answers,
    # before the daemon runs.
    seen: list[tuple[bool, set[int]]] = []

    def before_daemon() -> None:
        listening = {port for port, state, _ in tcp_sockets() or [] if state == LISTEN}
        seen.append((daemon_running(inst), listening))

    with pytest.raises(Boom), ensure_daemon(inst, before_daemon=before_daemon) as started:
        assert started is not None
        assert len(seen) == 1 and seen[0][0] is False and started.port in seen[0][1]
        assert started.workspace == factory_home / "daemon-workspace.yaml"
        assert yaml.safe_load(started.workspace.read_text()) == {"load_from": [{"grpc_server": {
            "host": "127.0.0.1", "port": started.port, "location_name": CODE_LOCATION}}]}
        assert _argv(started.pid)[-3:] == ["run", "-w", str(started.workspace)]
        assert _argv(started.code_server_pid) == code_server_command(started.port)

        wait_until(lambda: sensors_ticking(inst), timeout_s=120.0,
                   what="rollover_sensor and recovery_sensor ticking")
        assert not sensors_ticking(inst, now=time.time() + SENSOR_STALE_S + 1)
        # The sensors were evaluated, and the daemon's session holds the daemon alone: it
        # started no code server of its own.
        assert _group(started.pid) == [started.pid]
        with ensure_daemon(inst, before_daemon=lambda: seen.append((True, set()))) as again:
            assert again is None and len(seen) == 2  # one running: called before the block
        raise Boom
    for pid in (started.pid, started.code_server_pid):
        assert not is_alive(pid) and not _group(pid)
    logs = factory_home / "logs"
    assert "rollover_sensor" in (logs / "daemon.log").read_text()
    assert (logs / "code-server.log").exists()


def test_the_code_server_moves_to_a_fresh_port_when_its_port_is_held(factory_home: Path) -> None:
    """Two holders of the first ports tried: a plain listening socket (the code server's bind
    fails) and another gRPC server (the bind succeeds beside it through SO_REUSEPORT, and the
    two would share the daemon's calls); the code server ends on the third port, alone."""
    import grpc

    from factory.inference import free_port

    plain = socket.socket()
    plain.bind(("127.0.0.1", 0))
    plain.listen()
    other = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    shared = other.add_insecure_port("127.0.0.1:0")
    other.start()
    log = factory_home / "code-server.log"
    env = dict(os.environ)  # DAGSTER_HOME and FACTORY_HOME of the test's home
    try:
        held, free = plain.getsockname()[1], free_port()
        with code_server(log, env, ports=[held, shared, free]) as (proc, port):
            assert port == free and proc.poll() is None
            assert _argv(proc.pid) == code_server_command(free)
            assert listening_sockets(free) == 1
            assert listening_sockets(shared) == 1  # the other gRPC server's alone again
        assert not is_alive(proc.pid)
    finally:
        other.stop(grace=None)
        plain.close()
    assert "Failed to bind to address 127.0.0.1:" + str(held) in log.read_text()


BACKGROUND_STOP = """
import json, os, signal, sys, time
from pathlib import Path

signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a shell starts a background job
from factory.app import instance as fi

fi.STOP_GRACE_S = 20.0
with fi.code_server(Path(sys.argv[1]), dict(os.environ)) as (proc, port):
    started = time.monotonic()
print(json.dumps({"returncode": proc.returncode, "stop_s": time.monotonic() - started}))
"""


def test_a_code_server_started_from_a_background_job_stops_on_sigint(factory_home: Path) -> None:
    """A caller that ignores SIGINT (``factory run`` started in the background: its children
    inherit the ignore, and Dagster's code server then ignores SIGTERM too) still stops its code
    server with SIGINT, not by SIGKILL after the grace: ``factory run`` ends when its chain has."""
    out = subprocess.run([sys.executable, "-c", BACKGROUND_STOP,
                          str(factory_home / "code-server.log")],
                         capture_output=True, text=True, timeout=300, check=True)
    stopped = json.loads(out.stdout.strip().splitlines()[-1])
    assert stopped["returncode"] != -signal.SIGKILL, stopped
    assert stopped["stop_s"] < 20.0, stopped


def test_an_instance_made_from_its_ref_reads_the_schema_scripts_once_per_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every sensor tick with resources makes an instance from its ref; each SQLite storage then
    # checks its schema against the head of Dagster's migration scripts.
    from alembic.script import ScriptDirectory
    from dagster._core.storage import sql

    from factory import dagster_runs

    reads: list[str] = []
    original = ScriptDirectory.from_config.__func__  # type: ignore[attr-defined]

    def counted(cls: type, config: Any) -> Any:
        reads.append(str(config.get_main_option("script_location")))
        return original(cls, config)

    monkeypatch.setattr(ScriptDirectory, "from_config", classmethod(counted))
    monkeypatch.setattr(sql, "ScriptDirectory", ScriptDirectory)  # as Dagster ships it
    monkeypatch.setattr(dagster_runs, "_SCRIPTS", {})
    with dg.DagsterInstance.local_temp(str(tmp_path)) as inst:
        ref = inst.get_ref()
    reads.clear()
    with dg.DagsterInstance.from_ref(ref):
        pass
    assert len(reads) >= 2  # the run and schedule storages each read them
    assert dagster_runs.read_schema_scripts_once() is True
    reads.clear()
    for _ in range(3):
        with dg.DagsterInstance.from_ref(ref) as again:
            run = again.add_run(dg.DagsterRun(job_name="probe"))
            assert again.get_run_by_id(run.run_id) is not None  # the storages work as before
    assert len(set(reads)) == len(reads) == 1  # one location, read once for all three instances
    assert dagster_runs.read_schema_scripts_once() is True  # a second call changes nothing
