"""The serving size of a run: how its inference server is sized, from the run's plan.

The planner decides the eval serving size with the run (``Plan.eval_serving()``: devices, GPU
memory share, sequences in flight, generation batch, new tokens), stored in the run's
``training_plans`` row. ``serving_size_for`` turns it into the server's ``ServeSizing`` (the
``vllm serve`` flags) plus the generation batch and token budget; a value set explicitly on the
resource (an override) wins, and every value says where it came from (``plan``, ``override``
or ``default``) and why, for the run's metadata.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from factory.control.jobs import planned_run_id
from factory.inference.vllm import ServeSizing, lora_rank_bucket
from factory.lake import LakeSession
from factory.recipes import load_recipe

DEFAULTS: dict[str, Any] = {
    "tensor_parallel_size": 1, "gpu_memory_utilization": 0.9, "max_num_seqs": 8,
    "max_model_len": 4096, "max_lora_rank": 64, "batch_size": 8, "max_new_tokens": 128}
"""Sizes used when a run has no plan (a ready job file) and nothing is overridden."""
FIELDS = tuple(DEFAULTS)
MAX_CPU_BATCH = 16
"""Largest batch the CPU server forms, whatever the plan says (memory of the host)."""


@dataclass(frozen=True, kw_only=True)
class ServingSize:
    """Sizes of one inference server and the generation it serves."""

    sizing: ServeSizing
    """The server's limits (``vllm serve`` flags; the CPU server uses ``max_model_len``)."""
    batch_size: int
    """Requests in flight at once (the client's concurrency, the CPU server's largest batch)."""
    max_new_tokens: int
    """Token budget of each generated answer."""
    decisions: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Field -> ``{"value", "source": plan | override | default, "reason"}``."""

    def cpu_batch(self) -> int:
        return max(1, min(self.batch_size, MAX_CPU_BATCH))

    def metadata(self) -> dict[str, dict[str, Any]]:
        return {k: dict(v) for k, v in self.decisions.items()}


def plan_of_run(session: LakeSession, run_id: str, experiment: str) -> dict[str, Any] | None:
    """The plan (``Plan.to_dict()``) the run ``run_id`` was built from; None for a run that
    was not planned (a ready job file) or whose plan is gone. The read is recorded."""
    if not session.lake.exists("training_plans"):
        return None
    rows = session.sql("SELECT run_key, created_at, plan FROM training_plans WHERE experiment = ? "
                       "ORDER BY created_at DESC", [experiment]).to_pylist()
    for row in rows:
        if row["created_at"] is not None and row["plan"] and \
                planned_run_id(row["run_key"], row["created_at"]) == run_id:
            plan: dict[str, Any] = json.loads(row["plan"])
            return plan
    return None


def _from_plan(plan: Mapping[str, Any]) -> dict[str, tuple[Any, str]]:
    """Field -> (value, reason) for what the plan decides."""
    box = plan.get("eval_serving") or {}
    values = plan.get("values") or {}
    reasons = plan.get("reasons") or {}

    def why(key: str) -> str:
        r = reasons.get(key) or {}
        return f"plan {key}: {r.get('reason', '')}".rstrip(": ")

    out: dict[str, tuple[Any, str]] = {}
    for name, key in (("tensor_parallel_size", "devices"),
                      ("gpu_memory_utilization", "gpu_memory_utilization"),
                      ("max_num_seqs", "max_num_seqs"), ("batch_size", "batch_size"),
                      ("max_new_tokens", "max_new_tokens")):
        if box.get(key) is not None:
            out[name] = (box[key], why(f"eval_{key}"))
    new_tokens = box.get("max_new_tokens")
    if box.get("max_model_len") is not None:
        out["max_model_len"] = (box["max_model_len"], why("eval_max_model_len"))
    elif values.get("max_seq_len") is not None and new_tokens is not None:
        longest = int(values["max_seq_len"]) + int(new_tokens)
        reason = (f"plan: max_seq_len {values['max_seq_len']} (covers the longest sample) + "
                  f"{new_tokens} new tokens")
        context = _model_context(plan.get("recipe"))
        if context is not None and longest > context:
            longest, reason = context, reason + f", capped at the model's {context}-token context"
        out["max_model_len"] = (longest, reason)
    if values.get("lora_rank") is not None:
        rank = int(values["lora_rank"])
        out["max_lora_rank"] = (lora_rank_bucket(rank),
                                f"plan lora_rank {rank}: the smallest rank vLLM accepts above it")
    return out


def _model_context(recipe: Any) -> int | None:
    if not isinstance(recipe, str) or not recipe:
        return None

    try:
        return int(load_recipe(recipe).architecture.max_context)
    except Exception:  # noqa: BLE001 - a recipe renamed since planning: no cap, not a failure
        return None


def serving_size_for(plan: Mapping[str, Any] | None, overrides: Mapping[str, Any] | None = None,
                *, no_plan_reason: str = "no plan for this run",
                not_from_plan: Mapping[str, str] | None = None) -> ServingSize:
    """The serving size from ``plan`` (``Plan.to_dict()``), with ``overrides`` (field -> value;
    None values ignored) winning; ``not_from_plan`` (field -> why) keeps the default for
    fields the plan's eval sizing does not fit. ``ValueError`` for an unknown field or a bad
    size."""
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    unknown = set(overrides) - set(FIELDS)
    if unknown:
        raise ValueError(f"serving size overrides: unknown field(s) {sorted(unknown)}; "
                         f"known: {', '.join(FIELDS)}")
    planned = _from_plan(plan) if plan is not None else {}
    skipped = dict(not_from_plan or {})
    decisions: dict[str, dict[str, Any]] = {}
    for name in FIELDS:
        if name in overrides:
            decisions[name] = {"value": overrides[name], "source": "override",
                               "reason": "override: set on the resource"}
        elif name in skipped:
            decisions[name] = {"value": DEFAULTS[name], "source": "default",
                               "reason": skipped[name]}
        elif name in planned:
            value, reason = planned[name]
            decisions[name] = {"value": value, "source": "plan", "reason": reason}
        else:
            decisions[name] = {"value": DEFAULTS[name], "source": "default",
                               "reason": no_plan_reason if plan is None
                               else "the plan does not decide it"}
    v = {k: d["value"] for k, d in decisions.items()}
    for name in ("batch_size", "max_new_tokens"):
        if not isinstance(v[name], int) or isinstance(v[name], bool) or v[name] < 1:
            raise ValueError(f"{name}: must be an integer >= 1, got {v[name]!r}")
    sizing = ServeSizing(gpu_memory_utilization=float(v["gpu_memory_utilization"]),
                         max_num_seqs=v["max_num_seqs"],
                         tensor_parallel_size=v["tensor_parallel_size"],
                         max_model_len=v["max_model_len"], max_lora_rank=v["max_lora_rank"])
    sizing.validate()
    return ServingSize(sizing=sizing, batch_size=v["batch_size"], max_new_tokens=v["max_new_tokens"],
                   decisions=decisions)
