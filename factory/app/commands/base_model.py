"""``factory base-model [NAME] [--list]``: build (or reuse) an embedded base model directory, or
list every recipe's base model and whether it is on this machine."""

from __future__ import annotations

import argparse
import json
from typing import Any

from factory.app.materialize import materialize
from factory.base_model import BUILDERS, BUILT_MODELS, MissingBaseModelError, require_base_model
from factory.recipes import list_recipes
from factory.trainer.base_models import is_built


def register(sub: Any) -> None:
    p = sub.add_parser("base-model", help="build (or reuse) an embedded base model directory "
                                          "(--list: every recipe's base model)")
    p.add_argument("name", nargs="?", default=BUILT_MODELS[0], choices=BUILT_MODELS,
                   help=f"the model to build (default {BUILT_MODELS[0]})")
    p.add_argument("--list", action="store_true",
                   help="one JSON line per recipe: its base model, family and where it is")
    p.set_defaults(func=_base_model)


def _base_model(args: argparse.Namespace) -> int:
    if args.list:
        return _list()

    result = materialize(["base_model"], partition_key=args.name)
    mat = result.asset_materializations_for_node("base_model")[0]
    print(json.dumps({"name": args.name, "path": mat.metadata["path"].value,
                      "num_parameters": mat.metadata["num_parameters"].value}))
    return 0


def _list() -> int:
    from pathlib import Path

    for r in list_recipes():
        row: dict[str, Any] = {"recipe": r.name, "base_model": r.base_model_id,
                               "family": r.architecture.family,
                               "num_parameters": r.architecture.num_parameters}
        if r.builder in BUILDERS:
            row["built"] = is_built(Path(r.base_model_path()))
            row["path"] = r.base_model_path()
            row["available"] = True
        else:
            try:
                require_base_model(r)
                row["available"] = True
            except MissingBaseModelError as e:
                row["available"], row["missing"] = False, str(e)
        print(json.dumps(row))
    return 0
