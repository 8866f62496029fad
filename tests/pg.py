"""A throw-away PostgreSQL server for the registry tests (Debian's postgresql packages, no Docker).

It runs as the `postgres` OS user (initdb refuses root), listens on 127.0.0.1 and a socket in its
own temporary directory, and is stopped when the test session ends.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

from common.procs import free_port, wait_for_port


def _bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    if not found:
        raise RuntimeError(f"PostgreSQL's {name} not found: apt-get install postgresql (see .ci/run)")
    return found[-1]


def _as_postgres(cmd: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


class PostgresServer:
    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="fedforge-pg-"))
        self.port = free_port()
        if os.geteuid() == 0:
            shutil.chown(self.dir, "postgres", "postgres")
        data = self.dir / "data"
        subprocess.run(_as_postgres([_bin("initdb"), "-D", str(data), "-A", "trust", "-U", "fedforge", "--no-sync"]),
                       check=True, capture_output=True)
        subprocess.run(_as_postgres([_bin("pg_ctl"), "-D", str(data), "-l", str(self.dir / "log"), "-w", "start", "-o",
                                     f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off"]),
                       check=True, capture_output=True)
        wait_for_port("127.0.0.1", self.port, 30)
        self.data = data

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://fedforge@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        import psycopg

        name = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(f"host=127.0.0.1 port={self.port} user=fedforge dbname=postgres", autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def stop(self) -> None:
        subprocess.run(_as_postgres([_bin("pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop"]), capture_output=True, check=False)
        shutil.rmtree(self.dir, ignore_errors=True)
