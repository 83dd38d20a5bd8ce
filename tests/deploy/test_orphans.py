"""SIGKILL leaves nothing behind: ``factory run``, ``factory ui``, ``factory serve`` or the Dagster
run worker of a training run, killed outright mid-run, leave no process they started running
within 30 s, and no run recorded as running in the lake or in Dagster. Real processes on the
tiny model: ``factory run`` with its own daemon, ``factory ui``'s ``dagster dev``, the gateway.

The processes of a test's factory are those whose environment names its ``FACTORY_HOME``
(every process the factory starts inherits it)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from factory.lake import Lake
from tests.deploy.conftest import ROOT
from tests.deploy.dagster_ui import free_port
from tests.deploy.test_interrupt import _latest, _started_trainer
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

GONE_S = 30.0
"""The issue's bound: nothing the killed process started runs this long after it."""
FACTORY = str(Path(sys.executable).parent / "factory")


def processes_of(home: Path) -> dict[int, str]:
    """Every process but this one whose environment names ``home`` as its FACTORY_HOME: pid ->
    command line."""
    wanted = f"FACTORY_HOME={home}".encode()
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if wanted not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out[int(entry.name)] = cmd
    return out


def _nothing_left(home: Path) -> None:
    """Within ``GONE_S`` of the kill no process of ``home`` runs (polled: the end of a process
    sends no event this test could wait on)."""
    start = time.monotonic()
    while processes_of(home) and time.monotonic() - start < GONE_S:
        time.sleep(0.5)
    assert not processes_of(home), (f"still running {time.monotonic() - start:.0f} s after "
                                    f"the kill: {processes_of(home)}")


def _no_run_running(lake: Lake) -> None:
    """Neither the lake nor Dagster records a run as running (the reconcile after the
    lifeline's stop may take a few seconds more than the processes' end)."""
    import dagster as dg

    from factory.app.instance import instance

    def ended() -> bool:
        runs = _latest(lake, "training_runs", "run_id")
        return all(r["status"] not in ("queued", "running") for r in runs.values())

    wait_until(ended, timeout_s=60, what="the lake's training runs to end")
    unfinished = [dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.STARTING,
                  dg.DagsterRunStatus.CANCELING]
    wait_until(lambda: not instance().get_runs(filters=dg.RunsFilter(statuses=unfinished)),
               timeout_s=60, what="no Dagster run left started")


@pytest.fixture()
def started() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes a test starts; any still running at its end is killed."""
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def _factory_run(home: Path, started: list[subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
    log = open(home.parent / "run.log", "ab")  # noqa: SIM115 - closed with the test's tmp dir
    proc = subprocess.Popen([FACTORY, "run", "exp"], env=dict(os.environ), cwd=ROOT,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    started.append(proc)
    return proc


def _trainer_started(lake: Lake, proc: subprocess.Popen[bytes], home: Path) -> Any:
    def check() -> tuple[str, int] | None:
        if proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode} before training:\n"
                                 + (home.parent / "run.log").read_text()[-3000:])
        return _started_trainer(lake)

    return wait_until(check, timeout_s=400, what="the trainer to start")


@pytest.mark.timeout(600)
def test_sigkill_of_factory_run_leaves_nothing(home: Path,
                                               started: list[subprocess.Popen[bytes]]) -> None:
    lake = Lake()
    proc = _factory_run(home, started)
    run_id, trainer = _trainer_started(lake, proc, home)
    assert len(processes_of(home)) >= 4  # factory run, its daemon, code server, run worker, ...
    proc.kill()
    proc.wait()
    _nothing_left(home)
    _no_run_running(lake)
    run = _latest(lake, "training_runs", "run_id")[run_id]
    assert run["status"] in ("cancelled", "failed"), run


@pytest.mark.timeout(600)
def test_sigkill_of_the_run_worker_ends_its_trainer_for_good(
        home: Path, started: list[subprocess.Popen[bytes]]) -> None:
    lake = Lake()
    proc = _factory_run(home, started)
    run_id, trainer = _trainer_started(lake, proc, home)
    row = _latest(lake, "training_runs", "run_id")[run_id]
    owner = json.loads(row["job"])["owner"]
    worker = int(owner.split(":")[1])
    assert worker in processes_of(home) and worker != proc.pid
    os.kill(worker, signal.SIGKILL)
    # The trainer sees its owner gone at its next step: a checkpoint, then the end of the run
    # (never resumed); factory run sees its Dagster run fail and stops the rest.
    wait_until(lambda: proc.poll() is not None, timeout_s=120, what="factory run to exit")
    assert proc.returncode != 0
    _nothing_left(home)
    _no_run_running(lake)
    run = _latest(lake, "training_runs", "run_id")[run_id]
    assert run["status"] == "failed" and "owner gone" in run["reason"], run
    segs = _latest(lake, "training_segments", "segment_id")
    assert len(segs) == 1  # not relaunched
    events = [r for r in lake.read("training_events").to_pylist() if r["run_id"] == run_id]
    types = [e["type"] for e in sorted(events, key=lambda e: (e["event_time"], e["seq"]))]
    assert "checkpoint" in types  # it kept what it had learned


@pytest.mark.timeout(300)
def test_sigkill_of_factory_serve_leaves_nothing(home: Path,
                                                 started: list[subprocess.Popen[bytes]]) -> None:
    import httpx

    port = free_port()
    serve = subprocess.Popen([FACTORY, "serve", "--port", str(port)], cwd=ROOT,
                             env=dict(os.environ), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    started.append(serve)

    def up() -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(up, timeout_s=120, what="the gateway")
    serve.kill()
    serve.wait()
    _nothing_left(home)
