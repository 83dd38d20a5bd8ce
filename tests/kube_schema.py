"""A strict check of Kubernetes manifests against the API schema, without a cluster.

The schema is the ``kubernetes`` client's models: each ``V1...`` class lists its fields in
``openapi_types`` (Python name -> type: ``str``, ``int``, ``bool``, ``float``, ``object``,
``datetime``, ``list[X]``, ``dict[str, X]`` or another model) and ``attribute_map`` (Python name
-> JSON key). ``errors`` walks a manifest (JSON field names, as ``kubectl`` and Helm write them)
through those classes and reports every key the schema does not have and every value of the
wrong type, by path; then the client deserializes it, which refuses a missing required field
(``containers`` of a pod, ``name`` of an env var...). The client's own deserializer drops
unknown keys silently, which is why the walk comes first.
"""

from __future__ import annotations

import re
from typing import Any

from kubernetes import client as k

KINDS: dict[tuple[str, str], str] = {
    ("batch/v1", "Job"): "V1Job",
    ("apps/v1", "Deployment"): "V1Deployment",
    ("v1", "Service"): "V1Service",
    ("v1", "PersistentVolumeClaim"): "V1PersistentVolumeClaim",
    ("v1", "Namespace"): "V1Namespace",
    ("v1", "Secret"): "V1Secret",
    ("v1", "ConfigMap"): "V1ConfigMap",
    ("v1", "ServiceAccount"): "V1ServiceAccount",
    ("scheduling.k8s.io/v1", "PriorityClass"): "V1PriorityClass",
    ("rbac.authorization.k8s.io/v1", "Role"): "V1Role",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "V1RoleBinding",
}
"""``apiVersion`` and ``kind`` -> model class, for the kinds the factory's manifests use."""

_LIST = re.compile(r"^list\[(.+)\]$")
_DICT = re.compile(r"^dict[([]str, (.+)[])]$")


def _type_errors(value: Any, typ: str, path: str) -> list[str]:
    if value is None:
        return []
    if m := _LIST.match(typ):
        if not isinstance(value, list):
            return [f"{path}: expected a list, got {type(value).__name__}"]
        return [e for i, v in enumerate(value) for e in _type_errors(v, m[1], f"{path}[{i}]")]
    if m := _DICT.match(typ):
        if not isinstance(value, dict):
            return [f"{path}: expected a mapping, got {type(value).__name__}"]
        return [e for key, v in value.items() for e in _type_errors(v, m[1], f"{path}.{key}")]
    if typ == "object":  # IntOrString, RawExtension: the schema leaves it open
        return []
    if typ in ("str", "datetime", "date"):
        ok = isinstance(value, str)
    elif typ == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif typ == "float":
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    elif typ == "bool":
        ok = isinstance(value, bool)
    else:
        return model_errors(value, typ, path)
    return [] if ok else [f"{path}: expected {typ}, got {type(value).__name__} {value!r}"]


def model_errors(value: Any, model: str, path: str = "$") -> list[str]:
    """Unknown keys and wrongly typed values of ``value`` read as the model class ``model``."""
    cls = getattr(k, model)
    if not isinstance(value, dict):
        return [f"{path}: expected a {model} mapping, got {type(value).__name__}"]
    by_json = {json_key: name for name, json_key in cls.attribute_map.items()}
    found: list[str] = []
    for key, v in value.items():
        if key not in by_json:
            found.append(f"{path}.{key}: not a field of {model}")
        else:
            found += _type_errors(v, cls.openapi_types[by_json[key]], f"{path}.{key}")
    return found


def errors(manifest: dict[str, Any], model: str | None = None) -> list[str]:
    """Everything wrong with ``manifest`` as its kind (or as ``model``), empty when valid."""
    if model is None:
        kind = (manifest.get("apiVersion"), manifest.get("kind"))
        if kind not in KINDS:
            return [f"$: no schema here for apiVersion/kind {kind}"]
        model = KINDS[kind]  # type: ignore[index]
    found = model_errors(manifest, model)
    if not found:
        try:
            k.ApiClient()._ApiClient__deserialize(manifest, model)  # type: ignore[attr-defined]
        except ValueError as e:  # a required field missing
            found.append(f"$: {e}")
    return found


def assert_valid(manifest: dict[str, Any], model: str | None = None) -> None:
    found = errors(manifest, model)
    assert not found, "\n".join(found)
