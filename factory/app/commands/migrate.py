"""``factory migrate``: copy this home's embedded lake into the shared catalog.

A home with an embedded lake (``$FACTORY_HOME/catalog.db``) refuses a shared catalog
(``FACTORY_DATABASE_URL`` or ``FACTORY_CATALOG``) until this has run. Each table's rows at its
current snapshot become one snapshot of the same table in the shared catalog, written with the
shared warehouse; the embedded snapshot history is not copied. Blobs are copied to the shared
blob store (they are addressed by content, so every reference stays valid). Checkpoint and model
folders stay where they are: rows name them by path, and copying them is the operator's call.
A shared table that already holds rows stops the migration before anything is written. The
embedded catalog is then renamed to ``catalog.db.migrated-<time>`` (kept, with its warehouse).
"""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from factory.errors import FactoryError
from factory.lake import Lake, Lineage, embedded_tables, postgres_catalog
from factory.settings import get_settings
from factory.tables import NAMESPACE, TABLES


def register(sub: Any) -> None:
    p = sub.add_parser(
        "migrate", help="copy this home's embedded lake into the shared catalog",
        description="Copies every table of $FACTORY_HOME/catalog.db (rows at the current "
                    "snapshot) and the blob store into the catalog and warehouse named by "
                    "FACTORY_DATABASE_URL / FACTORY_CATALOG and FACTORY_WAREHOUSE, then renames "
                    "the embedded catalog aside. Ends with one JSON line.")
    p.set_defaults(func=_migrate)


def _migrate(args: argparse.Namespace) -> int:
    settings = get_settings().ensure()
    if not (settings.database_url or settings.catalog_name):
        raise FactoryError("nothing to migrate into: set FACTORY_DATABASE_URL (or "
                           "FACTORY_CATALOG) to the shared catalog first")
    held = embedded_tables(settings)
    if not held:
        print(json.dumps({"tables": {}, "blobs": 0, "embedded": None}))
        return 0
    embedded = Lake(replace(settings, database_url=None, catalog_name=None, warehouse_uri=None,
                            shared_dir=None))
    if settings.database_url:
        catalog = postgres_catalog(settings)
    else:
        from pyiceberg.catalog import load_catalog

        catalog = load_catalog(settings.catalog_name)
    if (NAMESPACE,) not in catalog.list_namespaces():
        catalog.create_namespace(NAMESPACE)
    shared = Lake(settings, catalog=catalog)
    names = [t.split(".", 1)[1] for t in held
             if t.startswith(f"{NAMESPACE}.") and t.split(".", 1)[1] in TABLES]
    taken = [n for n in names if shared.exists(n) and shared.table(n).current_snapshot()]
    if taken:
        raise FactoryError(f"the shared catalog already holds rows of {', '.join(taken)}: "
                           f"nothing was copied (merging two lakes is not a migration)")
    stamp = f"{datetime.now(UTC):%Y%m%dT%H%M%S}"
    run_id = f"migrate-{stamp}"
    copied: dict[str, int] = {}
    for name in names:
        rows = embedded.read(name)
        shared.table(name)
        shared.append(name, rows, lineage=Lineage(run_id=run_id, asset_key="migrate"))
        copied[name] = rows.num_rows
    blobs = _copy_blobs(embedded.settings.blobs, settings.blobs)
    aside = settings.catalog_db.with_name(f"{settings.catalog_db.name}.migrated-{stamp}")
    settings.catalog_db.rename(aside)
    print(json.dumps({"tables": copied, "blobs": blobs, "embedded": str(aside)}))
    return 0


def _copy_blobs(source: Path, target: Path) -> int:
    """Copy the blobs ``target`` lacks; returns how many were copied."""
    if source == target or not source.is_dir():
        return 0
    count = 0
    for path in source.glob("*/*"):
        dest = target / path.parent.name / path.name
        if path.is_file() and not dest.exists():
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_suffix(".tmp")
            shutil.copyfile(path, tmp)
            tmp.rename(dest)
            count += 1
    return count
