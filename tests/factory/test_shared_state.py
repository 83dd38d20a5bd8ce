"""Shared state past one machine: the settings that split it, the lake's catalog and Dagster's
storage in a real PostgreSQL (a throwaway cluster), the refusal to hide an embedded lake,
``factory migrate`` and ``factory doctor``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from factory import native
from factory.app.cli import main
from factory.errors import FactoryError, SettingsError, UnmigratedLakeError
from factory.lake import Lake
from factory.settings import get_settings


def _trace(i: int) -> dict[str, object]:
    return {"raw_trace_id": f"id-{i}", "source": "upload", "format": "openai",
            "payload": json.dumps({"i": i})}


# -- settings ---------------------------------------------------------------------------------

def test_embedded_default_keeps_everything_under_home(factory_home: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FACTORY_MODELS_DIR")
    s = get_settings()
    assert (s.database_url, s.catalog_name, s.warehouse_uri) == (None, None, None)
    assert s.shared == factory_home
    assert s.warehouse == factory_home / "warehouse"
    assert s.warehouse_location == (factory_home / "warehouse").as_uri()
    assert [s.blobs, s.checkpoints, s.runs, s.models_dir] == [
        factory_home / n for n in ("blobs", "checkpoints", "runs", "models")]


def test_a_shared_warehouse_path_takes_the_shared_artifacts(
        factory_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FACTORY_MODELS_DIR")
    shared = tmp_path / "nfs" / "lake"
    monkeypatch.setenv("FACTORY_WAREHOUSE", shared.as_uri())
    s = get_settings().ensure()
    assert s.warehouse == shared and s.warehouse_location == shared.as_uri()
    assert [s.blobs, s.checkpoints, s.runs, s.models_dir] == [
        shared / n for n in ("blobs", "checkpoints", "runs", "models")]
    # What one node alone uses stays on the node.
    assert [s.spool, s.uploads, s.dagster_home, s.catalog_db] == [
        factory_home / n for n in ("spool", "uploads", "dagster", "catalog.db")]
    assert all(p.is_dir() for p in (s.blobs, s.checkpoints, s.runs, s.models_dir, s.spool))


def test_an_object_store_warehouse_needs_a_shared_folder(
        factory_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FACTORY_WAREHOUSE", "s3://lake/warehouse")
    with pytest.raises(SettingsError, match="FACTORY_SHARED_DIR"):
        get_settings()
    monkeypatch.setenv("FACTORY_SHARED_DIR", str(tmp_path / "shared"))
    s = get_settings()
    assert s.warehouse_location == "s3://lake/warehouse"
    assert s.checkpoints == tmp_path / "shared" / "checkpoints"
    with pytest.raises(SettingsError, match="not a folder"):
        _ = s.warehouse


@pytest.mark.parametrize(("env", "match"), [
    ({"FACTORY_CATALOG": "prod", "FACTORY_DATABASE_URL": "postgresql://h/db"},
     "FACTORY_CATALOG and FACTORY_DATABASE_URL"),
    ({"FACTORY_CATALOG": "prod", "FACTORY_WAREHOUSE": "/shared"}, "FACTORY_SHARED_DIR"),
    ({"FACTORY_DATABASE_URL": "postgres://h/db"}, "write postgresql://"),
    ({"FACTORY_DATABASE_URL": "sqlite:///x.db"}, "must be a postgresql:// URL"),
])
def test_contradicting_settings_are_one_clear_error(
        factory_home: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        env: dict[str, str], match: str) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SettingsError, match=match):
        get_settings()
    assert main(["tables"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("factory tables: error: ") and match in err and "\n" not in err


# -- the lake's catalog in PostgreSQL ----------------------------------------------------------

def test_the_catalog_lives_in_postgres_and_the_data_in_the_shared_warehouse(
        shared_factory: Path, factory_home: Path, tmp_path: Path) -> None:
    lake = Lake()
    lake.append("raw_traces", [_trace(i) for i in range(3)])
    assert lake.catalog.engine.dialect.name == "postgresql"  # type: ignore[attr-defined]
    assert not (factory_home / "catalog.db").exists()
    assert list((shared_factory / "factory" / "raw_traces" / "data").glob("*.parquet"))
    # Another node: its own home, the same database and warehouse, sees the rows and adds some.
    other = dict(os.environ, FACTORY_HOME=str(tmp_path / "node-b"))
    code = ("from factory.lake import Lake; lake = Lake(); "
            "lake.append('raw_traces', [{'raw_trace_id': 'b', 'source': 'upload', "
            "'format': 'openai', 'payload': '{}'}]); print(lake.read('raw_traces').num_rows)")
    out = subprocess.run([sys.executable, "-c", code], env=other, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["4"]
    assert sorted(Lake().read("raw_traces").column("raw_trace_id").to_pylist()) == [
        "b", "id-0", "id-1", "id-2"]


def test_nodes_starting_at_once_on_an_empty_database_race_safely(
        shared_factory: Path, tmp_path: Path) -> None:
    """Four processes create the catalog's own tables, the namespace and raw_traces together
    on a fresh database; each append lands once."""
    code = ("import sys; from factory.lake import Lake; Lake().append('raw_traces', "
            "[{'raw_trace_id': sys.argv[1], 'source': 'upload', 'format': 'openai', "
            "'payload': '{}'}])")
    procs = [subprocess.Popen([sys.executable, "-c", code, f"n{i}"], stderr=subprocess.PIPE,
                              env=dict(os.environ, FACTORY_HOME=str(tmp_path / f"node-{i}")))
             for i in range(4)]
    for proc in procs:
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err.decode()[-2000:]
    assert sorted(Lake().read("raw_traces").column("raw_trace_id").to_pylist()) == [
        "n0", "n1", "n2", "n3"]


def test_an_embedded_lake_is_never_switched_away_from_silently(
        factory_home: Path, database_url: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from factory.blobs import BlobStore

    Lake().append("raw_traces", [_trace(i) for i in range(5)])
    digest = BlobStore().put(b"an image")
    monkeypatch.setenv("FACTORY_DATABASE_URL", database_url)
    monkeypatch.setenv("FACTORY_WAREHOUSE", str(tmp_path / "shared"))
    with pytest.raises(UnmigratedLakeError, match=r"factory migrate.*catalog\.db aside"):
        _ = Lake().catalog
    assert main(["tables"]) == 2
    assert "embedded lake of 1 table(s) (factory.raw_traces)" in capsys.readouterr().err

    assert main(["migrate"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["tables"] == {"raw_traces": 5} and result["blobs"] == 1
    assert BlobStore().path(digest).read_bytes() == b"an image"  # now in the shared store
    assert BlobStore().path(digest).is_relative_to(tmp_path / "shared")
    assert not (factory_home / "catalog.db").exists()
    assert Path(result["embedded"]).is_file()  # kept aside, not deleted
    lake = Lake()
    assert lake.read("raw_traces").num_rows == 5
    assert lake.catalog.engine.dialect.name == "postgresql"  # type: ignore[attr-defined]


def test_migrate_refuses_to_merge_into_a_shared_table_with_rows(
        factory_home: Path, database_url: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    Lake().append("raw_traces", [_trace(1)])
    monkeypatch.setenv("FACTORY_DATABASE_URL", database_url)
    monkeypatch.setenv("FACTORY_WAREHOUSE", str(tmp_path / "shared"))
    other = dict(os.environ, FACTORY_HOME=str(tmp_path / "node-b"))
    code = ("from factory.lake import Lake; Lake().append('raw_traces', [{'raw_trace_id': 'b', "
            "'source': 'upload', 'format': 'openai', 'payload': '{}'}])")
    subprocess.run([sys.executable, "-c", code], env=other, check=True, timeout=120)
    assert main(["migrate"]) == 2
    assert "already holds rows of raw_traces: nothing was copied" in capsys.readouterr().err
    assert (factory_home / "catalog.db").is_file()


def test_a_named_catalog_is_pyiceberg_s_own_and_refuses_an_embedded_lake_too(
        factory_home: Path, tmp_path: Path) -> None:
    # pyiceberg reads its environment once, at import: each step is a process of its own.
    env = dict(os.environ, PYICEBERG_CATALOG__PROD__URI=f"sqlite:///{tmp_path / 'prod.db'}",
               PYICEBERG_CATALOG__PROD__WAREHOUSE=(tmp_path / "prod").as_uri())
    code = ("from factory.lake import Lake; Lake().append('raw_traces', [{'raw_trace_id': 'a', "
            "'source': 'upload', 'format': 'openai', 'payload': '{}'}])")

    def append(**extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", code], env={**env, **extra},
                              capture_output=True, text=True, timeout=120)

    assert append(FACTORY_CATALOG="prod").returncode == 0
    assert (tmp_path / "prod.db").is_file() and not (factory_home / "catalog.db").exists()
    assert append().returncode == 0  # the embedded lake, now holding a table
    refused = append(FACTORY_CATALOG="prod")
    assert refused.returncode != 0
    assert "UnmigratedLakeError: FACTORY_CATALOG=prod is set" in refused.stderr


# -- Dagster's storage in PostgreSQL -----------------------------------------------------------

def test_dagster_storage_is_shared_by_instances_of_different_nodes(
        shared_factory: Path, factory_home: Path, tmp_path: Path) -> None:
    import dagster as dg

    from factory.app.instance import POSTGRES_STORAGE, instance

    inst = instance()
    assert type(inst.run_storage).__name__ == "PostgresRunStorage"
    assert POSTGRES_STORAGE in (factory_home / "dagster" / "dagster.yaml").read_text()
    assert os.environ["FACTORY_DATABASE_URL"] not in (
        factory_home / "dagster" / "dagster.yaml").read_text()

    @dg.asset
    def one() -> int:
        return 1

    run_id = dg.materialize([one], instance=inst).run_id
    other_home = tmp_path / "node-b"
    code = ("import sys; from factory.app.instance import instance; "
            "inst = instance(); run = inst.get_run_by_id(sys.argv[1]); "
            "print(run.status.value, type(inst.event_log_storage).__name__)")
    env = dict(os.environ, FACTORY_HOME=str(other_home), DAGSTER_HOME=str(other_home / "dagster"))
    out = subprocess.run([sys.executable, "-c", code, run_id], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["SUCCESS", "PostgresEventLogStorage"]


def test_a_dagster_home_that_disagrees_with_the_setting_is_an_error(
        factory_home: Path, database_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from factory.app.instance import dagster_home

    config = dagster_home() / "dagster.yaml"
    assert "storage" not in config.read_text()  # embedded: SQLite under the Dagster home
    monkeypatch.setenv("FACTORY_DATABASE_URL", database_url)
    with pytest.raises(FactoryError, match="keeps Dagster's runs in SQLite"):
        dagster_home()
    config.unlink()
    dagster_home()
    monkeypatch.delenv("FACTORY_DATABASE_URL")
    with pytest.raises(FactoryError, match="FACTORY_DATABASE_URL, which is not set"):
        dagster_home()


# -- factory doctor ----------------------------------------------------------------------------

def test_doctor_names_and_checks_the_shared_state(
        shared_factory: Path, database_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert f"database   {database_url}\n           ok: PostgreSQL 15" in out
    assert "catalog    SQL catalog in FACTORY_DATABASE_URL (PostgreSQL)\n           ok:" in out
    assert "ok: PostgresRunStorage, 0 run(s)" in out
    assert f"warehouse  {shared_factory.as_uri()}\n           ok: written, read back" in out
    assert f"ingest     normalizers {native.status()}; C fast path: " in out
    assert "FAILED" not in out


def test_doctor_says_which_piece_is_unreachable(
        shared_factory: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("FACTORY_DATABASE_URL", "postgresql://postgres:secret@127.0.0.1:1/x")
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "database   postgresql://postgres:***@127.0.0.1:1/x\n           FAILED: " in out
    assert "secret" not in out
    assert "not checked: the database did not answer" in out
    assert "warehouse  " in out and "ok: written, read back" in out


def test_doctor_on_the_embedded_default(factory_home: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert f"SQL catalog in {factory_home / 'catalog.db'} (SQLite, embedded)" in out
    assert "ok: SqliteRunStorage" in out and "database" not in out
