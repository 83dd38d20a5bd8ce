"""Running the gateway: ``serve()`` for ``factory serve`` and ``ServerThread`` for in-process use
(tests and other capabilities' tests start a gateway on a free port in a thread)."""

from __future__ import annotations

import asyncio
import socket
import sys
import threading
from typing import Any

import uvicorn

from factory.gateway.app import Gateway
from factory.gateway.config import GatewayConfig


def _uvicorn_config(app: Any, *, host: str, port: int, log_level: str = "warning") -> Any:
    return uvicorn.Config(app, host=host, port=port, loop="uvloop", http="httptools",
                          lifespan="on", access_log=False, log_level=log_level,
                          server_header=False, date_header=False, backlog=4096,
                          timeout_keep_alive=75)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0 picks a free one) with a deep backlog."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(4096)
    sock.set_inheritable(True)
    return sock


def serve(config: GatewayConfig, *, gateway: Gateway | None = None,
          on_ready: Any = None) -> None:
    """Run the gateway in the foreground until SIGINT/SIGTERM (graceful: spool sealed, one last
    flush attempt)."""
    app = gateway or Gateway(config)
    # The flusher thread normalizes and commits captures in Python while requests are served:
    # with the default 5 ms GIL switch interval the event loop can wait that long for the GIL at
    # every wake-up; 0.5 ms bounds that wait (64 concurrent clients: p50 ~35 -> ~25 ms, +40%
    # throughput on a loaded 2-core machine). Only the ``factory serve`` process is changed.
    sys.setswitchinterval(0.0005)
    sock = bind(config.host, config.port)
    server = uvicorn.Server(_uvicorn_config(app, host=config.host, port=config.port,
                                            log_level="info"))
    if on_ready is not None:
        on_ready(sock.getsockname()[1])
    server.run(sockets=[sock])


class ServerThread:
    """An ASGI app served by uvicorn on 127.0.0.1 in a background thread.

    >>> with ServerThread(Gateway(GatewayConfig(openai_base_url=...))) as srv:
    ...     openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
    """

    def __init__(self, app: Any, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.app = app
        self.sock = bind(host, port)
        self.host = host
        self.port: int = self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.server = uvicorn.Server(_uvicorn_config(app, host=host, port=self.port))
        self._thread = threading.Thread(target=self._run, name=f"asgi-{self.port}", daemon=True)
        self._error: BaseException | None = None

    def _run(self) -> None:
        try:
            asyncio.run(self.server.serve(sockets=[self.sock]))
        except BaseException as exc:  # surfaced by start()/stop() in the calling thread
            self._error = exc

    def start(self, timeout_s: float = 20.0) -> ServerThread:
        self._thread.start()
        deadline = threading.Event()
        waited = 0.0
        while not self.server.started and waited < timeout_s:
            if self._error is not None or not self._thread.is_alive():
                raise RuntimeError(f"server failed to start: {self._error!r}")
            deadline.wait(0.02)
            waited += 0.02
        if not self.server.started:
            raise RuntimeError(f"server did not start within {timeout_s}s")
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=timeout_s)
        self.sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def gateway_in_thread(config: GatewayConfig | None = None, **kwargs: Any) -> ServerThread:
    """Start a gateway (config defaults with ``kwargs`` as overrides, port 0) in a thread.

    Returns the started ``ServerThread``; its ``.app`` is the ``Gateway`` and ``.url`` its base.
    """
    cfg = config or GatewayConfig(**{"port": 0, **kwargs})
    return ServerThread(Gateway(cfg), host=cfg.host, port=cfg.port).start()
