"""An ASGI app served by uvicorn on a free loopback port in a thread, for
tests that need a real HTTP server (browsers, the CLI, event streams)."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

from tidal.control.local import free_port
from tidal.net import LOOPBACK


@contextmanager
def served(app: Any, start_timeout_s: float = 10.0) -> Iterator[str]:
    """Yield ``http://HOST:PORT`` once the server has started; stop it after."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host=LOOPBACK, port=port, log_level="warning"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    deadline = time.time() + start_timeout_s
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    assert server.started, f"the test server did not start within {start_timeout_s} s"
    try:
        yield f"http://{LOOPBACK}:{port}"
    finally:
        server.should_exit = True
        t.join(timeout=10)
