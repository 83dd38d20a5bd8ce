"""Curation and the lake: selecting an experiment's samples, writing one dataset version, checks.

Each experiment's rows in ``dataset_train``, ``dataset_eval``, ``dataset_drops`` and
``dataset_profile`` are replaced by one overwrite per table (filter ``experiment = '<name>'``;
the name is validated first, so the filter cannot be broken out of); a table's snapshot is
therefore one version of that experiment's dataset.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.compute as pc

from factory.base_model import model_dir_for
from factory.curation.config import CurationConfig, check_experiment_name
from factory.errors import FactoryError
from factory.lake import Lake, LakeSession
from factory.tables import TABLES

DATASET_TABLES = ("dataset_train", "dataset_eval")


def experiment_filter(name: str) -> str:
    return f"experiment = '{check_experiment_name(name)}'"


def tokenizer_dir_for(recipe: str) -> Path:
    """The tokenizer folder of a recipe's base model (built on first use);
    ``MissingBaseModelError`` when its model is not on this machine."""
    return model_dir_for(recipe)


def select_samples(session: LakeSession, where: str) -> tuple[pa.Table, int | None]:
    """The ``samples`` rows matching the experiment's predicate, and the snapshot read."""
    if not session.lake.exists("samples"):
        raise FactoryError("the lake has no samples yet: run `factory ingest` first")
    table = session.sql(f"SELECT * FROM samples WHERE ({where})")
    schema = TABLES["samples"]
    cols = [table.column(f.name).cast(f.type) if f.name in table.column_names
            else pa.nulls(table.num_rows, f.type) for f in schema]
    return pa.Table.from_arrays(cols, schema=schema), session.lineage.reads.get("samples")


def sample_files(session: LakeSession) -> tuple[list[str], int | None]:
    """The Parquet data files of the current ``samples`` snapshot, recorded as this run's read.

    The Spark engine reads these files itself (the selection never passes through this
    process). The lake writes copy-on-write, so a snapshot is exactly its data files; a
    snapshot with delete files is refused rather than read wrong.
    """
    if not session.lake.exists("samples"):
        raise FactoryError("the lake has no samples yet: run `factory ingest` first")
    table = session.lake.table("samples")
    snap = table.current_snapshot()
    if snap is None:
        raise FactoryError("the lake has no samples yet: run `factory ingest` first")
    tasks = list(table.scan(snapshot_id=snap.snapshot_id).plan_files())
    if not tasks:
        raise FactoryError("samples is empty: run `factory ingest` first")
    if any(t.delete_files for t in tasks):
        raise FactoryError("samples has delete files; the Spark engine reads data files only")
    session.lineage.record_read("samples", snap.snapshot_id)
    return [t.file.file_path for t in tasks], snap.snapshot_id


def write_dataset(session: LakeSession, experiment: str, result: Any) -> dict[str, int | None]:
    """Overwrite the experiment's train, eval and drops rows; returns the snapshot ids."""
    flt = experiment_filter(experiment)
    snaps = {}
    for name, table in (("dataset_train", result.train), ("dataset_eval", result.eval)):
        t = table.append_column("experiment", pa.array([experiment] * table.num_rows,
                                                       pa.string()))
        names = [f.name for f in TABLES[name] if f.name in t.column_names]
        snaps[name] = session.overwrite(name, t.select(names), where=flt)
    drops = [{"experiment": experiment, **d} for d in result.drops]
    snaps["dataset_drops"] = session.overwrite("dataset_drops", drops, where=flt)
    return snaps


def read_dataset(session: LakeSession, experiment: str) -> tuple[pa.Table, pa.Table, pa.Table]:
    flt = experiment_filter(experiment)
    return tuple(session.read(n, row_filter=flt).sort_by("sample_id")  # type: ignore[return-value]
                 for n in ("dataset_train", "dataset_eval", "dataset_drops"))


def write_profile(session: LakeSession, experiment: str, profile: dict[str, Any], *,
                  config: CurationConfig, tokenizer: str, samples_snapshot_id: int | None,
                  engine: str) -> int | None:
    row = {"experiment": experiment, "created_at": datetime.now(UTC), "engine": engine,
           "tokenizer": tokenizer, "samples_snapshot_id": samples_snapshot_id,
           "config": json.dumps(config.fingerprint(), sort_keys=True), **profile}
    return session.overwrite("dataset_profile", [row], where=experiment_filter(experiment))


def read_eval_split(lake: Lake, experiment: str) -> dict[str, str | None]:
    """How the experiment's newest dataset held out its eval set: ``{"eval_split": phrasing |
    recall only | None, "eval_split_reason": ...}`` (None before any profile, or for a
    profile written before the columns existed)."""
    out: dict[str, str | None] = {"eval_split": None, "eval_split_reason": None}
    if lake.exists("dataset_profile"):
        rows = lake.sql("SELECT eval_split, eval_split_reason FROM dataset_profile "
                        "WHERE experiment = ? ORDER BY created_at DESC LIMIT 1",
                        [experiment]).to_pylist()
        if rows:
            out.update(rows[0])
    return out


# -- checks (pure; the asset reports them as blocking asset checks) ----------------------------

def empty_assistant_turns(*tables: pa.Table) -> list[str]:
    """sample_ids holding an assistant turn with neither text nor tool calls."""
    bad = []
    for t in tables:
        for sid, raw in zip(t.column("sample_id").to_pylist(), t.column("messages").to_pylist(),
                            strict=True):
            for m in orjson.loads(raw or "[]"):
                if m.get("role") != "assistant" or m.get("tool_calls"):
                    continue
                if not any((p.get("text") or "").strip() or p.get("type") == "image"
                           for p in m.get("content") or []):
                    bad.append(sid)
                    break
    return sorted(set(bad))


def train_eval_overlap(train: pa.Table, ev: pa.Table) -> dict[str, list[str]]:
    """Shared sample ids and shared split groups (near-duplicates share a group)."""
    out = {}
    for col in ("sample_id", "split_group"):
        shared = pc.is_in(train.column(col), value_set=pc.unique(ev.column(col)))
        out[col] = sorted(set(train.filter(shared).column(col).to_pylist()))
    return out
