"""``rubric`` (per experiment): what ``checkpoint_evals`` judges answers by.

Inferred from the eval set's reference answers (plus judge-written criteria with an LLM judge), or
the experiment file's inline rubric; a row in ``rubrics``.
"""

from datetime import UTC, datetime

import dagster as dg

from factory.evals import judging
from factory.evals.rubric import Rubric
from factory.evals.runner import build_rubric, items_from_samples
from factory.experiments import EvalSpec, load_experiment
from factory.partitions import EXPERIMENTS
from factory.resources.judge import JudgeResource
from factory.resources.lake import LakeResource


def eval_rows(session, experiment: str, spec: EvalSpec):  # type: ignore[no-untyped-def]
    """The experiment's eval samples the rubric is inferred from (``judging.eval_rows``, at
    most ``spec.max_samples``); the step fails when there are none."""
    try:
        return judging.eval_rows(session, experiment, spec)
    except judging.EvalError as exc:
        raise dg.Failure(str(exc)) from None


@dg.asset(
    partitions_def=EXPERIMENTS,
    deps=["dataset"],
    group_name="evals",
    kinds={"iceberg", "python"},
    description="The experiment's rubric: code-checkable criteria inferred from the eval set's "
                "reference answers (JSON keys/types, tool-call schemas, length, language, "
                "format) plus reference similarity, and judge-written criteria when an LLM "
                "judge is configured; or the experiment file's inline rubric. Table rubrics.",
    code_version="1",
)
def rubric(context: dg.AssetExecutionContext, lake: LakeResource,  # type: ignore[no-untyped-def]
           judge: JudgeResource):
    experiment = load_experiment(context.partition_key)
    session = lake.session(context)
    spec = experiment.eval.rubric
    if isinstance(spec, dict):
        result = Rubric.from_dict(spec, source="inline")
    elif spec == "auto":
        items = items_from_samples(eval_rows(session, experiment.name, experiment.eval))
        result = build_rubric(items, judge=judge.judge())
    else:
        raise dg.Failure(f"eval.rubric {spec!r}: named rubrics are not supported; use 'auto' "
                         "or an inline mapping")
    session.append("rubrics", [{
        "experiment": experiment.name, "version": result.version, "source": result.source,
        "num_examples": result.num_examples, "rubric": result.to_json(),
        "created_at": datetime.now(UTC)}])
    return dg.MaterializeResult(metadata={
        "version": result.version, "source": result.source,
        "criteria": dg.MetadataValue.json(result.to_dict()["criteria"]), **session.metadata()})
