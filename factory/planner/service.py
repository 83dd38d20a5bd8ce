"""Planning an experiment's runs against the lake, and comparing a sweep's runs.

Shared by the ``training_plan`` asset and the ``factory plan`` / ``factory sweep`` commands so
that the UI and the CLI plan the same way.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from factory.control.jobs import mix_source_rows, planned_run_id, traffic_group_rows
from factory.experiments import (
    CONSTRAIN_AUTO,
    Experiment,
    experiment_sha,
    run_key,
    sweep_points,
)
from factory.planner.plan import Plan, make_plan
from factory.planner.profile import DatasetProfile, read_profile


def plan_runs(experiment: Experiment, profile: DatasetProfile, *,
              source_rows: Mapping[str, int] | None = None,
              time_cache: Path | None = None) -> list[Plan]:
    """One plan per sweep point (a single plan without a sweep); ``time_cache`` as
    ``make_plan``'s (``factory.planner.host.time_model_cache``: this host's constants)."""
    return [make_plan(experiment, profile, point=p, source_rows=source_rows,
                      time_cache=time_cache)
            for p in sweep_points(experiment)]


def plan_for_key(experiment: Experiment, profile: DatasetProfile, key: str, *,
                 source_rows: Mapping[str, int] | None = None,
                 time_cache: Path | None = None) -> Plan:
    """The plan of the run with stable key ``key``; ``ValueError`` if the sweep has no such run."""
    for point in sweep_points(experiment):
        if run_key(experiment.name, point) == key:
            return make_plan(experiment, profile, point=point, source_rows=source_rows,
                             time_cache=time_cache)
    raise ValueError(f"experiment {experiment.name} has no run {key!r} (its sweep changed?)")


def plan_row(plan: Plan, experiment: Experiment, dataset_version: str | None) -> dict[str, Any]:
    """The ``training_plans`` row of a plan."""
    cfg = plan.train_config()
    return {
        "run_key": plan.run_key, "experiment": plan.experiment, "recipe": plan.recipe,
        "point": json.dumps(plan.point, sort_keys=True),
        "experiment_sha": experiment_sha(experiment), "dataset_version": dataset_version or "",
        "created_at": datetime.now(UTC), "gpu": plan["gpu"], "num_devices": cfg["num_devices"],
        "max_seq_len": cfg["max_seq_len"], "micro_batch_size": cfg["micro_batch_size"],
        "grad_accum_steps": cfg["grad_accum_steps"], "learning_rate": cfg["learning_rate"],
        "lora_rank": cfg["lora_rank"],
        "peak_memory_gib": plan.memory.as_gib()["total"] if plan.memory else None,
        "estimated_hours": plan.estimates.get("hours"),
        "train_config": json.dumps(cfg, sort_keys=True),
        # The eval settings travel with the plan: a run's checkpoints are judged as planned,
        # whatever the experiment file says later (or if it is gone), and with them what
        # ``eval.constrain: auto`` means today.
        "plan": json.dumps({**plan.to_dict(), "eval": {
            **dataclasses.asdict(experiment.eval), "constrain_auto": sorted(CONSTRAIN_AUTO)}},
            sort_keys=True, default=str),
    }


def profile_version(lake: Any, experiment: str) -> str | None:
    """``dataset_version`` of the newest profile row (None when the column is absent)."""
    try:
        rows = lake.sql("SELECT dataset_version FROM dataset_profile WHERE experiment = ? "
                        "ORDER BY created_at DESC LIMIT 1", [experiment]).to_pylist()
    except Exception:  # noqa: BLE001 - informational only
        return None
    return rows[0]["dataset_version"] if rows else None


def mix_rows(experiment: Experiment, lake: Any) -> dict[str, int]:
    """Rows of each ``data.mix`` source of ``experiment``, and of each group of its traffic
    under ``data.balance`` (the planner's default included; empty with neither)."""
    data = experiment.data
    if not data.mix and data.balance is None:
        return {}

    rows = mix_source_rows(lake, experiment.name, [m.source for m in data.mix])
    if data.balance is not None:
        rows.update(traffic_group_rows(lake, experiment.name, data.balance.by))
    return rows


def plan_experiment(experiment: Experiment, lake: Any) -> list[Plan]:
    """Plan every run of the experiment from its newest ``dataset_profile`` row."""
    return plan_runs(experiment, read_profile(lake, experiment.name),
                     source_rows=mix_rows(experiment, lake))


def sweep_comparison(lake: Any, experiment: Experiment) -> list[dict[str, Any]]:
    """One row per run of the experiment's current sweep: the latest plan, final loss, best eval.

    Final loss comes from the last ``progress`` event in ``training_events`` of the trainer run
    of the run key's latest plan (``planned_run_id``); best eval score: the best per-checkpoint
    mean in ``eval_scores`` of that run.
    """
    existing = set(lake.existing_tables()) if hasattr(lake, "existing_tables") else set()
    plans: dict[str, dict[str, Any]] = {}
    planned_at: dict[str, Any] = {}
    if "training_plans" in existing:
        rows = lake.sql("SELECT run_key, plan, created_at FROM training_plans "
                        "WHERE experiment = ? ORDER BY created_at", [experiment.name]).to_pylist()
        for r in rows:
            plans[r["run_key"]] = json.loads(r["plan"])
            planned_at[r["run_key"]] = r["created_at"]
    out = []
    for point in sweep_points(experiment):
        key = run_key(experiment.name, point)
        row: dict[str, Any] = dict(plans.get(key) or {"run_key": key, "values": {}})
        row["run_key"] = key
        row["run_id"] = (planned_run_id(key, planned_at[key]) if key in planned_at
                         else None)
        row["final_loss"] = _final_loss(lake, existing, row["run_id"])
        row["best_eval_score"] = _best_eval(lake, existing, row["run_id"])
        out.append(row)
    return out


def _final_loss(lake: Any, existing: set[str], rid: str | None) -> float | None:
    if rid is None or "training_events" not in existing:
        return None
    rows = lake.sql("SELECT payload FROM training_events WHERE run_id = ? AND type = 'progress' "
                    "ORDER BY step DESC, seq DESC LIMIT 1", [rid]).to_pylist()
    if not rows:
        return None
    payload = json.loads(rows[0]["payload"] or "{}")
    loss = payload.get("loss", (payload.get("data") or {}).get("loss"))
    return float(loss) if loss is not None else None


def _best_eval(lake: Any, existing: set[str], rid: str | None) -> float | None:
    """The best mean rubric score over the run's checkpoints (failed scores left out)."""
    if rid is None or "eval_scores" not in existing:
        return None
    rows = lake.sql("SELECT max(mean_score) AS best FROM (SELECT step, avg(score) AS mean_score "
                    "FROM eval_scores WHERE run_id = ? AND kind = 'checkpoint' AND status = 'ok' "
                    "GROUP BY step)", [rid]).to_pylist()
    best = rows[0]["best"] if rows else None
    return float(best) if best is not None else None
