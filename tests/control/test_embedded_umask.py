"""An in-process server (``tidal up``, a test's cluster) makes its store,
tokens and logs private with a umask of 077 while it serves, and gives the
process its own umask back when it stops: a process that goes on after its
cluster (a test run, a notebook) makes files as before. A leaked 077 made a
later ``--run-as`` cluster's home 0700, which its jobs' users could not
pass (their masters exited 1 on their credential file)."""

from __future__ import annotations

import os
import stat

from tidal.control.local import EmbeddedServer, LocalCluster


def test_an_in_process_server_keeps_its_umask_to_itself(tmp_path):
    old = os.umask(0o022)
    try:
        server = EmbeddedServer(LocalCluster(tmp_path / "home", policy="fifo"))
        server.start()
        try:
            assert stat.S_IMODE((tmp_path / "home" / "admin.token").stat().st_mode) == 0o600
            assert stat.S_IMODE((tmp_path / "home" / "tidal.db").stat().st_mode) & 0o077 == 0  # the store: private
        finally:
            server.stop()
        after = os.umask(0o022)
        assert after == 0o022, oct(after)
        (tmp_path / "later").mkdir()
        assert stat.S_IMODE((tmp_path / "later").stat().st_mode) == 0o755
    finally:
        os.umask(old)
