"""``tidal server``: the control plane's REST API (FastAPI, OpenAPI docs at
``/docs``) over the store, with the scheduler loop running beside it.

The routes live in :mod:`tidal.control.api` (users, jobs, cluster, health, internal);
this module assembles them into an app over one store and one coordinator. A
bad request gets a 4xx naming the field; the service never crashes on one.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncContextManager, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy import select

from tidal import settings
from tidal.control import dashboard, promstats
from tidal.control.api import cluster, health, internal, jobs, users
from tidal.control.coordinator import Coordinator
from tidal.control.credentials import Credentials
from tidal.control.leader import Elector, LoopClock, fence, lease_for
from tidal.control.db import Node, Store
from tidal.core.errors import InputError
from tidal.net import advertise_addr, bind_addr

log = logging.getLogger(__name__)


def create_app(
    store: Store,
    *,
    policy: str = "edf",
    admin_token: str | None = None,
    credentials: Credentials | None = None,
    tick_s: float = 2.0,
    home: Path | None = None,
    server_url: str = "",
    start_loop: bool = True,
) -> FastAPI:
    """The API over ``store``: ``home`` (default ``$TIDAL_HOME``) holds the
    processes' logs; ``credentials`` issues and checks the agents', nodes'
    and jobs' credentials (default: a new secret); ``start_loop`` runs the
    scheduler loop while the app serves (tests drive
    ``app.state.coordinator.round()`` themselves)."""
    home = Path(home or settings.home())
    admin_token = admin_token or secrets.token_urlsafe(24)
    credentials = credentials or Credentials()
    store.add_user("admin", admin=True, token=admin_token)
    # every replica serves the API over the shared store; the one holding the lease schedules, and
    # hands it on when its loop is stuck (the loop's age is sampled from the coordinator's round counter)
    loop = LoopClock(lambda: coord.rounds, max(settings.READY_LOOP_S.get(), 5 * tick_s))
    elector = Elector(lease_for(store.engine), on_change=loop.reset, stuck=loop.stuck)
    coord = Coordinator(store, policy, server_url=server_url, tick_s=tick_s, home=home, leading=elector.leading)
    coord.cx.credentials = credentials
    fence(store.engine, elector)  # a leader whose lease lapsed mid-round writes nothing more
    app = FastAPI(title="Tidal control plane", version="0.1.0", lifespan=_lifespan(start_loop),
                  description="Submit elastic training jobs; the scheduler reshapes them.")
    app.state.store, app.state.coordinator, app.state.credentials = store, coord, credentials
    app.state.elector, app.state.loop_clock = elector, loop
    app.state.db_probe = health.DbProbe(store, settings.READY_DB_TIMEOUT_S.get())
    app.state.logs_dir = home / "logs"
    app.state.register_lock = threading.Lock()
    app.state.heartbeat_clock = internal.HeartbeatClock(time.time())
    app.add_middleware(BodyLimit, max_bytes=MAX_BODY_BYTES)
    promstats.install(app)  # API latency histogram (outermost: it times 413s too) and the decision log
    app.add_exception_handler(Exception, _any_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(InputError, _bad_input)
    for module in (users, jobs, cluster, health, internal):
        app.include_router(module.router)
    dashboard.mount(app)  # the web dashboard at /dashboard/ (docs/dashboard.md)
    _reset_after_restart(store)
    return app


def _lifespan(start_loop: bool) -> Callable[[FastAPI], AsyncContextManager[None]]:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        coord = app.state.coordinator
        if start_loop:
            coord.start()
        try:
            yield
        finally:
            coord.stop()
            app.state.elector.close()

    return lifespan


MAX_BODY_BYTES = 1 << 20  # the public API: a job spec is a few hundred bytes
MAX_INTERNAL_BODY_BYTES = 16 << 20  # agents' reports carry log chunks (256 KB per process and tick)


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` (``/internal/``:
    :data:`MAX_INTERNAL_BODY_BYTES`) gets 413 before any handler parses it
    (by its Content-Length, or while it streams in)."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = MAX_INTERNAL_BODY_BYTES if str(scope.get("path", "")).startswith("/internal/") else self.max_bytes
        length = dict(scope.get("headers") or []).get(b"content-length", b"0")
        if length.isdigit() and int(length) > limit:
            return await self._too_large(scope, receive, send, limit)
        seen = 0

        async def counted() -> dict[str, Any]:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > limit:
                raise _TooLarge
            return message

        try:
            await self.app(scope, counted, send)
        except _TooLarge:
            await self._too_large(scope, receive, send, limit)

    @staticmethod
    async def _too_large(scope: dict[str, Any], receive: Any, send: Any, limit: int) -> None:
        resp = JSONResponse(status_code=413, content={"detail": f"request body over {limit} bytes"})
        await resp(scope, receive, send)


class _TooLarge(Exception):
    pass


async def _invalid(request: Request, exc: Exception) -> JSONResponse:
    """422 naming each field and reason, without echoing the input (which may
    be huge, or hold values JSON cannot carry, such as Infinity)."""
    assert isinstance(exc, RequestValidationError)
    errors = [{"loc": [str(x) for x in e.get("loc", ())][:8], "msg": str(e.get("msg", ""))[:300],
               "type": str(e.get("type", ""))} for e in exc.errors()[:20]]
    return JSONResponse(status_code=422, content={"detail": errors})


async def _bad_input(request: Request, exc: Exception) -> JSONResponse:
    return JSONResponse(status_code=422, content={"detail": str(exc)[:1000]})


async def _any_error(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s", request.url.path)
    return JSONResponse(status_code=500, content={"detail": f"internal error: {type(exc).__name__}"})


def _reset_after_restart(store: Store) -> None:
    """A restarted server resumes from the store (the coordinator resumes
    each job's phase and its change in flight)."""
    with store.session() as s:
        # the server was away, not the nodes: their heartbeat clocks start now
        # (otherwise the first agent back would have all the others declared down)
        for n in s.scalars(select(Node).where(Node.state.in_(("up", "unreachable")))):
            n.last_heartbeat = time.time()
        store.log(s, "server.start")


def secret_path(home: Path) -> Path:
    """The server's secret: ``$TIDAL_SECRET_FILE``, else ``home/server.secret``."""
    return Path(settings.SECRET_FILE.get() or home / "server.secret")


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by this user only (0600 from the start)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    path.chmod(0o600)


def serve(
    host: str | None = None,
    port: int = 8470,
    db_url: str | None = None,
    policy: str = "edf",
    admin_token: str | None = None,
    tick_s: float = 2.0,
    home: Path | None = None,
    advertise: str | None = None,
    tls_cert: Path | None = None,
    tls_key: Path | None = None,
    on_ready: Callable[[str, Credentials], None] | None = None,
) -> None:
    """Run the server until interrupted; state in ``home`` (default
    ``$TIDAL_HOME``): the SQLite store unless ``db_url``, and the admin token
    (kept across restarts unless one is given). ``advertise``: the address
    job masters and agents on other hosts reach it at (default: ``host``, or
    with 0.0.0.0 this host's first non-loopback address; :mod:`tidal.net`).
    ``tls_cert`` and ``tls_key`` (PEM): serve HTTPS; clients verify the
    certificate against ``$TIDAL_CA_FILE``. ``on_ready(url, credentials)``
    runs before the server listens (e.g. the Ray engine's agents)."""
    import uvicorn

    host = bind_addr(host)

    home = Path(home or settings.home())
    home.mkdir(parents=True, exist_ok=True)
    os.umask(0o077)  # the store, logs and checkpoints it creates: this user's only
    store = Store(db_url or f"sqlite:///{home / 'tidal.db'}")
    if not db_url:
        for f in home.glob("tidal.db*"):
            f.chmod(0o600)
    admin_token = admin_token or settings.ADMIN_TOKEN.get()
    token_file = home / "admin.token"
    if admin_token is None:
        admin_token = token_file.read_text().strip() if token_file.exists() else secrets.token_urlsafe(24)
    write_private(token_file, admin_token)
    credentials = Credentials.from_file(secret_path(home))
    write_private(home / "agent.token", credentials.agent_token())  # the join token agents start with
    if (tls_cert is None) != (tls_key is None):
        raise InputError("give both a TLS certificate and its key, or neither", field="tls")
    scheme = "https" if tls_cert else "http"
    # replicas give their masters every replica's URL, so a master follows a failover
    url = settings.PUBLIC_URL.get() or \
        f"{scheme}://{advertise_addr(host, explicit=advertise or settings.ADVERTISE_ADDR.get())}:{port}"
    app = create_app(store, policy=policy, admin_token=admin_token, credentials=credentials, tick_s=tick_s,
                     home=home, server_url=url)
    if on_ready is not None:
        on_ready(url, credentials)
    tls = {"ssl_certfile": str(tls_cert), "ssl_keyfile": str(tls_key)} if tls_cert else {}
    # an idle keep-alive client must not hold a stopping server up
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5, **tls)
