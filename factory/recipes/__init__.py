"""Recipes: curated starting points for a fine-tune, one YAML file per base model.

A recipe names the base model (hub id, and for the embedded model the local folder and its
builder), the architecture facts the memory model needs, the judge model, the LoRA topology, the
FSDP version, the base learning rate (at a reference batch size and rank) and the eval cadence.
A recipe for a model that is not present locally still plans: every fact is in the file.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from factory.errors import FactoryError
from factory.settings import Settings, get_settings

RECIPES_DIR = Path(__file__).resolve().parent


class RecipeError(FactoryError):
    """A recipe that does not exist or whose file is malformed."""


@dataclass(frozen=True, kw_only=True)
class Architecture:
    """Facts about the base model that the planner and memory model use."""

    family: str
    """Model family (``llama``, ``qwen3``, ``gemma3``, ``qwen2_5_vl``)."""
    num_parameters: int
    """All parameters, vision tower included."""
    num_layers: int
    """Decoder layers of the language model."""
    hidden_size: int
    """Width of the residual stream."""
    intermediate_size: int
    """Width of the MLP (SwiGLU) inner layer."""
    num_heads: int
    """Attention (query) heads."""
    num_kv_heads: int
    """Key/value heads (grouped-query attention)."""
    head_dim: int
    """Width of one attention head."""
    vocab_size: int
    """Rows of the embedding and of the LM head."""
    max_context: int
    """Longest sequence the model supports, in tokens."""
    tie_word_embeddings: bool
    """Whether the LM head shares the embedding matrix."""
    linear_modules: tuple[str, ...]
    """Names of the linear modules present in every decoder layer (valid LoRA targets)."""
    vision_module: str | None = None
    """Module prefix of the vision tower, None for a text-only model."""
    vision_parameters: int = 0
    """Parameters of the vision tower."""
    supports_tools: bool = False
    """Whether the chat template renders tool schemas and tool calls."""
    untrained_tokens: tuple[tuple[str, int], ...] = ()
    """(token, id) of the chat format's tokens pretraining never trained (a base model that
    was never instruction-tuned: its turn tokens' rows are untrained near-copies of the unused
    tokens'); the planner trains their rows (``trainable_token_ids``)."""

    def module_shape(self, name: str) -> tuple[int, int]:
        """(in_features, out_features) of the decoder-layer linear module ``name``."""
        h, i = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                  "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
        return shapes[name]


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """A curated starting point for a LoRA fine-tune."""

    name: str
    """Recipe name (the file's stem), referenced by experiments."""
    description: str
    """One line for people."""
    base_model_id: str
    """Hub id of the base model."""
    local_dir: str | None
    """Folder under ``settings.models_dir`` holding the model, when it is built locally."""
    builder: str | None
    """How the local folder is built (``smollm2``, ``gemma3``: ``factory.base_model.BUILDERS``),
    None when it comes from a hub."""
    architecture: Architecture
    """Facts for the memory model and validation."""
    judge_model: str
    """Judge used by evals: ``embedded`` or a model id."""
    lora_rank: int
    """Default LoRA rank."""
    lora_alpha: float
    """Default LoRA alpha."""
    lora_dropout: float
    """Default LoRA dropout."""
    lora_target_modules: tuple[str, ...]
    """Default LoRA target modules."""
    fsdp_version: int
    """FSDP version used when sharding (2: ``fully_shard``)."""
    learning_rate: float
    """Learning rate at ``reference_batch_size`` and ``reference_rank``."""
    reference_batch_size: int
    """Effective batch size at which ``learning_rate`` is tuned."""
    reference_rank: int
    """LoRA rank at which ``learning_rate`` is tuned."""
    evals_per_epoch: int
    """Evaluations per pass over the data when the experiment does not set a cadence."""
    gpu: str
    """Default accelerator type of the hardware table."""
    path: Path
    """The recipe file."""

    def base_model_path(self, settings: Settings | None = None) -> str:
        """Where the trainer loads the base model: the local folder if any, else the hub id."""
        if self.local_dir:
            return str((settings or get_settings()).models_dir / self.local_dir)
        return self.base_model_id

    def is_local(self, settings: Settings | None = None) -> bool:
        """Whether the base model is present as a local directory now."""
        return bool(self.local_dir) and Path(self.base_model_path(settings)).is_dir()


def list_recipe_names() -> list[str]:
    """Names of every shipped recipe, sorted."""
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def _need(raw: dict[str, Any], key: str, path: Path, kind: type | tuple[type, ...]) -> Any:
    if key not in raw:
        raise RecipeError(f"{path}: missing field {key!r}")
    value = raw[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise RecipeError(f"{path}: field {key!r} has the wrong type ({value!r})")
    return value


def load_recipe(name: str) -> Recipe:
    """The recipe ``name``; ``RecipeError`` listing the shipped ones if there is none."""
    path = RECIPES_DIR / f"{name}.yaml"
    if not path.is_file():
        known = list_recipe_names()
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise RecipeError(f"unknown recipe {name!r}; {hint}recipes: {', '.join(known)}")
    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    if not isinstance(raw, dict):
        raise RecipeError(f"{path}: a recipe must be a mapping")
    base = _need(raw, "base_model", path, dict)
    arch_raw = dict(_need(raw, "architecture", path, dict))
    arch_raw["linear_modules"] = tuple(arch_raw.get("linear_modules") or ())
    untrained = arch_raw.get("untrained_tokens") or {}
    if not isinstance(untrained, dict) or not all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
            for k, v in untrained.items()):
        raise RecipeError(f"{path}: architecture.untrained_tokens must map tokens to their ids "
                          f"({untrained!r})")
    arch_raw["untrained_tokens"] = tuple(untrained.items())
    try:
        arch = Architecture(**arch_raw)
    except TypeError as exc:
        raise RecipeError(f"{path}: architecture: {exc}") from None
    lora = _need(raw, "lora", path, dict)
    targets = tuple(lora.get("target_modules") or ())
    missing = [t for t in targets if t not in arch.linear_modules]
    if missing:
        raise RecipeError(f"{path}: lora.target_modules {missing} are not modules of the model "
                          f"({', '.join(arch.linear_modules)})")
    hardware = raw.get("hardware") or {}
    return Recipe(
        name=_need(raw, "name", path, str), description=str(raw.get("description", "")),
        base_model_id=_need(base, "id", path, str), local_dir=base.get("local_dir"),
        builder=base.get("builder"), architecture=arch,
        judge_model=_need(raw, "judge_model", path, str),
        lora_rank=int(lora["rank"]), lora_alpha=float(lora["alpha"]),
        lora_dropout=float(lora["dropout"]), lora_target_modules=targets,
        fsdp_version=int(_need(raw, "fsdp_version", path, int)),
        learning_rate=float(_need(raw, "learning_rate", path, (int, float))),
        reference_batch_size=int(_need(raw, "reference_batch_size", path, int)),
        reference_rank=int(_need(raw, "reference_rank", path, int)),
        evals_per_epoch=int(_need(raw, "evals_per_epoch", path, int)),
        gpu=str(hardware.get("gpu", "H100")), path=path,
    )


def list_recipes() -> list[Recipe]:
    """Every shipped recipe, sorted by name."""
    return [load_recipe(name) for name in list_recipe_names()]
