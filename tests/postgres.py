"""A throwaway PostgreSQL cluster for the shared-state tests and benchmarks.

``make sysdeps`` installs Debian's ``postgresql-15``, whose server binaries are outside PATH
(``/usr/lib/postgresql/<v>/bin``). ``initdb`` and ``pg_ctl`` refuse to run as root, so as root
the cluster runs as the ``postgres`` user in a folder owned by it. It listens on 127.0.0.1 on a
free port, trusts local connections, and is removed when stopped.

PostgreSQL cannot bind port 0 and report the port, so the server gets a port free now and, when
another process bound that port first (``could not bind IPv4 address``), is started again on a
fresh one (``factory.inference.launcher.on_free_port``).
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from factory.inference.launcher import PortInUseError, bind_failed, on_free_port


def server_bin() -> Path | None:
    """The folder of ``initdb`` and ``pg_ctl`` (the newest installed version), or None."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                   key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0)
    if found:
        return Path(found[-1]).parent
    on_path = shutil.which("initdb")
    return Path(on_path).parent if on_path else None


@dataclass
class Cluster:
    """A running cluster: ``url(db)`` for a database in it."""

    bin: Path
    root: Path
    port: int
    as_postgres: bool

    def _run(self, *argv: str) -> None:
        cmd = ["runuser", "-u", "postgres", "--", *argv] if self.as_postgres else list(argv)
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)

    @classmethod
    def start(cls, *, durable: bool = False, ports: Iterable[int] | None = None) -> Cluster:
        """Create and start a cluster. ``durable=False`` turns fsync off: tests check what the
        factory does, not the disk; a benchmark passes True to measure real commits.
        ``ports``: the ports to try in turn (default: fresh free ones)."""
        binary = server_bin()
        if binary is None:
            raise FileNotFoundError("no PostgreSQL server binaries (initdb): run `make sysdeps`")
        as_postgres = os.geteuid() == 0
        root = Path(tempfile.mkdtemp(prefix="factory-pg-"))
        if as_postgres:
            shutil.chown(root, "postgres", "postgres")
        cluster = cls(bin=binary, root=root, port=0, as_postgres=as_postgres)
        try:
            cluster._run(str(binary / "initdb"), "-D", str(root / "data"), "-A", "trust",
                         "-U", "postgres", "--no-sync", "-E", "UTF8")
            on_free_port(lambda port: cluster._serve(port, durable=durable), ports=ports)
        except BaseException:
            shutil.rmtree(root, ignore_errors=True)
            raise
        return cluster

    def _serve(self, port: int, *, durable: bool) -> None:
        """Start the server on ``port``; ``PortInUseError`` when another process holds it."""
        log = self.root / "server.log"
        offset = log.stat().st_size if log.exists() else 0
        options = (f"-p {port} -k {self.root} -c listen_addresses=127.0.0.1 "
                   f"-c max_connections=200" + ("" if durable else " -c fsync=off"))
        try:
            self._run(str(self.bin / "pg_ctl"), "-D", str(self.root / "data"), "-o", options,
                      "-l", str(log), "-w", "start")
        except subprocess.CalledProcessError:
            with open(log, "rb") as f:
                f.seek(offset)
                if bind_failed(f.read().decode("utf-8", "replace")):
                    raise PortInUseError(f"PostgreSQL could not bind 127.0.0.1:{port}") from None
            raise
        self.port = port

    def stop(self) -> None:
        try:
            self._run(str(self.bin / "pg_ctl"), "-D", str(self.root / "data"), "-m", "immediate",
                      "-w", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        """The URL of a new, empty database in this cluster."""
        import psycopg2

        name = f"t_{uuid.uuid4().hex[:12]}"
        con = psycopg2.connect(self.url())
        try:
            con.autocommit = True
            with con.cursor() as cur:
                cur.execute(f'CREATE DATABASE "{name}"')  # an identifier: cannot be bound
        finally:
            con.close()
        return self.url(name)
