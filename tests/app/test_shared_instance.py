"""One Dagster instance over several nodes: a daemon started from one ``FACTORY_HOME`` runs what a
client on another home submits, through the instance storage both keep in PostgreSQL, and the
run's writes land in the shared catalog, where a third home reads them with their lineage."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from factory.app.instance import CODE_LOCATION, daemon_running, ensure_daemon, instance
from factory.lake import Lake
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

DAEMON_NODE = """
import sys
from factory.app.instance import ensure_daemon, instance
with ensure_daemon(instance()) as started:
    print("started" if started else "reused", flush=True)
    sys.stdin.read()  # until the test closes it
"""


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


def test_a_daemon_on_one_node_runs_what_another_node_submits(
        shared_factory: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import dagster as dg

    calls = shared_factory / "incoming" / "calls.jsonl"
    calls.parent.mkdir(parents=True)
    _calls(calls, 20)
    daemon_home, client_home = tmp_path / "node-daemon", tmp_path / "node-client"
    daemon = subprocess.Popen([sys.executable, "-c", DAEMON_NODE], env=_node(daemon_home),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert daemon.stdout is not None
        assert daemon.stdout.readline().strip() == "started"

        # The client node: a home of its own, the same database. It sees the other node's
        # daemon, so `factory run` there would start none of its own.
        for key, value in _node(client_home).items():
            monkeypatch.setenv(key, value)
        inst = instance()
        assert daemon_running(inst)
        with ensure_daemon(inst) as started:
            assert started is None
        config = {"ops": {"traces": {"config": {"paths": [str(calls)]}}}}
        out = subprocess.run([sys.executable, "-m", "dagster", "job", "launch", "-m",
                              CODE_LOCATION, "-j", "ingest_uploads_job", "--config-json",
                              json.dumps(config)], env=_node(client_home), capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        [run] = inst.get_runs(filters=dg.RunsFilter(job_name="ingest_uploads_job"))
        done = wait_until(lambda: (r := inst.get_run_by_id(run.run_id)) is not None
                          and r.is_finished and r, 300, "the run to finish")
        assert done.status == dg.DagsterRunStatus.SUCCESS
        # Launched by the daemon's node: its code server ran it, the client's home ran nothing.
        assert not (client_home / "logs").exists()
        assert (daemon_home / "logs" / "daemon.log").is_file()
    finally:
        if daemon.stdin is not None:
            daemon.stdin.close()
        daemon.wait(120)
    assert daemon.returncode == 0

    # A third node reads what the run wrote, stamped with the run's id.
    monkeypatch.setenv("FACTORY_HOME", str(tmp_path / "node-reader"))
    lake = Lake()
    assert sorted(lake.read("samples").column("raw_trace_id").to_pylist()) == sorted(
        lake.read("raw_traces").column("raw_trace_id").to_pylist())
    assert lake.read("samples").num_rows == 20
    assert lake.snapshot_info("samples")["run_id"] == run.run_id
