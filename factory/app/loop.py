"""``factory run``: one experiment from its samples to a live endpoint, through the daemon.

``run_experiment`` submits the experiment's chain (``start_experiment_job``: dataset, profile,
rubric) to the Dagster instance, starting a daemon for the instance when none runs, and then
follows it: ``chain_sensor`` plans and trains every sweep point, ``checkpoint_sensor`` evaluates
each checkpoint while it trains, the best checkpoint is selected once all are scored, and it is
deployed (``deploy: auto``, or ``--no-deploy``/``deploy: manual`` to stop at the selection).
Every run is on the instance, so ``factory ui`` shows the same chain a click would have made.
``summary`` reads the result back from the lake, each score with its 95% interval and sample
count (``format_score``), and ``run_experiment`` ends its progress with them.

Ctrl-C cancels the chain's runs (the training run cancels its trainer, which checkpoints and
exits; the run is recorded ``cancelled``) and ``factory run`` exits 130; SIGTERM does the same
and exits 143 (``factory.app.cli``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

from factory.app.client import TRAINER_RUN_TAG, cancel_chain, chain_runs, follow, submit
from factory.app.instance import control_plane, ensure_daemon, instance
from factory.base_model import require_base_model
from factory.control.plane import RUN_ACTIVE, cancel_run
from factory.curation.phrasing import RECALL
from factory.curation.store import read_eval_split
from factory.deploy.deployer import Deployer, route_model
from factory.evals.report import plot_png, read_curves
from factory.evals.selection import StepScore, format_score
from factory.experiments import experiment_sha, load_experiment
from factory.lake import Lake
from factory.process import interrupt_handled, signals_ignored
from factory.settings import get_settings

Progress = Callable[[str], None]


def _print(line: str) -> None:
    print(line, flush=True)


def cancel_orphan(run_id: str, *, reason: str) -> None:
    """Cancel the trainer run ``run_id`` from a process that did not launch its trainers: the
    run is marked cancelled, its provider stops each live local trainer by its recorded pid
    (after checking the pid still runs that segment's job: a recycled pid is left alone), and
    this waits up to 30 s for them to be gone."""
    cancel_run(control_plane(), run_id, reason=reason, wait_s=30)


def _stop(inst: Any, start: str, progress: Progress) -> None:
    """Cancel the chain; then any trainer of it still active (its training_run process died
    before it could cancel it) is cancelled here."""
    cancel_chain(inst, start, progress)
    trainers = sorted({r.tags[TRAINER_RUN_TAG] for r in chain_runs(inst, start)
                       if r.tags.get(TRAINER_RUN_TAG)})
    runs = control_plane().runs() if trainers else {}
    for trainer in trainers:
        if trainer in runs and runs[trainer].status in RUN_ACTIVE:
            cancel_orphan(trainer, reason="interrupted; its training_run process was gone")
    progress(f"  cancelled {', '.join(trainers) or 'the chain before training'}")


def run_experiment(name: str, *, progress: Progress = _print, deploy: bool = True,
                   poll_s: float = 1.0) -> dict[str, Any]:
    """Take experiment ``name`` from its samples to a deployment (or to the best checkpoint,
    with ``deploy=False`` or ``deploy: manual``) through the instance; the summary."""
    experiment = load_experiment(name)
    # Before anything is submitted: a recipe whose weights are not here fails in one line.
    require_base_model(experiment.recipe)
    inst = instance()
    if not inst.has_dynamic_partition("experiments", experiment.name):
        inst.add_dynamic_partitions("experiments", [experiment.name])
    started = time.monotonic()
    # Queued before the daemon starts (below): its experiments sensor then sees this file's
    # chain as started and does not start a second one.
    tags = {"factory/experiment": experiment.name, "factory/trigger": "factory run",
            "factory/reason": "factory run", "factory/experiment-sha": experiment_sha(experiment)}
    if not deploy:
        tags["factory/deploy"] = "manual"
    # `dagster job launch` in a process of its own (seconds: Dagster and the definitions) while
    # the code server boots; the daemon starts once it returned, and its sensors see the chain.
    with ThreadPoolExecutor(1) as pool:
        queued = pool.submit(submit, "start_experiment_job", experiment.name, tags)
        with ensure_daemon(inst, progress, before_daemon=queued.result):
            start = queued.result()
            progress(f"[{experiment.name}] chain {start}: dataset -> plan -> training (evals "
                     f"as checkpoints land) -> best checkpoint"
                     + (" -> deployment" if deploy and experiment.deploy == "auto" else ""))
            try:
                outcome = follow(inst, start, progress, poll_s=poll_s)
            except KeyboardInterrupt:
                interrupt_handled()
                progress("  interrupted: cancelling the chain ...")

                with signals_ignored():  # a second Ctrl-C must not leave the trainer running
                    _stop(inst, start, progress)
                raise
    progress(f"[{experiment.name}] {outcome}")
    out = summary(Lake(), experiment.name)
    if out["best_score_interval"]:
        progress(f"[{experiment.name}] best checkpoint: step {out['best_step']} of run "
                 f"{out['run_id']}, score {out['best_score_interval']}; base model "
                 f"{out['base_score_interval'] or '-'}"
                 + (" (RECALL ONLY: the eval set shares the traffic's phrasings)"
                    if out["eval_split"] == RECALL else ""))
    if out["eval_split"] == RECALL:
        progress(f"[{experiment.name}] eval scores measure {out['eval_split_reason']}")
    out["seconds"] = round(time.monotonic() - started, 1)
    out["chain"] = start
    return out


def summary(lake: Lake, name: str) -> dict[str, Any]:
    """Base score, best score and step, the curve PNG, the endpoint, from the lake; the two
    scores also as ``format_score`` prints them (``*_interval``: mean, 95% interval, count);
    how the dataset's eval set was held out (``eval_split``: ``phrasing`` or ``recall only``)."""
    settings = get_settings()
    best = lake.sql("SELECT * FROM best_checkpoints WHERE experiment = ? "
                    "ORDER BY selected_at DESC LIMIT 1", [name]).to_pylist() \
        if lake.exists("best_checkpoints") else []
    out: dict[str, Any] = {"experiment": name, "base_score": None, "best_score": None,
                           "base_score_interval": None, "best_score_interval": None,
                           "best_step": None, "run_id": None, "curve": [], "curve_png": None,
                           "endpoint": None, "model": route_model(name),
                           "factory_home": str(settings.home), **read_eval_split(lake, name)}
    if best:
        row = best[0]
        out.update(base_score=row["base_score"], best_score=row["mean_score"],
                   best_score_interval=format_score(StepScore.from_row(row)),
                   best_step=row["step"], run_id=row["run_id"])
        curves = read_curves(lake, row["run_id"])
        if curves.samples.get(0):
            # The base model's answers, judged in the best run's first eval.
            out["base_score_interval"] = format_score(curves.summary(0))
        out["curve"] = [[int(s), float(v)] for s, v in curves.scores]
        if curves.scores:
            png = plot_png(curves, settings.home / "reports" / row["run_id"] / "curve.png")
            out["curve_png"] = str(png)
    live = Deployer(lake).live(name)
    if live is not None:
        out["endpoint"] = live.endpoint
        out["version"] = live.version
    out["at"] = datetime.now(UTC).isoformat(timespec="seconds")
    return out


def terminal_plot(points: list[list[float]] | list[tuple[int, float]], *, width: int = 50,
                  height: int = 10, label: str = "score") -> str:
    """A small text plot of (step, value) points: y from 0 to 1, x by step."""
    if not points:
        return "(no points)"
    steps = [float(p[0]) for p in points]
    lo_x, hi_x = min(steps), max(steps)
    grid = [[" "] * width for _ in range(height)]
    for step, value in points:
        x = 0 if hi_x == lo_x else round((float(step) - lo_x) / (hi_x - lo_x) * (width - 1))
        y = min(height - 1, max(0, round(float(value) * (height - 1))))
        grid[height - 1 - y][x] = "*"
    lines = [f"{label}"]
    for i, row in enumerate(grid):
        tick = f"{1 - i / (height - 1):4.2f}" if i in (0, height - 1) else "    "
        lines.append(f"{tick} |{''.join(row)}")
    lines.append("     +" + "-" * width)
    lines.append(f"      step {int(lo_x)}{' ' * max(1, width - 12 - len(str(int(hi_x))))}"
                 f"{int(hi_x)}")
    return "\n".join(lines)


