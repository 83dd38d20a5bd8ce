"""An experiment's rubric, made and recorded (the ``rubric`` asset): the experiment file's inline
rubric, or with ``eval.rubric: auto`` criteria inferred from the eval set's reference answers
(``answers.build_rubric``: code-checkable criteria, plus judge-written ones with an LLM judge);
one row of ``rubrics`` per rubric made.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from factory.evals.answers import build_rubric, items_from_samples
from factory.evals.judging import EvalError, eval_rows
from factory.evals.rubric import Rubric
from factory.experiments import Experiment
from factory.lake import LakeSession


def experiment_rubric(session: LakeSession, experiment: Experiment, *,
                      judge: Callable[[], Any]) -> Rubric:
    """``experiment``'s rubric, appended to ``rubrics``. ``auto`` infers it from the eval
    samples (``judging.eval_rows``, at most ``eval.max_samples``) with the judge ``judge()``
    makes (made only then: an inline rubric needs no judge configured). Raises
    ``EvalError`` when there are no eval samples, and for a rubric named by a string other
    than ``auto``."""
    spec = experiment.eval.rubric
    if isinstance(spec, dict):
        rubric = Rubric.from_dict(spec, source="inline")
    elif spec == "auto":
        items = items_from_samples(eval_rows(session, experiment.name, experiment.eval))
        rubric = build_rubric(items, judge=judge())
    else:
        raise EvalError(f"eval.rubric {spec!r}: named rubrics are not supported; use 'auto' "
                        "or an inline mapping")
    session.append("rubrics", [{
        "experiment": experiment.name, "version": rubric.version, "source": rubric.source,
        "num_examples": rubric.num_examples, "rubric": rubric.to_json(),
        "created_at": datetime.now(UTC)}])
    return rubric
