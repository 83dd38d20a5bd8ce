"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for multi-device plans, and the launcher.

Each decoder layer is its own FSDP unit, and the loss module (embedding, final norm, LM head)
is the root, so its forward unshards them. Only LoRA parameters train; FSDP2 shards frozen and
trainable parameters alike, and checkpoints gather the adapter tensors one at a time
(``model.adapter_state``), never the full model.

``launch`` is how ``python -m trainer`` runs a plan with ``num_devices > 1``: it starts one
process per device with the torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT), forwards
SIGTERM/SIGINT to them, and returns rank 0's exit code (the documented codes survive, which
torchrun's own exit status would not preserve).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from typing import Any

import torch

from .config import TrainConfig

PACKAGE = __name__.rpartition(".")[0]
"""This package's import name: ``trainer`` in the image, ``factory.trainer`` installed."""


def shard_model(loss_module: torch.nn.Module, model: Any, *, device: torch.device,
                plan: TrainConfig) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (plan.num_devices,))
    mp = None
    if plan.precision in ("bf16", "bf16-autocast") and device.type == "cuda":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kwargs: dict[str, Any] = {"mesh": mesh}
    if mp is not None:
        kwargs["mp_policy"] = mp
    decoder: Any = loss_module.decoder
    for layer in decoder.layers:
        fully_shard(layer, **kwargs)
    fully_shard(loss_module, **kwargs)


def shard_like(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A full optimizer-state tensor, sharded the way ``param`` is (scalars stay as they are)."""
    if full.dim() == 0 or not hasattr(param, "device_mesh"):
        return full
    from torch.distributed.tensor import distribute_tensor

    sharded: Any = param
    return distribute_tensor(full.to(param.device), sharded.device_mesh, sharded.placements)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(job_path: str, num_processes: int) -> int:
    """Run ``python -m <this package> --job job_path`` (``trainer`` in the image,
    ``factory.trainer`` installed) in ``num_processes`` ranks; rank 0's code."""
    port = _free_port()
    procs = []
    for rank in range(num_processes):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank),
               "WORLD_SIZE": str(num_processes), "LOCAL_WORLD_SIZE": str(num_processes),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, "-m", PACKAGE, "--job", job_path],
                                      env=env))

    def forward(signum: int, frame: Any) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    codes = [p.wait() for p in procs]
    return codes[0] if codes[0] != 0 or all(c == 0 for c in codes) else next(
        c for c in codes if c != 0)
