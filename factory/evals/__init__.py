"""Evals: rubrics from the data, judges (LLM and embedded), checkpoint selection by the interval
of the task score (and the one way a score is printed), overfitting detection, and the
train/serve equivalence check."""

from factory.evals.answers import (
    Generated,
    build_rubric,
    generate_answers,
    items_from_samples,
    score_reference,
)
from factory.evals.equivalence import EquivalenceError, EquivalenceResult, check_equivalence
from factory.evals.judges import (
    EmbeddedJudge,
    EvalItem,
    JudgeOutputError,
    LLMJudge,
    ScoreRow,
    answer_from_message,
)
from factory.evals.rubric import Answer, Criterion, Rubric, infer_rubric
from factory.evals.selection import (
    EarlyStop,
    Interval,
    StepScore,
    decide_stop,
    detect_overfitting,
    detect_plateau,
    format_score,
    select_best,
    summarize,
    wilson_interval,
)

__all__ = ["Answer", "Criterion", "EarlyStop", "EmbeddedJudge", "EquivalenceError",
           "EquivalenceResult", "EvalItem", "Generated", "Interval", "JudgeOutputError",
           "LLMJudge", "Rubric", "ScoreRow", "StepScore", "answer_from_message", "build_rubric",
           "check_equivalence", "decide_stop", "detect_overfitting", "detect_plateau",
           "format_score", "generate_answers", "infer_rubric", "items_from_samples",
           "score_reference", "select_best", "summarize", "wilson_interval"]
