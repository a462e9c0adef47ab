"""Python client of the job master's HTTP JSON protocol (see
:mod:`tidal.runtime.master`). Used by workers, by ``tidal scale`` and, later,
by the control plane."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import uuid
from typing import Any
from urllib.parse import urlencode, urlparse

from tidal.runtime.messages import ScaleAnswer, Status


class MasterUnavailable(RuntimeError):
    """The master did not answer within the client's patience."""


class MasterClient:
    """Thread-safe (one keep-alive connection per thread). Follows ``moved``
    answers after a master handover and retries connection errors for up to
    ``patience_s`` (a restarting master)."""

    def __init__(self, url: str, timeout_s: float = 10.0, patience_s: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.patience_s = patience_s
        self._local = threading.local()

    # ------------------------------------------------------------------ transport
    def _conn(self) -> http.client.HTTPConnection:
        c = getattr(self._local, "conn", None)
        if c is None or getattr(self._local, "url", None) != self.url:
            u = urlparse(self.url)
            c = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port or 80, timeout=self.timeout_s)
            c.connect()
            c.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._local.conn, self._local.url = c, self.url
        return c

    def _drop(self) -> None:
        c = getattr(self._local, "conn", None)
        if c is not None:
            c.close()
        self._local.conn = None

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
        deadline = time.monotonic() + self.patience_s
        for _ in range(8):  # bounded number of redirects
            while True:
                try:
                    c = self._conn()
                    data = json.dumps(body or {}).encode() if method == "POST" else None
                    headers = {"Content-Type": "application/json"} if data is not None else {}
                    c.request(method, path, body=data, headers=headers)
                    r = c.getresponse()
                    code, obj = r.status, json.loads(r.read() or b"{}")
                    break
                except (ConnectionError, http.client.HTTPException, OSError) as e:
                    self._drop()
                    if time.monotonic() > deadline:
                        raise MasterUnavailable(f"{self.url}{path}: {e}") from e
                    time.sleep(0.05)
            if obj.get("status") == "moved":
                self.url = str(obj["url"]).rstrip("/")
                continue
            return code, obj
        raise MasterUnavailable("too many redirects")

    def post(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.request("POST", path, body)[1]

    def get(self, path: str, **query: Any) -> dict[str, Any]:
        q = ("?" + urlencode(query)) if query else ""
        return self.request("GET", path + q)[1]

    # ------------------------------------------------------------------ scheduler API
    # scaling requests carry an id: the transport retries a request whose answer
    # was lost (master restart), and the master answers a repeated id only once
    def scale_out(self, n: int | None = None, hosts: list[str] | None = None) -> ScaleAnswer:
        return ScaleAnswer.from_json(self.post("/scale_out", {"n": n, "hosts": hosts, "request_id": uuid.uuid4().hex}))

    def scale_in(self, n: int | None = None, ranks: list[int] | None = None) -> ScaleAnswer:
        return ScaleAnswer.from_json(self.post("/scale_in", {"n": n, "ranks": ranks, "request_id": uuid.uuid4().hex}))

    def migrate(self, ranks: list[int], hosts: list[str] | None = None) -> ScaleAnswer:
        return ScaleAnswer.from_json(self.post("/migrate", {"ranks": ranks, "hosts": hosts, "request_id": uuid.uuid4().hex}))

    def suspend(self) -> ScaleAnswer:
        return ScaleAnswer.from_json(self.post("/suspend", {"request_id": uuid.uuid4().hex}))

    def reshare(self, shares: dict[str, float]) -> ScaleAnswer:
        return ScaleAnswer.from_json(self.post("/reshare", {"shares": shares, "request_id": uuid.uuid4().hex}))

    def status(self) -> Status:
        return Status.from_json(self.get("/status"))

    def scale_to(self, workers: int, timeout_s: float = 120.0) -> ScaleAnswer:
        """Ask for ``workers`` workers, retrying while another change is in
        progress. Returns the accepted (or error) answer."""
        deadline = time.monotonic() + timeout_s
        while True:
            st = self.status()
            if st.state == "finished":
                return ScaleAnswer("error", "job finished")
            cur = st.world_size
            if st.state not in ("forming", "changing") and cur == workers:
                return ScaleAnswer("accepted", "already at that size", target_size=workers)
            if st.state in ("forming", "changing"):
                ans = ScaleAnswer("retry", st.pending or st.state, retry_after_s=0.2)
            elif workers > cur:
                ans = self.scale_out(workers - cur)
            else:
                ans = self.scale_in(cur - workers)
            if ans.status != "retry":
                return ans
            if time.monotonic() > deadline:
                return ans
            time.sleep(max(0.05, ans.retry_after_s))

    def wait_for(self, world_size: int, timeout_s: float = 120.0) -> Status:
        """Block until the job runs at ``world_size`` with no change pending."""
        deadline = time.monotonic() + timeout_s
        while True:
            st = self.status()
            if (st.world_size == world_size and not st.changing) or st.state == "finished":
                return st
            if time.monotonic() > deadline:
                raise TimeoutError(f"job did not reach {world_size} workers: {st}")
            time.sleep(0.05)
