"""``ProviderResource`` (key ``provider``): the provider ladder and the control policy.

The rungs are the library's providers (``factory.control.providers``) and the policy is
``factory.control.plane.ControlConfig``; their config here is made from those dataclasses
(``factory.resources.config``), so every setting, its type and its default are declared once, in
the library. The policy's fields sit at the top of the resource's config, next to ``order`` and
the rungs (the shape ``$FACTORY_PROVIDERS`` and the Helm values use).
"""

from typing import Any

import dagster as dg

from factory.control.base import Provider
from factory.control.plane import ControlConfig, ControlPlane
from factory.control.providers import KubernetesProvider, LocalProvider, SandboxProvider
from factory.lake import Lake
from factory.resources.config import config_class, from_config

RUNGS: dict[str, type[Provider]] = {"local": LocalProvider, "sandbox": SandboxProvider,
                                    "kubernetes": KubernetesProvider}
"""Rung name in ``order`` -> its provider class (whose default ``name`` is that rung name)."""

# The rung's name is its key in ``order``, so it is not configured.
_LocalFields: Any = config_class(LocalProvider, exclude=["name"])
_SandboxFields: Any = config_class(SandboxProvider, exclude=["name"])
_KubernetesFields: Any = config_class(KubernetesProvider, exclude=["name"])
_ControlFields: Any = config_class(ControlConfig, base=dg.ConfigurableResource)


class LocalConfig(_LocalFields):
    """The ``local`` rung: the fields of ``LocalProvider``."""


class SandboxConfig(_SandboxFields):
    """The ``sandbox`` rung: the fields of ``SandboxProvider``."""


class KubernetesConfig(_KubernetesFields):
    """The ``kubernetes`` rung: the fields of ``KubernetesProvider``."""


class ProviderResource(_ControlFields):
    """The provider ladder and the control policy (the fields of ``ControlConfig``).

    ``order`` lists rung names, preferred first; only configured rungs may be named.
    """

    order: list[str] = ["local"]
    local: LocalConfig = LocalConfig()
    sandbox: SandboxConfig | None = None
    kubernetes: KubernetesConfig | None = None

    def ladder(self) -> list[Provider]:
        rungs: list[Provider] = []
        for name in self.order:
            config = getattr(self, name) if name in RUNGS else None
            if config is None:
                raise ValueError(f"order: rung {name!r} is not configured "
                                 f"(configure local, sandbox or kubernetes)")
            rungs.append(from_config(RUNGS[name], config))
        return rungs

    def control_config(self) -> ControlConfig:
        return from_config(ControlConfig, self)

    def plane(self, lake: Lake) -> ControlPlane:
        return ControlPlane(lake, self.ladder(), self.control_config())
