"""The trainer's held-out loss: measured on the eval split at every eval step and at every
checkpoint it saves (the final one included), so each checkpoint the evals judge has one for
``best_checkpoint`` to rank equal judge scores by."""

from __future__ import annotations

import math
from pathlib import Path

from factory.trainer.config import TrainerJob
from factory.trainer.train import ExitCode, run_job
from factory.trainer.webhooks import read_events
from tests.trainer.conftest import make_samples, write_parquet


def test_held_out_loss_at_each_eval_step_and_each_saved_checkpoint(make_job,
                                                                   tmp_path: Path) -> None:
    evals = write_parquet(tmp_path / "eval.parquet", make_samples(6, seed=5))
    for log_every in (1, 100):  # in the step's progress event, or in an event of its own
        job = TrainerJob.from_json(make_job(
            f"ev{log_every}", eval_data_files=[str(evals)],
            plan={"num_steps": 7, "eval_every_steps": 2, "checkpoint_every_steps": 3,
                  "log_every_steps": log_every}))
        assert run_job(job) == ExitCode.FINISHED
        events = read_events(job.events_path)
        losses = {e["step"]: e["eval_loss"] for e in events
                  if e["type"] == "progress" and "eval_loss" in e}
        saved = {e["step"] for e in events if e["type"] == "checkpoint"}
        assert saved == {3, 6, 7}
        assert set(losses) == {2, 4, 6} | saved, log_every
        assert all(math.isfinite(v) and v > 0 for v in losses.values())
        # with the seconds the pass took, which a pace from event times leaves out
        took = [e["eval_loss_s"] for e in events if e["type"] == "progress" and "eval_loss" in e]
        assert len(took) == len(losses) and all(0 < s < 60 for s in took)
