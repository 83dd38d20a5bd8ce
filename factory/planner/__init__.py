"""The planner: every hyperparameter of a run from the data profile, recipe and hardware.

``make_plan(experiment, profile, point=...)`` returns a ``Plan`` whose every value carries the
rule that produced it; ``Plan.train_config()`` is the trainer's ``TrainConfig`` keyword dict.
"""

from __future__ import annotations

from factory.planner.hardware import HARDWARE, Hardware, get_hardware
from factory.planner.memory import MemoryEstimate, estimate_memory
from factory.planner.plan import Decision, Plan, PlanError, make_plan
from factory.planner.profile import DatasetProfile

__all__ = ["HARDWARE", "DatasetProfile", "Decision", "Hardware", "MemoryEstimate", "Plan",
           "PlanError", "estimate_memory", "get_hardware", "make_plan"]
