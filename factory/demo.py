"""The main job on the embedded default: what ``make demo`` runs.

Today it builds the base model through Dagster and shows the factory's tables; the later stages
(traffic, dataset, plan, training, evals, deployment) join here as they land.
"""

from __future__ import annotations

from typing import Any

from factory.lake import Lake
from factory.output import print_rows
from factory.runner import materialize
from factory.settings import get_settings


def run_demo() -> dict[str, Any]:
    settings = get_settings().ensure()
    print(f"factory home: {settings.home}", flush=True)
    print("[1/2] base model: building SmolLM2-135M-Instruct (cached after the first run)",
          flush=True)
    result = materialize(["base_model"])
    mat = result.asset_materializations_for_node("base_model")[0]
    print("[2/2] the lake:", flush=True)
    lake = Lake(settings)
    tables = lake.describe()
    print_rows(tables, columns=["table", "rows", "snapshot_id", "last_writer", "run_id"])
    print(f"Open the UI with: FACTORY_HOME={settings.home} .venv/bin/factory ui", flush=True)
    return {
        "base_model": mat.metadata["path"].value,
        "tables": {t["table"]: t["rows"] for t in tables},
        "factory_home": str(settings.home),
    }
