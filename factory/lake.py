"""The lake: Iceberg tables through a pyiceberg catalog, queried with DuckDB, with lineage.

Embedded default: pyiceberg's SQL catalog on SQLite plus a local warehouse under
``$FACTORY_HOME``. With ``FACTORY_DATABASE_URL=postgresql://...`` the same SQL catalog lives in
PostgreSQL, shared by every node, with table data in ``FACTORY_WAREHOUSE``. With
``FACTORY_CATALOG=<name>`` set, the catalog is pyiceberg's own ``load_catalog(<name>)``
(``~/.pyiceberg.yaml`` or ``PYICEBERG_CATALOG__<NAME>__*`` variables), so a REST, Glue or Hive
catalog on object storage needs no code change. A home that still holds an embedded lake is
never switched to a shared catalog silently: ``UnmigratedLakeError`` says what to do with it.

Every write goes through ``LakeSession`` (or ``Lake.append`` with a ``Lineage``) and records, in
the Iceberg snapshot summary, the Dagster run id, the asset key, the code version and the
snapshot ids of every table read before it. ``walk_lineage`` follows that chain back.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import threading
import time
import uuid
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import pyarrow as pa
from pyiceberg.catalog import Catalog, load_catalog
from pyiceberg.exceptions import CommitFailedException, NoSuchTableError, TableAlreadyExistsError
from pyiceberg.table import Table, TableMetadata, Transaction
from pyiceberg.table.snapshots import Snapshot

from factory import __version__
from factory.datafiles import FileTarget
from factory.errors import QueryError, SnapshotNotFoundError, UnmigratedLakeError
from factory.settings import Settings, get_settings
from factory.tables import DOCUMENT_COLUMNS, NAMESPACE, TABLE_PROPERTIES, TABLES, schema_of

# Keys written into each snapshot summary.
RUN_ID = "factory.run_id"
ASSET_KEY = "factory.asset_key"
CODE_VERSION = "factory.code_version"
READS = "factory.reads"


def _cache_transaction_metadata() -> None:
    """Make pyiceberg's ``Transaction.table_metadata`` compute once per state.

    In pyiceberg 0.12 every read of the property replays the staged updates and deep-copies the
    whole table metadata, every snapshot included, and one append reads it about 18 times: a
    commit's CPU grew by ~1 ms per snapshot the table already had (300 snapshots: 290 ms a
    commit), which a gateway committing every flush reaches within minutes. The value is
    cached per (table metadata, staged updates) object pair, the fix proposed upstream
    (apache/iceberg-python#3302, #3784): both are replaced, never mutated, when they change, so
    an identity check invalidates it. The only difference callers see is a ``last_updated_ms``
    that stays the same across reads of one state (the committed timestamp is unaffected).
    """
    prop = Transaction.__dict__.get("table_metadata")
    if not isinstance(prop, property) or getattr(prop.fget, "factory_cached", False):
        return
    compute = prop.fget
    assert compute is not None

    def table_metadata(self: Transaction) -> TableMetadata:
        base, updates = self._table.metadata, self._updates
        hit = self.__dict__.get("_factory_metadata")
        if hit is not None and hit[0] is base and hit[1] is updates:
            return hit[2]  # type: ignore[no-any-return]
        value = compute(self)
        self.__dict__["_factory_metadata"] = (base, updates, value)
        return value  # type: ignore[no-any-return]

    table_metadata.factory_cached = True  # type: ignore[attr-defined]
    table_metadata.uncached = prop  # type: ignore[attr-defined] # bench/commit_growth.py
    Transaction.table_metadata = property(table_metadata)  # type: ignore[method-assign,assignment]


_cache_transaction_metadata()

# A commit that loses a race is retried after reloading the table. 60 tries with capped jittered
# backoff outlast two writers hammering one table (measured: 37 of 80 commits conflicted).
_MAX_COMMIT_TRIES = 60


@cache
def code_version() -> str:
    """The git sha of the checkout the factory runs from, or the package version outside git."""
    root = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                             text=True, timeout=5, check=True)
        sha = out.stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return __version__


@dataclass
class Lineage:
    """Who is writing (run and asset) and which table snapshots it read."""

    run_id: str
    asset_key: str
    reads: dict[str, int] = field(default_factory=dict)

    def record_read(self, table: str, snapshot_id: int | None) -> None:
        if snapshot_id is not None:
            self.reads[table] = snapshot_id

    def snapshot_properties(self) -> dict[str, str]:
        return {
            RUN_ID: self.run_id,
            ASSET_KEY: self.asset_key,
            CODE_VERSION: code_version(),
            READS: json.dumps(self.reads, sort_keys=True),
        }


class TableNotShownError(Exception):
    """The catalog does not show a table this lake loaded or created moments before, and
    refuses to create it again (it exists).

    The factory never drops a table, so the table is there and the catalog's answer lags (seen
    on the SQLite catalog under load: ``shadow_pairs`` missing right after the gateway's flusher
    created it, there 0.2 s later). A commit retries it as it retries a conflict
    (``_is_transient``); the message says what the catalog's file holds for the table."""


def _is_transient(exc: BaseException) -> bool:
    """A commit conflict, SQLite busy under concurrent writers, or a table the catalog does not
    show yet (``TableNotShownError``): each succeeds on retry."""
    if isinstance(exc, CommitFailedException | TableNotShownError):
        return True
    text = str(exc).lower()
    return "database is locked" in text or "database table is locked" in text


def _retry(fn: Any, *args: Any, deadline: float | None = None, **kwargs: Any) -> Any:
    """Call ``fn`` until it succeeds, retrying transient errors with jittered backoff, at most
    ``_MAX_COMMIT_TRIES`` times and, with a ``deadline`` (``time.monotonic()``), not after it."""
    delay = 0.01
    for attempt in range(_MAX_COMMIT_TRIES):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            if (not _is_transient(exc) or attempt == _MAX_COMMIT_TRIES - 1
                    or (deadline is not None and time.monotonic() >= deadline)):
                raise
            time.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 0.5)
    raise AssertionError("unreachable")


_CATALOG_INIT_LOCK = threading.Lock()

_LOG_LOCK = threading.Lock()
_LOG_CACHE: dict[tuple[str, str], tuple[int, list[dict[str, Any]]]] = {}
"""``Lake.log_rows``: (table uuid, name) -> (the snapshot read, its rows)."""
_LOG_CHAIN = 10_000
"""``_appended_files`` walks at most this many snapshots back before it reads anew."""


def _appended_files(tbl: Table, since: int, now: Snapshot) -> list[str] | None:
    """The data files the commits after snapshot ``since`` up to ``now`` added, when each of
    them is an append and ``since`` is an ancestor of ``now``; None otherwise."""
    from pyiceberg.manifest import ManifestEntryStatus
    from pyiceberg.table.snapshots import Operation

    new: set[int] = set()
    at: Snapshot | None = now
    while at is not None and at.snapshot_id != since and len(new) < _LOG_CHAIN:
        if at.summary is None or at.summary.operation != Operation.APPEND:
            return None
        new.add(at.snapshot_id)
        at = (tbl.snapshot_by_id(at.parent_snapshot_id)
              if at.parent_snapshot_id is not None else None)
    if at is None or at.snapshot_id != since:
        return None
    files = []
    for manifest in now.manifests(tbl.io):
        if manifest.added_snapshot_id not in new:
            continue
        for entry in manifest.fetch_manifest_entry(tbl.io, discard_deleted=True):
            if entry.status == ManifestEntryStatus.ADDED and entry.snapshot_id in new:
                files.append(entry.data_file.file_path)
    return files


def _open_sql_catalog(settings: Settings, deadline: float | None = None) -> Catalog:
    """The embedded SQLite catalog. Its constructor creates the catalog tables when absent,
    which races with other threads and processes doing the same ("table already exists",
    "database is locked"): serialize threads here and retry the cross-process race (20 tries,
    each up to SQLite's 5 s busy wait, and none after ``deadline``)."""
    from pyiceberg.catalog.sql import SqlCatalog

    for attempt in range(20):
        try:
            with _CATALOG_INIT_LOCK:
                return SqlCatalog("factory", uri=f"sqlite:///{settings.catalog_db}",
                                  warehouse=settings.warehouse_location)
        except Exception as exc:
            lost_race = "already exists" in str(exc).lower() or _is_transient(exc)
            if (not lost_race or attempt == 19
                    or (deadline is not None and time.monotonic() >= deadline)):
                raise
            time.sleep(0.02 * (attempt + 1))
    raise AssertionError("unreachable")


def postgres_catalog(settings: Settings, deadline: float | None = None) -> Catalog:
    """pyiceberg's SQL catalog in ``settings.database_url``, table data in the warehouse.

    The constructor creates the catalog tables when absent; two processes doing that at once
    collide on PostgreSQL's unique index of type names ("duplicate key", "already exists"):
    the loser retries and finds them (20 tries, none after ``deadline``). Connections are
    checked before use (``pool_pre_ping``): a long-lived gateway outlives a database restart.
    """
    from pyiceberg.catalog.sql import SqlCatalog

    assert settings.database_url is not None
    for attempt in range(20):
        try:
            return SqlCatalog("factory", uri=settings.database_url,
                              warehouse=settings.warehouse_location, pool_pre_ping="true")
        except Exception as exc:
            text = str(exc).lower()
            lost_race = "already exists" in text or "duplicate key" in text
            if (not lost_race or attempt == 19
                    or (deadline is not None and time.monotonic() >= deadline)):
                raise
            time.sleep(0.02 * (attempt + 1))
    raise AssertionError("unreachable")


def embedded_tables(settings: Settings) -> list[str]:
    """The tables the embedded catalog at ``settings.catalog_db`` holds (none without one)."""
    import sqlite3

    if not settings.catalog_db.is_file():
        return []
    con = sqlite3.connect(f"{settings.catalog_db.as_uri()}?mode=ro", uri=True)
    try:
        rows = con.execute("SELECT table_namespace, table_name FROM iceberg_tables "
                           "ORDER BY 1, 2").fetchall()
    except sqlite3.OperationalError:
        return []  # created but never written: no catalog tables yet
    finally:
        con.close()
    return [f"{ns}.{name}" for ns, name in rows]


def refuse_unmigrated(settings: Settings) -> None:
    """Raise ``UnmigratedLakeError`` when a shared catalog is configured while this home's
    embedded catalog still holds tables: using the shared one would hide them silently."""
    held = embedded_tables(settings)
    if not held:
        return
    target = ("FACTORY_DATABASE_URL" if settings.database_url
              else f"FACTORY_CATALOG={settings.catalog_name}")
    raise UnmigratedLakeError(
        f"{target} is set, but {settings.catalog_db} holds an embedded lake of {len(held)} "
        f"table(s) ({', '.join(held[:5])}{', ...' if len(held) > 5 else ''}). It is not "
        f"migrated silently: run `factory migrate` to copy it into the shared catalog, or "
        f"move {settings.catalog_db.name} aside to start the shared catalog without it, or "
        f"unset {target.split('=')[0]} to keep using it")


def to_arrow(name: str, data: pa.Table | Sequence[Mapping[str, Any]]) -> pa.Table:
    """Shape rows or an Arrow table to the declared schema of ``name`` (missing columns null)."""
    schema = schema_of(name)
    if not isinstance(data, pa.Table):
        return pa.Table.from_pylist(list(data), schema=schema)
    unknown = set(data.column_names) - set(schema.names)
    if unknown:
        raise ValueError(f"table {name!r} has no column(s) {sorted(unknown)}")
    columns = [
        data.column(f.name).cast(f.type) if f.name in data.column_names
        else pa.nulls(data.num_rows, f.type)
        for f in schema
    ]
    return pa.Table.from_arrays(columns, schema=schema)


class Lake:
    """The factory's tables. Cheap to construct; safe to use from several threads/processes.

    A busy catalog (SQLite locked by another writer), a commit that lost a race, or a table the
    catalog does not show right after this lake loaded or created it is retried within each
    call. ``patience_s`` bounds how long one call keeps retrying before it raises;
    None retries up to 60 times, which on a locked SQLite catalog (5 s busy wait a try) is
    minutes. A caller with its own retry loop that must report an outage while it lasts (the
    gateway's flusher) passes a few seconds.
    """

    def __init__(self, settings: Settings | None = None, catalog: Catalog | None = None, *,
                 patience_s: float | None = None) -> None:
        self.settings = (settings or get_settings()).ensure()
        self._catalog = catalog
        self._lock = threading.Lock()
        self._ready: set[str] = set()
        self.patience_s = patience_s

    def _retry(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return _retry(fn, *args, deadline=self._deadline(), **kwargs)

    def _deadline(self) -> float | None:
        return None if self.patience_s is None else time.monotonic() + self.patience_s

    # -- catalog and tables ------------------------------------------------------------------
    @property
    def catalog(self) -> Catalog:
        if self._catalog is None:
            settings = self.settings
            if settings.catalog_name:
                refuse_unmigrated(settings)
                self._catalog = load_catalog(settings.catalog_name)
            elif settings.database_url:
                refuse_unmigrated(settings)
                self._catalog = postgres_catalog(settings, self._deadline())
            else:
                self._catalog = _open_sql_catalog(self.settings, self._deadline())
            try:
                self._retry(self._catalog.create_namespace, NAMESPACE)
            except Exception:
                # Lost a creation race (SQLite reports it as an IntegrityError, not
                # NamespaceAlreadyExistsError): fine as long as the namespace is there now.
                if (NAMESPACE,) not in self._catalog.list_namespaces():
                    raise
        return self._catalog

    def table(self, name: str) -> Table:
        """Load table ``name``, creating it or evolving its schema to the declaration."""
        schema = schema_of(name)
        ident = (NAMESPACE, name)
        try:
            tbl = self._retry(self.catalog.load_table, ident)
        except NoSuchTableError:
            try:
                tbl = self._retry(self.catalog.create_table, ident, schema=schema,
                             properties=TABLE_PROPERTIES.get(name, {}))
            except Exception as exc:
                # A concurrent creator won (TableAlreadyExistsError, or IntegrityError from
                # SQLite): load theirs; anything else is a real failure.
                try:
                    tbl = self._retry(self.catalog.load_table, ident)
                except NoSuchTableError:
                    if isinstance(exc, TableAlreadyExistsError):
                        raise TableNotShownError(
                            f"table {name!r}: the catalog refused to create it (it exists) but "
                            f"does not show it{self._catalog_view(name)}") from exc
                    raise exc from None
        if name not in self._ready:
            have = set(tbl.schema().column_names)
            if any(f.name not in have for f in schema):
                def evolve() -> None:
                    with self._load(name, recreate=False).update_schema() as update:
                        update.union_by_name(schema)
                self._retry(evolve)
                tbl = self._retry(self._load, name)
            # Declared properties a table lacks (made by older code) are added; a value set
            # on purpose (an operator's own codec) is left alone.
            wanted = {k: v for k, v in TABLE_PROPERTIES.get(name, {}).items()
                      if k not in tbl.properties}
            if wanted:
                def set_properties() -> None:
                    with self._load(name, recreate=False).transaction() as tx:
                        tx.set_properties(wanted)
                self._retry(set_properties)
                tbl = self._retry(self._load, name)
            self._ready.add(name)
        return tbl

    def _load(self, name: str, *, recreate: bool = True) -> Table:
        """``name`` as the catalog holds it now, for a commit to a table ``table`` has just
        loaded or created.

        The factory never drops a table, so one the catalog does not show is either lagging
        (another writer's creation not visible yet) or a creation that did not land: it is
        created again, as ``table`` creates a missing one. A lagging catalog refuses the
        creation (the row exists) and the load after it finds the table; where it still does
        not show it, ``TableNotShownError`` (retried by the caller's commit loop).
        ``recreate=False`` (``table``'s own schema and property updates): not created again."""
        try:
            return self.catalog.load_table((NAMESPACE, name))
        except NoSuchTableError as exc:
            missing = exc
        self._ready.discard(name)
        try:
            if not recreate:
                raise missing
            return self.table(name)
        except NoSuchTableError as exc:
            raise TableNotShownError(f"table {name!r} is not in the catalog, though this lake "
                                     f"loaded or created it moments ago"
                                     f"{self._catalog_view(name)}") from exc

    def _catalog_view(self, name: str) -> str:
        """What the embedded catalog's file holds for ``name``, read past the catalog's engine,
        for an error that says a table is missing (empty for other catalogs)."""
        if self.settings.database_url or self.settings.catalog_name:
            return ""
        import sqlite3

        try:
            con = sqlite3.connect(f"{self.settings.catalog_db.as_uri()}?mode=ro", uri=True,
                                  timeout=1.0)
            try:
                rows = con.execute("SELECT catalog_name, metadata_location FROM iceberg_tables "
                                   "WHERE table_namespace = ? AND table_name = ?",
                                   (NAMESPACE, name)).fetchall()
            finally:
                con.close()
        except sqlite3.Error as exc:
            return f" ({self.settings.catalog_db} could not be read directly: {exc})"
        return f" ({self.settings.catalog_db} read directly holds {rows or 'no row for it'})"

    def exists(self, name: str) -> bool:
        return bool(self.catalog.table_exists((NAMESPACE, name)))

    def existing_tables(self) -> list[str]:
        return sorted(t for t in TABLES if self.exists(t))

    def snapshot_id(self, name: str) -> int | None:
        if not self.exists(name):
            return None
        snap = self.table(name).current_snapshot()
        return snap.snapshot_id if snap else None

    # -- reads ---------------------------------------------------------------------------------
    def read(self, name: str, *, snapshot_id: int | None = None, row_filter: str | None = None,
             columns: Sequence[str] | None = None, lineage: Lineage | None = None) -> pa.Table:
        """Scan ``name`` at ``snapshot_id`` (default current) into Arrow, recording the read."""
        tbl = self.table(name)
        if snapshot_id is None:
            snap = tbl.current_snapshot()
            snapshot_id = snap.snapshot_id if snap else None
        elif tbl.snapshot_by_id(snapshot_id) is None:
            raise SnapshotNotFoundError(f"table {name!r} has no snapshot {snapshot_id}")
        if lineage is not None:
            lineage.record_read(name, snapshot_id)
        if snapshot_id is None:
            empty = schema_of(name)
            return empty.empty_table() if columns is None else empty.empty_table().select(columns)
        kwargs: dict[str, Any] = {"snapshot_id": snapshot_id}
        if row_filter:
            kwargs["row_filter"] = row_filter
        if columns:
            kwargs["selected_fields"] = tuple(columns)
        return tbl.scan(**kwargs).to_arrow()

    def log_rows(self, name: str) -> list[dict[str, Any]]:
        """Every row of ``name`` at its current snapshot as Python dicts, kept per process and
        table: when every commit since this process last read the table was an append, only the
        data files those commits added are read.

        For the append-only logs a frequent reader re-reads while a writer appends (the control
        loop's ``training_events`` and ``training_segments``, read by two sensors every 15
        s and appended about as often during a run): a full scan costs one manifest and one
        data file per commit, so each tick cost more than the last and the sensors took more
        of the cores from the trainer as a run went on. Any other commit since (an overwrite,
        a delete, a table created anew) reads the whole table. The list is shared: do not
        change it or its rows.
        """
        tbl = self.table(name)
        snap = tbl.current_snapshot()
        if snap is None:
            return []
        key = (str(tbl.metadata.table_uuid), name)
        with _LOG_LOCK:
            hit = _LOG_CACHE.get(key)
        if hit is not None and hit[0] == snap.snapshot_id:
            return hit[1]
        rows: list[dict[str, Any]] | None = None
        if hit is not None:
            added = _appended_files(tbl, hit[0], snap)
            if added is not None:
                rows = hit[1] + self.read_files(name, added).to_pylist() if added else hit[1]
        if rows is None:
            rows = tbl.scan(snapshot_id=snap.snapshot_id).to_arrow().to_pylist()
        with _LOG_LOCK:
            _LOG_CACHE[key] = (snap.snapshot_id, rows)
        return rows

    # -- writes --------------------------------------------------------------------------------
    def append(self, name: str, data: pa.Table | Sequence[Mapping[str, Any]], *,
               lineage: Lineage | None = None) -> int | None:
        """Append rows; retried on commit conflicts so concurrent writers lose nothing.

        Returns the new snapshot id (None when there was nothing to write).
        """
        arrow = to_arrow(name, data)
        if arrow.num_rows == 0:
            return None
        props = lineage.snapshot_properties() if lineage else {}

        def commit() -> int:
            tbl = self._load(name)
            tbl.append(arrow, snapshot_properties=props)
            snap = tbl.current_snapshot()
            assert snap is not None
            return snap.snapshot_id

        self.table(name)
        return int(self._retry(commit))

    # -- two-stage writes: data files written anywhere, committed here -----------------------
    def file_target(self, name: str) -> FileTarget:
        """How to write data files of ``name`` in a process without the catalog."""
        from pyiceberg.io.pyarrow import _get_parquet_writer_kwargs, schema_to_pyarrow

        tbl = self.table(name)
        schema = schema_to_pyarrow(tbl.schema())
        options = _get_parquet_writer_kwargs(tbl.properties)
        options["use_dictionary"] = [f.name for f in schema if f.name not in DOCUMENT_COLUMNS]
        return FileTarget(table=name, schema=schema, writer_options=options)

    def new_data_locations(self, name: str, count: int) -> list[str]:
        """``count`` fresh locations for data files of ``name`` (``FileTarget.write``)."""
        from pyiceberg.table.locations import load_location_provider

        tbl = self.table(name)
        provider = load_location_provider(table_location=tbl.metadata.location,
                                          table_properties=tbl.properties)
        return [provider.new_data_location(data_file_name=f"{uuid.uuid4()}.parquet")
                for _ in range(count)]

    def describer(self, name: str) -> FileDescriber:
        """Describes data files of ``name`` as they are written (for ``commit_files``)."""
        return FileDescriber(self.table(name))

    def commit_files(self, name: str, locations: Sequence[str], *,
                     lineage: Lineage | None = None,
                     describer: FileDescriber | None = None) -> int | None:
        """Append data files written with ``file_target`` in one snapshot.

        Each file's statistics come from its Parquet footer, read now or, for files handed to
        ``describer`` before, when they were written; a conflicting commit is retried
        without writing anything again. Returns the new snapshot id (None when ``locations``
        is empty). Files never committed are unreferenced garbage, as after a failed append.
        """
        if not locations:
            return None
        props = lineage.snapshot_properties() if lineage else {}
        tbl = self.table(name)
        files = (describer.take(tbl, locations) if describer is not None
                 else describe_data_files(tbl, locations))

        def commit() -> int:
            fresh = self._load(name)
            with fresh.transaction() as tx, tx.update_snapshot(
                    snapshot_properties=props).fast_append() as append:
                for data_file in files:
                    append.append_data_file(data_file)
            snap = fresh.current_snapshot()
            assert snap is not None
            return snap.snapshot_id

        return int(self._retry(commit))

    def read_files(self, name: str, locations: Sequence[str]) -> pa.Table:
        """The rows of data files of ``name`` (committed or not)."""
        import pyarrow.parquet as pq

        tbl = self.table(name)
        schema = schema_of(name)
        parts = []
        for loc in locations:
            with tbl.io.new_input(loc).open() as fh:
                parts.append(to_arrow(name, pq.read_table(fh)))  # by column name
        return pa.concat_tables(parts) if parts else schema.empty_table()

    def delete_files(self, name: str, locations: Sequence[str]) -> None:
        """Remove data files of ``name`` that will never be committed."""
        tbl = self.table(name)
        for loc in locations:
            tbl.io.delete(loc)

    def overwrite(self, name: str, data: pa.Table | Sequence[Mapping[str, Any]], *,
                  where: str | None = None, lineage: Lineage | None = None) -> int | None:
        """Replace the rows matching ``where`` (all rows if None) with ``data``."""
        arrow = to_arrow(name, data)
        props = lineage.snapshot_properties() if lineage else {}

        def commit() -> int | None:
            tbl = self._load(name)
            with warnings.catch_warnings():
                # An overwrite whose filter matches nothing (the first version of a partition)
                # is normal here, not a mistake worth a warning.
                warnings.filterwarnings("ignore", "Delete operation did not match any records")
                if where is None:
                    tbl.overwrite(arrow, snapshot_properties=props)
                else:
                    tbl.overwrite(arrow, overwrite_filter=where, snapshot_properties=props)
            snap = tbl.current_snapshot()
            return snap.snapshot_id if snap else None

        self.table(name)
        return self._retry(commit)  # type: ignore[no-any-return]

    def session(self, *, run_id: str, asset_key: str) -> LakeSession:
        return LakeSession(self, Lineage(run_id=run_id, asset_key=asset_key))

    def buffered(self, name: str, *, lineage: Lineage | None = None, max_rows: int = 5000,
                 max_delay_s: float = 1.0) -> BufferedAppender:
        return BufferedAppender(self, name, lineage=lineage, max_rows=max_rows,
                                max_delay_s=max_delay_s)

    # -- SQL -----------------------------------------------------------------------------------
    def sql(self, query: str, params: Sequence[Any] | Mapping[str, Any] | None = None,
            *, lineage: Lineage | None = None) -> pa.Table:
        """Run DuckDB SQL with every lake table visible by its bare name at its current snapshot.

        Only the tables the query names are scanned. Values go in ``params`` (bind parameters).
        """
        import duckdb

        con = duckdb.connect()
        try:
            for name in self.existing_tables():
                if re.search(rf"\b{re.escape(name)}\b", query, flags=re.IGNORECASE):
                    con.register(name, self.read(name, lineage=lineage))
            try:
                rel = con.sql(query, params=params) if params is not None else con.sql(query)
                arrow = rel.to_arrow_table() if rel is not None else pa.table({})
            except duckdb.Error as exc:
                first = str(exc).strip().splitlines()[0]
                raise QueryError(f"SQL error: {first}") from None
            return arrow
        finally:
            con.close()

    # -- introspection -------------------------------------------------------------------------
    def describe(self) -> list[dict[str, Any]]:
        """One row per existing table: name, rows, current snapshot, last writer."""
        out = []
        for name in self.existing_tables():
            snap = self.table(name).current_snapshot()
            props = dict(snap.summary.additional_properties) if snap and snap.summary else {}
            out.append({
                "table": name,
                "rows": int(props.get("total-records", 0)),
                "snapshot_id": snap.snapshot_id if snap else None,
                "committed_at": _iso(snap.timestamp_ms) if snap else None,
                "last_writer": props.get(ASSET_KEY, ""),
                "run_id": props.get(RUN_ID, ""),
            })
        return out

    def expire_snapshots(self, names: Sequence[str], *, retain_s: float, keep_last: int
                         ) -> dict[str, int]:
        """Drop old snapshots of the tables ``names`` from their metadata; returns table ->
        snapshots expired.

        For tables committed at a high rate (one snapshot per gateway flush): a commit rewrites
        the whole metadata, so each snapshot kept costs every later commit CPU. A snapshot
        stays when it is among the last ``keep_last``, newer than ``retain_s`` seconds (a run
        that read it may not have committed its lineage yet), or read by the lineage of a
        snapshot that stays, in any table, followed transitively: ``walk_lineage`` from any
        snapshot still reaches the raw traces. Data files are not touched (these tables only
        grow: the current snapshot holds every row).
        """
        existing = self.existing_tables()
        expirable = [n for n in names if n in existing]
        if not expirable:
            return {}
        tables = {n: self.table(n) for n in existing}
        cutoff_ms = (time.time() - retain_s) * 1000
        kept: dict[str, set[int]] = {n: set() for n in expirable}
        todo: list[Any] = []
        for name, tbl in tables.items():
            snaps = tbl.snapshots()
            if name in kept:
                snaps = sorted(snaps, key=lambda s: (s.timestamp_ms, s.sequence_number))
                recent = snaps[-keep_last:] if keep_last > 0 else []
                stay = [s for s in snaps if s.timestamp_ms >= cutoff_ms] + recent
                current = tbl.current_snapshot()
                stay += [current] if current is not None else []
                kept[name].update(s.snapshot_id for s in stay)
                todo += stay
            else:
                todo += snaps
        while todo:
            snap = todo.pop()
            props = snap.summary.additional_properties if snap.summary else {}
            for table, sid in json.loads(props.get(READS, "{}")).items():
                if table in kept and int(sid) not in kept[table]:
                    kept[table].add(int(sid))
                    found = tables[table].snapshot_by_id(int(sid))
                    if found is not None:
                        todo.append(found)
        out: dict[str, int] = {}
        for name in expirable:
            old = [s.snapshot_id for s in tables[name].snapshots()
                   if s.snapshot_id not in kept[name]]
            if not old:
                continue

            def expire(name: str = name, old: list[int] = old) -> int:
                fresh = self._load(name)
                present = {s.snapshot_id for s in fresh.snapshots()}
                gone = [i for i in old if i in present]  # another process may have expired some
                if gone:
                    fresh.maintenance.expire_snapshots().by_ids(gone).commit()
                return len(gone)

            out[name] = int(self._retry(expire))
        return out

    def snapshot_info(self, name: str, snapshot_id: int | None = None) -> dict[str, Any]:
        """The lineage properties of one snapshot of ``name`` (default: current)."""
        tbl = self.table(name)
        snap = tbl.current_snapshot() if snapshot_id is None else tbl.snapshot_by_id(snapshot_id)
        if snap is None:
            what = "no snapshots yet" if snapshot_id is None else f"no snapshot {snapshot_id}"
            raise SnapshotNotFoundError(f"table {name!r} has {what}")
        props = dict(snap.summary.additional_properties) if snap.summary else {}
        ancestors = 0
        parent = snap.parent_snapshot_id
        while parent is not None:
            ancestors += 1
            prev = tbl.snapshot_by_id(parent)
            parent = prev.parent_snapshot_id if prev else None
        return {
            "table": name,
            "snapshot_id": snap.snapshot_id,
            "committed_at": _iso(snap.timestamp_ms),
            "operation": str(snap.summary.operation.value) if snap.summary else "",
            "rows": int(props.get("total-records", 0)),
            "run_id": props.get(RUN_ID, ""),
            "asset_key": props.get(ASSET_KEY, ""),
            "code_version": props.get(CODE_VERSION, ""),
            "reads": json.loads(props.get(READS, "{}")),
            "earlier_snapshots": ancestors,
        }


def stop_idle_reader_pool() -> None:
    """Stop pyiceberg's reader threads when they are this process's only other threads.

    pyiceberg reads manifests and data files on a thread pool it keeps for the process's
    life (and makes again when next needed). A file ingest reads the ids the lake holds that
    way, then starts its workers, which are forked only from a process with no other thread
    (``factory.ingest.workers.worker_context``): without this, every ingest into a lake that
    had data would spawn them. Called from the main thread, between two reads: the pool is
    idle then, and nothing else can be using it. Does nothing otherwise.
    """
    from concurrent.futures import ThreadPoolExecutor

    from pyiceberg.utils.concurrent import ExecutorFactory

    if threading.current_thread() is not threading.main_thread():
        return
    others = {t for t in threading.enumerate() if t is not threading.current_thread()}
    pool = getattr(ExecutorFactory, "_instance", None)
    if not others or not isinstance(pool, ThreadPoolExecutor):
        return
    if not others <= set(getattr(pool, "_threads", ())):
        return
    ExecutorFactory._instance = None
    pool.shutdown(wait=True)


def describe_data_files(tbl: Table, locations: Sequence[str]) -> list[Any]:
    """The Iceberg ``DataFile`` of each Parquet file, from its footer.

    What pyiceberg's ``parquet_file_to_data_file`` gives, file by file (a test holds them
    equal), at a third of its cost: the statistics plan and the column ids are worked out once
    for all the files, and the schema check once per distinct file schema, where
    ``parquet_file_to_data_file`` redid all three per file (0.18 s of the final commit of 134
    files of a 200k-record ingest, where nothing else runs).
    """
    return FileDescriber(tbl).describe(locations)


class FileDescriber:
    """Describes a table's data files (``describe_data_files``), also as they are written,
    so that their commit does not: a file ingest describes each block's files as it arrives,
    while the workers are busy, where the final commit ran alone (0.13 s of the bench's 200k
    records in 264 files).

    ``take`` hands the descriptions to a commit. Those made against other table metadata than
    the commit's (a schema, spec or property changed meanwhile) are made again.
    """

    def __init__(self, tbl: Table) -> None:
        self.files: dict[str, Any] = {}
        self._use(tbl)

    def _use(self, tbl: Table) -> None:
        from pyiceberg.io.pyarrow import compute_statistics_plan, parquet_path_to_id_mapping

        self.table = tbl
        schema = tbl.metadata.schema()
        self._plan = compute_statistics_plan(schema, tbl.metadata.properties)
        self._ids = parquet_path_to_id_mapping(schema)
        self._checked: list[pa.Schema] = []
        """File schemas found compatible (Schema == ignores the field ids: compared in
        full)."""

    def describe(self, locations: Sequence[str]) -> list[Any]:
        """The ``DataFile`` of each location (not kept)."""
        import pyarrow.parquet as pq
        from pyiceberg.io.pyarrow import (
            _check_pyarrow_schema_compatible,
            data_file_statistics_from_parquet_metadata,
        )
        from pyiceberg.manifest import DataFile, DataFileContent, FileFormat

        meta = self.table.metadata
        schema = meta.schema()
        spec = meta.spec()
        files = []
        for location in locations:
            input_file = self.table.io.new_input(location)
            with input_file.open() as stream:
                footer = pq.read_metadata(stream)
            arrow_schema = footer.schema.to_arrow_schema()
            if not any(arrow_schema.equals(seen, check_metadata=True)
                       for seen in self._checked):
                _check_pyarrow_schema_compatible(schema, arrow_schema,
                                                 format_version=meta.format_version)
                self._checked.append(arrow_schema)
            stats = data_file_statistics_from_parquet_metadata(
                parquet_metadata=footer, stats_columns=self._plan,
                parquet_column_mapping=self._ids)
            files.append(DataFile.from_args(
                content=DataFileContent.DATA, file_path=location,
                file_format=FileFormat.PARQUET, partition=stats.partition(spec, schema),
                file_size_in_bytes=len(input_file), sort_order_id=None,
                spec_id=meta.default_spec_id, equality_ids=None, key_metadata=None,
                **stats.to_serialized_dict()))
        return files

    def add(self, locations: Sequence[str]) -> None:
        """Describe these files now, for a later ``take``."""
        new = [loc for loc in locations if loc not in self.files]
        self.files.update(zip(new, self.describe(new), strict=True))

    def take(self, tbl: Table, locations: Sequence[str]) -> list[Any]:
        """The ``DataFile`` of each location, for a commit to ``tbl`` as loaded now."""
        old, new = self.table.metadata, tbl.metadata
        if (old.current_schema_id, old.default_spec_id, old.properties, old.format_version) != (
                new.current_schema_id, new.default_spec_id, new.properties, new.format_version):
            self._use(tbl)
            self.files.clear()
        self.add(locations)
        return [self.files.pop(loc) for loc in locations]


def walk_lineage(lake: Lake, name: str, snapshot_id: int | None = None,
                 _seen: set[tuple[str, int]] | None = None) -> dict[str, Any]:
    """The lineage tree of ``name@snapshot_id``: each node with the nodes it read."""
    seen = _seen if _seen is not None else set()
    node = lake.snapshot_info(name, snapshot_id)
    key = (name, node["snapshot_id"])
    node["upstream"] = []
    if key in seen:
        node["cycle"] = True
        return node
    seen.add(key)
    for table, snap in sorted(node["reads"].items()):
        try:
            node["upstream"].append(walk_lineage(lake, table, int(snap), seen))
        except SnapshotNotFoundError:
            node["upstream"].append({"table": table, "snapshot_id": snap, "missing": True,
                                     "upstream": []})
    return node


def _iso(ms: int) -> str:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat(timespec="seconds")


class LakeSession:
    """A lake bound to one writer (a Dagster run and asset): reads recorded, writes stamped."""

    def __init__(self, lake: Lake, lineage: Lineage) -> None:
        self.lake = lake
        self.lineage = lineage
        self.writes: dict[str, int] = {}

    def read(self, name: str, **kwargs: Any) -> pa.Table:
        return self.lake.read(name, lineage=self.lineage, **kwargs)

    def sql(self, query: str, params: Sequence[Any] | Mapping[str, Any] | None = None) -> pa.Table:
        return self.lake.sql(query, params, lineage=self.lineage)

    def append(self, name: str, data: pa.Table | Sequence[Mapping[str, Any]]) -> int | None:
        snap = self.lake.append(name, data, lineage=self.lineage)
        if snap is not None:
            self.writes[name] = snap
        return snap

    def overwrite(self, name: str, data: pa.Table | Sequence[Mapping[str, Any]],
                  where: str | None = None) -> int | None:
        snap = self.lake.overwrite(name, data, where=where, lineage=self.lineage)
        if snap is not None:
            self.writes[name] = snap
        return snap

    def metadata(self) -> dict[str, Any]:
        """Lineage for the Dagster materialization metadata (plain JSON-able values)."""
        return {
            "dagster_run_id": self.lineage.run_id,
            "code_version": code_version(),
            "read_snapshots": dict(self.lineage.reads),
            "written_snapshots": dict(self.writes),
        }


class BufferedAppender:
    """Batches small frequent writes: flushes at ``max_rows`` rows or ``max_delay_s`` seconds.

    Commit cost grows with snapshot count (38 ms -> 134 ms over 100 appends here), so one commit
    per batch instead of per row keeps writers fast and the snapshot history short.
    """

    def __init__(self, lake: Lake, name: str, *, lineage: Lineage | None, max_rows: int,
                 max_delay_s: float) -> None:
        self.lake, self.name, self.lineage = lake, name, lineage
        self.max_rows, self.max_delay_s = max_rows, max_delay_s
        self._rows: list[Mapping[str, Any]] = []
        self._first_at: float | None = None
        self._lock = threading.Lock()
        self.snapshots: list[int] = []

    def add(self, rows: Iterable[Mapping[str, Any]]) -> None:
        with self._lock:
            for row in rows:
                if self._first_at is None:
                    self._first_at = time.monotonic()
                self._rows.append(row)
            due = len(self._rows) >= self.max_rows or (
                self._first_at is not None
                and time.monotonic() - self._first_at >= self.max_delay_s)
        if due:
            self.flush()

    def flush(self) -> int | None:
        with self._lock:
            rows, self._rows, self._first_at = self._rows, [], None
            if not rows:
                return None
            snap = self.lake.append(self.name, rows, lineage=self.lineage)
            if snap is not None:
                self.snapshots.append(snap)
            return snap

    def __enter__(self) -> BufferedAppender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.flush()
