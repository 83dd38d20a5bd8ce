"""``ensure_daemon``: the daemon it starts reads a workspace whose one ``grpc_server`` entry is
the code server started beside it (so a workspace refresh never starts a code server of its own),
the control sensors tick through it, an already running daemon is reused, and both processes
are gone once the block ends, also when it ends with an error."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from factory.app.instance import CODE_LOCATION, code_server_command, ensure_daemon, instance
from factory.deploy.process import is_alive
from factory.runs import SENSOR_STALE_S, sensors_ticking
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
    with pytest.raises(Boom), ensure_daemon(inst) as started:
        assert started is not None
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
        with ensure_daemon(inst) as again:
            assert again is None
        raise Boom
    for pid in (started.pid, started.code_server_pid):
        assert not is_alive(pid) and not _group(pid)
    logs = factory_home / "logs"
    assert "rollover_sensor" in (logs / "daemon.log").read_text()
    assert (logs / "code-server.log").exists()
