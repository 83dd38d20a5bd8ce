"""A running plan's prediction corrected by its own steps.

The trainer emits a ``progress`` event (``step``, ``time``, and ``eval_loss`` where it ran the
held-out loss pass first) every ``log_every_steps``. After ``MIN_STEPS`` steps past the first
event the observed seconds per step replace the plan's ``step_seconds``: a host's load, its
thread count and the data's real lengths all show in them, which no calibration made before
the run can know. ``corrected`` gives the corrected training and wall seconds, ``pace_line``
puts them next to the plan's figure.

The first event's interval is left out (it holds the model load and oneDNN's first-call kernel
creation, seconds that ``train_fixed_s`` counts). An interval ending at an event with
``eval_loss`` (the held-out pass, which the plan counts apart) counts less the pass's seconds
the event reports in ``eval_loss_s`` (``bench/loop.py``'s step pace reads them the same way);
an event with ``eval_loss`` and no ``eval_loss_s`` (a trainer before that field) leaves its
interval out. On a CPU the evals share
the training cores and whatever slows the steps slows them too, so their seconds scale by the
same ratio; on GPUs they run on their own devices and keep the plan's figure.

At a run's end ``record_run_pace`` keeps its pace on this host for the next plans
(``factory.planner.host.record_pace``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from factory.planner.host import record_pace, time_model_cache
from factory.planner.timing import duration
from factory.recipes import Recipe, RecipeError, load_recipe

MIN_STEPS = 3
"""Steps (past the first logged one) before the observed pace replaces the plan's."""


@dataclass(frozen=True, kw_only=True)
class Pace:
    """The observed pace of a run and the prediction it gives."""

    steps: int
    """Steps the pace was measured over."""
    step_s: float
    """Observed seconds per optimizer step."""
    predicted_step_s: float
    """The plan's ``step_seconds``."""
    train_s: float
    """Training seconds with the observed pace."""
    wall_s: float
    """Wall seconds with the observed pace."""
    predicted_wall_s: float
    """The plan's ``wall_seconds``."""

    @property
    def ratio(self) -> float:
        """Observed over predicted seconds per step."""
        return self.step_s / self.predicted_step_s


def observed_step_seconds(events: Iterable[Mapping[str, Any]]) -> tuple[int, float] | None:
    """(steps, seconds per step) of the trainer's ``progress`` events (see the module
    docstring for what is left out); None before two training events."""
    points = sorted((int(e["step"]), float(e["time"]), _held_out_seconds(e)) for e in events
                    if e.get("type") == "progress" and "loss" in e
                    and e.get("step") is not None and e.get("time") is not None)
    steps, seconds = 0, 0.0
    for (s0, t0, _), (s1, t1, held_out_s) in zip(points, points[1:], strict=False):
        if held_out_s is None or s1 <= s0:
            continue
        steps += s1 - s0
        seconds += t1 - t0 - held_out_s
    return (steps, seconds / steps) if steps else None


def _held_out_seconds(event: Mapping[str, Any]) -> float | None:
    """Seconds of the held-out loss pass inside ``event``'s interval (0 without one); None
    when it ran one and did not say how long it took."""
    if "eval_loss" not in event:
        return 0.0
    seconds = event.get("eval_loss_s")
    return float(seconds) if seconds is not None else None


def corrected(estimates: Mapping[str, float], events: Iterable[Mapping[str, Any]], *,
              evals_share_devices: bool, min_steps: int = MIN_STEPS) -> Pace | None:
    """The plan's ``estimates`` with the pace of the run's ``events``; None until ``min_steps``
    steps were observed."""
    seen = observed_step_seconds(events)
    if seen is None or seen[0] < min_steps:
        return None
    steps, step_s = seen
    predicted = estimates["step_seconds"]
    train_s = estimates["train_seconds"] + (step_s - predicted) * estimates["steps"]
    evals_s = estimates["evals_seconds"] * (step_s / predicted if evals_share_devices else 1.0)
    return Pace(steps=steps, step_s=step_s, predicted_step_s=predicted, train_s=train_s,
                wall_s=train_s + evals_s, predicted_wall_s=estimates["wall_seconds"])


def pace_line(pace: Pace) -> str:
    """One line for beside the plan's predicted wall time."""
    return (f"observed over {pace.steps} steps: {pace.step_s:.3g} s a step (plan "
            f"{pace.predicted_step_s:.3g} s, x{pace.ratio:.2f}): wall ~{duration(pace.wall_s)} "
            f"(plan {duration(pace.predicted_wall_s)}), training ~{duration(pace.train_s)}")


def measured_train_seconds(events: Iterable[Mapping[str, Any]]) -> float | None:
    """Seconds from the trainer's first event to its last (``started``, ``progress``,
    ``finished``; every segment's wait between included); None before two."""
    times = [float(e["time"]) for e in events
             if e.get("type") in ("started", "progress", "finished") and e.get("time") is not None]
    return max(times) - min(times) if len(times) > 1 else None


RATIO_MOVE = 0.10
"""A pace is said again once its ratio to the plan moved by more than this share."""


def trainer_events(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The trainer's events as it wrote them, from stored ``training_events`` rows."""
    import json

    return [json.loads(r["payload"]) for r in rows if r.get("payload")]


@dataclass(kw_only=True)
class PaceWatch:
    """A running plan's pace, said as it becomes known: ``update`` (given the stored events,
    every few seconds by ``factory.control.follow.follow_run``) logs ``pace_line`` the first
    time ``corrected`` gives a figure and again whenever the ratio moved by ``RATIO_MOVE``;
    ``metadata`` puts the plan's figures, the observed pace and the measured training seconds
    side by side at the run's end."""

    estimates: Mapping[str, float]
    """The plan's ``estimates``."""
    evals_share_devices: bool
    """Whether the evals run on the training devices (a CPU plan) and slow with them."""
    say: Callable[[str], Any]
    """Called with each line (a logger's ``info``)."""
    said_ratio: float | None = None

    def update(self, rows: Iterable[Mapping[str, Any]]) -> Pace | None:
        pace = corrected(self.estimates, trainer_events(rows),
                         evals_share_devices=self.evals_share_devices)
        if pace is not None and (self.said_ratio is None
                                 or abs(pace.ratio / self.said_ratio - 1) > RATIO_MOVE):
            self.said_ratio = pace.ratio
            self.say(f"training pace {pace_line(pace)}")
        return pace

    def metadata(self, rows: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
        """``predicted_train_s`` and ``predicted_step_s`` (the plan), ``measured_train_s`` (from
        the first training event to the last, every segment's wait between included),
        ``train_s_ratio`` (measured over predicted), and the observed ``pace``."""
        events = trainer_events(rows)
        out: dict[str, Any] = {"predicted_train_s": self.estimates["train_seconds"],
                               "predicted_step_s": self.estimates["step_seconds"]}
        measured = measured_train_seconds(events)
        if measured is not None and self.estimates["train_seconds"] > 0:
            out["measured_train_s"] = round(measured, 1)
            out["train_s_ratio"] = round(measured / self.estimates["train_seconds"], 3)
        pace = corrected(self.estimates, events, evals_share_devices=self.evals_share_devices)
        if pace is not None:
            out["pace"] = pace_line(pace)
        return out


def record_run_pace(plan: Mapping[str, Any], events: Iterable[Mapping[str, Any]], *,
                    run_id: str, cache: Path | None = None, recipe: Recipe | None = None
                    ) -> str | None:
    """Keep a finished run's pace for this host's next plans (``factory.planner.host.
    record_pace``): its observed seconds a step over what the plan's calibrated rates predicted
    (the plan's ``step_seconds`` divided by its ``step_factor``). Only for a CPU plan made with
    this host's calibrated constants (``time_model`` ``calibrated``) whose trainer ran on this
    host; ``cache``: the time-model folder (default ``time_model_cache()``); ``recipe``: the
    plan's (default: the shipped recipe it names). Returns the line to log, or None when nothing
    was kept; a cache that cannot be read or written is said in the line, and the run it
    follows stands."""
    values, estimates = plan.get("values") or {}, plan.get("estimates") or {}
    if values.get("time_model") != "calibrated" or not estimates.get("step_seconds"):
        return None
    seen = observed_step_seconds(events)
    folder = cache if cache is not None else time_model_cache()
    if seen is None or folder is None:
        return None
    if recipe is None:
        try:
            recipe = load_recipe(str(plan.get("recipe")))
        except RecipeError:
            return None
    steps, step_s = seen
    factor = float(estimates.get("step_factor") or 1.0)
    ratio = step_s * factor / float(estimates["step_seconds"])
    try:
        kept = record_pace(folder, recipe, str(values.get("precision", "bf16-autocast")),
                           ratio=ratio, steps=steps, run_id=run_id)
    except (OSError, ValueError) as exc:
        return f"this host's pace (x{ratio:.2f}) not kept: {exc}"
    if kept is None:
        return None
    return (f"this host's pace kept for its next plans: {step_s:.3g} s a step over {steps} "
            f"steps, x{ratio:.2f} of the calibrated rates' prediction ({kept})")
