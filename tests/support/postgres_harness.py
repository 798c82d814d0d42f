"""A real, throwaway PostgreSQL server for the tests: ``initdb`` in a temporary folder, ``pg_ctl start`` on a free
loopback port (no Unix socket in a shared place, trust authentication on loopback only), a fresh database per test,
and ``pg_ctl stop`` at the end of the session. The server can be stopped and started mid-test (``stop``/``start``),
as a database restarted under a running queue.

The binaries are found on ``PATH`` or in Debian's ``/usr/lib/postgresql/<version>/bin`` (``.ci/run`` installs
Debian's ``postgresql`` package when they are missing); PostgreSQL refuses to run as root, so as root the server runs
as the ``postgres`` user. Where neither the binaries nor psycopg can be had, the tests that need the server skip and
say why.
"""
from __future__ import annotations

import glob
import os
import pwd
import secrets
import shutil
import socket
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest


def find_bindir() -> Path | None:
    """The folder of ``initdb`` and ``pg_ctl``: PATH first, then the newest of Debian's versioned folders."""
    found = shutil.which("initdb")
    if found and shutil.which("pg_ctl"):
        return Path(found).parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3])
                      if Path(p).parts[-3].isdigit() else 0)
    return Path(versions[-1]).parent if versions else None


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class PostgresServer:
    """One cluster in ``root``, served on 127.0.0.1:``port``."""

    bindir: Path
    root: Path
    port: int
    user: str | None

    @property
    def data(self) -> Path:
        return self.root / "cluster"

    @property
    def log(self) -> Path:
        return self.root / "server.log"

    def _run(self, *args: str) -> None:
        command = [str(self.bindir / args[0]), *args[1:]]
        if self.user is not None:
            command = ["runuser", "-u", self.user, "--", *command]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
        if proc.returncode != 0:
            tail = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
            raise RuntimeError(f"{' '.join(args[:2])} failed ({proc.returncode}): {proc.stderr[-2000:]}\n{tail}")

    def init(self) -> None:
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync")

    def start(self) -> None:
        """Start the server and wait until it accepts connections."""
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", options, "-w", "-t", "60", "start")

    def stop(self) -> None:
        """Stop the server (``fast``: every connection is closed, as a restart does)."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "-t", "60", "stop")

    def running(self) -> bool:
        command = [str(self.bindir / "pg_ctl"), "-D", str(self.data), "status"]
        if self.user is not None:
            command = ["runuser", "-u", self.user, "--", *command]
        return subprocess.run(command, capture_output=True, timeout=60, check=False).returncode == 0

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        """A fresh, empty database; returns its URL."""
        import psycopg

        name = f"test_{secrets.token_hex(6)}"
        with psycopg.connect(self.url(), autocommit=True) as connection:
            connection.execute(f"CREATE DATABASE {name}")
        return self.url(name)


def start_server() -> PostgresServer:
    """A new cluster, started; skips the test when PostgreSQL or psycopg is not installed here."""
    pytest.importorskip("psycopg", reason="psycopg is not installed (pip install -e \".[fleet]\")")
    bindir = find_bindir()
    if bindir is None:
        pytest.skip("PostgreSQL's initdb/pg_ctl are not installed (Debian: apt-get install postgresql)")
    user = None
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root without a 'postgres' user: PostgreSQL refuses to run as root")
        user = "postgres"
    root = Path(tempfile.mkdtemp(prefix="pixal3d-pg-"))
    if user is not None:
        shutil.chown(root, user)
    server = PostgresServer(bindir, root, free_port(), user)
    server.init()
    server.start()
    return server


@pytest.fixture(scope="session")
def postgres():
    """The session's PostgreSQL server."""
    server = start_server()
    yield server
    try:
        server.stop()
    except RuntimeError:  # stopped by a test that failed halfway through a restart
        pass
    shutil.rmtree(server.root, ignore_errors=True)


@pytest.fixture
def postgres_url(postgres):
    """A fresh database on the session's server (started again if a test stopped it and failed before starting it)."""
    if not postgres.running():
        postgres.start()
    return postgres.new_database()
