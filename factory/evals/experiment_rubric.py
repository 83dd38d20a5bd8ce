"""An experiment's rubric, made and recorded (the ``rubric`` asset): the experiment file's inline
rubric, or with ``eval.rubric: auto`` criteria inferred from the eval set's reference answers
and the training set's (``answers.build_rubric``: code-checkable criteria, plus judge-written
ones with an LLM judge from the eval examples); one row of ``rubrics`` per rubric made.

The training answers are there for what a kind is recognized by across the whole task: a
phrasing split holds out whole clusters, so an eval set of a many-label task can hold each
label once (CLINC150 at 10 queries an intent: 150 eval samples, 150 intents). From those alone
the labels never repeat and the task read as free text: graded by similarity (86% where the
deployment was exactly right on 58% of the official test queries), and no label constraint at
eval or serve time. With the training answers the labels repeat and every label is in the set.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from factory.evals.answers import build_rubric, items_from_samples
from factory.evals.judging import EvalError, eval_rows
from factory.evals.rubric import Answer, Rubric
from factory.experiments import Experiment
from factory.lake import LakeSession

TRAIN_REFERENCES = 5000
"""At most this many training answers (the first by ``sample_id``) join the eval set's: enough
for each label of a task of hundreds to repeat, without reading a large dataset whole."""


def training_references(session: LakeSession, experiment: str,
                        limit: int = TRAIN_REFERENCES) -> list[Answer]:
    """The reference answers (``items_from_samples``, as the eval set's) of up to ``limit`` of
    ``experiment``'s ``dataset_train`` rows (none when the table does not exist)."""
    if not session.lake.exists("dataset_train"):
        return []
    rows = session.sql("SELECT sample_id, messages, tools FROM dataset_train WHERE experiment = ? "
                       f"ORDER BY sample_id LIMIT {int(limit)}", [experiment]).to_pylist()
    return [item.reference for item in items_from_samples(rows)]


def experiment_rubric(session: LakeSession, experiment: Experiment, *,
                      judge: Callable[[], Any]) -> Rubric:
    """``experiment``'s rubric, appended to ``rubrics``. ``auto`` infers it from the eval
    samples (``judging.eval_rows``, at most ``eval.max_samples``) and the training answers
    (``training_references``) with the judge ``judge()``
    makes (made only then: an inline rubric needs no judge configured). Raises
    ``EvalError`` when there are no eval samples, and for a rubric named by a string other
    than ``auto``."""
    spec = experiment.eval.rubric
    if isinstance(spec, dict):
        rubric = Rubric.from_dict(spec, source="inline")
    elif spec == "auto":
        items = items_from_samples(eval_rows(session, experiment.name, experiment.eval))
        rubric = build_rubric(items, judge=judge(),
                              references=training_references(session, experiment.name))
    else:
        raise EvalError(f"eval.rubric {spec!r}: named rubrics are not supported; use 'auto' "
                        "or an inline mapping")
    session.append("rubrics", [{
        "experiment": experiment.name, "version": rubric.version, "source": rubric.source,
        "num_examples": rubric.num_examples, "rubric": rubric.to_json(),
        "created_at": datetime.now(UTC)}])
    return rubric
