"""``synthetic_samples``, ``dataset`` and ``dataset_profile``: an experiment's samples (and
the samples a teacher wrote for its thin slices, with ``data.synthesize``) made into train/eval
sets.

Partitioned per experiment with the dynamic partitions ``experiments`` (the partition key is
the experiment name; ``factory dataset NAME`` and the experiments sensor add keys). The three
checks are blocking: when one fails, ``dataset_profile`` (and all that reads it) does not run.

Two engines, one logic: the run config ``engine`` picks the embedded engine (default: in
process, feature batches over every core) or Spark (reads the samples snapshot's Parquet files,
writes the datasets as Parquet that the lake commits with ``add_files``). Both give the same
datasets (tests/curation/test_spark.py). The work is ``factory.curation.build``'s.
"""

import json
from typing import Any

import dagster as dg

from factory.curation.build import build_dataset, profile_dataset, synthesize
from factory.curation.phrasing import SPLIT_FIELDS
from factory.curation.store import empty_assistant_turns, train_eval_overlap
from factory.experiments import load_experiment
from factory.partitions import EXPERIMENTS
from factory.resources.judge import JudgeResource
from factory.resources.lake import LakeResource


class DatasetConfig(dg.Config):
    """Run config of ``dataset`` (``factory dataset NAME --engine spark`` sets it)."""

    engine: str = ""
    """``embedded`` (in process) or ``spark`` (a local Spark session; same datasets); empty:
    the experiment file's ``data.engine``."""
    num_workers: int = 0
    """Embedded engine: processes computing sample features; 0 uses every core."""

_CHECKS = [
    dg.AssetCheckSpec("no_empty_assistant_turns", asset="dataset", blocking=True,
                      description="every assistant turn has text or tool calls"),
    dg.AssetCheckSpec("no_train_eval_overlap", asset="dataset", blocking=True,
                      description="train and eval share no sample and no split group "
                                  "(related samples and near-duplicates share a group)"),
    dg.AssetCheckSpec("eval_not_empty", asset="dataset", blocking=True,
                      description="the eval set has at least one sample"),
]


@dg.asset(
    partitions_def=EXPERIMENTS,
    deps=["samples"],
    group_name="curation",
    kinds={"iceberg", "python"},
    description="With data.synthesize: a teacher (any OpenAI-compatible endpoint) writes new "
                "samples for the slices of the traffic train split that are thin, from train "
                "seed samples only. Each attempt gives a sample (table synthetic_samples, with "
                "teacher, prompt and seed ids) or a drop with its reason (synthesis_drops); a "
                "slice stops once it holds its target, and a rerun skips recorded attempts and "
                "counts their samples. Without data.synthesize: nothing to do.",
    code_version="1",
)
def synthetic_samples(context: dg.AssetExecutionContext,
                      lake: LakeResource) -> dg.MaterializeResult:
    experiment = load_experiment(context.partition_key)
    spec = experiment.data.synthesize
    if spec is None:
        return dg.MaterializeResult(metadata={"experiment": experiment.name,
                                              "synthesis": "not asked (no data.synthesize)"})
    session = lake.session(context)
    done = synthesize(session, experiment)
    outcome = done.outcome
    return dg.MaterializeResult(metadata={
        "experiment": experiment.name,
        "teacher": spec.teacher,
        "teacher_base_url": done.teacher_base_url,
        "thin_slices": dg.MetadataValue.json([s.to_dict() for s in done.slices if s.thin]),
        "num_planned": outcome.num_planned,
        "num_resumed": outcome.num_skipped,
        "num_written": outcome.num_written,
        "num_not_needed": outcome.num_not_needed,
        "written_by_slice": dg.MetadataValue.json(outcome.by_slice),
        "drops_by_reason": dg.MetadataValue.json(outcome.drops),
        "samples_snapshot_id": done.samples_snapshot_id,
        **session.metadata(),
    })


@dg.asset(
    partitions_def=EXPERIMENTS,
    deps=["samples", synthetic_samples],
    group_name="curation",
    kinds={"iceberg", "python"},
    description="The experiment's samples (data.where) split by stable hash with related "
                "samples together, then cleaned on both sides (empty, too long, duplicates, "
                "near-duplicates, train decontamination, detectors, judge). Synthetic samples "
                "(data.synthesize) take the same steps on the train side only (origin column). "
                "Tables dataset_train, dataset_eval, dataset_drops; trace-pattern report in "
                "metadata.",
    check_specs=_CHECKS,
    code_version="3",
)
def dataset(context: dg.AssetExecutionContext, config: DatasetConfig,  # type: ignore[no-untyped-def]
            lake: LakeResource, judge: JudgeResource):
    experiment = load_experiment(context.partition_key)
    session = lake.session(context)
    built = build_dataset(session, experiment, judge=judge.judge, engine=config.engine,
                          num_workers=config.num_workers)
    result, train, ev = built.result, built.train, built.ev
    yield dg.MaterializeResult(metadata={
        "experiment": experiment.name,
        "engine": built.engine,
        "num_selected": result.num_selected,
        "num_train": train.num_rows,
        "num_eval": ev.num_rows,
        "num_synthetic": result.profile["num_synthetic"],
        **{k: result.profile[k] for k in SPLIT_FIELDS},
        "drops_by_reason": dg.MetadataValue.json(result.drops_by_reason()),
        "clean_loss_by_reason": dg.MetadataValue.json(result.clean_loss_by_reason()),
        "samples_snapshot_id": built.samples_snapshot_id,
        **built.judged,
        "report": dg.MetadataValue.md(result.report),
        **session.metadata(),
    })
    empty = empty_assistant_turns(train, ev)
    yield dg.AssetCheckResult(check_name="no_empty_assistant_turns", passed=not empty,
                              metadata={"num_bad": len(empty), "examples": empty[:5]})
    overlap = train_eval_overlap(train, ev)
    yield dg.AssetCheckResult(
        check_name="no_train_eval_overlap",
        passed=not overlap["sample_id"] and not overlap["split_group"],
        metadata={"shared_samples": len(overlap["sample_id"]),
                  "shared_groups": len(overlap["split_group"]),
                  "examples": (overlap["sample_id"] + overlap["split_group"])[:5]})
    yield dg.AssetCheckResult(check_name="eval_not_empty", passed=ev.num_rows > 0,
                              metadata={"num_eval": ev.num_rows})


@dg.asset(
    partitions_def=EXPERIMENTS,
    deps=[dataset],
    group_name="curation",
    kinds={"iceberg", "python"},
    description="Profile of the experiment's dataset for the planner: prompt/completion token "
                "percentiles, turns, share with images and tool calls, languages, size, share "
                "of synthetic samples, and slices (tool, answer label, length) with the thin "
                "ones flagged.",
    code_version="2",
)
def dataset_profile(context: dg.AssetExecutionContext, lake: LakeResource) -> dg.MaterializeResult:
    experiment = load_experiment(context.partition_key)
    session = lake.session(context)
    profiled = profile_dataset(session, experiment, _dataset_metadata(context))
    profile = profiled.profile
    return dg.MaterializeResult(metadata={
        **{k: v for k, v in profile.items()
           if k not in ("languages", "drops_by_reason", "slices")},
        "languages": dg.MetadataValue.json(json.loads(profile["languages"])),
        "thin_slices": dg.MetadataValue.json([s.key for s in profiled.slices if s.thin]),
        **session.metadata(),
    })


def _dataset_metadata(context: dg.AssetExecutionContext) -> dict[str, Any]:
    """The metadata values of the partition's latest ``dataset`` materialization: its engine
    and how its eval set was held out (``SPLIT_FIELDS``)."""
    records = context.instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey("dataset"),
                              asset_partitions=[context.partition_key]), limit=1).records
    mat = records[0].asset_materialization if records else None
    return {k: v.value for k, v in mat.metadata.items()} if mat is not None else {}
