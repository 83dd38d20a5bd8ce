"""The ``factory`` CLI contracts: JSON rows for scripts, one-line errors for user mistakes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from factory.app.cli import main
from factory.lake import Lake

BIN = Path(sys.executable).parent


def test_sql_json_contract_in_a_fresh_home(factory_home: Path) -> None:
    out = subprocess.run([str(BIN / "factory"), "sql", "select 1 as x", "--format", "json"],
                         capture_output=True, text=True, env=dict(os.environ), timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [{"x": 1}]
    assert out.stdout.strip() == '[{"x": 1}]'


def test_a_closed_pipe_ends_the_command_quietly(factory_home: Path) -> None:
    """``factory sql ... | head``: the reader goes away; no traceback, SIGPIPE's status."""
    with subprocess.Popen([str(BIN / "factory"), "sql", "select * from range(200000)",
                           "--format", "json"], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, env=dict(os.environ)) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        assert proc.stdout.read(10) == b'[{"range":'
        proc.stdout.close()  # what head does once it has its lines
        assert proc.wait(120) == 141  # 128 + SIGPIPE
        assert proc.stderr.read() == b""


def test_sql_over_lake_tables(factory_home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    Lake().append("raw_traces", [{"raw_trace_id": "a", "source": "upload", "tags": {"k": "v"}}])
    assert main(["sql", "select raw_trace_id, tags from raw_traces", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == [{"raw_trace_id": "a", "tags": {"k": "v"}}]


@pytest.mark.parametrize("argv, message", [
    (["sql", "select * from nowhere_at_all"], "SQL error"),
    (["sql", "selec 1"], "SQL error"),
    (["lineage", "no_such_table"], "unknown table 'no_such_table'"),
    (["lineage", "samples"], "has not been written yet"),
    (["lineage", "raw_traces@abc"], "snapshot must be an integer"),
])
def test_user_mistakes_are_one_line_and_non_zero(factory_home: Path, argv: list[str],
                                                 message: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    Lake().append("raw_traces", [{"raw_trace_id": "a"}])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert len(err.strip().splitlines()) == 1
    assert "Traceback" not in err


def test_tables_lists_rows_snapshot_and_writer(factory_home: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    lake = Lake()
    snap = lake.session(run_id="r1", asset_key="raw_traces").append(
        "raw_traces", [{"raw_trace_id": "a"}, {"raw_trace_id": "b"}])
    assert main(["tables", "--format", "json"]) == 0
    [row] = json.loads(capsys.readouterr().out)
    assert row["table"] == "raw_traces"
    assert row["rows"] == 2
    assert row["snapshot_id"] == snap
    assert row["last_writer"] == "raw_traces"
    assert row["run_id"] == "r1"
