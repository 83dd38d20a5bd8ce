"""Process providers: the sandbox's hard wall-clock limit (SIGTERM, then SIGKILL after the
grace period), capacity accounting, and stop. Stand-in executables keep these fast."""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from pathlib import Path

import pytest

from factory.control.base import Handle
from factory.control.providers import LocalProvider, SandboxProvider
from tests.waiting import wait_until


def _script(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


def _segment(handle: Handle) -> Path:
    """The segment's folder: the stand-ins' working directory (the job file is there)."""
    return Path(handle.info["job"]).parent


def _trap_installed(handle: Handle) -> None:
    """The stand-in touches ``ready`` once its SIGTERM trap is installed."""
    wait_until((_segment(handle) / "ready").exists, timeout_s=10.0, what="the shell's trap")


def _wait(provider, handle, timeout_s: float = 10.0):
    def ended():
        st = provider.status(handle)
        return st if st.done else None

    return wait_until(ended, timeout_s=timeout_s, what="the trainer's end")


def test_sandbox_deadline_sigterm_then_sigkill(factory_home, make_job, tmp_path: Path) -> None:
    stubborn = _script(tmp_path, "stubborn", "trap '' TERM\nsleep 30 & wait\nsleep 30\n")
    polite = _script(tmp_path, "polite", "trap 'exit 75' TERM\nsleep 30 & wait\n")
    job = make_job("r")
    box = SandboxProvider(limit_s=1.0, grace_s=1.0, max_gpus=2, python=stubborn,
                          warm_start=False)
    t0 = time.monotonic()
    h = box.launch(job, segment_id="r-s000")
    assert h.deadline == pytest.approx(h.launched_at + 1.0)
    assert box.capacity() == 1
    st = _wait(box, h)
    assert st.exit_code == -9 and "SIGKILL" in st.detail  # ignored SIGTERM: killed
    assert 1.8 < time.monotonic() - t0 < 15.0  # limit + grace, then the kill (loaded cores)
    box2 = SandboxProvider(limit_s=1.0, grace_s=5.0, python=polite, warm_start=False)
    st = _wait(box2, box2.launch(job, segment_id="r-s001"))
    assert st.exit_code == 75  # the trainer's "preempted" exit on SIGTERM
    assert box.capacity() == 2


def test_local_stop_and_capacity(factory_home, make_job, tmp_path: Path) -> None:
    polite = _script(tmp_path, "polite", "trap 'exit 75' TERM\ntouch ready\nsleep 30 & wait\n")
    local = LocalProvider(max_gpus=1, python=polite)
    job = make_job("r")
    h = local.launch(job, segment_id="r-s000")
    assert local.capacity() == 0 and h.deadline is None
    with pytest.raises(ValueError, match="GPU slot"):
        local.launch(job, segment_id="r-s001", num_gpus=2)
    _trap_installed(h)
    local.stop(h)
    assert _wait(local, h).exit_code == 75
    assert local.capacity() == 1
    assert Path(h.info["job"]).is_file() and Path(h.info["log"]).exists()


def test_stop_by_pid_for_a_trainer_another_process_launched(factory_home, make_job,
                                                            tmp_path: Path) -> None:
    # SIGWINCH is a probe: the shell answers it by touching ``probed`` and waits on.
    polite = _script(tmp_path, "polite", "trap 'exit 75' TERM\ntrap 'touch probed' WINCH\n"
                     "touch ready\nwhile :; do sleep 30 & wait; done\n")
    launcher = LocalProvider(max_gpus=1, python=polite)
    h = launcher.launch(make_job("r"), segment_id="r-s000")
    _trap_installed(h)
    # A provider of another process knows the segment only by its handle (pid and job file).
    elsewhere = LocalProvider(name="elsewhere", python=polite)
    recycled = dataclasses.replace(h, info={**h.info, "job": str(tmp_path / "other.json")})
    elsewhere.stop(recycled)  # the pid does not run that job: left alone
    # Any SIGTERM of that stop was sent before it returned. The shell runs pending traps in
    # signal-number order, so with a SIGTERM (15) pending it exits before answering the probe
    # (SIGWINCH, 28): the answer shows that no SIGTERM came.
    os.kill(h.info["pid"], signal.SIGWINCH)

    def answered() -> bool:
        assert not launcher.status(h).done, "the trainer ended: the stop was not left alone"
        return (_segment(h) / "probed").exists()

    wait_until(answered, timeout_s=10.0, what="the answer to the probe")
    assert launcher.status(h).state == "running"
    elsewhere.stop(h)
    assert _wait(launcher, h).exit_code == 75
