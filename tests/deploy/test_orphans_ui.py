"""SIGKILL of ``factory ui`` mid-run leaves nothing: its ``dagster dev`` (webserver, daemon, code
server, the run worker of the training run ``factory run`` submitted to it) is stopped by the UI's
lifeline, the run with it, and ``factory run`` stops following a chain no daemon moves. In a file
of its own so that the suite's workers can run it beside ``test_orphans.py``."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from factory.lake import Lake
from tests.deploy.conftest import ROOT
from tests.deploy.dagster_ui import free_port
from tests.deploy.test_orphans import (
    FACTORY,
    _factory_run,
    _no_run_running,
    _nothing_left,
    _trainer_started,
    started,
)
from tests.waiting import wait_until

pytestmark = pytest.mark.slow
__all__ = ["started"]  # a fixture


@pytest.mark.timeout(600)
def test_sigkill_of_factory_ui_leaves_nothing(home: Path,
                                              started: list[subprocess.Popen[bytes]]) -> None:
    """``factory ui``'s daemon runs what ``factory run`` submits; killing the UI stops its
    ``dagster dev`` (webserver, daemon, code server, run worker), and the run with it."""
    from factory.app.instance import daemon_running, instance

    lake = Lake()
    ui = subprocess.Popen([FACTORY, "ui", "--port", str(free_port())], cwd=ROOT,
                          env=dict(os.environ), stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL, start_new_session=True)
    started.append(ui)
    wait_until(lambda: daemon_running(instance()), timeout_s=240, what="the UI's daemon")
    proc = _factory_run(home, started)
    run_id, trainer = _trainer_started(lake, proc, home)
    ui.kill()
    ui.wait()
    wait_until(lambda: proc.poll() is not None, timeout_s=120, what="factory run to exit")
    _nothing_left(home)
    _no_run_running(lake)
