"""Ports without a race: the CPU server binds port 0 and reports the port it got (no port is
probed and bound later), a port held by another process fails a start at once as
``PortInUseError``, and programs that cannot bind port 0 are started again on a fresh port
(``on_free_port``; here with PostgreSQL, the code server's case is in tests/app/test_instance.py).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from factory.inference import InferenceServer, InferenceServerError, free_port
from factory.inference.launcher import PortInUseError, bind_failed, on_free_port
from tests.postgres import Cluster, server_bin


@pytest.fixture()
def held_port() -> Iterator[int]:
    """A port another process's socket listens on (this test's, for the test's length)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def _argv(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


def test_the_cpu_server_binds_port_0_and_reports_the_port(cpu_server: InferenceServer) -> None:
    import httpx

    assert cpu_server.proc is not None and cpu_server.port is not None
    argv = _argv(cpu_server.proc.pid)
    assert argv[argv.index("--port") + 1] == "0" and "--port-fd" in argv
    assert httpx.get(cpu_server.url + "/health").status_code == 200


def test_a_held_port_fails_the_start_as_port_in_use(tmp_path: Path, held_port: int) -> None:
    """The server binds before it loads anything: the start fails without a model to load."""
    server = InferenceServer(tmp_path / "no-model", port=held_port, startup_timeout_s=60,
                             log_path=tmp_path / "server.log")
    with pytest.raises(PortInUseError, match=f"could not bind 127.0.0.1:{held_port}"):
        server.start()
    assert server.proc is None  # stopped


def test_only_a_port_in_use_is_tried_again(tmp_path: Path, held_port: int) -> None:
    """The first port is held: a fresh one is tried; that start fails for another reason (no
    model), which is raised, not tried again."""
    tried: list[int] = []

    def start(port: int) -> InferenceServer:
        tried.append(port)
        return InferenceServer(tmp_path / "no-model", port=port, startup_timeout_s=120,
                               log_path=tmp_path / f"server-{port}.log").start()

    second, third = free_port(), free_port()
    with pytest.raises(InferenceServerError, match="exited with code") as failed:
        on_free_port(start, ports=[held_port, second, third])
    assert not isinstance(failed.value, PortInUseError)
    assert tried == [held_port, second]


def test_the_last_port_in_use_is_raised(held_port: int) -> None:
    def start(port: int) -> None:
        raise PortInUseError(f"port {port} is held")

    with pytest.raises(PortInUseError, match=f"port {held_port} is held"):
        on_free_port(start, ports=[free_port(), held_port], attempts=2)


def test_bind_failures_are_recognized_in_each_program_s_words() -> None:
    assert bind_failed("OSError: [Errno 98] Address already in use")
    assert bind_failed("RuntimeError: Failed to bind to address 127.0.0.1:5; set GRPC_VERBOSITY")
    assert bind_failed('LOG:  could not bind IPv4 address "127.0.0.1": Address already in use')
    assert not bind_failed("OSError: model folder not found")


@pytest.mark.skipif(server_bin() is None, reason="no PostgreSQL (`make sysdeps` installs it)")
def test_postgresql_is_started_again_on_a_fresh_port(held_port: int) -> None:
    import psycopg2

    fresh = free_port()
    cluster = Cluster.start(ports=[held_port, fresh])
    try:
        assert cluster.port == fresh
        con = psycopg2.connect(cluster.url())
        with con.cursor() as cur:
            cur.execute("SELECT 1")
            assert cur.fetchone() == (1,)
        con.close()
        log = (cluster.root / "server.log").read_text()
        assert "could not bind" in log and str(held_port) in log
    finally:
        cluster.stop()
