"""One Dagster instance over several nodes, each with a ``FACTORY_HOME`` of its own and the
storage in one PostgreSQL: ``factory daemon`` on one node runs what is launched from the web UI
on another (``factory ui``, which starts the webserver alone there since the instance's daemon
already runs), and what the run writes lands in the shared catalog, where a third home reads it
with its lineage. A client on yet another home sees that daemon and starts none."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from factory.app.instance import daemon_running, ensure_daemon, instance
from factory.lake import Lake
from tests.deploy.dagster_ui import LAUNCH, factory_ui, gql
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _node(home: Path) -> dict[str, str]:
    return {**os.environ, "FACTORY_HOME": str(home), "DAGSTER_HOME": str(home / "dagster")}


def _calls(path: Path, n: int) -> None:
    with path.open("w") as out:
        for i in range(n):
            out.write(json.dumps({
                "request": {"model": "m", "messages": [{"role": "user", "content": f"q{i}"}]},
                "response": {"id": f"c{i}", "object": "chat.completion", "created": 1,
                             "model": "m", "choices": [{"index": 0, "finish_reason": "stop",
                                                        "message": {"role": "assistant",
                                                                    "content": "ok"}}]}}) + "\n")


def _commands_of(home: Path) -> list[str]:
    """The command lines of the live processes started with ``FACTORY_HOME=home``."""
    want = f"FACTORY_HOME={home}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if want in (entry / "environ").read_bytes().split(b"\0"):
                found.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            continue
    return found


def test_a_daemon_on_one_node_runs_what_the_ui_of_another_launches(
        shared_factory: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import dagster as dg

    calls = shared_factory / "incoming" / "calls.jsonl"
    calls.parent.mkdir(parents=True)
    _calls(calls, 20)
    daemon_home, web_home = tmp_path / "node-daemon", tmp_path / "node-web"
    daemon = subprocess.Popen([sys.executable, "-m", "factory.app.cli", "daemon"],
                              env=_node(daemon_home), stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        assert daemon.stdout is not None
        wait_until(lambda: "Ctrl-C stops both" in (daemon.stdout.readline() if daemon.stdout
                                                     else ""), 240, "factory daemon to start")
        # A second daemon for the same instance, from any node, is refused.
        again = subprocess.run([sys.executable, "-m", "factory.app.cli", "daemon"],
                               env=_node(tmp_path / "node-other"), capture_output=True,
                               text=True, timeout=120)
        assert again.returncode == 2 and "already running for this instance" in again.stderr

        with factory_ui(_node(web_home)) as ui:
            heads = [cmd.split()[1:4] for cmd in _commands_of(web_home)]
            assert ["-m", "dagster_webserver", "-m"] in heads
            assert ["-m", "dagster", "dev"] not in heads  # so no daemon of its own
            assert not [h for h in heads if h[1:2] == ["dagster._daemon"]]
            params = {"selector": {"repositoryLocationName": ui.location,
                                   "repositoryName": ui.repo, "jobName": "ingest_uploads_job"},
                      "runConfigData": {"ops": {"traces": {"config": {"paths": [str(calls)]}}}}}
            launched = gql(ui.url, LAUNCH, {"p": params})["launchRun"]
            assert launched["__typename"] == "LaunchRunSuccess", launched
            run_id = launched["run"]["runId"]

            # A client on a fourth home: same database, sees the daemon, starts none.
            for key, value in _node(tmp_path / "node-client").items():
                monkeypatch.setenv(key, value)
            inst = instance()
            assert daemon_running(inst)
            with ensure_daemon(inst) as started:
                assert started is None
            done = wait_until(lambda: (r := inst.get_run_by_id(run_id)) is not None
                              and r.is_finished and r, 300, "the run to finish")
            assert done.status == dg.DagsterRunStatus.SUCCESS
    finally:
        os.killpg(daemon.pid, signal.SIGTERM)
        daemon.wait(120)
        if daemon.stdout is not None:
            daemon.stdout.close()
    assert daemon.returncode == 130  # stopped as Ctrl-C stops it, its processes with it
    # Its lifeline ends the node's ownerless runs once the daemon is gone, then exits itself:
    # nothing of the node remains within 30 s.
    wait_until(lambda: _commands_of(daemon_home) == [], 30,
               "the daemon's lifeline to finish after it")

    # A third node reads what the run wrote, stamped with the run's id.
    monkeypatch.setenv("FACTORY_HOME", str(tmp_path / "node-reader"))
    lake = Lake()
    assert lake.read("samples").num_rows == 20
    assert sorted(lake.read("samples").column("raw_trace_id").to_pylist()) == sorted(
        lake.read("raw_traces").column("raw_trace_id").to_pylist())
    assert lake.snapshot_info("samples")["run_id"] == run_id
