"""The control plane's roles and their credentials (docs/security.md).

* **admin** — the operator: a random token (``$TIDAL_HOME/admin.token``, mode
  0600), stored hashed in the users table; may do everything.
* **tenant** — a user (``tidal user NAME``): its own jobs only.
* **agent** — the join token agents start with (``$TIDAL_HOME/agent.token``):
  it can only register a node, and the registration answers with that node's
  credential.
* **node** — one agent's credential: that node's heartbeats only.
* **job** — one job's credential, given to its master and its workers by the
  agent that starts them (never stored): that job's internal routes and its
  master's HTTP API only.

Agent, node and job credentials are HMACs of the server's secret
(``$TIDAL_HOME/server.secret``, 0600), so none is kept in the database and a
restarted server (or another server with the same secret) recognises them.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import secrets
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

ADMIN, TENANT, AGENT, NODE, JOB = "admin", "tenant", "agent", "node", "job"


@dataclass(frozen=True)
class Principal:
    """Who is calling: ``role`` and, for node and job credentials, the
    node or job it is bound to (``scope``)."""

    name: str
    role: str
    scope: str = ""

    @property
    def admin(self) -> bool:
        return self.role == ADMIN


def _b64(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def _unb64(text: str) -> str:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)).decode()


class Credentials:
    """Issues and checks the derived credentials (agent, node, job)."""

    PREFIX = {AGENT: "tda", NODE: "tdn", JOB: "tdj"}

    def __init__(self, secret: bytes | None = None) -> None:
        self._secret = secret or secrets.token_bytes(32)

    @classmethod
    def from_file(cls, path: Path) -> "Credentials":
        """The secret in ``path`` (created with mode 0600 if missing)."""
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch(mode=0o600)
            path.write_text(secrets.token_hex(32))
        if path.stat().st_mode & 0o077:
            try:
                path.chmod(0o600)
            except OSError as e:  # e.g. a read-only mount (a Kubernetes Secret): say so, do not stop
                log.warning("%s is readable by others and cannot be made private: %s", path, e)
        return cls(bytes.fromhex(path.read_text().strip()))

    def _mac(self, role: str, scope: str) -> str:
        return hmac.new(self._secret, f"{role}\0{scope}".encode(), hashlib.sha256).hexdigest()[:40]

    def issue(self, role: str, scope: str = "") -> str:
        """The credential of ``role`` (agent, node or job) bound to ``scope``."""
        return f"{self.PREFIX[role]}.{_b64(scope)}.{self._mac(role, scope)}"

    def agent_token(self) -> str:
        return self.issue(AGENT)

    def node_token(self, node: str) -> str:
        return self.issue(NODE, node)

    def job_token(self, job: str) -> str:
        return self.issue(JOB, job)

    def check(self, token: str) -> Principal | None:
        """The principal of a derived credential, None if it is not one of ours."""
        parts = token.split(".")
        if len(parts) != 3:
            return None
        role = next((r for r, p in self.PREFIX.items() if p == parts[0]), None)
        if role is None:
            return None
        try:
            scope = _unb64(parts[1])
        except (ValueError, UnicodeDecodeError):
            return None
        if not hmac.compare_digest(parts[2], self._mac(role, scope)):
            return None
        return Principal(name=f"{role}:{scope}" if scope else role, role=role, scope=scope)
