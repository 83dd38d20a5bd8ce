"""The embedded base model, built once under the models folder and recorded in ``base_models``."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from factory.settings import Settings, get_settings
from factory.trainer.base_models import SMOLLM2_NAME, build_smollm2, model_info


def smollm2_dir(settings: Settings | None = None) -> Path:
    return (settings or get_settings()).models_dir / SMOLLM2_NAME


def ensure_smollm2(settings: Settings | None = None) -> tuple[Path, dict[str, Any]]:
    """Build (or reuse) the SmolLM2-135M-Instruct directory; returns it and its ``base_models`` row."""
    dest = build_smollm2(smollm2_dir(settings))
    weights = sorted(dest.glob("*.safetensors"))
    digest = hashlib.sha256()
    for path in weights:
        with path.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
    info = model_info(dest)
    row = {
        "name": SMOLLM2_NAME,
        "path": str(dest),
        "source": str(info.get("source", "")),
        "sha256": digest.hexdigest(),
        "num_parameters": int(info.get("num_parameters", 0)),  # type: ignore[call-overload]
        "built_at": datetime.now(UTC),
    }
    return dest, row
