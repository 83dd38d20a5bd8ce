"""A table created in a process takes that process's next append, on both SQL catalogs (SQLite
under the home, PostgreSQL): through the lake that created it, through another lake opened
before it existed, after another process created it, and with writers racing to create it.

``shadow_pairs`` is the table the gateway's shadow flusher creates on its first commit while the
capture flusher, another lake of the same process, expires its snapshots."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

import pytest
from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import NoSuchTableError

from factory.lake import Lake, Lineage, TableNotShownError

NAME = "shadow_pairs"


@pytest.fixture(params=["sqlite", "postgresql"])
def catalog(request: pytest.FixtureRequest, factory_home: Path,
            monkeypatch: pytest.MonkeyPatch) -> str:
    """The catalog the lakes of the test use (the home's SQLite, or a fresh PostgreSQL
    database): its name."""
    if request.param == "postgresql":
        monkeypatch.setenv("FACTORY_DATABASE_URL", request.getfixturevalue("database_url"))
    return str(request.param)


def _pairs(*ids: str) -> list[dict[str, Any]]:
    return [{"pair_id": i, "experiment": "triage", "version": "v1", "route": "gpt-4o-mini",
             "created_at": datetime.now(UTC)} for i in ids]


def _ids(lake: Lake) -> list[str]:
    return sorted(lake.read(NAME, columns=["pair_id"]).column(0).to_pylist())


def test_the_lake_that_created_a_table_appends_to_it_next(catalog: str) -> None:
    lake = Lake()
    assert not lake.exists(NAME)
    lake.append(NAME, _pairs("a"), lineage=Lineage(run_id="gateway", asset_key=NAME))
    lake.append(NAME, _pairs("b"), lineage=Lineage(run_id="gateway", asset_key=NAME))
    assert _ids(lake) == ["a", "b"]


def test_a_lake_opened_before_the_table_existed_appends_to_it(catalog: str) -> None:
    """Two lakes of one process, as the gateway's two flushers: the one that saw no table
    appends after the other created it, and the creator expires snapshots meanwhile."""
    creator, other = Lake(), Lake()
    assert not other.exists(NAME) and not creator.exists(NAME)
    creator.append(NAME, _pairs("a"))
    other.append(NAME, _pairs("b"))
    creator.expire_snapshots([NAME], retain_s=0, keep_last=1)
    other.append(NAME, _pairs("c"))
    assert _ids(creator) == _ids(other) == ["a", "b", "c"]


def test_a_table_another_process_created_takes_this_process_s_append(catalog: str) -> None:
    lake = Lake()
    assert not lake.exists(NAME)
    subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        from datetime import UTC, datetime
        from factory.lake import Lake
        Lake().append({NAME!r}, [{{"pair_id": "there", "created_at": datetime.now(UTC)}}])
        """)], check=True, timeout=120)
    lake.append(NAME, _pairs("here"))
    assert _ids(lake) == ["here", "there"]


def test_writers_racing_to_create_a_table_all_append(catalog: str) -> None:
    """Four lakes, each in its own thread, create the table at once and append to it."""
    start = threading.Barrier(4)
    errors: list[str] = []

    def write(who: int) -> None:
        lake = Lake()
        lake.exists(NAME)  # each catalog open before the race
        start.wait(timeout=60)
        try:
            for i in range(3):
                lake.append(NAME, _pairs(f"{who}-{i}"))
        except Exception as exc:  # collected: any failure is the finding
            errors.append(repr(exc))

    threads = [threading.Thread(target=write, args=(who,)) for who in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert _ids(Lake()) == sorted(f"{w}-{i}" for w in range(4) for i in range(3))


def test_a_table_whose_creation_did_not_land_is_created_again(catalog: str) -> None:
    """A commit whose load finds no table though ``table`` loaded it moments before (its row
    gone from the catalog) creates it again, as an append to a missing table does."""
    lake = Lake()
    lake.append(NAME, _pairs("a"))
    lake.catalog.drop_table(("factory", NAME))
    assert lake._load(NAME).name() == ("factory", NAME)
    lake.append(NAME, _pairs("b"))
    assert _ids(Lake()) == ["b"]


class _Lagging:
    """The embedded catalog, except that its loads never show ``NAME``: a catalog whose answer
    lags its own creations."""

    def __init__(self, real: Any) -> None:
        self.real = real

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.real, attr)

    def load_table(self, ident: Any) -> Any:
        if tuple(ident)[-1] == NAME:
            raise NoSuchTableError(f"Table does not exist: factory.{NAME}")
        return self.real.load_table(ident)


def test_a_table_the_catalog_refuses_to_create_and_does_not_show_is_retried(
        factory_home: Path) -> None:
    """The table exists (the catalog refuses to create it again) but the catalog's loads do not
    show it: the commit is tried again as after a conflict, and raised once the lake's
    patience is spent, saying what the catalog's file holds."""
    Lake().append(NAME, _pairs("a"))
    lake = Lake(catalog=cast(Catalog, _Lagging(Lake().catalog)), patience_s=0.3)
    tries: list[int] = []

    def commit() -> None:
        tries.append(1)
        lake._load(NAME)

    with pytest.raises(TableNotShownError) as raised:
        lake._retry(commit)
    assert len(tries) > 1
    assert "refused to create it (it exists)" in str(raised.value)
    assert f"{NAME}/metadata/" in str(raised.value)  # the row the file holds
