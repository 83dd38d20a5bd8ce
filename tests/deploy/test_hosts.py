"""``ProcessHost`` places a server without probing a port for it to bind later: the factory's
CPU server binds port 0 and reports the port through a pipe; ``vllm serve``, which binds the
port it is told, is started again on a fresh port when another process holds its port (its
bind fails, or another server listens there, whose port vLLM's ``SO_REUSEPORT`` bind would
share).

No vLLM runs here: ``vllm`` on the tests' PATH is a program that binds its port the way
``vllm serve`` does before it loads a model (``create_server_socket`` in vLLM's OpenAI server:
``SO_REUSEADDR`` and ``SO_REUSEPORT``, bound, not listening yet; ``Address already in use``
when taken), then holds it until stopped. The placement is what is tested, not vLLM.
"""

from __future__ import annotations

import itertools
import os
import socket
import stat
import sys
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import pytest

from factory.deploy.deployer import Deployment
from factory.deploy.hosts import HostError, ProcessHost, ServerSpec
from factory.inference import ServeSizing, free_port
from factory.process import is_alive, port_taken, stop_group

VLLM = """#!{python}
import signal, socket, sys

args = sys.argv
host, port = args[args.index("--host") + 1], int(args[args.index("--port") + 1])
sock = socket.socket()
sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, {reuse_port:d})
sock.bind((host, port))  # OSError: [Errno 98] Address already in use, when taken
print(f"bound {{host}}:{{port}}", flush=True)
if {listen}:
    sock.listen()
signal.pause()  # "loading the model" (or serving) until stop_group's SIGTERM
"""


def _spec(base_model: Path, backend: str) -> ServerSpec:
    return ServerSpec(name="exp", version="v1", adapter="exp-v1", checkpoint="/no-adapter",
                      base_model=str(base_model), backend=backend, sizing=ServeSizing(),
                      started_at=datetime.now(UTC))


def _argv(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


@pytest.fixture()
def vllm_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                 request: pytest.FixtureRequest) -> None:
    """``vllm`` binding as vLLM does (``SO_REUSEPORT``, not listening); with the parameter
    ``"listening"``: a server that binds without ``SO_REUSEPORT`` and listens at once."""
    listening = getattr(request, "param", "") == "listening"
    folder = tmp_path / "bin"
    folder.mkdir()
    program = folder / "vllm"
    program.write_text(VLLM.format(python=sys.executable, reuse_port=not listening,
                                   listen=listening))
    program.chmod(program.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")


def _taken(*, listen: bool, reuse_port: bool = False) -> Iterator[int]:
    with socket.socket() as s:
        if reuse_port:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(("127.0.0.1", 0))
        if listen:
            s.listen()
        yield s.getsockname()[1]


@pytest.fixture()
def bound_port() -> Iterator[int]:
    """A port another process (this test) has bound, not listening (a server loading its model):
    /proc/net does not show it, vLLM's bind fails on it."""
    yield from _taken(listen=False)


@pytest.fixture()
def listened_port() -> Iterator[int]:
    """A port another server listens on."""
    yield from _taken(listen=True)


@pytest.fixture()
def shared_port() -> Iterator[int]:
    """A port another server listens on with ``SO_REUSEPORT``: vLLM's bind on it succeeds, and
    the two would share its connections."""
    yield from _taken(listen=True, reuse_port=True)


def test_the_cpu_server_is_placed_on_the_port_it_bound(factory_home: Path, tmp_path: Path,
                                                       tiny_model_dir: Path) -> None:
    host = ProcessHost(log_root=tmp_path / "logs")
    placed = host.start(_spec(tiny_model_dir, "transformers"))
    try:
        assert placed.pid is not None and placed.port > 0
        assert placed.endpoint == f"http://127.0.0.1:{placed.port}/v1"
        argv = _argv(placed.pid)
        assert argv[argv.index("--port") + 1] == "0" and "--port-fd" in argv
        assert port_taken("127.0.0.1", placed.port)  # bound before it was reported
        assert Path(placed.log_path).parent == tmp_path / "logs" / "exp"
    finally:
        stop_group(placed.pid or 0, timeout_s=10)


def test_a_cpu_server_on_a_reported_port_is_known_by_its_port(factory_home: Path,
                                                              tmp_path: Path,
                                                              tiny_model_dir: Path) -> None:
    """Its command line says ``--port 0``: the guard against a recycled pid (``alive``) knows
    it by the port it holds (bound while it loads, listening once it serves: the deploy tests
    stop served ones), so the host stops it; another port is not its."""
    host = ProcessHost(log_root=tmp_path / "logs")
    placed = host.start(_spec(tiny_model_dir, "transformers"))
    dep = Deployment(name="exp", version="v1", checkpoint="/no-adapter",
                     base_model=str(tiny_model_dir), adapter="exp-v1", route_model="factory/exp",
                     endpoint=placed.endpoint, backend="transformers", status="starting",
                     pid=placed.pid, port=placed.port, log_path=placed.log_path)
    try:
        assert host.running(dep)  # still importing torch: bound, not listening yet
        assert not replace(dep, port=free_port()).alive
    finally:
        host.stop(dep, timeout_s=10)
    assert not is_alive(placed.pid)


def test_a_cpu_server_that_cannot_bind_is_a_clear_error(factory_home: Path, tmp_path: Path,
                                                        tiny_model_dir: Path) -> None:
    # 192.0.2.1 (TEST-NET-1) is no address of this machine: the bind fails before any report.
    host = ProcessHost(listen="192.0.2.1", log_root=tmp_path / "logs")
    with pytest.raises(HostError, match="exited before it bound a port(.|\n)*cannot bind"):
        host.start(_spec(tiny_model_dir, "transformers"))


@pytest.mark.parametrize("vllm_on_path", ["bound", "listening"], indirect=True)
@pytest.mark.usefixtures("vllm_on_path")
def test_vllm_is_placed_once_it_holds_its_port(factory_home: Path, tmp_path: Path,
                                               tiny_model_dir: Path) -> None:
    placed = ProcessHost(log_root=tmp_path / "logs").start(_spec(tiny_model_dir, "vllm"))
    try:
        port = placed.port
        assert placed.endpoint == f"http://127.0.0.1:{port}/v1"
        assert f"bound 127.0.0.1:{port}" in Path(placed.log_path).read_text()
        argv = _argv(placed.pid or 0)
        assert argv[argv.index("--port") + 1] == str(port)
    finally:
        stop_group(placed.pid or 0, timeout_s=10)


@pytest.mark.usefixtures("vllm_on_path")
def test_vllm_whose_bind_fails_is_started_again(factory_home: Path, tmp_path: Path,
                                                tiny_model_dir: Path, bound_port: int) -> None:
    ports = itertools.chain([bound_port], (free_port() for _ in range(4)))
    placed = ProcessHost(log_root=tmp_path / "logs", ports=ports).start(
        _spec(tiny_model_dir, "vllm"))
    try:
        assert placed.port != bound_port
        log = Path(placed.log_path).read_text()  # every attempt's, in turn
        assert "Address already in use" in log and f"bound 127.0.0.1:{placed.port}" in log
    finally:
        stop_group(placed.pid or 0, timeout_s=10)


@pytest.mark.usefixtures("vllm_on_path")
@pytest.mark.parametrize("taken", ["listened_port", "shared_port"])
def test_vllm_never_shares_a_port_another_server_listens_on(
        factory_home: Path, tmp_path: Path, tiny_model_dir: Path, taken: str,
        request: pytest.FixtureRequest) -> None:
    port = request.getfixturevalue(taken)
    ports = itertools.chain([port], (free_port() for _ in range(4)))
    placed = ProcessHost(log_root=tmp_path / "logs", ports=ports).start(
        _spec(tiny_model_dir, "vllm"))
    try:
        assert placed.port != port
        assert f"bound 127.0.0.1:{placed.port}" in Path(placed.log_path).read_text()
    finally:
        stop_group(placed.pid or 0, timeout_s=10)


@pytest.mark.usefixtures("vllm_on_path")
def test_vllm_gives_up_after_its_attempts(factory_home: Path, tmp_path: Path,
                                          tiny_model_dir: Path, bound_port: int) -> None:
    host = ProcessHost(log_root=tmp_path / "logs", ports=[bound_port] * 5)
    with pytest.raises(HostError, match=f"could not bind 127.0.0.1:{bound_port}"):
        host.start(_spec(tiny_model_dir, "vllm"))
