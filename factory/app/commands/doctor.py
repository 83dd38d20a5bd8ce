"""``factory doctor``: which catalog, Dagster storage and warehouse this node uses, each checked.

Every line names a piece of state, where it is, and whether it answered: the catalog (listing
its tables), Dagster's instance storage (counting runs), the warehouse and the shared artifact
folder (writing and removing a probe file), and the node-local home; then whether ingest runs
the compiled normalizers and their C fast path (``factory.native``). Exit status 1 when any
check failed, with the reason on that line.
"""

from __future__ import annotations

import argparse
import uuid
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from factory import native
from factory.app.instance import instance
from factory.lake import Lake
from factory.settings import Settings, get_settings

CONNECT_TIMEOUT_S = 5
"""How long the database check waits for a connection before calling it unreachable."""


def register(sub: Any) -> None:
    p = sub.add_parser(
        "doctor", help="show which catalog, Dagster storage and warehouse are in use; check each",
        description="Prints where this node's catalog, Dagster storage, warehouse and shared "
                    "artifacts are, checks that each answers, and exits 1 when one does not.")
    p.set_defaults(func=_doctor)


def redact(url: str) -> str:
    """``url`` without its password."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)
    user = netloc[0].split(":", 1)[0]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc[1]}"))


def _check(what: str, where: str, probe: Callable[[], str]) -> bool:
    try:
        result = probe()
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        print(f"{what:<10} {where}\n{'':<10} FAILED: {type(exc).__name__}: {first}")
        return False
    print(f"{what:<10} {where}\n{'':<10} ok: {result}")
    return True


def _database(url: str) -> str:
    import psycopg2

    con = psycopg2.connect(url, connect_timeout=CONNECT_TIMEOUT_S)
    try:
        with con.cursor() as cur:
            cur.execute("SELECT current_setting('server_version')")
            row = cur.fetchone()
    finally:
        con.close()
    return f"PostgreSQL {row[0] if row else '?'}"


def _catalog(settings: Settings) -> str:
    lake = Lake(settings, patience_s=CONNECT_TIMEOUT_S)
    tables = lake.existing_tables()
    return f"{len(tables)} factory table(s)" + (f": {', '.join(tables)}" if tables else "")


def _storage() -> str:
    inst = instance()
    return f"{type(inst.run_storage).__name__}, {inst.get_runs_count()} run(s)"


def _writable(settings: Settings, location: str) -> str:
    from pyiceberg.io import load_file_io

    settings.ensure()  # the folders of a fresh node

    io = load_file_io({}, location)
    probe = f"{location.rstrip('/')}/.factory-doctor-{uuid.uuid4().hex}"
    with io.new_output(probe).create() as out:
        out.write(b"ok")
    with io.new_input(probe).open() as stream:
        data = stream.read()
    io.delete(probe)
    if data != b"ok":
        raise OSError(f"read back {data!r} from {probe}")
    return "written, read back and removed a probe file"


def _doctor(args: argparse.Namespace) -> int:
    settings = get_settings()
    ok = reachable = True
    if settings.database_url:
        ok = reachable = _check("database", redact(settings.database_url),
                                lambda: _database(settings.database_url or ""))
    if settings.catalog_name:
        where = f"pyiceberg catalog {settings.catalog_name!r} (FACTORY_CATALOG)"
    elif settings.database_url:
        where = "SQL catalog in FACTORY_DATABASE_URL (PostgreSQL)"
    else:
        where = f"SQL catalog in {settings.catalog_db} (SQLite, embedded)"
    storage = ("dagster-postgres in FACTORY_DATABASE_URL" if settings.database_url
               else "SQLite (embedded)")
    if reachable:
        ok &= _check("catalog", where, lambda: _catalog(settings))
        ok &= _check("dagster", f"{storage}; home {settings.dagster_home}", _storage)
    else:
        for what, at in (("catalog", where), ("dagster", storage)):
            print(f"{what:<10} {at}\n{'':<10} not checked: the database did not answer")
    if settings.catalog_name:
        print(f"{'warehouse':<10} set by catalog {settings.catalog_name!r}")
    else:
        ok &= _check("warehouse", settings.warehouse_location,
                     lambda: _writable(settings, settings.warehouse_location))
    ok &= _check("shared", f"{settings.shared} (blobs, checkpoints, runs)",
                 lambda: _writable(settings, settings.shared.as_uri()))
    if settings.models_dir.parent != settings.shared:
        ok &= _check("models", str(settings.models_dir),
                     lambda: _writable(settings, settings.models_dir.as_uri()))
    print(f"{'local':<10} {settings.home} (spool, uploads, Dagster home, logs)")
    built = native.status()
    print(f"{'ingest':<10} normalizers {built}; C fast path: "
          f"{native.fastpath() if built == 'compiled' else 'not used'}")
    if settings.database_url and settings.warehouse_uri is None:
        print(f"{'':<10} note: the catalog is shared but table data is under this node's home "
              f"({settings.warehouse}); set FACTORY_WAREHOUSE for other nodes to read it")
    return 0 if ok else 1
