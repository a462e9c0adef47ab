"""Python client of the job master's HTTP JSON protocol (see
:mod:`tidal.runtime.server`). Used by workers, by ``tidal scale`` and by the
control plane's coordinator."""

from __future__ import annotations

import logging
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from tidal import settings
from tidal.httpjson import JsonHttp, Unavailable
from tidal.runtime.messages import ScaleAnswer, Status


log = logging.getLogger(__name__)

LOCATE_EVERY_S = 2.0  # while the master does not answer, look for a new address this often


class MasterUnavailable(Unavailable):
    """The master did not answer within the client's patience."""


def url_file(path: str | Path) -> Callable[[], str | None]:
    """A locator reading the master's current URL from ``path`` (the agent
    rewrites it when the master restarts on another host)."""

    def locate() -> str | None:
        try:
            return Path(path).read_text().strip() or None
        except OSError:
            return None

    return locate


def retry_while_busy(call: Callable[[], ScaleAnswer], timeout_s: float,
                     sleep: Callable[[float], None] = time.sleep) -> ScaleAnswer:
    """Repeat ``call`` while the master answers *retry* (a change is in
    progress, EDL §3.1), for up to ``timeout_s``; the last answer."""
    deadline = time.monotonic() + timeout_s
    while True:
        ans = call()
        if ans.status != "retry" or time.monotonic() > deadline:
            return ans
        sleep(max(0.05, ans.retry_after_s))


class MasterClient:
    """Thread-safe (one keep-alive connection per thread). Follows ``moved``
    answers after a master handover and retries connection errors for up to
    ``patience_s`` (a restarting master); meanwhile ``locate`` (if given)
    may name a new address: a master restarted on another host. ``token``:
    the job's credential (default ``$TIDAL_JOB_TOKEN``)."""

    def __init__(self, url: str, timeout_s: float = 10.0, patience_s: float = 30.0, token: str | None = None,
                 locate: Callable[[], str | None] | None = None) -> None:
        token = settings.job_token() if token is None else token
        self.http = JsonHttp(url, token=token, timeout_s=timeout_s, patience_s=patience_s)
        self.locate = locate

    @property
    def url(self) -> str:
        return self.http.url

    @url.setter
    def url(self, value: str) -> None:
        self.http.url = value.rstrip("/")
        self.http.urls = [self.http.url]

    def request(self, method: str, path: str, body: dict[str, Any] | None = None,
                patience_s: float | None = None) -> tuple[int, dict[str, Any]]:
        for _ in range(8):  # bounded number of redirects
            try:
                code, obj = self._call(method, path, body if method == "POST" else None, patience_s)
            except Unavailable as e:
                raise MasterUnavailable(str(e)) from e
            if not isinstance(obj, dict):
                obj = {"status": "error", "message": str(obj)}
            if obj.get("status") == "moved":
                self.url = str(obj["url"])
                continue
            return code, obj
        raise MasterUnavailable("too many redirects")

    def _call(self, method: str, path: str, body: dict[str, Any] | None,
              patience_s: float | None) -> tuple[int, Any]:
        """One call; while the master does not answer, ask ``locate`` every
        :data:`LOCATE_EVERY_S` whether it moved, until the patience is spent."""
        if self.locate is None:
            return self.http.call(method, path, body, patience_s=patience_s)
        deadline = time.monotonic() + (self.http.patience_s if patience_s is None else patience_s)
        while True:
            left = max(0.0, deadline - time.monotonic())
            try:
                return self.http.call(method, path, body, patience_s=min(LOCATE_EVERY_S, left))
            except Unavailable:
                if self.relocate():
                    continue
                if time.monotonic() >= deadline:
                    raise

    def relocate(self) -> bool:
        """Ask ``locate`` where the master is now (a worker whose store
        connection failed: the master's host may be gone, and the agent
        rewrote ``$TIDAL_MASTER_FILE``); True if it moved and the client
        follows it."""
        new = self.locate() if self.locate is not None else None
        if not new or new.rstrip("/") == self.url:
            return False
        log.warning("job master moved: %s -> %s", self.url, new)
        self.url = new
        return True

    def post(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.request("POST", path, body or {})[1]

    def get(self, path: str, **query: Any) -> dict[str, Any]:
        from urllib.parse import urlencode

        q = ("?" + urlencode(query)) if query else ""
        return self.request("GET", path + q)[1]

    # ------------------------------------------------------------------ scheduler API
    # scaling requests carry an id: the transport retries a request whose answer
    # was lost (master restart), and the master answers a repeated id only once
    def _scale(self, path: str, body: dict[str, Any]) -> ScaleAnswer:
        body = {k: v for k, v in body.items() if v is not None}
        return ScaleAnswer.from_json(self.post(path, dict(body, request_id=uuid.uuid4().hex)))

    def scale_out(self, count: int | None = None, hosts: list[str] | None = None,
                  workers: list[str] | None = None) -> ScaleAnswer:
        """Add ``count`` workers started by the master's spawner (on ``hosts``
        if given), or expect ``workers`` (ids) started by someone else."""
        return self._scale("/scale_out", {"count": count, "hosts": hosts, "workers": workers})

    def scale_in(self, count: int | None = None, ranks: list[int] | None = None,
                 workers: list[str] | None = None) -> ScaleAnswer:
        """Remove ``count`` workers (the highest ranks), the given ranks, or the given worker ids."""
        return self._scale("/scale_in", {"count": count, "ranks": ranks, "workers": workers})

    def migrate(self, ranks: list[int], hosts: list[str] | None = None,
                workers: list[str] | None = None) -> ScaleAnswer:
        return self._scale("/migrate", {"ranks": ranks, "hosts": hosts, "workers": workers})

    def suspend(self) -> ScaleAnswer:
        return self._scale("/suspend", {})

    def reshare(self, shares: dict[str, float]) -> ScaleAnswer:
        return self._scale("/reshare", {"shares": shares})

    def status(self) -> Status:
        return Status.from_json(self.get("/status"))

    def scale_to(self, size: int, timeout_s: float = 120.0) -> ScaleAnswer:
        """Ask for a job of ``size`` workers, retrying while another change is
        in progress. Returns the accepted (or error) answer."""

        def once() -> ScaleAnswer:
            st = self.status()
            if st.state == "finished":
                return ScaleAnswer("error", "job finished")
            if st.state in ("forming", "changing"):
                return ScaleAnswer("retry", st.pending or st.state, retry_after_s=0.2)
            if st.world_size == size:
                return ScaleAnswer("accepted", "already at that size", size=size)
            if size > st.world_size:
                return self.scale_out(size - st.world_size)
            return self.scale_in(st.world_size - size)

        return retry_while_busy(once, timeout_s)

    def wait_for(self, size: int, timeout_s: float = 120.0) -> Status:
        """Block until the job runs at ``size`` workers with no change pending."""
        deadline = time.monotonic() + timeout_s
        while True:
            st = self.status()
            if (st.world_size == size and not st.changing) or st.state == "finished":
                return st
            if time.monotonic() > deadline:
                raise TimeoutError(f"job did not reach {size} workers: {st}")
            time.sleep(0.05)
