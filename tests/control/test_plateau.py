"""The plateau stop on a tiny run: a real trainer on the local provider checkpoints every two
steps; each checkpoint is scored as it lands (the same score on every sample, standing in for the
judge, which needs an inference server per checkpoint), and ``record_early_stop`` (what
``checkpoint_evals`` calls after scoring) decides. Once three checkpoints fail to beat the best
before them by more than its bootstrap interval, the plane stops the run, which ends
``stopped`` long before its 400 steps, its stop checkpoint in the lake and the rule's numbers
in ``early_stops``."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from factory.control.plane import ControlPlane
from factory.evals.report import record_early_stop
from factory.lake import Lake
from factory.resources.providers import LocalConfig, ProviderResource
from tests.control.conftest import ONE_THREAD
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

SAMPLES = ("a", "b", "c", "d", "e", "f")


def _score(lake: Lake, run_id: str, step: int, score: float) -> None:
    lake.append("eval_scores", [{
        "run_id": run_id, "experiment": "demo", "step": step, "kind": "checkpoint",
        "sample_id": s, "score": score, "status": "ok", "rubric_version": "r1",
        "evaluated_at": datetime.now(UTC)} for s in SAMPLES])


def test_a_run_whose_score_plateaus_stops_early(factory_home, make_job) -> None:
    run_id = "plateau"
    job = make_job(run_id, num_steps=400, checkpoint_every_steps=2,
                   debug={"sleep_per_step_s": 0.2})
    provider = ProviderResource(local=LocalConfig(env=ONE_THREAD), backoff_s=0)
    lake = Lake()
    plane = provider.plane(lake)
    assert isinstance(plane, ControlPlane)
    plane.submit(job, experiment="demo")
    scored: list[int] = []
    stops = []

    def stopped() -> bool:
        plane.tick()
        if lake.exists("checkpoints"):
            steps = sorted({int(r["step"]) for r in lake.read("checkpoints").to_pylist()
                            if r["run_id"] == run_id and r["verified"]})
            for step in steps:
                if step not in scored:
                    # Rising at first, then flat: the scores of a run that has learned its task.
                    _score(lake, run_id, step, min(0.9, 0.3 * (len(scored) + 1)))
                    scored.append(step)
                    _, stop = record_early_stop(lake, run_id, "demo")
                    if stop is not None:
                        stops.append(stop)
        return plane.runs()[run_id].status not in ("queued", "running")

    wait_until(stopped, timeout_s=600, what="the run to end")
    run = plane.runs()[run_id]
    assert run.status == "stopped" and "plateau" in run.reason
    stop = stops[0]
    assert stop.rule == "plateau"
    # 0.3, 0.6, 0.9, then three at 0.9: stopped at the third checkpoint after the peak.
    assert stop.peak_step == scored[2] and stop.last_step == scored[5]
    rows = [r for r in lake.read("early_stops").to_pylist() if r["run_id"] == run_id]
    assert rows[0]["peak_step"] == stop.peak_step and "plateau" in rows[0]["reason"]
    last = max(s.last_step or 0 for s in plane.segments(run_id))
    assert last < 400
