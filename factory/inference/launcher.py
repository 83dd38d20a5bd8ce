"""Start an inference server (the CPU server or vLLM) as a subprocess and wait until it is healthy.

One code path for evals and deploys: ``InferenceServer(...).start()`` runs the server on
127.0.0.1 (on the port it is given, else on a free one), polls ``GET /health`` and returns once
it answers 200; a server that exits or stays unhealthy past ``startup_timeout_s`` raises
``InferenceServerError`` with the tail of its log, and is stopped.

Without a port, the CPU server binds port 0 and reports the port the kernel gave it through a
pipe (``--port-fd``), before it loads the model: no other process can take the port between the
choice and the bind. vLLM cannot report a port it picked, so it gets one that is free
now (``free_port``) and, when it exits because another process bound that port first
(``PortInUseError``), is started again on a fresh one (``on_free_port``, which other programs
that cannot bind port 0 use too: the Dagster code server, PostgreSQL in the tests).

vLLM is this machine's (``factory.inference.vllm.local_vllm``: ``$FACTORY_VLLM_PYTHON``, a
``vllm`` on ``PATH``, or the checkout's ``.venv-vllm`` that ``make vllm`` builds); without one, or
with one that is not built from the current pins, ``start`` raises at once, naming the fix.
vLLM answers ``/health`` before its first forward pass, so once healthy it is asked for one
token: an engine that cannot run the model dies there, and ``start`` raises with its error.

Both servers render prompts with the trainer's chat template of the base model's chat format
(``factory.trainer.chat.chat_format`` of its tokenizer): the CPU server by default, vLLM through
``--chat-template``, a file holding ``factory.trainer.chat.chat_template(fmt)`` (vLLM would otherwise use
the base tokenizer's shipped template, which for SmolLM2 knows no tools and for Gemma 3 270M
does not exist). The file is named
by its content's hash under the factory home and never removed, so the command is the same every
time it is built and a deployment spawned detached from it keeps a template to restart with.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import re
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, NoReturn, TypeVar

import httpx
from tokenizers import Tokenizer

from factory import codepin
from factory.blobs import BlobStore
from factory.errors import FactoryError
from factory.inference.client import InferenceClient
from factory.inference.vllm import (
    BUILD_HINT,
    IMAGE,
    VLLM_ENV,
    ServeSizing,
    VLLMInstall,
    busy_threads,
    install_problem,
    local_vllm,
    vllm_serve_command,
)
from factory.lifeline import guard, release
from factory.normalize.request import image_data_urls
from factory.settings import get_settings
from factory.trainer.chat import CHAT_TEMPLATE, chat_format, chat_template
from factory.trainer.cores import claim_for, folder_of

BACKENDS = ("transformers", "vllm")


BIND_ATTEMPTS = 5
"""Starts ``on_free_port`` tries: each loses its port only to a process binding that very port
within the moment between the probe and the program's own bind."""

_BIND_FAILURES = ("address already in use", "failed to bind to address", "could not bind")
"""How programs say they could not bind their port, lower-cased: Python's and gRPC's
``EADDRINUSE`` text, gRPC's ``Failed to bind to address`` (the Dagster code server), PostgreSQL's
``could not bind IPv4 address``."""

T = TypeVar("T")


class InferenceServerError(FactoryError):
    """The server did not come up (or died)."""


class PortInUseError(InferenceServerError):
    """A server could not bind the port it was given: another process holds it."""


_ERROR_LINE = re.compile(
    r"^(?:\(\S+ pid=\d+\) ERROR [^]]*\] )?([\w.]*\w(?:Error|Exception)): (.+)$", re.M)
"""The last line of a traceback in a log, alone or as vLLM logs it (``(Worker pid=N) ERROR
<time> [file:line] RuntimeError: ...``)."""


_MODULE_MISSING = re.compile(r"\((ModuleNotFoundError|ImportError): ([^)\n]+)\)")
"""How ``python -m MODULE`` reports a module it cannot import (``Error while finding module
specification for 'MODULE' (ModuleNotFoundError: No module named 'vllm')``)."""


def _first_error(output: str) -> str | None:
    """The first exception a program's output reports (``RuntimeError: ...``), or None."""
    match = _ERROR_LINE.search(output)
    return f"{match[1]}: {match[2].strip()}" if match else None


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing is bound to on ``host`` now. Another process may bind it before the
    caller's program does: start that program with ``on_free_port``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def bind_failed(output: str) -> bool:
    """Whether a program's output says it could not bind its port (``_BIND_FAILURES``)."""
    text = output.lower()
    return any(failure in text for failure in _BIND_FAILURES)


def on_free_port(start: Callable[[int], T], *, host: str = "127.0.0.1",
                 ports: Iterable[int] | None = None, attempts: int = BIND_ATTEMPTS) -> T:
    """``start(port)`` for a program that cannot bind port 0 and report the port: on a port
    free now, and again on a fresh one each time ``start`` raises ``PortInUseError`` (another
    process bound the port first), ``attempts`` times at most; the last ``PortInUseError`` is
    raised. ``ports``: the ports to try, in order (default: a fresh ``free_port`` each time)."""
    candidates = iter(ports) if ports is not None else (free_port(host) for _ in range(attempts))
    error: PortInUseError | None = None
    for port in itertools.islice(candidates, attempts):
        try:
            return start(port)
        except PortInUseError as exc:
            error = exc
    raise error or PortInUseError(f"no port to try on {host}")


def cpu_serve_command(model: str, adapters: Mapping[str, str] | None = None, *,
                      served_model_name: str | None = None, host: str = "127.0.0.1",
                      port: int = 8000, max_model_len: int = 4096, max_num_seqs: int = 8,
                      dtype: str = "float32", threads: int | None = None,
                      port_fd: int | None = None) -> list[str]:
    """argv of the factory's CPU server (same flag names as ``vllm serve``); ``port_fd``: an
    inherited descriptor the server writes its bound port to (with ``port`` 0)."""
    cmd = [sys.executable, "-m", "factory.inference", model, "--host", host, "--port", str(port),
           "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
           "--dtype", dtype]
    if port_fd is not None:
        cmd += ["--port-fd", str(port_fd)]
    if served_model_name:
        cmd += ["--served-model-name", served_model_name]
    if threads:
        cmd += ["--threads", str(threads)]
    if adapters:
        cmd.append("--lora-modules")
        cmd += [f"{n}={p}" for n, p in adapters.items()]
    return cmd


def model_chat_template(model: str) -> str:
    """The trainer's template for base model ``model``: of its tokenizer's chat format when
    ``model`` is a folder with a ``tokenizer.json``, ChatML otherwise (a hub id: the Qwen
    recipes' format)."""
    path = Path(model) / "tokenizer.json"
    if not path.is_file():
        return CHAT_TEMPLATE

    return chat_template(chat_format(Tokenizer.from_file(str(path))))


def chat_template_file(template: str | None = None) -> Path:
    """``<home>/inference/chat-template-<sha256 prefix>.jinja`` holding ``template`` (ChatML's
    ``CHAT_TEMPLATE`` by default), written (atomically) if it is not there yet."""
    data = (template or CHAT_TEMPLATE).encode("utf-8")
    folder = get_settings().home / "inference"
    path = folder / f"chat-template-{hashlib.sha256(data).hexdigest()[:16]}.jinja"
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".chat-template-", dir=folder)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    return path


class InferenceServer:
    """A running inference server; use as a context manager or call ``start``/``stop``."""

    def __init__(self, model: str | os.PathLike[str], *,
                 adapters: Mapping[str, str] | None = None, served_model_name: str | None = None,
                 backend: str = "transformers", sizing: ServeSizing | None = None,
                 host: str = "127.0.0.1", port: int | None = None,
                 startup_timeout_s: float = 300.0, threads: int | None = None,
                 max_batch_size: int | None = None,
                 log_path: str | os.PathLike[str] | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        """``max_batch_size``: the CPU server's largest batch (default: ``sizing.max_num_seqs``,
        at most 16); vLLM schedules by ``sizing.max_num_seqs`` instead. ``threads``: the CPU
        server's torch threads; vLLM's CPU build runs that many OpenMP threads, unbound, instead
        of one bound to each core."""
        if backend not in BACKENDS:
            raise ValueError(f"backend: must be one of {', '.join(BACKENDS)}, got {backend!r}")
        self.model = str(model)
        self.adapters = dict(adapters or {})
        self.served_model_name = served_model_name or self.model
        self.backend = backend
        self.sizing = sizing or ServeSizing()
        self.host = host
        self.port = port
        self.startup_timeout_s = startup_timeout_s
        self.threads = threads
        self.max_batch_size = max_batch_size
        self.log_path = Path(log_path) if log_path else None
        self.env = dict(env or {})
        self.vllm: VLLMInstall | None = local_vllm() if backend == "vllm" else None
        """The vLLM install that runs (``backend`` vllm), None when this machine has none."""
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_file: Any = None
        self._log_start = 0
        """Size of the log when the current start began: what it wrote comes after."""

    @property
    def url(self) -> str:
        """``http://host:port`` (no path)."""
        if self.port is None:
            raise InferenceServerError("server not started")
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI base URL, ``http://host:port/v1``."""
        return self.url + "/v1"

    def command(self, *, port_fd: int | None = None,
                vllm: VLLMInstall | None = None) -> list[str]:
        """The server's argv on its port (0 before a port is known: any free one);
        ``port_fd``: where the CPU server reports the port it bound; ``vllm``: the vLLM install
        it is for (default ``self.vllm``, this machine's; ``factory.inference.vllm.IMAGE`` for
        ``vllm serve`` in a vLLM image)."""
        port = 0 if self.port is None else self.port
        if self.backend == "vllm":
            install = vllm or self.vllm
            return vllm_serve_command(self.sizing, self.model, self.adapters,
                                      served_model_name=self.served_model_name,
                                      host=self.host, port=port,
                                      chat_template=str(self.chat_template_file()),
                                      install=install or IMAGE)
        return cpu_serve_command(self.model, self.adapters,
                                 served_model_name=self.served_model_name, host=self.host,
                                 port=port, max_model_len=self.sizing.max_model_len,
                                 max_num_seqs=self.max_batch_size
                                 or min(self.sizing.max_num_seqs, 16),
                                 threads=self.threads, port_fd=port_fd)

    def chat_template_file(self) -> Path:
        """The file holding the trainer's chat template of the model's format (written if
        missing)."""
        return chat_template_file(model_chat_template(self.model))

    def environment(self) -> dict[str, str]:
        """What the server's process gets on top of this one's environment: for vLLM,
        ``VLLM_ENV``, ``HF_HUB_OFFLINE`` for a model in a folder (nothing is fetched while it
        serves) and ``threads`` unbound OpenMP threads on its CPU build; then ``env``."""
        extra: dict[str, str] = {}
        if self.backend == "vllm":
            extra.update(VLLM_ENV)
            if Path(self.model).is_dir():
                extra["HF_HUB_OFFLINE"] = "1"
            if self.threads and self.vllm is not None and self.vllm.cpu:
                extra.update(VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS=str(self.threads))
        return {**extra, **self.env}

    def start(self) -> InferenceServer:
        if self.proc is not None:
            raise InferenceServerError("server already started")
        codepin.check()  # the server imports the factory: the run's code, or a refusal
        if self.backend == "vllm":
            problem = install_problem(self.vllm)
            if problem:
                raise InferenceServerError(f"cannot start the vllm server: {problem}")
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="inference-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        if self.port is not None:
            self._start_on(self.port)
        elif self.backend == "transformers":
            self._start_reporting()
        else:
            # vllm serve binds the port it is told and cannot report one it picked.
            on_free_port(self._start_on, host=self.host)
        self.claim_cores()
        return self

    def claim_cores(self, pid: int | None = None) -> Path | None:
        """For a vLLM server on the CPU build, the busy-while claim on the machine's cores
        (``factory.trainer.cores.claim_for``) of process ``pid`` (default this server's): its
        ``busy_threads`` while its ``/metrics`` report requests; the claims folder is the
        server's (its environment's ``FACTORY_CORE_SHARES``). None, and nothing written, for
        the CPU server (it claims while it has requests itself), a GPU build, or sharing off.
        The claim goes when the process exits."""
        pid = pid if pid is not None else self.proc.pid if self.proc is not None else None
        threads = busy_threads(self.vllm, self.threads) if self.backend == "vllm" else None
        folder = folder_of({**os.environ, **self.environment()})
        if pid is None or threads is None or folder is None:
            return None
        return claim_for(pid, pinned=threads, busy_url=self.url + "/metrics", folder=folder)

    def _start_on(self, port: int) -> None:
        """Start on ``port`` and wait until healthy; ``PortInUseError`` when it was taken."""
        self.port = port
        self._spawn(self.command())
        deadline = time.monotonic() + self.startup_timeout_s
        self._wait_healthy(deadline)
        if self.backend == "vllm":
            self._check_generates(deadline)

    def _check_generates(self, deadline: float) -> None:
        """Ask the healthy vLLM for one token: an engine that cannot run the model (its CPU
        attention has no kernel for a head size of 16, the tiny test model's) dies on its first
        request, after ``/health`` said 200."""
        try:
            r = httpx.post(self.base_url + "/completions",
                           json={"model": self.served_model_name, "prompt": "Hello",
                                 "max_tokens": 1},
                           timeout=max(deadline - time.monotonic(), 10.0))
            if r.status_code == 200:
                return
            answer = f"HTTP {r.status_code}"
        except httpx.HTTPError as exc:
            answer = str(exc) or type(exc).__name__
        cause = _first_error(self._this_start())
        tail = self.log_tail()
        self.stop()
        raise InferenceServerError(
            f"the vllm server started but cannot serve {self.model} ({answer} to its first "
            f"request{': ' + cause if cause else ''}); serve it with the transformers backend; "
            f"log tail:\n{tail}")

    def _start_reporting(self) -> None:
        """Start the CPU server on port 0; it reports the port it bound through a pipe."""
        read_fd, write_fd = os.pipe()
        try:
            self._spawn(self.command(port_fd=write_fd), pass_fds=(write_fd,))
        finally:
            os.close(write_fd)  # the server holds the only write end: EOF once it exits
        deadline = time.monotonic() + self.startup_timeout_s
        assert self.proc is not None
        with os.fdopen(read_fd, "rb", buffering=0) as pipe:
            report = b""
            while not report.endswith(b"\n"):
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([pipe], [], [], left)[0]:
                    self._fail_unhealthy()
                chunk = pipe.read(16)
                if not chunk:  # the server closed the pipe without a port: it is exiting
                    try:
                        self.proc.wait(timeout=max(deadline - time.monotonic(), 1.0))
                    except subprocess.TimeoutExpired:
                        self._fail_unhealthy()
                    self._fail_exited()
                report += chunk
        self.port = int(report)
        self._wait_healthy(deadline)

    def _spawn(self, argv: list[str], pass_fds: tuple[int, ...] = ()) -> None:
        assert self.log_path is not None
        self._log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        self._log_file = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the server
        env = {**os.environ, **self.environment()}
        try:
            self.proc = subprocess.Popen(argv, stdout=self._log_file,
                                         stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True, pass_fds=pass_fds)
            # Stopped by ``stop``, or by this process's lifeline should it die first.
            guard(self.proc.pid, signal.SIGTERM)
        except (FileNotFoundError, PermissionError) as e:
            self._log_file.close()
            self._log_file = None
            hint = f" ({BUILD_HINT})" if self.backend == "vllm" else ""
            raise InferenceServerError(f"cannot start the {self.backend} server: {e}{hint}"
                                       ) from None

    def _wait_healthy(self, deadline: float) -> None:
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                self._fail_exited()
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self._fail_unhealthy()
            time.sleep(0.25)

    def _fail_exited(self) -> NoReturn:
        """Raise for a server that exited before it was healthy: ``PortInUseError`` when its
        output of this start says its port was taken."""
        assert self.proc is not None
        code = self.proc.returncode
        tail = self.log_tail()
        self.stop()
        this_start = self._this_start()
        if bind_failed(this_start):
            raise PortInUseError(f"the {self.backend} server could not bind {self.host}:"
                                 f"{self.port}; log tail:\n{tail}")
        why = ""
        if self.backend == "vllm":
            # ``python -m`` of a module it cannot find says so mid-line, in parentheses.
            missing = _MODULE_MISSING.search(this_start)
            cause = _first_error(this_start) or (f"{missing[1]}: {missing[2]}" if missing else None)
            if cause and cause.startswith(("ModuleNotFoundError", "ImportError")):
                why = f" ({cause}: vLLM does not import; {BUILD_HINT})"
            elif cause:
                why = f" ({cause})"
        raise InferenceServerError(f"the {self.backend} server exited with code {code}"
                                   f" before it was healthy{why}; log tail:\n{tail}")

    def _this_start(self) -> str:
        """What the server wrote to its log since the current start began."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        with open(self.log_path, "rb") as f:
            f.seek(self._log_start)
            return f.read().decode("utf-8", "replace")

    def _fail_unhealthy(self) -> NoReturn:
        tail = self.log_tail()
        self.stop()
        raise InferenceServerError(f"the {self.backend} server was not healthy after "
                                   f"{self.startup_timeout_s:.0f} s; log tail:\n{tail}")

    def log_tail(self, num_bytes: int = 4000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        data = self.log_path.read_bytes()
        return data[-num_bytes:].decode("utf-8", "replace")

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM the server (its whole process group), SIGKILL if it lingers."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=timeout_s)
        if proc is not None:
            release(proc.pid)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def client(self, timeout_s: float = 600.0) -> Any:
        # torch (~2 s): only a model that reads images needs it; deploys and the daemon import this
        from factory.trainer.vision import has_vision

        image_url = None
        if has_vision(self.model):
            # the model reads images: send them as data URLs of the blob store's bytes

            image_url = image_data_urls(BlobStore().root)
        return InferenceClient(self.base_url, timeout_s=timeout_s, image_url=image_url)

    def __enter__(self) -> InferenceServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
