"""Ctrl-C on ``factory run`` stops what it started: the trainer the control plane launched is
stopped, the run is recorded ``cancelled``, and the command exits 130; SIGTERM (``kill``,
``timeout``, a CI job's cancel) does the same and exits 143. A real ``factory run`` process on
the tiny model gets the signal once its trainer reports ``started``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from factory.lake import Lake
from factory.process import is_alive
from tests.deploy.conftest import ROOT
from tests.waiting import wait_until

pytestmark = pytest.mark.slow


def _latest(lake: Lake, table: str, key: str) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for row in sorted(lake.read(table).to_pylist(), key=lambda r: r["updated_at"]):
        out[row[key]] = row
    return out


def _started_trainer(lake: Lake) -> tuple[str, int] | None:
    """(run id, trainer pid) once a trainer has reported ``started``."""
    if not lake.exists("training_events") or not lake.exists("training_segments"):
        return None
    started = {r["segment_id"] for r in lake.read("training_events").to_pylist()
               if r["type"] == "started"}
    for seg in _latest(lake, "training_segments", "segment_id").values():
        pid = json.loads(seg["handle"])["info"].get("pid")
        if seg["segment_id"] in started and pid and is_alive(pid):
            return seg["run_id"], int(pid)
    return None


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)],
                         ids=["ctrl_c", "sigterm"])
def test_an_interrupt_cancels_the_training_run_and_exits(home: Path, sig: int,
                                                         code: int) -> None:
    lake = Lake()
    out_path, err_path = home.parent / "run.out", home.parent / "run.err"
    with open(out_path, "w") as out_f, open(err_path, "w") as err_f:
        proc = subprocess.Popen([str(Path(sys.executable).parent / "factory"), "run", "exp"],
                                env=dict(os.environ), cwd=ROOT, stdout=out_f, stderr=err_f)

    def trainer_started() -> tuple[str, int] | None:
        if proc.poll() is not None:
            raise AssertionError(f"factory run exited {proc.returncode} before training:\n"
                                 f"{err_path.read_text()[-3000:]}")
        return _started_trainer(lake)

    try:
        run_id, pid = wait_until(trainer_started, timeout_s=400, what="the trainer to start")
        proc.send_signal(sig)
        proc.wait(timeout=150)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out, err = out_path.read_text(), err_path.read_text()
    assert proc.returncode == code, err[-3000:]
    assert "cancelled" in err and run_id in err
    assert out == ""  # no summary line: the run did not finish
    assert not is_alive(pid)  # the trainer is gone, not orphaned
    run = _latest(lake, "training_runs", "run_id")[run_id]
    assert (run["status"], run["reason"]) == ("cancelled", "interrupted")
    # As the control plane reads them (a sensor's tick may append a stale live row after the
    # cancel ended a segment; the plane's reading keeps ended final).
    from factory.app.instance import control_plane

    segments = control_plane().segments(run_id)
    assert segments and all(s.status == "ended" for s in segments)


def test_a_trainer_left_by_a_dead_training_process_is_stopped(
        factory_home: Path, tmp_path: Path) -> None:
    """The fallback of ``factory run``'s Ctrl-C: a training_run process that died on the
    interrupt without cancelling its run leaves a live trainer; ``cancel_orphan`` cancels the
    run and stops the trainer by the recorded pid, once the pid is checked to still run that
    segment's job. Another run is left alone."""
    import time

    from factory.app.instance import control_plane
    from factory.app.loop import cancel_orphan
    from factory.control.base import Handle
    from factory.control.plane import Segment
    from factory.experiments import run_id as run_id_for_key
    from factory.trainer.config import TrainerJob
    from tests.control.conftest import write_data

    data = write_data(tmp_path / "data.parquet", n=4)
    plane = control_plane()

    def submit(suffix: str) -> TrainerJob:
        job = TrainerJob.from_dict({"run_id": f"{run_id_for_key('exp')}-{suffix}",
                             "plan": {"base_model": "m", "max_seq_len": 64,
                                      "micro_batch_size": 1, "grad_accum_steps": 1,
                                      "learning_rate": 1e-3, "num_steps": 2, "lora_rank": 4,
                                      "lora_alpha": 8, "checkpoint_every_steps": 2},
                             "data_files": [str(data)],
                             "output_dir": str(tmp_path / suffix)})
        plane.submit(job, experiment="exp")
        return job

    other = submit("20260101T000000")
    job = submit("20260102T000000")
    job_file = tmp_path / "job.json"
    # Stands in for the trainer: a process whose command line names the segment's job file.
    trainer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)",
                                "--job", str(job_file)], start_new_session=True)
    try:
        now = time.time()
        plane._write_segments([Segment(
            segment_id=f"{job.run_id}-s000", run_id=job.run_id, seq=0, provider="local",
            handle=Handle(provider="local", handle_id="elsewhere", launched_at=now,
                          info={"pid": trainer.pid, "job": str(job_file)}),
            status="running", launched_at=now, deadline=None, resume_from=None,
            resume_step=0)])
        cancel_orphan(job.run_id, reason="interrupted; its training_run process was gone")
        assert trainer.wait(timeout=30) == -signal.SIGTERM
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    runs = control_plane().runs()
    assert runs[job.run_id].status == "cancelled"
    assert runs[other.run_id].status == "queued"
    [seg] = control_plane().segments(job.run_id)
    assert (seg.status, seg.end_reason) == ("ended", "stopped")
