"""Where the factory keeps its state, read from the environment once per call.

Embedded default: everything lives under ``$FACTORY_HOME`` (default ``./.factory``), so pointing
it at an empty folder gives a fresh factory.

Past one machine, three settings split that state into what nodes share and what stays on the
node:

- ``FACTORY_DATABASE_URL=postgresql://...`` puts the Iceberg catalog (pyiceberg's SQL catalog)
  and Dagster's run, event and schedule storage (``dagster-postgres``) in that database.
- ``FACTORY_WAREHOUSE`` (a shared path, ``file://`` URI or object-store URI such as ``s3://``)
  holds table data. When it is a filesystem path, the artifacts several nodes open (blobs,
  checkpoints, built base models, the trainer's job files) go under it too.
- ``FACTORY_SHARED_DIR`` (a shared filesystem path) holds those artifacts instead; it is needed
  when table data is in an object store or named by ``FACTORY_CATALOG``, because the trainer and
  the inference server open checkpoints and models as files.

What only one node uses stays under ``$FACTORY_HOME``: the gateway's spool, the upload drop
folder, the Dagster home (its ``dagster.yaml``, compute logs), logs and caches.

``FACTORY_SPARK_MASTER`` picks where the Spark curation engine runs: ``local[N]`` (the default,
in process), a standalone cluster (``spark://host:port``), Kubernetes (``k8s://https://...``) or
a Spark Connect server (``sc://host:port``). Past ``local``, executors open the tokenizer folder
(under ``FACTORY_MODELS_DIR``) and write the staging Parquet (under the warehouse) by the same
paths as the driver, so both must be on the shared filesystem.

``FACTORY_GATEWAY_URL`` (default ``http://127.0.0.1:8787``) is where the factory's own clients
reach the gateway (the comparison page's vibe check, synthesis teachers behind it), and
``FACTORY_GATEWAY_KEY`` the factory key they send it in ``X-Factory-Key``: once any key exists
(``factory keys create``) the gateway refuses calls without one, its own clients' included.

``FACTORY_CATALOG`` (a catalog pyiceberg configures itself) and ``FACTORY_DATABASE_URL`` both
name where the catalog lives: together they are an error, as is ``FACTORY_WAREHOUSE`` with
``FACTORY_CATALOG`` (that catalog's own ``warehouse`` property places its data).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from factory.errors import SettingsError

SPARK_MASTER_SCHEMES = ("spark", "k8s", "sc")
"""URL schemes ``FACTORY_SPARK_MASTER`` accepts besides ``local``/``local[N]``: a standalone
master, a Kubernetes API server, a Spark Connect server."""

_LOCAL_MASTER = re.compile(r"local(\[(\*|[1-9][0-9]*)(,[1-9][0-9]*)?\])?")

POSTGRES_SCHEMES = ("postgresql", "postgresql+psycopg2")
"""URL schemes ``FACTORY_DATABASE_URL`` accepts: SQLAlchemy's names for the psycopg2 driver,
which pyiceberg's SQL catalog and dagster-postgres both use (SQLAlchemy 2 refuses the
``postgres://`` alias, and Dagster reads the variable as it is)."""

DEFAULT_GATEWAY_URL = "http://127.0.0.1:8787"
"""Where ``factory serve`` listens by default."""


@dataclass(frozen=True, kw_only=True)
class Settings:
    """Paths and locations of the factory's state, and where its own clients reach its gateway."""

    home: Path
    """Root of the node-local state (``$FACTORY_HOME``)."""
    experiments_dir: Path
    """Folder of experiment files (``$FACTORY_EXPERIMENTS_DIR``, default ``experiments/``)."""
    models_dir: Path
    """Built base models (``$FACTORY_MODELS_DIR``, default ``models/`` of the shared root)."""
    database_url: str | None = None
    """PostgreSQL holding the catalog and Dagster's storage (``$FACTORY_DATABASE_URL``); None
    for the embedded SQLite catalog and Dagster's SQLite storage under ``home``."""
    catalog_name: str | None = None
    """A catalog pyiceberg configures from its own settings (``$FACTORY_CATALOG``)."""
    warehouse_uri: str | None = None
    """Where table data goes (``$FACTORY_WAREHOUSE``: a path, ``file://`` or object-store URI);
    None for ``home/warehouse``."""
    shared_dir: Path | None = None
    """Root of the artifacts several nodes open (``$FACTORY_SHARED_DIR``); None for the
    warehouse when it is a filesystem path, else ``home``."""
    spark_master: str | None = None
    """Master of the Spark curation engine (``$FACTORY_SPARK_MASTER``): ``local[N]``,
    ``spark://``, ``k8s://`` or Spark Connect ``sc://``; None for ``local`` on this machine's
    cores."""
    gateway_url: str = DEFAULT_GATEWAY_URL
    """The gateway the factory's own clients call (``$FACTORY_GATEWAY_URL``), no ``/v1``."""
    gateway_key: str | None = field(default=None, repr=False)
    """The factory key those clients send the gateway in ``X-Factory-Key``
    (``$FACTORY_GATEWAY_KEY``); None while the gateway has no keys (it then serves 127.0.0.1
    only). Left out of ``repr``: settings get logged."""
    vllm_python: Path | None = None
    """The Python of the environment vLLM is installed in (``$FACTORY_VLLM_PYTHON``), which the
    ``vllm`` backend starts as ``python -m vllm.entrypoints.openai.api_server``; None: the
    ``vllm`` on ``PATH``, else the checkout's ``.venv-vllm`` (``make vllm``), as
    ``factory.inference.vllm.local_vllm`` finds them."""

    def __post_init__(self) -> None:
        if self.catalog_name and self.database_url:
            raise SettingsError(
                "FACTORY_CATALOG and FACTORY_DATABASE_URL both say where the catalog is: keep "
                "FACTORY_CATALOG for a catalog pyiceberg configures (REST, Glue, Hive), or "
                "FACTORY_DATABASE_URL for the SQL catalog on PostgreSQL, not both")
        if self.catalog_name and self.warehouse_uri:
            raise SettingsError(
                f"FACTORY_WAREHOUSE is set with FACTORY_CATALOG={self.catalog_name}: that "
                "catalog's own 'warehouse' property places table data; set FACTORY_SHARED_DIR "
                "for the shared artifacts instead")
        if self.database_url is not None:
            scheme = urlsplit(self.database_url).scheme
            if scheme not in POSTGRES_SCHEMES:
                raise SettingsError(
                    f"FACTORY_DATABASE_URL must be a postgresql:// URL, got scheme {scheme!r}"
                    + (" (write postgresql://)" if scheme == "postgres" else ""))
        if self.spark_master is not None:
            check_spark_master(self.spark_master)
        if (self.shared_dir is None and self.warehouse_uri is not None
                and _local_path(self.warehouse_uri) is None):
            raise SettingsError(
                f"FACTORY_WAREHOUSE={self.warehouse_uri} puts table data in an object store; "
                "checkpoints, blobs and built models are files every node opens: set "
                "FACTORY_SHARED_DIR to a shared filesystem path for them")

    # -- shared state ------------------------------------------------------------------------
    @property
    def shared(self) -> Path:
        """Root of the artifacts several nodes open (``home`` on one machine)."""
        if self.shared_dir is not None:
            return self.shared_dir
        local = _local_path(self.warehouse_uri) if self.warehouse_uri else None
        return local if local is not None else self.home

    @property
    def warehouse_location(self) -> str:
        """The warehouse as the catalog takes it (a URI)."""
        if self.warehouse_uri is None:
            return (self.home / "warehouse").as_uri()
        local = _local_path(self.warehouse_uri)
        return local.as_uri() if local is not None else self.warehouse_uri

    @property
    def warehouse(self) -> Path:
        """The warehouse as a folder; a ``SettingsError`` when it is in an object store."""
        if self.warehouse_uri is None:
            return self.home / "warehouse"
        local = _local_path(self.warehouse_uri)
        if local is None:
            raise SettingsError(f"FACTORY_WAREHOUSE={self.warehouse_uri} is not a folder")
        return local

    @property
    def blobs(self) -> Path:
        return self.shared / "blobs"

    @property
    def checkpoints(self) -> Path:
        return self.shared / "checkpoints"

    @property
    def runs(self) -> Path:
        """Trainer job files and their data: read by whichever node runs the trainer."""
        return self.shared / "runs"

    # -- node-local state --------------------------------------------------------------------
    @property
    def catalog_db(self) -> Path:
        """The embedded SQLite catalog (used without ``database_url`` and ``catalog_name``)."""
        return self.home / "catalog.db"

    @property
    def spool(self) -> Path:
        return self.home / "spool"

    @property
    def uploads(self) -> Path:
        return self.home / "uploads"

    @property
    def dagster_home(self) -> Path:
        return self.home / "dagster"

    def ensure(self) -> Settings:
        local = [self.home, self.spool, self.uploads, self.dagster_home]
        shared = [self.blobs, self.checkpoints, self.runs, self.models_dir]
        if _local_path(self.warehouse_location) is not None:
            shared.append(self.warehouse)
        for path in local + shared:
            path.mkdir(parents=True, exist_ok=True)
        return self


def check_spark_master(master: str) -> str:
    """``master`` when Spark can run there (``SPARK_MASTER_SCHEMES`` or ``local[N]``), else a
    ``SettingsError`` saying what is accepted."""
    scheme, sep, rest = master.partition("://")
    if _LOCAL_MASTER.fullmatch(master) or (sep and scheme in SPARK_MASTER_SCHEMES and rest):
        return master
    raise SettingsError(
        f"FACTORY_SPARK_MASTER={master!r}: use local, local[N], spark://HOST:PORT (standalone), "
        "k8s://https://HOST:PORT (Kubernetes) or sc://HOST:PORT (Spark Connect)")


def _local_path(location: str) -> Path | None:
    """``location`` as a folder when it is a plain path or a ``file://`` URI, else None."""
    parts = urlsplit(location)
    if parts.scheme == "file":
        return Path(unquote(parts.path)).absolute()
    if parts.scheme == "":
        return Path(location).expanduser().absolute()
    return None


def get_settings() -> Settings:
    """Read the settings from the environment (not cached: tests switch ``FACTORY_HOME``)."""
    env = os.environ
    home = Path(env.get("FACTORY_HOME") or ".factory").absolute()
    experiments = Path(env.get("FACTORY_EXPERIMENTS_DIR") or "experiments").absolute()
    shared_dir = (Path(env["FACTORY_SHARED_DIR"]).expanduser().absolute()
                  if env.get("FACTORY_SHARED_DIR") else None)
    settings = Settings(home=home, experiments_dir=experiments, models_dir=home / "models",
                        database_url=env.get("FACTORY_DATABASE_URL") or None,
                        catalog_name=env.get("FACTORY_CATALOG") or None,
                        warehouse_uri=env.get("FACTORY_WAREHOUSE") or None,
                        shared_dir=shared_dir,
                        spark_master=env.get("FACTORY_SPARK_MASTER") or None,
                        gateway_url=(env.get("FACTORY_GATEWAY_URL")
                                     or DEFAULT_GATEWAY_URL).rstrip("/"),
                        gateway_key=env.get("FACTORY_GATEWAY_KEY") or None,
                        vllm_python=(Path(env["FACTORY_VLLM_PYTHON"]).expanduser()
                                     if env.get("FACTORY_VLLM_PYTHON") else None))
    models = Path(env.get("FACTORY_MODELS_DIR") or settings.shared / "models").absolute()
    return replace(settings, models_dir=models)


def env_json_object(var: str) -> dict[str, Any] | None:
    """The JSON object in ``$var`` (``FACTORY_PROVIDERS``, ``FACTORY_JUDGE``,
    ``FACTORY_DEPLOYER``); None when it is unset or empty, ``ValueError`` when it is not one."""
    raw = os.environ.get(var)
    if not raw:
        return None
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"{var}: not JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{var}: must be a JSON object, got {type(config).__name__}")
    return config
