"""A real PostgreSQL server for the store tests (Debian's postgresql package;
.ci/run installs it). Skipped with a reason where the binaries are missing."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest


def _pg_bin(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for d in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        if (d / name).exists():
            return str(d / name)
    return None


def _as_postgres(cmd: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


@pytest.fixture(scope="session")
def pg_url():
    initdb, pg_ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
    if not (initdb and pg_ctl):
        pytest.skip("PostgreSQL server binaries not installed (apt-get install postgresql)")
    pytest.importorskip("psycopg")
    # not under pytest's tmp dir: the postgres user must be able to reach it
    d = Path(tempfile.mkdtemp(prefix="tidal-pg-"))
    data = d / "data"
    if os.geteuid() == 0:
        shutil.chown(d, "postgres", "postgres")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    subprocess.run(_as_postgres([initdb, "-D", str(data), "-A", "trust", "-U", "postgres"]), check=True,
                   capture_output=True, timeout=120)
    subprocess.run(_as_postgres([pg_ctl, "-D", str(data), "-w", "-l", str(d / "log"), "-o",
                                 f"-p {port} -k {d} -c listen_addresses=127.0.0.1", "start"]),
                   check=True, capture_output=True, timeout=60)
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run(_as_postgres([pg_ctl, "-D", str(data), "-m", "fast", "stop"]), capture_output=True, timeout=60)
        shutil.rmtree(d, ignore_errors=True)


def reset_postgres(url: str) -> None:
    """An empty database (the PostgreSQL server lives for the session)."""
    from sqlalchemy import create_engine, text

    eng = create_engine(url)
    with eng.begin() as c:
        c.execute(text("DROP SCHEMA public CASCADE; CREATE SCHEMA public"))
    eng.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request, tmp_path):
    """A fresh store's URL: a SQLite file, or the session's PostgreSQL emptied."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 't.db'}"
    url = request.getfixturevalue("pg_url")
    reset_postgres(url)
    return url
