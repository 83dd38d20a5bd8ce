"""``factory base-model``: build (or reuse) the embedded base model directory."""

from __future__ import annotations

import argparse
import json
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser("base-model", help="build (or reuse) the embedded SmolLM2-135M directory")
    p.set_defaults(func=_base_model)


def _base_model(args: argparse.Namespace) -> int:
    from factory.app.runner import materialize

    result = materialize(["base_model"])
    mat = result.asset_materializations_for_node("base_model")[0]
    print(json.dumps({"path": mat.metadata["path"].value,
                      "num_parameters": mat.metadata["num_parameters"].value}))
    return 0
