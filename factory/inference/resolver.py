"""Adapters found by name in a folder: vLLM's filesystem LoRA resolver, and the same in the CPU
server, so an engine with many replicas learns a new adapter without being told each replica.

vLLM's ``lora_filesystem_resolver`` plugin (``VLLM_PLUGINS``, with
``VLLM_LORA_RESOLVER_CACHE_DIR`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``: ``resolver_env``)
answers a request naming a model the server does not know by looking for ``<folder>/<name>/``:
a LoRA adapter there whose ``adapter_config.json`` has ``peft_type`` ``LORA`` and
``base_model_name_or_path`` equal to the server's base model as its ``--model`` names it (not
its served name: ``OpenAIServingModels.resolve_lora`` passes ``model_config.model``) is loaded
under ``name`` and serves the request (vllm/plugins/lora_resolvers/filesystem_resolver.py). The CPU server
does the same (``find``) when given the folder (``--lora-resolver-dir``, default the same
variable).

The deployer writes an adapter there with ``publish``: a folder of links to the checkpoint's
files, with a copy of its ``adapter_config.json`` naming the base exactly as the engine's
``--model`` does (the trainer's may name it through another path to the same folder, which the
resolver would refuse). ``withdraw`` removes
it: no replica resolves it again; one that loaded it keeps it until its LoRA cache evicts it,
unreachable once no route names it. ``published`` lists what is there.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

RESOLVER_DIR_ENV = "VLLM_LORA_RESOLVER_CACHE_DIR"
"""vLLM's variable naming the folder its filesystem resolver reads; the CPU server's default."""
PLUGIN = "lora_filesystem_resolver"
"""vLLM's plugin name of the filesystem resolver (``VLLM_PLUGINS``)."""
CONFIG = "adapter_config.json"


def resolver_env(folder: str | Path) -> dict[str, str]:
    """Environment that makes a vLLM server (and the CPU server) resolve adapters from
    ``folder``."""
    return {"VLLM_PLUGINS": PLUGIN, RESOLVER_DIR_ENV: str(folder),
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


def find(folder: str | Path, name: str, base_model: str) -> Path | None:
    """The adapter folder vLLM's resolver would load for a request naming ``name`` on a server
    started with ``--model base_model``; None when there is none (no such folder, or its config
    is not a LoRA adapter of that base)."""
    if not name or "/" in name or name in (".", ".."):
        return None
    path = Path(folder) / name
    try:
        config = json.loads((path / CONFIG).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA" \
            or config.get("base_model_name_or_path") != base_model:
        return None
    return path


def publish(folder: str | Path, name: str, checkpoint: str | Path, base_model: str) -> Path:
    """Make adapter ``checkpoint`` resolvable as ``name`` by servers started with ``--model
    base_model`` reading ``folder``: ``<folder>/<name>/`` holds a link to each of the
    checkpoint's files and its ``adapter_config.json`` naming that base. Written beside and
    renamed into place, so a server never reads a half-made folder; one already there under
    ``name`` is replaced. ``ValueError`` for a checkpoint without an adapter config."""
    source = Path(checkpoint)
    try:
        config = json.loads((source / CONFIG).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{source}: no readable {CONFIG} ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{source / CONFIG}: not a JSON object")
    config["base_model_name_or_path"] = base_model
    config.setdefault("peft_type", "LORA")
    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    staging = root / f".{name}.{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    for item in sorted(source.iterdir()):
        if item.name != CONFIG:
            (staging / item.name).symlink_to(item.absolute())
    (staging / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
    target = root / name
    if target.exists():
        withdraw(root, name)
    os.replace(staging, target)
    return target


def withdraw(folder: str | Path, name: str) -> None:
    """Remove adapter ``name`` from ``folder`` (nothing there: nothing to do). Only the links and
    the config go: the checkpoint's own files stay."""
    target = Path(folder) / name
    if not target.exists():
        return
    gone = target.with_name(f".{name}.gone.{uuid.uuid4().hex[:8]}")
    os.replace(target, gone)  # no server resolves it from here on
    shutil.rmtree(gone)


def published(folder: str | Path) -> list[str]:
    """The adapters in ``folder``, by name."""
    root = Path(folder)
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir()
                  if not p.name.startswith(".") and (p / CONFIG).is_file())


def adapter_rank(checkpoint: str | Path) -> int | None:
    """The highest LoRA rank of adapter ``checkpoint`` (``r``, or a larger one in
    ``rank_pattern``), what an engine's ``--max-lora-rank`` must hold; None when its config does
    not say."""
    try:
        config = json.loads((Path(checkpoint) / CONFIG).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    ranks = [config.get("r"), *((config.get("rank_pattern") or {}).values())]
    found = [int(r) for r in ranks if isinstance(r, int) and not isinstance(r, bool)]
    return max(found) if found else None
