"""Dagster config made from the library's keyword dataclasses, so a setting is declared once.

The control plane's policy (``factory.control.plane.ControlConfig``) and the provider rungs
(``factory.control.providers``) are dataclasses of the library, which knows nothing of Dagster.
``config_class`` gives the resource layer a config class with the same fields, types and
defaults, so the launchpad shows every setting the library has; ``from_config`` builds the
dataclass back from a config value. A field added to the dataclass needs nothing here.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Iterable
from typing import Any, TypeVar

import dagster as dg

T = TypeVar("T")


def _nested(hint: Any) -> Any:
    """The dataclass of a ``list[<dataclass>]`` field, else None."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is list and args and dataclasses.is_dataclass(args[0]):
        return args[0]
    return None


def config_class(source: type, *, base: type = dg.Config, exclude: Iterable[str] = ()) -> Any:
    """A subclass of ``base`` (``dg.Config`` or ``dg.ConfigurableResource``) whose fields are
    those of the dataclass ``source`` but ``exclude`` and those whose metadata says
    ``config: False``: same names, types and defaults; a list of
    dataclasses becomes a list of config classes made the same way.

    Typed ``Any``: a type checker cannot see fields made at run time, so subclass the result
    under a name of your own to use it in annotations."""
    hints = typing.get_type_hints(source)
    skip = set(exclude)
    annotations: dict[str, Any] = {}
    defaults: dict[str, Any] = {}
    for f in dataclasses.fields(source):
        if f.name in skip or not f.metadata.get("config", True):
            continue  # excluded, or not a setting (e.g. a provider's clock)
        nested = _nested(hints[f.name])
        annotations[f.name] = (types.GenericAlias(list, (config_class(nested),)) if nested
                               else hints[f.name])
        if f.default is not dataclasses.MISSING:
            defaults[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            defaults[f.name] = f.default_factory()

    def body(namespace: dict[str, Any]) -> None:
        namespace.update(defaults, __annotations__=annotations, __module__=__name__,
                         __doc__=f"The fields of ``{source.__module__}.{source.__qualname__}``.")

    return types.new_class(f"{source.__name__}Fields", (base,), exec_body=body)


def from_config(target: type[T], config: Any) -> T:
    """The dataclass ``target`` from the fields of ``config`` it declares (nested lists of
    dataclasses too); a field ``config`` does not have keeps the dataclass's default."""
    hints = typing.get_type_hints(target)
    present = type(config).model_fields
    values: dict[str, Any] = {}
    for f in dataclasses.fields(target):  # type: ignore[arg-type]
        if f.name not in present:
            continue
        value = getattr(config, f.name)
        nested = _nested(hints[f.name])
        values[f.name] = [from_config(nested, v) for v in value] if nested else value
    return target(**values)
