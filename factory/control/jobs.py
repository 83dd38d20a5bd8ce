"""From a planned run to a trainer job: the newest ``training_plans`` row of a run key, the
experiment's dataset snapshot exported to Parquet for the trainer, and the output location.

The trainer reads only files (it never touches the lake), so the experiment's rows of
``dataset_train``/``dataset_eval`` are written once per dataset version to
``$FACTORY_HOME/runs/data/`` (columns ``sample_id``, ``messages``, ``tools``). A plan with a
mixture (``data.mix``) exports each source the same way, a file source normalized to canonical
samples once per content, and the job lists them with their weights (``TrainerJob.mix``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from factory.errors import FactoryError
from factory.experiments import BALANCE_BY, UNDETERMINED, group_of, group_source
from factory.experiments import run_id as run_id_for_key
from factory.lake import Lake, Lineage
from factory.normalize import normalize_record
from factory.normalize.canon import NormalizeError
from factory.settings import Settings, get_settings
from factory.trainer.config import TrainerJob


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


EXPORT_ROW_GROUP = 4096
"""Rows per Parquet row group of an exported source: the trainer holds one row group of raw
rows per source at a time (``trainer.data.SourceReader``), ~5 MiB of typical conversations."""
_EXPORT_SCHEMA = pa.schema([("sample_id", pa.string()), ("messages", pa.string()),
                            ("tools", pa.string())])


def _write(rows: pa.Table, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    pq.write_table(rows, tmp, row_group_size=EXPORT_ROW_GROUP)
    tmp.rename(path)  # atomic: a concurrent reader never sees half a file
    return path


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
    return _write(rows, path)


def _has_origin(lake: Lake) -> bool:
    """Whether ``dataset_train`` marks each row's origin (traffic or synthetic)."""
    return "origin" in {f.name for f in lake.table("dataset_train").schema().fields}


def _source_query(lake: Lake, source: str, experiment: str) -> tuple[str, list[Any]]:
    """The ``WHERE`` clause and parameters of a lake source of ``data.mix`` over
    ``dataset_train``."""
    group = group_of(source)
    if group is not None:  # a group of the traffic (data.balance)
        by, value = group
        where, params = _source_query(lake, "traffic", experiment)
        return f"({where}) AND coalesce({_group_column(by)}, ?) = ?", [*params, UNDETERMINED,
                                                                       value]
    kind, _, target = source.partition(":")
    if kind == "experiment":
        return "experiment = ?", [target]
    if kind == "synthetic":
        if not _has_origin(lake):
            return "false", []
        return "experiment = ? AND origin = 'synthetic'", [experiment]
    if kind == "traffic":
        if not _has_origin(lake):
            return "experiment = ?", [experiment]
        return "experiment = ? AND coalesce(origin, 'traffic') <> 'synthetic'", [experiment]
    raise ValueError(f"data.mix: {source!r} is not a lake source")


def _file_samples(path: Path) -> Iterator[dict[str, Any]]:
    """The canonical samples of a JSONL file of records (any format ``factory ingest`` reads:
    canonical samples, OpenAI chat records...), a line at a time; a line no normalizer takes
    is skipped."""
    with path.open("rb") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                convs = normalize_record(json.loads(line))
            except (NormalizeError, json.JSONDecodeError, RecursionError):
                continue
            for conv in convs:
                yield {"sample_id": conv["sample_id"], "messages": conv["messages_json"],
                       "tools": conv["tools_json"]}


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
    return h.hexdigest()


def export_file_source(path: Path, dest: Path) -> tuple[Path, int]:
    """A ``file:`` source as canonical samples in Parquet (row groups of
    ``EXPORT_ROW_GROUP``), written once per file content; (the file, its rows)."""
    out = dest / f"file-{_file_digest(path)[:24]}.parquet"
    if not out.exists():
        dest.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        with pq.ParquetWriter(tmp, _EXPORT_SCHEMA) as writer:
            batch: list[dict[str, Any]] = []
            for row in _file_samples(path):
                batch.append(row)
                if len(batch) == EXPORT_ROW_GROUP:
                    writer.write_table(pa.Table.from_pylist(batch, _EXPORT_SCHEMA))
                    batch = []
            if batch:
                writer.write_table(pa.Table.from_pylist(batch, _EXPORT_SCHEMA))
        tmp.rename(out)
    return out, pq.ParquetFile(out).metadata.num_rows


def mix_source_rows(lake: Lake, experiment: str, sources: Sequence[str], *,
                    settings: Settings | None = None) -> dict[str, int]:
    """Rows of each ``data.mix`` source (a file source is exported to count its samples)."""
    settings = settings or get_settings()
    out: dict[str, int] = {}
    for source in sources:
        kind, _, target = source.partition(":")
        if kind == "file":
            out[source] = export_file_source(Path(target), settings.runs / "data")[1]
        elif not lake.exists("dataset_train"):
            out[source] = 0
        else:
            where, params = _source_query(lake, source, experiment)
            out[source] = int(lake.sql(f"SELECT count(*) AS n FROM dataset_train WHERE {where}",
                                       params).column("n")[0].as_py())
    return out


def _group_column(by: str) -> str:
    """``by`` as a column name for SQL: one of ``BALANCE_BY``, else a ``ValueError``."""
    if by not in BALANCE_BY:
        raise ValueError(f"data.balance: {by!r} is not a column to group by")
    return by


def traffic_group_rows(lake: Lake, experiment: str, by: str) -> dict[str, int]:
    """Rows of each group of the experiment's traffic by the column ``by`` (``data.balance``),
    keyed by the group's source name (``group_source``); empty before the dataset exists."""
    column = _group_column(by)
    if not lake.exists("dataset_train"):
        return {}
    where, params = _source_query(lake, "traffic", experiment)
    rows = lake.sql(f"SELECT coalesce({column}, ?) AS value, count(*) AS n FROM dataset_train "
                    f"WHERE {where} GROUP BY 1", [UNDETERMINED, *params]).to_pylist()
    return {group_source(by, r["value"]): int(r["n"]) for r in rows}


def export_mix(lake: Lake, experiment: str, mix: Sequence[dict[str, Any]], dest: Path, *,
               lineage: Lineage | None = None) -> list[dict[str, Any]]:
    """``TrainerJob.mix`` for a planned mixture: each source's samples as a Parquet file, with its
    weight. A source without samples is a ``FactoryError``."""
    out = []
    snapshot = lake.snapshot_id("dataset_train") if lake.exists("dataset_train") else None
    for entry in mix:
        source = entry["source"]
        kind, _, target = source.partition(":")
        if kind == "file":
            path, n = export_file_source(Path(target), dest)
        elif snapshot is None:
            path, n = None, 0
        else:
            if lineage is not None:
                lineage.record_read("dataset_train", snapshot)
            name = hashlib.sha256(f"{experiment}|{source}".encode()).hexdigest()[:12]
            path = dest / f"mix-{name}-{snapshot}.parquet"
            n = 1
            if not path.exists():
                where, params = _source_query(lake, source, experiment)
                rows = lake.sql(f"SELECT sample_id, messages, tools FROM dataset_train "
                                f"WHERE {where} ORDER BY sample_id", params)
                n = rows.num_rows
                if n:
                    _write(rows, path)
        if not n:
            raise FactoryError(f"experiment {experiment!r}: data.mix source {source!r} has no "
                               f"samples" + (" (materialize its dataset first)"
                                             if kind in ("traffic", "experiment") else ""))
        out.append({"name": source, "weight": float(entry["weight"]),
                    "data_files": [str(path)]})
    return out


def job_from_plan(lake: Lake, run_key: str, *, settings: Settings | None = None,
                  lineage: Lineage | None = None,
                  plan: dict[str, Any] | None = None) -> tuple[TrainerJob, str]:
    """The trainer job for the newest plan of ``run_key`` (or for ``plan``, its
    ``training_plans`` row already read), and its experiment. With a lineage, the
    ``training_plans`` and dataset snapshots the job is built from are recorded as read."""
    settings = settings or get_settings()
    if plan is None:
        plan = latest_plan(lake, run_key, lineage=lineage)
    experiment = plan["experiment"]
    version = plan["dataset_version"] or "unversioned"
    data_dir = settings.runs / "data"
    mix = json.loads(plan["plan"] or "{}").get("mix") or []
    data: dict[str, Any]
    if mix:
        data = {"mix": export_mix(lake, experiment, mix, data_dir, lineage=lineage)}
    else:
        train = export_split(lake, "dataset_train", experiment, version, data_dir,
                             lineage=lineage)
        if train is None:
            raise FactoryError(f"experiment {experiment!r} has no training samples: "
                               f"materialize its dataset first")
        data = {"data_files": [str(train)]}
    config = json.loads(plan["train_config"])
    evals = export_split(lake, "dataset_eval", experiment, version, data_dir, lineage=lineage)
    if evals is None:
        config["eval_every_steps"] = None  # held-out loss needs held-out rows
    run_id = planned_run_id(run_key, plan["created_at"])
    job = TrainerJob.from_dict({
        "run_id": run_id, "plan": config, **data,
        "eval_data_files": [str(evals)] if evals is not None else [],
        "output_dir": str(settings.checkpoints / run_id), "blob_dir": str(settings.blobs)})
    return job, experiment
