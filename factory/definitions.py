"""The one composition root: every asset, check, sensor, job, schedule and resource.

Assets and checks are collected from the modules of the ``factory.assets`` package; sensors, jobs
and schedules from the ``SENSORS``/``JOBS``/``SCHEDULES`` lists of the modules of
``factory.sensors``.
``workspace.yaml`` loads ``defs`` from here, so ``dagster dev`` / ``factory ui`` show the graph.
Loaded as a code location it pins the factory's code (``factory.codepin``): every run it creates
runs on that code, or its steps refuse to start.

Resources are picked per deployment, named by ``$FACTORY_DEPLOYMENT``:

- ``embedded`` (the default): one machine, no services. The lake under ``$FACTORY_HOME``, the
  factory's CPU server for evals and deployments.
- ``gpu``: ``vllm serve`` for evals and deployments; the rest as ``embedded``.

In both, three systems outside the factory are configured by a JSON object in the environment
(how the Helm values set them): ``$FACTORY_PROVIDERS``, the provider ladder and control policy
(``ProviderResource``; unset: the local rung only), ``$FACTORY_JUDGE``, an LLM judge
(``LLMJudgeResource``: ``{"base_url": ..., "model": ..., "api_key_env": ...}``; unset: the
embedded judge), and ``$FACTORY_DEPLOYER``, a cluster deployed servers run on
(``KubernetesCPUDeployerResource`` / ``KubernetesVLLMDeployerResource`` by the deployment's
server: ``{"api_server": ..., "image": ..., "shared_claim": ...}``; unset: processes on this
machine). The launchpad then configures the chosen classes per run.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
from collections.abc import Callable
from types import ModuleType
from typing import Any

import dagster as dg

from factory import assets, codepin, sensors
from factory.dagster_runs import read_schema_scripts_once
from factory.resources.deployer import (
    CPUDeployerResource,
    DeployerResource,
    KubernetesCPUDeployerResource,
    KubernetesDeployerResource,
    KubernetesVLLMDeployerResource,
    VLLMDeployerResource,
)
from factory.resources.inference import CPUInferenceResource, VLLMInferenceResource
from factory.resources.judge import EmbeddedJudgeResource, JudgeResource, LLMJudgeResource
from factory.resources.lake import LakeResource
from factory.resources.providers import ProviderResource
from factory.settings import env_json_object


def _modules(package: ModuleType) -> list[ModuleType]:
    return [importlib.import_module(f"{package.__name__}.{m.name}")
            for m in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name)]


def _collect(name: str) -> list[Any]:
    return [item for module in _modules(sensors) for item in getattr(module, name, [])]


DEPLOYMENT_ENV = "FACTORY_DEPLOYMENT"


def _judge() -> JudgeResource:
    config = env_json_object("FACTORY_JUDGE")
    return LLMJudgeResource(**config) if config is not None else EmbeddedJudgeResource()


def _deployer(local: type[DeployerResource],
              on_kubernetes: type[KubernetesDeployerResource]) -> DeployerResource:
    """The deployment's server as processes here, or on the cluster ``$FACTORY_DEPLOYER``
    configures."""
    config = env_json_object("FACTORY_DEPLOYER")
    return on_kubernetes(**config) if config is not None else local()


def embedded() -> dict[str, Any]:
    """One machine, no services: the CPU server for evals and deployments (deployed servers on
    a cluster when ``$FACTORY_DEPLOYER`` names one)."""
    return {
        "lake": LakeResource(),
        "judge": _judge(),
        "inference": CPUInferenceResource(),
        "provider": ProviderResource(**(env_json_object("FACTORY_PROVIDERS") or {})),
        "deployer": _deployer(CPUDeployerResource, KubernetesCPUDeployerResource),
    }


def gpu() -> dict[str, Any]:
    """GPU machines: ``vllm serve`` for evals and deployments, the rest as ``embedded``."""
    return {**embedded(), "inference": VLLMInferenceResource(),
            "deployer": _deployer(VLLMDeployerResource, KubernetesVLLMDeployerResource)}


DEPLOYMENTS: dict[str, Callable[[], dict[str, Any]]] = {"embedded": embedded, "gpu": gpu}


def build_resources(deployment: str | None = None) -> dict[str, Any]:
    """Resource instances by key for ``deployment`` (default: ``$FACTORY_DEPLOYMENT``, else
    ``embedded``)."""
    name = deployment or os.environ.get(DEPLOYMENT_ENV) or "embedded"
    if name not in DEPLOYMENTS:
        raise ValueError(f"{DEPLOYMENT_ENV}: must be one of {', '.join(DEPLOYMENTS)}, "
                         f"got {name!r}")
    return DEPLOYMENTS[name]()


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


read_schema_scripts_once()  # each sensor tick makes an instance: ~85 ms of CPU without it
CODE = codepin.pin()
"""The fingerprint of the factory's code this code location loaded, or in a run worker the one
its run started with (None when imported as a plain module); runs pin their code through it
(``factory.codepin``)."""
defs = build_definitions()
