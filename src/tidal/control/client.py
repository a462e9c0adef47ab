"""Client of the control plane's REST API, and where the CLI finds the server.

Server URL: ``--server``, ``$TIDAL_SERVER`` or ``$TIDAL_HOME/server.json``
(written by ``tidal server`` / ``tidal up``). Token: ``--token``,
``$TIDAL_TOKEN``, ``$TIDAL_HOME/token`` (a user's) or ``$TIDAL_HOME/admin.token``.
"""

from __future__ import annotations

import json
import secrets
from typing import Any
from urllib.parse import quote

from tidal import settings
from tidal.httpjson import JsonHttp, Unavailable
from tidal.net import LOOPBACK

DEFAULT_SERVER = f"http://{LOOPBACK}:8470"  # the single-host default (`tidal up`)


def find_server(explicit: str | None = None) -> str:
    if explicit:
        return explicit.rstrip("/")
    env = settings.SERVER.get()
    if env:
        return env.rstrip("/")
    f = settings.home() / "server.json"
    if f.exists():
        return json.loads(f.read_text())["url"].rstrip("/")
    return DEFAULT_SERVER


def find_token(explicit: str | None = None) -> str:
    if explicit:
        return explicit
    env = settings.TOKEN.get()
    if env:
        return env
    for name in ("token", "admin.token"):
        f = settings.home() / name
        if f.exists():
            return f.read_text().strip()
    return ""


class ApiError(RuntimeError):
    def __init__(self, status: int, detail: Any) -> None:
        self.status, self.detail = status, detail
        super().__init__(f"HTTP {status}: {format_detail(detail)}")


def format_detail(detail: Any) -> str:
    if isinstance(detail, list):  # pydantic validation errors
        return "; ".join(
            f"{'.'.join(str(x) for x in e.get('loc', []) if x != 'body')}: {e.get('msg')}" for e in detail
        )
    return str(detail)


class Api:
    """The REST API's calls. An unreachable server raises
    :class:`tidal.httpjson.Unavailable` once ``patience_s`` has run out; an
    answer of 400 or more raises :class:`ApiError`."""

    def __init__(self, server: str | None = None, token: str | None = None, timeout_s: float = 15.0,
                 patience_s: float = 2.0) -> None:
        self.url = find_server(server)
        self.token = find_token(token)
        self.http = JsonHttp(self.url, token=self.token, timeout_s=timeout_s, patience_s=patience_s)

    def _call(self, method: str, path: str, body: Any = None, params: dict[str, Any] | None = None,
              headers: dict[str, str] | None = None) -> Any:
        r = self.http.send(method, path, body, params, headers=headers)
        if r.status >= 400:
            try:
                detail = r.json().get("detail", r.text)
            except (ValueError, AttributeError):
                detail = r.text
            raise ApiError(r.status, detail)
        return r.json() if r.is_json else r.text

    def submit(self, spec: dict[str, Any], idempotency_key: str | None = None) -> dict[str, Any]:
        """Submit a job under an idempotency key (a fresh random one unless
        given): the transport's retries resend the same key, so a submission
        whose answer was lost is found, not created twice."""
        key = idempotency_key or secrets.token_urlsafe(24)
        return self._call("POST", "/v1/jobs", spec, headers={"Idempotency-Key": key})

    def jobs(self) -> list[dict[str, Any]]:
        return self._call("GET", "/v1/jobs")

    def job(self, job_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/jobs/{job_id}")

    def scale(self, job_id: str, gpus: int) -> dict[str, Any]:
        return self._call("POST", f"/v1/jobs/{job_id}/scale", {"gpus": gpus})

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self._call("POST", f"/v1/jobs/{job_id}/cancel")

    def logs(self, job_id: str, offset: int = 0, worker: str | None = None) -> str:
        return self._call("GET", f"/v1/jobs/{job_id}/logs", params={"offset": offset, "worker": worker or None})

    def cluster(self) -> dict[str, Any]:
        return self._call("GET", "/v1/cluster")

    def events(self, since: int = 0) -> list[dict[str, Any]]:
        return self._call("GET", "/v1/events", params={"since": since})

    def add_user(self, name: str, rotate: bool = False) -> str:
        return self._call("POST", f"/v1/users/{quote(name, safe='')}" + ("?rotate=true" if rotate else ""))["token"]

    def healthy(self) -> bool:
        """One quick probe of ``/healthz`` (no retries)."""
        probe = JsonHttp(self.url, timeout_s=2.0, patience_s=0.0)
        try:
            return probe.send("GET", "/healthz").status == 200
        except (Unavailable, ValueError):
            return False
        finally:
            probe.close()
