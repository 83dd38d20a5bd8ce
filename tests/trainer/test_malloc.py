"""``python -m factory.trainer`` runs under jemalloc when it is installed (``make sysdeps``
installs Debian's ``libjemalloc2``): glibc's malloc fragments a CPU run's heap, so the same step
slows over a run. ``FACTORY_TRAINER_MALLOC=system`` keeps glibc's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from factory.trainer.__main__ import JEMALLOC
from factory.trainer.config import TrainerJob
from factory.trainer.webhooks import read_events
from tests.conftest import ROOT


def _started(job_path: Path, cwd: Path, **env: str) -> dict[str, object]:
    full = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **env}
    full.pop("LD_PRELOAD", None)
    proc = subprocess.run([sys.executable, "-m", "factory.trainer", "--job", str(job_path)],
                          cwd=cwd, env=full, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [started] = [e for e in read_events(TrainerJob.from_json(job_path).events_path)
                 if e["type"] == "started"]
    return started


@pytest.mark.parametrize("choice", ["jemalloc", "system"])
def test_the_trainer_runs_under_the_allocator_asked_for(make_job, tmp_path: Path,
                                                        choice: str) -> None:
    assert any(os.path.exists(p) for p in JEMALLOC), \
        "jemalloc is not installed: `make sysdeps` installs Debian's libjemalloc2"
    job = make_job(f"malloc-{choice}", plan={"num_steps": 2})
    env = {"FACTORY_TRAINER_MALLOC": choice} if choice == "system" else {}
    started = _started(job, tmp_path, **env)
    assert started["malloc"] == choice
