"""Resumable, verifiable, inference-ready checkpoints (adapter only), on any fsspec filesystem.

Layout of ``{output_dir}/checkpoints/step-{step:08d}/``::

    adapter_model.safetensors   LoRA weights only (PEFT key names)       } PEFT / vLLM load
    adapter_config.json         PEFT LoraConfig, base_model_name_or_path } this directory
    tokenizer.json, tokenizer_config.json, chat_template.jinja            } as is
    optimizer.safetensors       AdamW state tensors (``state.{i}.{name}``)
    optimizer.json              param groups and the parameter names in order
    rng.safetensors             torch CPU (and CUDA) generator states
    trainer_state.json          step, data position, loss history, schedule, python/numpy RNG
    manifest.json               sha256 and size of every file above; written last

No pickles anywhere: tensors go to safetensors, the rest to JSON. A local checkpoint is built in
a temp directory and renamed into place; on object stores (no atomic rename) the files are
uploaded first and ``manifest.json`` last, so a checkpoint without a manifest, or whose hashes do
not match, never counts (``verify_checkpoint``).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

MANIFEST = "manifest.json"
FORMAT = "factory-checkpoint/1"
ADAPTER = "adapter_model.safetensors"
REQUIRED = (ADAPTER, "adapter_config.json", "optimizer.safetensors", "optimizer.json",
            "rng.safetensors", "trainer_state.json")
_STEP_DIR = re.compile(r"^step-(\d{8})$")


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, corrupted or holds non-finite weights."""


@dataclass(frozen=True, kw_only=True)
class CheckpointInfo:
    """A verified checkpoint."""

    path: str
    """Directory (local path or fsspec URL)."""
    step: int
    """Optimizer steps done when it was written."""
    manifest_sha256: str
    """sha256 of manifest.json: names this exact checkpoint in events and tables."""


def checkpoints_dir(output_dir: str) -> str:
    return output_dir.rstrip("/") + "/checkpoints"


def step_dir(output_dir: str, step: int) -> str:
    return f"{checkpoints_dir(output_dir)}/step-{step:08d}"


def _fs(url: str) -> tuple[Any, str]:
    import fsspec.core

    fs, path = fsspec.core.url_to_fs(url)
    return fs, path


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_checkpoint(output_dir: str, step: int, files: dict[str, bytes], *,
                     run_id: str, extra_dirs: tuple[Path, ...] = ()) -> CheckpointInfo:
    """Write ``files`` (name -> bytes) plus the files of ``extra_dirs`` (a saved tokenizer) as
    checkpoint ``step``, manifest last; returns its verified info."""
    all_files = dict(files)
    for d in extra_dirs:
        for p in sorted(Path(d).iterdir()):
            if p.is_file():
                all_files.setdefault(p.name, p.read_bytes())
    manifest = {"format": FORMAT, "run_id": run_id, "step": step, "created_at": time.time(),
                "files": {n: {"sha256": _sha256(b), "bytes": len(b)}
                          for n, b in sorted(all_files.items())}}
    manifest_bytes = json.dumps(manifest, indent=1, sort_keys=True).encode()
    dest = step_dir(output_dir, step)
    fs, path = _fs(dest)
    parent = path.rsplit("/", 1)[0]
    fs.makedirs(parent, exist_ok=True)
    from fsspec.implementations.local import LocalFileSystem

    if isinstance(fs, LocalFileSystem):
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-step-{step:08d}-", dir=parent))
        try:
            for name, data in all_files.items():
                (tmp / name).write_bytes(data)
            (tmp / MANIFEST).write_bytes(manifest_bytes)
            if Path(path).exists():  # a re-run of the same step (e.g. SIGTERM right after one)
                old = Path(parent) / f".old-{uuid.uuid4().hex}"
                Path(path).rename(old)
                shutil.rmtree(old, ignore_errors=True)
            tmp.rename(path)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    else:
        if fs.exists(path + "/" + MANIFEST):
            fs.rm(path + "/" + MANIFEST)
        for name, data in all_files.items():
            fs.pipe_file(path + "/" + name, data)
        fs.pipe_file(path + "/" + MANIFEST, manifest_bytes)
    return verify_checkpoint(dest)


def verify_checkpoint(path: str) -> CheckpointInfo:
    """Check the manifest, every file's sha256, and that the adapter weights are finite.

    Raises CheckpointError saying what is wrong; the control plane calls this before it lets a
    checkpoint count (for evals, rollover or recovery).
    """
    import torch
    from safetensors.torch import load
    fs, p = _fs(str(path))
    try:
        manifest_bytes = fs.cat_file(p + "/" + MANIFEST)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no {MANIFEST} (incomplete checkpoint)") from None
    try:
        manifest = json.loads(manifest_bytes)
    except json.JSONDecodeError:
        raise CheckpointError(f"{path}: {MANIFEST} is not JSON") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: unknown format {manifest.get('format')!r}")
    listed = manifest.get("files", {})
    for name in REQUIRED:
        if name not in listed:
            raise CheckpointError(f"{path}: manifest lacks {name}")
    adapter: bytes | None = None
    for name, meta in listed.items():
        try:
            data = fs.cat_file(p + "/" + name)
        except FileNotFoundError:
            raise CheckpointError(f"{path}: {name} is missing") from None
        if _sha256(data) != meta["sha256"]:
            raise CheckpointError(f"{path}: {name} does not match its sha256")
        if name == ADAPTER:
            adapter = data
    assert adapter is not None
    for key, tensor in load(adapter).items():
        if not torch.isfinite(tensor).all():
            raise CheckpointError(f"{path}: adapter weight {key} is not finite")
    return CheckpointInfo(path=str(path), step=int(manifest["step"]),
                          manifest_sha256=_sha256(manifest_bytes))


def list_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every step directory under output_dir, oldest first (not verified)."""
    fs, p = _fs(checkpoints_dir(output_dir))
    if not fs.exists(p):
        return []
    found = []
    prefix = checkpoints_dir(output_dir)
    for entry in fs.ls(p, detail=False):
        m = _STEP_DIR.match(str(entry).rstrip("/").rsplit("/", 1)[-1])
        if m:
            found.append((int(m.group(1)), f"{prefix}/step-{m.group(1)}"))
    return sorted(found)


def latest_checkpoint(output_dir: str) -> CheckpointInfo | None:
    """The newest checkpoint that verifies; corrupt or partial ones are skipped."""
    for _, path in reversed(list_checkpoints(output_dir)):
        try:
            return verify_checkpoint(path)
        except CheckpointError:
            continue
    return None


def read_checkpoint(path: str) -> dict[str, bytes]:
    """Every file of a verified checkpoint, by name."""
    verify_checkpoint(path)
    fs, p = _fs(str(path))
    manifest = json.loads(fs.cat_file(p + "/" + MANIFEST))
    return {name: fs.cat_file(p + "/" + name) for name in manifest["files"]}


# --- state <-> bytes (no pickles) -----------------------------------------------------------


def tensors_to_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save
    return save({k: v.detach().cpu().contiguous() for k, v in tensors.items()},
                metadata={"format": "pt"})


def optimizer_to_files(state: dict[str, Any], names: list[str]) -> dict[str, bytes]:
    """AdamW ``state_dict`` (with full, unsharded tensors) to safetensors + JSON."""
    import torch
    tensors = {}
    for idx, per_param in state["state"].items():
        for key, value in per_param.items():
            assert isinstance(value, torch.Tensor), f"optimizer state {key} is not a tensor"
            tensors[f"state.{idx}.{key}"] = value
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()}
              for g in state["param_groups"]]
    meta = {"param_groups": groups, "param_names": names}
    return {"optimizer.safetensors": tensors_to_bytes(tensors),
            "optimizer.json": json.dumps(meta, sort_keys=True).encode()}


def optimizer_from_files(files: dict[str, bytes]) -> tuple[dict[str, Any], list[str]]:
    from safetensors.torch import load
    tensors = load(files["optimizer.safetensors"])
    meta = json.loads(files["optimizer.json"])
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        _, idx, name = key.split(".", 2)
        state.setdefault(int(idx), {})[name] = value
    groups = [{k: (tuple(v) if k == "betas" else v) for k, v in g.items()}
              for g in meta["param_groups"]]
    return {"state": state, "param_groups": groups}, list(meta["param_names"])


def rng_to_files(per_rank: dict[str, list[torch.Tensor]] | None = None) -> dict[str, bytes]:
    """Every RNG state: torch CPU (and CUDA), Python and NumPy of this process, plus the torch
    states of every rank (``per_rank``: name -> one state per rank) under multi-process plans,
    whose ranks draw different amounts of dropout noise."""
    import random

    import numpy as np
    import torch

    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda.{i}"] = s
    for name, states in (per_rank or {}).items():
        for rank, state in enumerate(states):
            tensors[f"{name}.rank{rank}"] = state
    py = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
    meta = {"python": [py[0], list(py[1]), py[2]],
            "numpy": [kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]}
    return {"rng.safetensors": tensors_to_bytes(tensors),
            "rng.json": json.dumps(meta).encode()}


def restore_rng(files: dict[str, bytes], *, rank: int = 0) -> None:
    import random

    import numpy as np
    import torch
    from safetensors.torch import load

    tensors = load(files["rng.safetensors"])
    torch.set_rng_state(tensors.get(f"torch_cpu.rank{rank}", tensors["torch_cpu"]))
    if torch.cuda.is_available():
        mine = tensors.get(f"cuda_current.rank{rank}")
        if mine is not None:
            torch.cuda.set_rng_state(mine)
        else:
            cuda = [tensors[f"cuda.{i}"] for i in range(len(tensors)) if f"cuda.{i}" in tensors]
            if cuda:
                torch.cuda.set_rng_state_all(cuda)
    meta = json.loads(files["rng.json"])
    v, keys, gauss = meta["python"]
    random.setstate((v, tuple(keys), gauss))
    kind, keys, pos, has_gauss, cached = meta["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def all_finite(tensors: dict[str, torch.Tensor]) -> bool:
    import torch
    return all(bool(torch.isfinite(t).all()) for t in tensors.values())


def finite_float(x: float) -> float | None:
    """JSON-safe float (NaN/inf become null)."""
    return x if math.isfinite(x) else None
