"""One experiment from its samples to a live endpoint, through Dagster, in process.

``run_experiment`` materializes, on the persistent instance (so the UI shows every run with
its lineage): ``dataset`` + ``dataset_profile`` and ``rubric`` (partition: the experiment),
``training_plan`` for each sweep point (partition: the run key), then ``training_run`` on the
plan's trainer job; while it trains, ``checkpoint_sensor`` is evaluated and each run request it
makes (a new verified checkpoint) is materialized as ``checkpoint_evals``, so the score curve
fills in mid-training. Then ``best_checkpoint`` and ``deployment``. ``summary`` reads the
result back from the lake.

Ctrl-C stops what was started: the training run is cancelled through the control plane (its
trainer checkpoints and exits, the run is recorded ``cancelled``) and ``factory run`` exits 130.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from factory.deploy.process import signals_ignored, stop_group
from factory.errors import FactoryError
from factory.lake import Lake

Progress = Callable[[str], None]
CANCEL_WAIT_S = 90.0
"""How long an interrupted ``training_run`` process gets to cancel its run (the trainer's
checkpoint on SIGTERM plus the provider's grace before SIGKILL) before it is killed."""


def _print(line: str) -> None:
    print(line, flush=True)


def _ensure_partitions(inst: Any, name: str, keys: list[str]) -> None:
    for defn, wanted in (("experiments", [name]), ("runs", keys)):
        missing = [k for k in wanted if not inst.has_dynamic_partition(defn, k)]
        if missing:
            inst.add_dynamic_partitions(defn, missing)


def _step(progress: Progress, label: str, selection: list[str], **kwargs: Any) -> Any:
    from factory.runner import materialize

    started = time.monotonic()
    progress(f"  {label}: materializing {', '.join(selection)} ...")
    result = materialize(selection, raise_on_error=False, **kwargs)
    if not result.success:
        if _interrupted(result):
            raise KeyboardInterrupt
        raise FactoryError(f"{label} failed: {_failure(result)}")
    progress(f"  {label}: done in {time.monotonic() - started:.1f} s")
    return result


def _interrupted(result: Any) -> bool:
    """The run failed because it was interrupted (Ctrl-C): Dagster reports the interrupt as a
    step failure instead of raising it."""
    for event in result.all_events:
        if event.event_type_value == "STEP_FAILURE":
            error = getattr(event.event_specific_data, "error", None)
            if getattr(error, "cls_name", "") == "DagsterExecutionInterruptedError":
                return True
    return False


def _failure(result: Any) -> str:
    for event in result.all_events:
        if event.event_type_value in ("STEP_FAILURE", "ASSET_CHECK_EVALUATION"):
            data = event.event_specific_data
            error = getattr(data, "error", None)
            if error is not None:
                while getattr(error, "cause", None) is not None:
                    error = error.cause
                text = str(getattr(error, "message", error)).strip()
                return text.removeprefix(
                    "dagster._core.definitions.events.Failure: ").splitlines()[0]
            if getattr(data, "passed", True) is False:
                return f"blocking check {data.check_name} failed"
    return "see the run in the UI"


def _train(run_key: str, evals: _Evals, progress: Progress, *, poll_s: float) -> None:
    """``training_run`` in its own process while this one evaluates checkpoints as they land.

    Two in-process Dagster runs cannot overlap: each redirects the process's stdout/stderr
    into its compute log and restores them when it ends, so overlapping runs leave the output
    pointing at a log file. The training run therefore runs as ``python -m factory.deploy.loop``
    (a run on the same instance, as a UI launch would be), its output in ``training_run.log``.
    """
    from factory.experiments import run_id
    from factory.settings import get_settings

    log = get_settings().runs / run_id(run_key) / "training_run.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "factory.deploy.loop", "train", run_key,
           "--poll-s", str(min(poll_s, 2.0))]
    started, since = time.monotonic(), time.time()
    progress(f"  training_run: running (log {log})")
    offset = log.stat().st_size if log.exists() else 0  # the log is appended to per run key
    with open(log, "ab") as out:
        # Its own session: a Ctrl-C in the terminal reaches this process only, which then
        # stops the training run in order (below) instead of killing it half way.
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            while proc.poll() is None:
                evals.tick()
                try:
                    proc.wait(timeout=poll_s)
                except subprocess.TimeoutExpired:
                    pass
        except BaseException as exc:
            why = "interrupted" if isinstance(exc, KeyboardInterrupt) else "stopping"
            progress(f"  training_run: {why}; cancelling the training run ...")
            with signals_ignored():  # a second Ctrl-C must not leave the trainer running
                cancelled = stop_training(proc, run_key, since=since)
            progress(f"  training_run: cancelled {', '.join(cancelled) or 'nothing'}")
            raise
    if proc.returncode != 0:
        text = log.read_bytes()[offset:].decode("utf-8", "replace")
        # main() below prints the run's failure reason as its last word: lead with it.
        said = [line for line in text.splitlines() if line.startswith("training_run failed: ")]
        if said:
            raise FactoryError(f"{said[-1]} (log {log})")
        raise FactoryError(f"training_run failed (exit {proc.returncode}); log {log}:\n"
                           f"{text[-2000:]}")
    progress(f"  training_run: done in {time.monotonic() - started:.1f} s")


def stop_training(proc: subprocess.Popen[bytes], run_key: str, *, since: float,
                  wait_s: float = CANCEL_WAIT_S) -> list[str]:
    """Stop the ``training_run`` process ``proc`` and the runs of ``run_key`` it submitted
    (active runs of the key submitted at or after ``since``, a wall-clock time).

    ``proc`` gets SIGINT, which its ``training_run`` asset answers by cancelling the run it
    submitted (the trainer is SIGTERMed, checkpoints and exits) before it exits itself. Such
    runs still active afterwards (``proc`` died before it could) are cancelled here, their
    trainers stopped by pid. Returns the ids of the runs cancelled (by either).
    """
    from factory.experiments import run_id

    before = {r.run_id for r in _active_runs(run_id(run_key), since)}
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            stop_group(proc.pid, timeout_s=10)
            proc.wait(timeout=30)
    for run in _active_runs(run_id(run_key), since):
        cancel_orphan(run.run_id, reason="interrupted; its training_run process was gone")
    return sorted(before)


def _plane() -> Any:
    from factory.definitions import defs

    return (defs.resources or {})["provider"].plane(Lake())


def _active_runs(prefix: str, since: float) -> list[Any]:
    from factory.control.loop import RUN_ACTIVE

    lake = Lake()
    if not lake.exists("training_runs"):
        return []
    # Trainer run ids of a run key are "<run_id(key)[:100]>-<plan stamp>" (job_from_plan).
    return [r for r in _plane().runs().values()
            if r.status in RUN_ACTIVE and r.run_id.startswith(prefix[:100] + "-")
            and r.submitted_at >= since]


def cancel_orphan(run_id: str, *, reason: str) -> None:
    """Cancel ``run_id`` from a process that did not launch its trainers: the run is marked
    cancelled, its provider stops each live local trainer by its recorded pid (after checking
    the pid still runs that segment's job: a recycled pid is left alone), and this waits up to
    30 s for them to be gone."""
    from factory.control.loop import cancel_run

    cancel_run(_plane(), run_id, reason=reason, wait_s=30)


class _Evals:
    """Evaluates ``checkpoint_sensor`` and materializes the ``checkpoint_evals`` it requests."""

    def __init__(self, inst: Any, progress: Progress) -> None:
        from factory.definitions import defs

        self.inst = inst
        self.progress = progress
        self.sensor = next(s for s in defs.sensors or [] if s.name == "checkpoint_sensor")
        self.resources = {"lake": (defs.resources or {})["lake"]}
        self.cursor: str | None = None
        self.done: set[str] = set()

    def tick(self) -> int:
        import dagster as dg

        with dg.build_sensor_context(instance=self.inst, cursor=self.cursor,
                                     resources=self.resources) as context:
            result = self.sensor(context)
        if not isinstance(result, dg.SensorResult):
            return 0
        self.cursor = result.cursor or self.cursor
        num = 0
        for request in result.run_requests or []:
            key = request.partition_key
            if key is None or request.run_key in self.done:
                continue
            self.done.add(str(request.run_key))
            res = _step(self.progress, f"checkpoint_evals {key}", ["checkpoint_evals"],
                        partition_key=key, tags=dict(request.tags))
            mats = res.asset_materializations_for_node("checkpoint_evals")
            if mats:
                score = mats[0].metadata["mean_score"].value
                self.progress(f"    step {key.rsplit(':', 1)[1]}: mean score {score:.3f}")
            num += 1
        return num


def run_experiment(name: str, *, progress: Progress = _print, deploy: bool = True,
                   poll_s: float = 5.0) -> dict[str, Any]:
    """Materialize everything from the dataset to the deployment for experiment ``name``."""
    from factory.experiments import load_experiment, run_keys
    from factory.runner import instance

    experiment = load_experiment(name)
    keys = run_keys(experiment)
    inst = instance()
    _ensure_partitions(inst, experiment.name, keys)
    lake = Lake()
    started = time.monotonic()
    progress(f"[1/5] dataset for {experiment.name}")
    _step(progress, "dataset", ["dataset", "dataset_profile"], partition_key=experiment.name)
    _step(progress, "rubric", ["rubric"], partition_key=experiment.name)
    evals = _Evals(inst, progress)
    for i, key in enumerate(keys, 1):
        progress(f"[2/5] plan {key} ({i}/{len(keys)})")
        _step(progress, "plan", ["training_plan"], partition_key=key)
        progress(f"[3/5] training {key}; checkpoint_sensor fires evals as checkpoints land")
        _train(key, evals, progress, poll_s=poll_s)
        evals.tick()  # the last checkpoint lands as the run ends
    progress("[4/5] best checkpoint")
    _step(progress, "best_checkpoint", ["best_checkpoint"], partition_key=experiment.name)
    if deploy:
        progress("[5/5] deployment")
        _step(progress, "deployment", ["deployment"], partition_key=experiment.name)
    out = summary(lake, experiment.name)
    out["seconds"] = round(time.monotonic() - started, 1)
    return out


def summary(lake: Lake, name: str) -> dict[str, Any]:
    """Base score, best score and step, the curve PNG, the endpoint, from the lake."""
    from factory.deploy.deployer import Deployer, route_model
    from factory.evals.report import plot_png, read_curves
    from factory.settings import get_settings

    settings = get_settings()
    best = lake.sql("SELECT * FROM best_checkpoints WHERE experiment = ? "
                    "ORDER BY selected_at DESC LIMIT 1", [name]).to_pylist() \
        if lake.exists("best_checkpoints") else []
    out: dict[str, Any] = {"experiment": name, "base_score": None, "best_score": None,
                           "best_step": None, "run_id": None, "curve": [], "curve_png": None,
                           "endpoint": None, "model": route_model(name),
                           "factory_home": str(settings.home)}
    if best:
        row = best[0]
        out.update(base_score=row["base_score"], best_score=row["mean_score"],
                   best_step=row["step"], run_id=row["run_id"])
        curves = read_curves(lake, row["run_id"])
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


def main(argv: list[str] | None = None) -> int:
    """``python -m factory.deploy.loop train RUN_KEY``: one ``training_run`` run."""
    parser = argparse.ArgumentParser(prog="python -m factory.deploy.loop")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="materialize training_run for a planned run key")
    p.add_argument("run_key")
    p.add_argument("--poll-s", type=float, default=2.0)
    args = parser.parse_args(argv)
    from factory.runner import materialize

    result = materialize(["training_run"], partition_key=args.run_key, raise_on_error=False,
                         run_config={"ops": {"training_run": {"config": {
                             "poll_s": args.poll_s}}}})
    if not result.success:
        if _interrupted(result):
            print("training_run interrupted: its run was cancelled", file=sys.stderr)
            return 130
        print(f"training_run failed: {_failure(result)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
