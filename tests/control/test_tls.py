"""The server over TLS: a real ``tidal server --tls-cert --tls-key`` process
on loopback with a certificate made here; the CLI and API client verify it
against ``$TIDAL_CA_FILE`` and refuse it without that CA."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tidal.cli.main import app
from tidal.control.client import Api
from tidal.control.local import free_port
from tidal.httpjson import BadCertificate


def _certificate(d: Path) -> tuple[Path, Path]:
    cert, key = d / "server.pem", d / "server.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    return cert, key


@pytest.mark.slow  # 8 s: the default suite stays within 5 min
@pytest.mark.timeout(120)
def test_the_server_speaks_tls_and_clients_verify_it(tmp_path, monkeypatch):
    if subprocess.run(["which", "openssl"], capture_output=True).returncode:
        pytest.skip("openssl not installed")
    cert, key = _certificate(tmp_path)
    port, home = free_port(), tmp_path / "home"
    env = dict(os.environ, TIDAL_HOME=str(home), TIDAL_ADMIN_TOKEN="tls-admin")
    proc = subprocess.Popen([sys.executable, "-m", "tidal", "server", "--port", str(port), "--tls-cert", str(cert),
                             "--tls-key", str(key)], env=env, stdout=open(tmp_path / "server.log", "wb"), stderr=subprocess.STDOUT)
    url = f"https://127.0.0.1:{port}"
    try:
        monkeypatch.setenv("TIDAL_CA_FILE", str(cert))
        api = Api(url, "tls-admin")
        deadline = time.monotonic() + 60
        while not api.healthy():
            assert proc.poll() is None and time.monotonic() < deadline, "the TLS server did not come up"
            time.sleep(0.2)
        assert api.cluster()["nodes"] == []
        res = CliRunner().invoke(app, ["jobs", "--server", url, "--token", "tls-admin"])
        assert res.exit_code == 0, res.output
        assert "tls-admin" not in " ".join(open(f"/proc/{proc.pid}/cmdline").read().split("\0"))
        monkeypatch.delenv("TIDAL_CA_FILE")  # the system's CAs do not know this certificate
        with pytest.raises(BadCertificate, match="TIDAL_CA_FILE"):
            Api(url, "tls-admin").cluster()
        res = CliRunner().invoke(app, ["jobs", "--server", url, "--token", "tls-admin"])
        assert res.exit_code == 1 and "certificate does not verify" in " ".join(res.output.split())
        assert (home / "admin.token").stat().st_mode & 0o077 == 0  # the token files are the owner's only
        assert (home / "agent.token").stat().st_mode & 0o077 == 0
        assert (home / "tidal.db").stat().st_mode & 0o077 == 0
    finally:
        proc.terminate()
        proc.wait(timeout=20)
