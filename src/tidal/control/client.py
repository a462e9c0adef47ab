"""Client of the control plane's REST API, and where the CLI finds the server.

Server URL: ``--server``, ``$TIDAL_SERVER`` or ``$TIDAL_HOME/server.json``
(written by ``tidal server`` / ``tidal up``). Token: ``--token``,
``$TIDAL_TOKEN``, ``$TIDAL_HOME/token`` (a user's) or ``$TIDAL_HOME/admin.token``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import httpx


def home() -> Path:
    return Path(os.environ.get("TIDAL_HOME", Path.home() / ".tidal"))


def find_server(explicit: str | None = None) -> str:
    if explicit:
        return explicit.rstrip("/")
    if os.environ.get("TIDAL_SERVER"):
        return os.environ["TIDAL_SERVER"].rstrip("/")
    f = home() / "server.json"
    if f.exists():
        return json.loads(f.read_text())["url"].rstrip("/")
    return "http://127.0.0.1:8470"


def find_token(explicit: str | None = None) -> str:
    if explicit:
        return explicit
    if os.environ.get("TIDAL_TOKEN"):
        return os.environ["TIDAL_TOKEN"]
    for name in ("token", "admin.token"):
        f = home() / name
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
    def __init__(self, server: str | None = None, token: str | None = None, timeout_s: float = 15.0) -> None:
        self.url = find_server(server)
        self.http = httpx.Client(base_url=self.url, timeout=timeout_s,
                                 headers={"Authorization": f"Bearer {find_token(token)}"})

    def _call(self, method: str, path: str, **kw: Any) -> Any:
        r = self.http.request(method, path, **kw)
        if r.status_code >= 400:
            try:
                detail = r.json().get("detail", r.text)
            except ValueError:
                detail = r.text
            raise ApiError(r.status_code, detail)
        ct = r.headers.get("content-type", "")
        return r.json() if ct.startswith("application/json") else r.text

    def submit(self, spec: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", "/v1/jobs", json=spec)

    def jobs(self) -> list[dict[str, Any]]:
        return self._call("GET", "/v1/jobs")

    def job(self, job_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/jobs/{job_id}")

    def scale(self, job_id: str, gpus: int) -> dict[str, Any]:
        return self._call("POST", f"/v1/jobs/{job_id}/scale", json={"gpus": gpus})

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self._call("POST", f"/v1/jobs/{job_id}/cancel")

    def logs(self, job_id: str, offset: int = 0, worker: str | None = None) -> str:
        params: dict[str, Any] = {"offset": offset}
        if worker:
            params["worker"] = worker
        return self._call("GET", f"/v1/jobs/{job_id}/logs", params=params)

    def cluster(self) -> dict[str, Any]:
        return self._call("GET", "/v1/cluster")

    def events(self, since: int = 0) -> list[dict[str, Any]]:
        return self._call("GET", "/v1/events", params={"since": since})

    def add_user(self, name: str) -> str:
        return self._call("POST", f"/v1/users/{name}")["token"]

    def healthy(self) -> bool:
        try:
            return self.http.get("/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False
