"""Score-and-loss curves of a run, from the lake: PNG (matplotlib) and a self-contained HTML.

Scores come from ``eval_scores`` (mean per step with its 95% interval, ``selection.summarize``,
clustered by the samples' phrasing clusters in ``dataset_eval.split_group``;
the base model at step 0 and the reference answers as a horizontal line); the loss curve from
the ``trainer_state.json`` of the run's newest checkpoint listed in ``checkpoints`` (it holds
the whole loss history). The trainer's held-out losses per step (``read_eval_losses``) come
from ``training_events``.
"""

from __future__ import annotations

import base64
import html
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from factory.evals.selection import StepScore, decide_stop, format_score, summarize


@dataclass(kw_only=True)
class RunCurves:
    """Everything a run's report plots."""

    run_id: str
    """The run."""
    scores: list[tuple[int, float]] = field(default_factory=list)
    """(step, mean score) of the base model (step 0) and each checkpoint."""
    samples: dict[int, list[float]] = field(default_factory=dict)
    """Step -> the sample scores behind that mean (for their intervals)."""
    clusters: dict[int, list[str]] = field(default_factory=dict)
    """Step -> each sample score's phrasing cluster, in the order of ``samples[step]``
    (``dataset_eval.split_group``; a sample no longer in the eval set is its own cluster):
    the ``clusters`` of ``selection.summarize``."""
    reference: float | None = None
    """Mean score of the reference answers."""
    loss: list[tuple[int, float]] = field(default_factory=list)
    """(step, training loss)."""

    def summary(self, step: int) -> StepScore:
        """``step``'s score with its interval, clustered by its samples' phrasing clusters
        (``selection.summarize``)."""
        return summarize(step, self.samples[step], clusters=self.clusters.get(step))


def record_early_stop(lake: Any, run_id: str, experiment: str) -> tuple[RunCurves, Any]:
    """After a checkpoint of ``run_id`` is scored: its curves, and the early stop they call for
    (``selection.decide_stop``: the score fell after its peak, or it plateaued), appended to
    ``early_stops`` (the recovery sensor then stops the run). Returns (curves, stop or None)."""
    from datetime import UTC, datetime

    curves = read_curves(lake, run_id)
    stop = decide_stop(curves.samples, clusters=curves.clusters)
    if stop is not None:
        lake.append("early_stops", [{
            "run_id": run_id, "experiment": experiment, "peak_step": stop.peak_step,
            "peak_score": stop.peak_score, "last_step": stop.last_step,
            "last_score": stop.last_score, "reason": stop.reason,
            "created_at": datetime.now(UTC)}])
    return curves, stop


def read_eval_losses(lake: Any, run_id: str) -> dict[int, float]:
    """Step -> the trainer's held-out loss (``eval_loss`` of its ``progress`` events in
    ``training_events``) of ``run_id``; the newest event wins where a resumed segment repeats a
    step. Empty when the run had no eval split or its events are not synced."""
    root = getattr(lake, "lake", lake)
    if not root.exists("training_events"):
        return {}
    rows = lake.sql("SELECT step, payload FROM training_events WHERE run_id = ? "
                    "AND type = 'progress' AND payload LIKE '%eval_loss%' "
                    "ORDER BY event_time, seq", [run_id]).to_pylist()
    out: dict[int, float] = {}
    for r in rows:
        value = json.loads(r["payload"] or "{}").get("eval_loss")
        if r["step"] is not None and isinstance(value, int | float) and value == value:
            out[int(r["step"])] = float(value)
    return out


def read_curves(lake: Any, run_id: str) -> RunCurves:
    """Curves of ``run_id`` (``lake``: a Lake or LakeSession), under the rubric version of the
    run's newest eval: scores from different rubrics are never averaged together. Each sample
    score comes with its phrasing cluster, as ``final.read_scores`` reads it."""
    root = getattr(lake, "lake", lake)
    curves = RunCurves(run_id=run_id)
    if not root.exists("eval_scores"):
        return curves
    t = lake.sql("SELECT kind, step, experiment, sample_id, score FROM eval_scores "
                 "WHERE run_id = ? AND status = 'ok' AND rubric_version = ("
                 "  SELECT rubric_version FROM eval_scores WHERE run_id = ? "
                 "  ORDER BY evaluated_at DESC LIMIT 1) "
                 "ORDER BY step, sample_id", [run_id, run_id]).to_pylist()
    experiments = sorted({r["experiment"] for r in t if r["experiment"] is not None})
    cluster_of = {r["sample_id"]: r["split_group"] for r in lake.sql(
        "SELECT sample_id, split_group FROM dataset_eval WHERE experiment IN "
        f"({', '.join('?' * len(experiments))})", experiments).to_pylist()} \
        if experiments and root.exists("dataset_eval") else {}
    reference: list[float] = []
    for r in t:
        if r["kind"] == "reference":
            reference.append(float(r["score"]))
        else:
            step = int(r["step"])
            curves.samples.setdefault(step, []).append(float(r["score"]))
            curves.clusters.setdefault(step, []).append(
                cluster_of.get(r["sample_id"]) or r["sample_id"])
    if reference:
        curves.reference = sum(reference) / len(reference)
    curves.scores = [(step, sum(v) / len(v)) for step, v in sorted(curves.samples.items())]
    if root.exists("checkpoints"):
        paths = lake.sql("SELECT path FROM checkpoints WHERE run_id = ? ORDER BY step DESC "
                         "LIMIT 1", [run_id]).to_pylist()
        if paths:
            state = Path(paths[0]["path"]) / "trainer_state.json"
            if state.is_file():
                hist = json.loads(state.read_text()).get("loss_history", [])
                curves.loss = [(int(s), float(v)) for s, v in hist if v is not None]
    return curves


def plot_png(curves: RunCurves, dest: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    if curves.scores:
        steps = [s for s, _ in curves.scores]
        spans = [curves.summary(s) for s in steps]
        ax.errorbar(steps, [c.mean for c in spans],
                    # max: the interval holds its mean, up to rounding.
                    yerr=[[max(0.0, c.mean - c.ci_low) for c in spans],
                          [max(0.0, c.ci_high - c.mean) for c in spans]],
                    marker="o", color="tab:blue", capsize=3,
                    label="rubric score (95% interval)")
    if curves.reference is not None:
        ax.axhline(curves.reference, color="tab:green", linestyle="--", label="reference")
    ax.set_xlabel("step")
    ax.set_ylabel("mean rubric score (0-1)")
    ax.set_ylim(0, 1.05)
    if curves.loss:
        ax2 = ax.twinx()
        ax2.plot(*zip(*curves.loss, strict=True), color="tab:red", alpha=0.6, label="loss")
        ax2.set_ylabel("training loss")
        ax2.legend(loc="upper right")
    ax.legend(loc="upper left")
    ax.set_title(f"run {curves.run_id}")
    fig.tight_layout()
    dest.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(dest, dpi=100)
    plt.close(fig)
    return dest


def write_html(curves: RunCurves, png: Path, dest: Path) -> Path:
    img = base64.b64encode(png.read_bytes()).decode()
    rows = "".join(f"<tr><td>{s}</td><td>"
                   f"{html.escape(format_score(curves.summary(s)))}</td></tr>"
                   for s, _ in curves.scores)
    ref = f"{curves.reference:.3f}" if curves.reference is not None else "n/a"
    loss = (f"{curves.loss[-1][1]:.4f} at step {curves.loss[-1][0]}" if curves.loss
            else "n/a (no trainer_state.json for the run's newest checkpoint)")
    dest.write_text(
        f"<!doctype html><html><head><meta charset='utf-8'><title>run "
        f"{html.escape(curves.run_id)}</title></head><body><h1>run "
        f"{html.escape(curves.run_id)}</h1><img src='data:image/png;base64,{img}'>"
        f"<p>reference answers: {ref}</p><p>final training loss: {loss}</p><table border='1'><tr><th>step</th>"
        f"<th>score</th></tr>{rows}</table></body></html>")
    return dest
