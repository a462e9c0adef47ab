"""The one HTTP client every Tidal process uses: JSON over HTTP/1.1 keep-alive
(one connection per thread), a bearer token, and retries with exponential
backoff while the other side is unreachable (a restarting server or job
master). Callers: the job master's client (workers, ``tidal scale``, the
coordinator), the control plane's REST client (CLI), the agent and the job
master process.

Only transport errors are retried; an HTTP answer, whatever its status, is
returned to the caller, who decides what it means. ``https://`` URLs are
verified against ``$TIDAL_CA_FILE`` (else the system's CAs); a certificate
that does not verify is an error at once (:class:`BadCertificate`), not retried.
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import threading
import time
from typing import Any
from urllib.parse import urlencode, urlparse


class Unavailable(RuntimeError):
    """No answer within the client's patience (connection refused, reset, timed out)."""


class BadCertificate(RuntimeError):
    """The server's TLS certificate did not verify against the CA file."""


def tls_context() -> ssl.SSLContext:
    """Verifies servers against ``$TIDAL_CA_FILE`` if set, else the system's CAs."""
    from tidal import settings

    return ssl.create_default_context(cafile=settings.CA_FILE.get() or None)


class Response:
    """Status code, headers and body of one answer."""

    __slots__ = ("status", "content_type", "body")

    def __init__(self, status: int, content_type: str, body: bytes) -> None:
        self.status, self.content_type, self.body = status, content_type, body

    def json(self) -> Any:
        return json.loads(self.body or b"{}")

    @property
    def text(self) -> str:
        return self.body.decode(errors="replace")

    @property
    def is_json(self) -> bool:
        return self.content_type.startswith("application/json")


#: how long connecting to a replica may take (a silent host answers no SYN)
CONNECT_TIMEOUT_S = 3.0
#: what a keep-alive connection the server closed while idle raises on its next request
STALE = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError, ConnectionAbortedError)


class JsonHttp:
    """Thread-safe: each thread keeps its own keep-alive connection.

    ``patience_s``: how long to keep retrying transport errors (0: one try);
    the pause between tries doubles from ``backoff_s`` up to ``max_backoff_s``.
    ``url`` may list several comma-separated replicas of one service (the
    server's): a transport error moves on to the next one.
    """

    def __init__(self, url: str, *, token: str = "", timeout_s: float = 10.0, patience_s: float = 30.0,
                 backoff_s: float = 0.05, max_backoff_s: float = 1.0) -> None:
        self.urls = [u.strip().rstrip("/") for u in url.split(",") if u.strip()] or [url.rstrip("/")]
        self.url = self.urls[0]
        self.token = token
        self.timeout_s, self.patience_s = float(timeout_s), float(patience_s)
        self.backoff_s, self.max_backoff_s = float(backoff_s), float(max_backoff_s)
        self._local = threading.local()

    # -- connections ---------------------------------------------------------------
    def _conn(self) -> http.client.HTTPConnection:
        c = getattr(self._local, "conn", None)
        if c is None or getattr(self._local, "url", None) != self.url:
            self._drop()
            u = urlparse(self.url)
            if u.scheme not in ("http", "https", ""):
                raise ValueError(f"unsupported URL scheme in {self.url!r} (http or https)")
            if not u.hostname:
                raise ValueError(f"no host in URL {self.url!r}")
            # a silent replica (no reset) is given up on after CONNECT_TIMEOUT_S, not the read time-out
            connect_s = min(self.timeout_s, CONNECT_TIMEOUT_S)
            if u.scheme == "https":
                c = http.client.HTTPSConnection(u.hostname, u.port or 443, timeout=connect_s,
                                                context=tls_context())
            else:
                c = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=connect_s)
            c.connect()
            assert c.sock is not None
            c.sock.settimeout(self.timeout_s)
            c.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._local.conn, self._local.url = c, self.url
        return c

    def _drop(self) -> None:
        c = getattr(self._local, "conn", None)
        if c is not None:
            c.close()
        self._local.conn = None

    def close(self) -> None:
        """Close this thread's connection."""
        self._drop()

    # -- requests ------------------------------------------------------------------
    def send(self, method: str, path: str, body: Any = None, params: dict[str, Any] | None = None,
             patience_s: float | None = None, headers: dict[str, str] | None = None) -> Response:
        """One request (with extra ``headers``), retried on transport errors;
        raises :class:`Unavailable` when the patience runs out."""
        if params:
            path = f"{path}?{urlencode({k: v for k, v in params.items() if v is not None})}"
        data = None if body is None else json.dumps(body).encode()
        headers = {**({"Content-Type": "application/json"} if data is not None else {}), **(headers or {})}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        patience = self.patience_s if patience_s is None else patience_s
        deadline = time.monotonic() + patience
        pause = self.backoff_s
        stale_retried = False
        while True:
            reused = getattr(self._local, "conn", None) is not None and getattr(self._local, "url", None) == self.url
            try:
                c = self._conn()
                c.request(method, path, body=data, headers=headers)
                r = c.getresponse()
                return Response(r.status, r.getheader("Content-Type") or "", r.read())
            except ssl.SSLCertVerificationError as e:
                self._drop()
                raise BadCertificate(f"{self.url}: the server's certificate does not verify ({e.verify_message}); "
                                     f"set $TIDAL_CA_FILE to the CA that signed it") from e
            except (ConnectionError, http.client.HTTPException, OSError) as e:
                self._drop()
                if reused and not stale_retried and isinstance(e, STALE):
                    stale_retried = True  # an idle keep-alive connection the server closed: once more, anew
                    continue
                failed = self.url
                if len(self.urls) > 1 and failed in self.urls:  # the next replica
                    self.url = self.urls[(self.urls.index(failed) + 1) % len(self.urls)]
                if time.monotonic() + pause > deadline:
                    raise Unavailable(f"{failed}{path}: {e}") from e
                time.sleep(pause)
                pause = min(self.max_backoff_s, pause * 2)

    def call(self, method: str, path: str, body: Any = None, params: dict[str, Any] | None = None,
             patience_s: float | None = None) -> tuple[int, Any]:
        """``(status, decoded JSON or text)``."""
        r = self.send(method, path, body, params, patience_s)
        if r.is_json or (r.body[:1] in (b"{", b"[")):
            try:
                return r.status, r.json()
            except ValueError:
                pass
        return r.status, r.text
