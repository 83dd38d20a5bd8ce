"""``raw_traces``, ``samples``, ``rejected_traces``: uploaded files ingested into the lake.

One multi-asset writes the three tables (raw first), each commit stamped with its own asset key
and the run id. The files come from the run config (the UI's materialize dialog, or the uploads
sensor); with none given, everything under ``$FACTORY_HOME/uploads`` is (re-)ingested, which is
cheap because records already in ``raw_traces`` are skipped by content hash.
"""

from pathlib import Path

import dagster as dg
from pydantic import Field

from factory.ingest import ingest_paths
from factory.lake import Lineage
from factory.resources.lake import LakeResource

TABLE_KEYS = ("raw_traces", "samples", "rejected_traces")


class IngestConfig(dg.Config):
    """Which files to ingest and how."""

    paths: list[str] = Field(
        default_factory=list,
        description="Files or folders (.jsonl, .json, .gz); relative paths are under "
                    "$FACTORY_HOME/uploads. Empty: the whole uploads folder.")
    format: str = Field(default="auto", description="auto, openai, anthropic, gemini, sharegpt "
                                                    "or otlp")
    tags: dict[str, str] = Field(default_factory=dict, description="Labels copied onto every "
                                                                  "record and sample.")
    project: str | None = Field(default=None, description="Project the records belong to.")


@dg.multi_asset(
    name="traces",
    specs=[
        dg.AssetSpec("raw_traces", group_name="ingest", kinds={"iceberg", "python"},
                     description="Every input record once (id = content hash), as received, "
                                 "with source, detected format, time and tags."),
        dg.AssetSpec("samples", group_name="ingest", kinds={"iceberg", "python"},
                     deps=["raw_traces"],
                     description="Canonical conversations (messages, tools, sample_id) "
                                 "normalized from raw_traces; one row per conversation."),
        dg.AssetSpec("rejected_traces", group_name="ingest", kinds={"iceberg", "python"},
                     deps=["raw_traces"],
                     description="Records no normalizer accepted, with the payload and the "
                                 "field-level reason."),
    ],
    code_version="1",
)
def traces(context: dg.AssetExecutionContext, config: IngestConfig, lake: LakeResource):
    store = lake.lake()
    uploads = store.settings.uploads
    paths = [p if Path(p).is_absolute() else str(uploads / p) for p in config.paths]
    if not paths:
        paths = [str(uploads)]
    lineages = {key: Lineage(run_id=context.run.run_id, asset_key=key) for key in TABLE_KEYS}
    summary = ingest_paths(store, paths, format=config.format, tags=config.tags,
                           project=config.project, lineages=lineages)
    context.log.info(f"ingest {paths}: {summary.as_dict()}")
    counts = {**summary.as_dict(), "num_samples": summary.num_samples}
    for key in TABLE_KEYS:
        snap = summary.snapshots.get(key)
        yield dg.MaterializeResult(asset_key=key, metadata={
            **counts,
            "paths": paths,
            "dagster_run_id": context.run.run_id,
            "read_snapshots": dict(lineages[key].reads),
            "written_snapshots": {key: snap} if snap is not None else {},
        })
