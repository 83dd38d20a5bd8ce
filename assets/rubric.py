"""``rubric`` (per experiment): what ``checkpoint_evals`` judges answers by.

Inferred from the eval set's reference answers (plus judge-written criteria with an LLM judge), or
the experiment file's inline rubric; a row in ``rubrics`` (``factory.evals.experiment_rubric``).
"""

import dagster as dg

from factory.evals.experiment_rubric import experiment_rubric
from factory.evals.judging import EvalError
from factory.experiments import load_experiment
from factory.partitions import EXPERIMENTS
from factory.resources.judge import JudgeResource
from factory.resources.lake import LakeResource


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
    try:
        result = experiment_rubric(session, experiment, judge=judge.judge)
    except EvalError as exc:
        raise dg.Failure(str(exc)) from None
    return dg.MaterializeResult(metadata={
        "version": result.version, "source": result.source,
        "criteria": dg.MetadataValue.json(result.to_dict()["criteria"]), **session.metadata()})
