"""From a planned run to a trainer job: the newest ``training_plans`` row of a run key, the
experiment's dataset snapshot exported to Parquet for the trainer, and the output location.

The trainer reads only files (it never touches the lake), so the experiment's rows of
``dataset_train``/``dataset_eval`` are written once per dataset version to
``$FACTORY_HOME/runs/data/`` (columns ``sample_id``, ``messages``, ``tools``).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from factory.errors import FactoryError
from factory.experiments import run_id as run_id_for_key
from factory.lake import Lake, Lineage
from factory.settings import Settings, get_settings
from factory.trainer.config import Job


def planned_run_id(run_key: str, created_at: datetime) -> str:
    """The trainer run id of the plan of ``run_key`` made at ``created_at``: one plan, one run
    (evals find a run's plan again from this id)."""
    return f"{run_id_for_key(run_key)[:100]}-{created_at.strftime('%Y%m%dT%H%M%S')}"


def latest_plan(lake: Lake, run_key: str, *, lineage: Lineage | None = None) -> dict[str, Any]:
    """The newest ``training_plans`` row of ``run_key``; FactoryError if it was never planned."""
    if not lake.exists("training_plans"):
        raise FactoryError(f"run {run_key!r} has no plan yet: materialize training_plan first")
    rows = lake.sql("SELECT * FROM training_plans WHERE run_key = ? ORDER BY created_at DESC "
                    "LIMIT 1", [run_key], lineage=lineage).to_pylist()
    if not rows:
        raise FactoryError(f"run {run_key!r} has no plan yet: materialize training_plan first")
    return rows[0]


def export_split(lake: Lake, table: str, experiment: str, version: str, dest: Path, *,
                 lineage: Lineage | None = None) -> Path | None:
    """The experiment's rows of ``table`` as one Parquet file (None when it has none). With a
    lineage, the snapshot of ``table`` is recorded as read even when the file already exists
    (the file is that dataset version's rows)."""
    path = dest / f"{experiment}-{version[:16]}-{table}.parquet"
    if not lake.exists(table):
        return None
    if lineage is not None:
        lineage.record_read(table, lake.snapshot_id(table))
    if path.exists():
        return path
    rows = lake.sql(f"SELECT sample_id, messages, tools FROM {table} WHERE experiment = ? "
                    "ORDER BY sample_id", [experiment])
    if rows.num_rows == 0:
        return None
    dest.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    pq.write_table(rows, tmp)
    tmp.rename(path)  # atomic: a concurrent reader never sees half a file
    return path


def job_from_plan(lake: Lake, run_key: str, *, settings: Settings | None = None,
                  lineage: Lineage | None = None) -> tuple[Job, str]:
    """The trainer job for the newest plan of ``run_key``, and its experiment. With a lineage,
    the ``training_plans`` and dataset snapshots the job is built from are recorded as read."""
    settings = settings or get_settings()
    plan = latest_plan(lake, run_key, lineage=lineage)
    experiment = plan["experiment"]
    version = plan["dataset_version"] or "unversioned"
    data_dir = settings.runs / "data"
    train = export_split(lake, "dataset_train", experiment, version, data_dir, lineage=lineage)
    if train is None:
        raise FactoryError(f"experiment {experiment!r} has no training samples: materialize "
                           f"its dataset first")
    config = json.loads(plan["train_config"])
    evals = export_split(lake, "dataset_eval", experiment, version, data_dir, lineage=lineage)
    if evals is None:
        config["eval_every_steps"] = None  # held-out loss needs held-out rows
    run_id = planned_run_id(run_key, plan["created_at"])
    job = Job.from_dict({
        "run_id": run_id, "plan": config, "data_files": [str(train)],
        "eval_data_files": [str(evals)] if evals is not None else [],
        "output_dir": str(settings.checkpoints / run_id)})
    return job, experiment
