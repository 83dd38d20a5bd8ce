"""``synthetic_samples``, ``dataset`` and ``dataset_profile``: an experiment's samples (and
the samples a teacher wrote for its thin slices, with ``data.synthesize``) made into train/eval
sets.

Partitioned per experiment with the dynamic partitions ``experiments`` (the partition key is
the experiment name; ``factory dataset NAME`` and the experiments sensor add keys). The three
checks are blocking: when one fails, ``dataset_profile`` (and all that reads it) does not run.

Two engines, one logic: the run config ``engine`` picks the embedded engine (default: in
process, feature batches over every core) or Spark (reads the samples snapshot's Parquet files,
writes the datasets as Parquet that the lake commits with ``add_files``). Both give the same
datasets (tests/curation/test_spark.py).
"""

import json
from dataclasses import replace
from typing import Any

import dagster as dg
import pyarrow as pa

from factory.curation import synthesis
from factory.curation.config import CurationConfig
from factory.curation.decide import TRAFFIC
from factory.curation.phrasing import SPLIT_FIELDS
from factory.curation.pipeline import curate, default_workers
from factory.curation.profile import build_profile
from factory.curation.slices import profile_slices
from factory.curation.store import (
    empty_assistant_turns,
    read_dataset,
    sample_files,
    select_samples,
    tokenizer_dir_for,
    train_eval_overlap,
    write_dataset,
    write_profile,
)
from factory.curation.text import parse_json
from factory.curation.tokens import RenderCounter, shared_prefix_tokens
from factory.errors import FactoryError
from factory.evals.rejection import rejection_judge
from factory.experiments import CURATION_ENGINES, load_experiment
from factory.partitions import EXPERIMENTS
from factory.recipes import load_recipe
from factory.resources.judge import JudgeResource
from factory.resources.lake import LakeResource


def curation_config(experiment: Any) -> CurationConfig:
    """The experiment's curation settings; samples longer than ``data.max_tokens`` or the
    recipe's context (as the trainer renders them) are dropped as ``too_long``."""
    context = load_recipe(experiment.recipe).architecture.max_context
    return CurationConfig.from_data_spec(experiment.data, context_limit=context)



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
    cur = curation_config(experiment)
    session = lake.session(context)
    samples, snapshot = select_samples(session, experiment.data.where)
    samples = synthesis.without_teacher_calls(samples)
    # the traffic train split the dataset will have, before rejection sampling (no judge
    # calls here: the dataset asset judges every sample once)
    counter = RenderCounter(tokenizer_dir_for(experiment.recipe))
    traffic = curate(samples, replace(cur, judge_threshold=None), counter,
                     num_workers=default_workers())
    teacher = synthesis.teacher_for(spec, experiment.name)
    try:
        outcome, slices = synthesis.run(
            session, experiment.name, traffic.train, teacher,
            known_ids=samples.column("sample_id").to_pylist(),
            max_per_slice=spec.max_per_slice, seed=experiment.data.seed,
            samples_snapshot_id=snapshot, counter=counter,
            attempts_per_sample=spec.attempts_per_sample)
    finally:
        teacher.close()
    return dg.MaterializeResult(metadata={
        "experiment": experiment.name,
        "teacher": spec.teacher,
        "teacher_base_url": teacher.base_url,
        "thin_slices": dg.MetadataValue.json([s.to_dict() for s in slices if s.thin]),
        "num_planned": outcome.num_planned,
        "num_resumed": outcome.num_skipped,
        "num_written": outcome.num_written,
        "num_not_needed": outcome.num_not_needed,
        "written_by_slice": dg.MetadataValue.json(outcome.by_slice),
        "drops_by_reason": dg.MetadataValue.json(outcome.drops),
        "samples_snapshot_id": snapshot,
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
    if config.engine and config.engine not in CURATION_ENGINES:
        raise FactoryError(f"engine {config.engine!r}: choose one of {', '.join(CURATION_ENGINES)}")
    experiment = load_experiment(context.partition_key)
    engine = config.engine or experiment.data.engine
    cur = curation_config(experiment)
    session = lake.session(context)
    tokenizer_dir = tokenizer_dir_for(experiment.recipe)
    judged: dict[str, str] = {}
    if engine == "spark":
        if experiment.data.synthesize is not None:
            raise FactoryError("data.synthesize: the spark engine does not curate synthetic "
                               "samples; use the embedded engine")
        result, snapshot, rejection = _curate_on_spark(session, experiment, cur, tokenizer_dir,
                                                       judge)
    else:
        samples, snapshot = select_samples(session, experiment.data.where)
        samples = synthesis.without_teacher_calls(samples)
        rejection = _rejection(judge, experiment, cur, samples)
        spec = experiment.data.synthesize
        if spec is not None and rejection is not None and spec.judge_threshold is None \
                and experiment.data.judge_threshold is None:
            cur = replace(cur, synthetic_judge_threshold=synthesis.default_judge_threshold(
                rejection.rubric))
        if spec is not None:
            samples = pa.concat_tables([
                samples.append_column("origin", pa.array([TRAFFIC] * samples.num_rows,
                                                         pa.string())),
                synthesis.read_synthetic(session, experiment.name)])
        result = curate(samples, cur, RenderCounter(tokenizer_dir), judge=rejection,
                        num_workers=config.num_workers or default_workers())
        write_dataset(session, experiment.name, result)
    if rejection is not None:
        judged = {"judge": rejection.name, "judge_rubric_version": rejection.rubric.version}
    train, ev, _ = read_dataset(session, experiment.name)

    yield dg.MaterializeResult(metadata={
        "experiment": experiment.name,
        "engine": engine,
        "num_selected": result.num_selected,
        "num_train": train.num_rows,
        "num_eval": ev.num_rows,
        "num_synthetic": result.profile["num_synthetic"],
        **{k: result.profile[k] for k in SPLIT_FIELDS},
        "drops_by_reason": dg.MetadataValue.json(result.drops_by_reason()),
        "clean_loss_by_reason": dg.MetadataValue.json(result.clean_loss_by_reason()),
        "samples_snapshot_id": snapshot,
        **judged,
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


def _rejection(judge: JudgeResource, experiment: Any, cur: CurationConfig,
               samples: Any) -> Any:
    """Rejection sampling (data.judge_threshold, and synthetic samples'): the judge scores each
    sample's own answer against the reference-free part of the experiment's rubric, inferred
    from the traffic ``samples`` (an Arrow table, or a Spark DataFrame streamed in
    ``sample_id`` order as far as the rubric needs); None without a threshold."""
    if cur.judge_threshold is None and cur.synthetic_judge_threshold is None:
        return None
    if isinstance(samples, pa.Table):
        return rejection_judge(judge.judge(), samples.select(["sample_id", "messages", "tools"])
                               .to_pylist(), rubric=experiment.eval.rubric)
    rows = (r.asDict() for r in samples.select("sample_id", "messages", "tools")
            .orderBy("sample_id").toLocalIterator())
    return rejection_judge(judge.judge(), rows, rubric=experiment.eval.rubric, ordered=True)


def _curate_on_spark(session: Any, experiment: Any, cur: CurationConfig, tokenizer_dir: Any,
                     judge: JudgeResource) -> tuple[Any, int | None, Any]:
    """Curate on Spark (``FACTORY_SPARK_MASTER``, default local) and commit its Parquet with
    ``add_files``."""
    try:
        from factory.curation.spark import commit, curate_spark, spark_session
    except ImportError as exc:  # pyspark is the optional extra `spark`
        raise FactoryError(f"engine 'spark' needs pyspark (pip install 'factory[spark]'): "
                           f"{exc}") from exc
    files, snapshot = sample_files(session)
    spark = spark_session(session.lake.settings.spark_master)
    try:
        samples = spark.read.parquet(*files).where(experiment.data.where).where(
            f"NOT coalesce(map_contains_key(tags, '{synthesis.TEACHER_TAG}'), false)")
        rejection = None
        if cur.judge_threshold is not None:
            rejection = _rejection(judge, experiment, cur, samples)
        result = curate_spark(spark, samples, cur, str(tokenizer_dir), judge=rejection)
        staging = session.lake.settings.warehouse / "spark-staging"
        commit(session, experiment.name, result, str(staging))
    finally:
        spark.stop()
    return result, snapshot, rejection


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
    config = curation_config(experiment)
    session = lake.session(context)
    train, ev, drops = read_dataset(session, experiment.name)
    profile = build_profile(train, ev, drops.to_pylist(),
                            num_selected=train.num_rows + ev.num_rows + drops.num_rows)
    tokenizer_dir = tokenizer_dir_for(experiment.recipe)
    tokenizer = tokenizer_dir.name
    slices = profile_slices(train)
    profile["slices"] = json.dumps([s.to_dict() for s in slices])
    profile["shared_prefix_tokens"] = shared_prefix_tokens(
        RenderCounter(tokenizer_dir), [parse_json(m) for m in train.column("messages").to_pylist()],
        [parse_json(t) for t in train.column("tools").to_pylist()], seed=config.seed)
    # The samples snapshot the dataset was built from, from the dataset's own lineage.
    reads = session.lake.snapshot_info("dataset_train").get("reads", {})
    made = _dataset_metadata(context)
    profile.update({k: made.get(k) for k in SPLIT_FIELDS})
    write_profile(session, experiment.name, profile, config=config, tokenizer=tokenizer,
                  samples_snapshot_id=reads.get("samples"),
                  engine=str(made.get("engine") or "embedded"))
    return dg.MaterializeResult(metadata={
        **{k: v for k, v in profile.items()
           if k not in ("languages", "drops_by_reason", "slices")},
        "languages": dg.MetadataValue.json(json.loads(profile["languages"])),
        "thin_slices": dg.MetadataValue.json([s.key for s in slices if s.thin]),
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
