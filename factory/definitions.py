"""The one composition root: every asset, check, sensor, job, schedule and resource.

Assets and checks are collected from the modules of the ``factory.assets`` package; sensors, jobs
and schedules from the ``SENSORS``/``JOBS``/``SCHEDULES`` lists of the modules of
``factory.sensors``.
``workspace.yaml`` loads ``defs`` from here, so ``dagster dev`` / ``factory ui`` show the graph.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType
from typing import Any

import dagster as dg

from factory import assets, sensors
from factory.resources.deployer import DeployerResource
from factory.resources.inference import InferenceResource
from factory.resources.judge import JudgeResource
from factory.resources.lake import LakeResource
from factory.resources.providers import ProviderResource


def _modules(package: ModuleType) -> list[ModuleType]:
    return [importlib.import_module(f"{package.__name__}.{m.name}")
            for m in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name)]


def _collect(name: str) -> list[Any]:
    return [item for module in _modules(sensors) for item in getattr(module, name, [])]


def build_resources() -> dict[str, Any]:
    """Resource instances by key: the embedded defaults."""
    return {
        "lake": LakeResource(),
        "judge": JudgeResource(),
        "inference": InferenceResource(),
        "provider": ProviderResource.from_env(),
        "deployer": DeployerResource(),
    }


def build_definitions() -> dg.Definitions:
    asset_modules = _modules(assets)
    return dg.Definitions(
        assets=dg.load_assets_from_modules(asset_modules),
        asset_checks=dg.load_asset_checks_from_modules(asset_modules),
        sensors=_collect("SENSORS"),
        jobs=_collect("JOBS"),
        schedules=_collect("SCHEDULES"),
        resources=build_resources(),
        # Steps of a run in its process: a step per subprocess re-imports torch and the
        # definitions (~4 s each here), and a chain's runs are small and sequential.
        executor=dg.in_process_executor,
    )


defs = build_definitions()
