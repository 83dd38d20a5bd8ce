"""Start an inference server (the CPU server or vLLM) as a subprocess and wait until it is healthy.

One code path for evals and deploys: ``InferenceServer(...).start()`` picks a free port on
127.0.0.1 (unless given one), runs the server, polls ``GET /health`` and returns once it answers
200; a server that exits or stays unhealthy past ``startup_timeout_s`` raises
``InferenceServerError`` with the tail of its log, and is stopped.

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
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from factory.errors import FactoryError
from factory.inference.vllm import VLLM_ENV, ServeSizing, vllm_serve_command

BACKENDS = ("transformers", "vllm")


class InferenceServerError(FactoryError):
    """The server did not come up (or died)."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def cpu_serve_command(model: str, adapters: Mapping[str, str] | None = None, *,
                      served_model_name: str | None = None, host: str = "127.0.0.1",
                      port: int = 8000, max_model_len: int = 4096, max_num_seqs: int = 8,
                      dtype: str = "float32", threads: int | None = None) -> list[str]:
    """argv of the factory's CPU server (same flag names as ``vllm serve``)."""
    cmd = [sys.executable, "-m", "factory.inference", model, "--host", host, "--port", str(port),
           "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
           "--dtype", dtype]
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
    from factory.trainer.chat import CHAT_TEMPLATE, chat_format, chat_template

    path = Path(model) / "tokenizer.json"
    if not path.is_file():
        return CHAT_TEMPLATE
    from tokenizers import Tokenizer

    return chat_template(chat_format(Tokenizer.from_file(str(path))))


def chat_template_file(template: str | None = None) -> Path:
    """``<home>/inference/chat-template-<sha256 prefix>.jinja`` holding ``template`` (ChatML's
    ``CHAT_TEMPLATE`` by default), written (atomically) if it is not there yet."""
    from factory.settings import get_settings
    from factory.trainer.chat import CHAT_TEMPLATE

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
        at most 16); vLLM schedules by ``sizing.max_num_seqs`` instead."""
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
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_file: Any = None

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

    def command(self) -> list[str]:
        assert self.port is not None
        if self.backend == "vllm":
            return vllm_serve_command(self.sizing, self.model, self.adapters,
                                      served_model_name=self.served_model_name, host=self.host,
                                      port=self.port, chat_template=str(self.chat_template_file()))
        return cpu_serve_command(self.model, self.adapters,
                                 served_model_name=self.served_model_name, host=self.host,
                                 port=self.port, max_model_len=self.sizing.max_model_len,
                                 max_num_seqs=self.max_batch_size
                                 or min(self.sizing.max_num_seqs, 16),
                                 threads=self.threads)

    def chat_template_file(self) -> Path:
        """The file holding the trainer's chat template of the model's format (written if
        missing)."""
        return chat_template_file(model_chat_template(self.model))

    def start(self) -> InferenceServer:
        if self.proc is not None:
            raise InferenceServerError("server already started")
        if self.port is None:
            self.port = free_port(self.host)
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="inference-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        self._log_file = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the server
        env = {**os.environ, **(VLLM_ENV if self.backend == "vllm" else {}), **self.env}
        try:
            self.proc = subprocess.Popen(self.command(), stdout=self._log_file,
                                         stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        except FileNotFoundError as e:
            self._log_file.close()
            raise InferenceServerError(f"cannot start the {self.backend} server: {e}") from None
        self._wait_healthy()
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            assert self.proc is not None
            code = self.proc.poll()
            if code is not None:
                tail = self.log_tail()
                self.stop()
                raise InferenceServerError(f"the {self.backend} server exited with code {code}"
                                           f" before it was healthy; log tail:\n{tail}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                tail = self.log_tail()
                self.stop()
                raise InferenceServerError(f"the {self.backend} server was not healthy after "
                                           f"{self.startup_timeout_s:.0f} s; log tail:\n{tail}")
            time.sleep(0.25)

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
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def client(self, timeout_s: float = 600.0) -> Any:
        from factory.inference.client import InferenceClient
        from factory.trainer.vision import has_vision

        image_url = None
        if has_vision(self.model):
            # the model reads images: send them as data URLs of the blob store's bytes
            from factory.blobs import BlobStore
            from factory.inference.protocol import image_data_urls

            image_url = image_data_urls(BlobStore().root)
        return InferenceClient(self.base_url, timeout_s=timeout_s, image_url=image_url)

    def __enter__(self) -> InferenceServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
