"""A real PostgreSQL server for the test run: `initdb` and `pg_ctl` in a temporary directory
on a free loopback port (PostgreSQL refuses to run as root, so as root it runs as the
`postgres` user). The binaries come from PATH or Debian's /usr/lib/postgresql/*/bin
(`.ci/run` installs the `postgresql` package where neither has them)."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import psycopg

from tests.governor.server_thread import free_port


class PostgresUnavailable(RuntimeError):
    """No PostgreSQL binaries, or the server would not start."""


def find_bin_dir() -> Path:
    on_path = shutil.which("pg_ctl")
    if on_path and shutil.which("initdb"):
        return Path(on_path).parent
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"),
                   key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0)
    if not found:
        raise PostgresUnavailable("no PostgreSQL binaries (pg_ctl, initdb) on PATH or under "
                                  "/usr/lib/postgresql/*/bin; .ci/run installs `postgresql`")
    return Path(found[-1]).parent


@dataclass
class PostgresServer:
    root: Path
    port: int
    bin_dir: Path
    run_as: str | None

    @property
    def data(self) -> Path:
        return self.root / "data"

    def dsn(self, database: str = "postgres") -> str:
        return f"postgresql://fak@127.0.0.1:{self.port}/{database}"

    def _run(self, tool: str, *args: str) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.bin_dir / tool), *args]
        if self.run_as:
            cmd = ["runuser", "-u", self.run_as, "--", *cmd]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120)

    def initdb(self) -> None:
        done = self._run("initdb", "-D", str(self.data), "-U", "fak", "--auth=trust",
                         "-E", "UTF8", "--no-sync")
        if done.returncode:
            raise PostgresUnavailable(f"initdb failed: {done.stderr.strip()}")

    def start(self) -> None:
        options = (f"-c listen_addresses=127.0.0.1 -p {self.port} "
                   f"-c unix_socket_directories={self.root} -c max_connections=200")
        done = self._run("pg_ctl", "-D", str(self.data), "-l", str(self.root / "server.log"),
                         "-o", options, "-w", "-t", "60", "start")
        if done.returncode:
            log = (self.root / "server.log").read_text()[-2000:] if (
                self.root / "server.log").exists() else ""
            raise PostgresUnavailable(f"pg_ctl start failed: {done.stderr.strip()}\n{log}")

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop")

    def create_database(self) -> str:
        name = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")  # name is ours: hex only
        return self.dsn(name)


def start_postgres() -> PostgresServer:
    run_as = None
    root = Path(tempfile.mkdtemp(prefix="fak-pg-"))
    if os.geteuid() == 0:
        try:
            user = pwd.getpwnam("postgres")
        except KeyError as exc:
            raise PostgresUnavailable("running as root and no `postgres` user to run "
                                      "PostgreSQL as (install the postgresql package)") from exc
        os.chown(root, user.pw_uid, user.pw_gid)
        run_as = "postgres"
    server = PostgresServer(root, free_port(), find_bin_dir(), run_as)
    server.initdb()
    server.start()
    return server


def remove_postgres(server: PostgresServer) -> None:
    server.stop("immediate")
    shutil.rmtree(server.root, ignore_errors=True)
