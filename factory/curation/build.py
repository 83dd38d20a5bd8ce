"""An experiment's curation as its assets run it (``synthetic_samples``, ``dataset``,
``dataset_profile``): the samples selected, synthesized for, curated and profiled on the lake.

- ``synthesize``: with ``data.synthesize``, a teacher writes samples for the thin slices of the
  traffic train split the dataset will have (``synthesis.run``).
- ``build_dataset``: the experiment's samples curated by the embedded engine (in process) or
  Spark (reads the samples snapshot's Parquet files, writes the datasets as Parquet that the
  lake commits with ``add_files``); both give the same datasets (tests/curation/test_spark.py).
- ``profile_dataset``: the profile the planner reads, from the written dataset.

The judge comes in as a callable that makes one (``JudgeResource.judge``), called only when the
experiment asks for rejection sampling.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pyarrow as pa

from factory.curation import synthesis
from factory.curation.config import CurationConfig
from factory.curation.decide import TRAFFIC
from factory.curation.phrasing import SPLIT_FIELDS
from factory.curation.pipeline import CurationResult, curate, default_workers
from factory.curation.profile import build_profile
from factory.curation.slices import Slice, profile_slices
from factory.curation.spark import commit, curate_spark, spark_session
from factory.curation.store import (
    read_dataset,
    sample_files,
    select_samples,
    tokenizer_dir_for,
    write_dataset,
    write_profile,
)
from factory.curation.text import parse_json
from factory.curation.tokens import RenderCounter, shared_prefix_tokens
from factory.errors import FactoryError
from factory.evals.rejection import RejectionJudge, rejection_judge
from factory.experiments import CURATION_ENGINES, Experiment
from factory.lake import LakeSession
from factory.recipes import load_recipe


def curation_config(experiment: Experiment) -> CurationConfig:
    """The experiment's curation settings; samples longer than ``data.max_tokens`` or the
    recipe's context (as the trainer renders them) are dropped as ``too_long``."""
    context = load_recipe(experiment.recipe).architecture.max_context
    return CurationConfig.from_data_spec(experiment.data, context_limit=context)


def rejection(judge: Callable[[], Any], experiment: Experiment, cur: CurationConfig,
              samples: Any) -> RejectionJudge | None:
    """Rejection sampling (data.judge_threshold, and synthetic samples'): the judge ``judge()``
    makes scores each sample's own answer against the reference-free part of the experiment's
    rubric, inferred from the traffic ``samples`` (an Arrow table, or a Spark DataFrame streamed
    in ``sample_id`` order as far as the rubric needs); None without a threshold (and no judge
    made)."""
    if cur.judge_threshold is None and cur.synthetic_judge_threshold is None:
        return None
    if isinstance(samples, pa.Table):
        return rejection_judge(judge(), samples.select(["sample_id", "messages", "tools"])
                               .to_pylist(), rubric=experiment.eval.rubric)
    rows = (r.asDict() for r in samples.select("sample_id", "messages", "tools")
            .orderBy("sample_id").toLocalIterator())
    return rejection_judge(judge(), rows, rubric=experiment.eval.rubric, ordered=True)


@dataclass(frozen=True, kw_only=True)
class Synthesized:
    """What one ``synthesize`` run did."""

    outcome: synthesis.Outcome
    """Attempts planned, resumed, written and dropped (with reasons), samples per slice."""
    slices: list[Slice]
    """The slices of the traffic train split, the thin ones flagged."""
    teacher_base_url: str
    """The OpenAI base URL the teacher was called at."""
    samples_snapshot_id: int | None
    """The ``samples`` snapshot the traffic was selected from."""


def synthesize(session: LakeSession, experiment: Experiment) -> Synthesized:
    """With ``data.synthesize``: the teacher writes new samples for the thin slices of the
    traffic train split, from train seed samples only (``synthesis.run``: table
    ``synthetic_samples``, drops in ``synthesis_drops``; a rerun skips recorded attempts). The
    split is the dataset's before rejection sampling: no judge calls here, the dataset judges
    every sample once. Raises ``ValueError`` for an experiment without ``data.synthesize``."""
    spec = experiment.data.synthesize
    if spec is None:
        raise ValueError(f"experiment {experiment.name!r} has no data.synthesize")
    cur = curation_config(experiment)
    samples, snapshot = select_samples(session, experiment.data.where)
    samples = synthesis.without_teacher_calls(samples)
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
    return Synthesized(outcome=outcome, slices=slices, teacher_base_url=teacher.base_url,
                       samples_snapshot_id=snapshot)


@dataclass(frozen=True, kw_only=True)
class Built:
    """A dataset as ``build_dataset`` wrote it, read back."""

    result: CurationResult[Any]
    """The curation run: counts, drops, profile, trace-pattern report."""
    samples_snapshot_id: int | None
    """The ``samples`` snapshot the dataset was built from."""
    engine: str
    """``embedded`` or ``spark``."""
    judged: dict[str, str]
    """With rejection sampling: the judge's name (``judge``) and its rubric's version
    (``judge_rubric_version``); empty without."""
    train: pa.Table
    """The experiment's rows of ``dataset_train``."""
    ev: pa.Table
    """The experiment's rows of ``dataset_eval``."""


def build_dataset(session: LakeSession, experiment: Experiment, *, judge: Callable[[], Any],
                  engine: str = "", num_workers: int = 0) -> Built:
    """Curate ``experiment``'s samples (``data.where``) into ``dataset_train``,
    ``dataset_eval`` and ``dataset_drops``, with synthetic samples (``data.synthesize``) on the
    train side only, and read the two splits back.

    ``engine``: ``embedded`` or ``spark``; empty: the experiment's ``data.engine``.
    ``num_workers``: embedded engine processes computing sample features; 0: every core.
    ``judge``: makes the rejection-sampling judge (``rejection``). Raises ``FactoryError`` for
    an unknown engine (before anything is read or written) and for synthetic samples on Spark.
    """
    if engine and engine not in CURATION_ENGINES:
        raise FactoryError(f"engine {engine!r}: choose one of {', '.join(CURATION_ENGINES)}")
    engine = engine or experiment.data.engine
    cur = curation_config(experiment)
    tokenizer_dir = tokenizer_dir_for(experiment.recipe)
    result: CurationResult[Any]
    if engine == "spark":
        if experiment.data.synthesize is not None:
            raise FactoryError("data.synthesize: the spark engine does not curate synthetic "
                               "samples; use the embedded engine")
        result, snapshot, judge_used = _curate_on_spark(session, experiment, cur, tokenizer_dir,
                                                        judge)
    else:
        samples, snapshot = select_samples(session, experiment.data.where)
        samples = synthesis.without_teacher_calls(samples)
        judge_used = rejection(judge, experiment, cur, samples)
        spec = experiment.data.synthesize
        if spec is not None and judge_used is not None and spec.judge_threshold is None \
                and experiment.data.judge_threshold is None:
            cur = replace(cur, synthetic_judge_threshold=synthesis.default_judge_threshold(
                judge_used.rubric))
        if spec is not None:
            samples = pa.concat_tables([
                samples.append_column("origin", pa.array([TRAFFIC] * samples.num_rows,
                                                         pa.string())),
                synthesis.read_synthetic(session, experiment.name)])
        result = curate(samples, cur, RenderCounter(tokenizer_dir), judge=judge_used,
                        num_workers=num_workers or default_workers())
        write_dataset(session, experiment.name, result)
    judged: dict[str, str] = {}
    if judge_used is not None:
        judged = {"judge": judge_used.name, "judge_rubric_version": judge_used.rubric.version}
    train, ev, _ = read_dataset(session, experiment.name)
    return Built(result=result, samples_snapshot_id=snapshot, engine=engine, judged=judged,
                 train=train, ev=ev)


def _curate_on_spark(session: LakeSession, experiment: Experiment, cur: CurationConfig,
                     tokenizer_dir: Path, judge: Callable[[], Any]
                     ) -> tuple[CurationResult[Any], int | None, RejectionJudge | None]:
    """Curate on Spark (``FACTORY_SPARK_MASTER``, default local) and commit its Parquet with
    ``add_files``."""
    files, snapshot = sample_files(session)
    spark = spark_session(session.lake.settings.spark_master)
    try:
        samples = spark.read.parquet(*files).where(experiment.data.where).where(
            f"NOT coalesce(map_contains_key(tags, '{synthesis.TEACHER_TAG}'), false)")
        judge_used = None
        if cur.judge_threshold is not None:
            judge_used = rejection(judge, experiment, cur, samples)
        result = curate_spark(spark, samples, cur, str(tokenizer_dir), judge=judge_used)
        staging = session.lake.settings.warehouse / "spark-staging"
        commit(session, experiment.name, result, str(staging))
    finally:
        spark.stop()
    return result, snapshot, judge_used


@dataclass(frozen=True, kw_only=True)
class Profiled:
    """A dataset profile as ``profile_dataset`` wrote it."""

    profile: dict[str, Any]
    """The ``dataset_profile`` row's values (``languages``, ``drops_by_reason`` and ``slices``
    as JSON text)."""
    slices: list[Slice]
    """The train split's slices, the thin ones flagged."""


def profile_dataset(session: LakeSession, experiment: Experiment,
                    made: Mapping[str, Any]) -> Profiled:
    """Profile ``experiment``'s dataset for the planner and write it to ``dataset_profile``:
    prompt/completion token percentiles as the trainer renders them, turns, share with images
    and tool calls, languages, size, share of synthetic samples, slices (tool, answer label,
    length) with the thin ones flagged, and the tokens the samples share as a prefix.

    ``made``: the metadata of the dataset's materialization; its engine and how its eval set was
    held out (``SPLIT_FIELDS``) go into the profile. The samples snapshot comes from the
    dataset's own lineage."""
    config = curation_config(experiment)
    train, ev, drops = read_dataset(session, experiment.name)
    profile = build_profile(train, ev, drops.to_pylist(),
                            num_selected=train.num_rows + ev.num_rows + drops.num_rows)
    tokenizer_dir = tokenizer_dir_for(experiment.recipe)
    slices = profile_slices(train)
    profile["slices"] = json.dumps([s.to_dict() for s in slices])
    profile["shared_prefix_tokens"] = shared_prefix_tokens(
        RenderCounter(tokenizer_dir), [parse_json(m) for m in train.column("messages").to_pylist()],
        [parse_json(t) for t in train.column("tools").to_pylist()], seed=config.seed)
    reads = session.lake.snapshot_info("dataset_train").get("reads", {})
    profile.update({k: made.get(k) for k in SPLIT_FIELDS})
    write_profile(session, experiment.name, profile, config=config, tokenizer=tokenizer_dir.name,
                  samples_snapshot_id=reads.get("samples"),
                  engine=str(made.get("engine") or "embedded"))
    return Profiled(profile=profile, slices=slices)
