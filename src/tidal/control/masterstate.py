"""Where a job master on the control plane keeps its state (Elan §V-D keeps
the master's in etcd): a local file for a restart on the same host, mirrored
to the server's store, so that a master whose host died restarts on another
host of the job from the same state.

``tidal://HOST:PORT/JOB`` is the server's copy (the store's ``master_states``
table, through ``/internal/jobs/JOB/master-state``). :class:`Mirrored` writes
the file at once and the server's copy from a background thread, newest
first (a save never waits on the network under the master's lock); each
document carries a sequence number and the server keeps the highest, so the
newer of the two copies is the one a restarted master loads.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from tidal import settings
from tidal.httpjson import JsonHttp, Unavailable
from tidal.runtime.persistence import FileBackend, StateBackend, register_backend

log = logging.getLogger(__name__)

SEQ = "_seq"  # the sequence number inside a saved document


class Fenced(RuntimeError):
    """The server took this job's master away from this node (it was
    restarted on another host): this master must stop."""


class ServerBackend(StateBackend):
    """The copy of job ``job``'s master state kept by the server at ``urls``
    (comma-separated replicas). Writes name this node; the server refuses them
    (409) once the job's master runs on another node."""

    def __init__(self, urls: str, job: str, token: str | None = None, node: str | None = None) -> None:
        self.job, self.node = job, node or settings.NODE.get() or ""
        self.http = JsonHttp(urls, token=token if token is not None else settings.job_token(),
                             timeout_s=5.0, patience_s=2.0)

    def save(self, snapshot: dict[str, Any]) -> None:
        body = {"seq": int(snapshot.get(SEQ, 0)), "doc": snapshot, "node": self.node}
        status, ans = self.http.call("POST", f"/internal/jobs/{self.job}/master-state", body)
        if status == 409:
            raise Fenced(str(ans))
        if status >= 400:
            raise RuntimeError(f"the server refused the master state of {self.job}: {status} {ans}")

    def load(self) -> dict[str, Any] | None:
        status, ans = self.http.call("GET", f"/internal/jobs/{self.job}/master-state", None, patience_s=30.0)
        if status == 404:
            return None
        if status >= 400 or not isinstance(ans, dict):
            raise RuntimeError(f"cannot read the master state of {self.job}: {status} {ans}")
        doc = ans.get("doc")
        return doc if isinstance(doc, dict) else None

    def close(self) -> None:
        self.http.close()


@register_backend("tidal")
def _server_backend(rest: str) -> ServerBackend:
    """``tidal://HOST:PORT/JOB``."""
    hostport, _, job = rest.partition("/")
    if not hostport or not job:
        raise ValueError(f"tidal state backend: expected tidal://HOST:PORT/JOB, got tidal://{rest}")
    return ServerBackend(f"http://{hostport}", job)


class Mirrored(StateBackend):
    """The local file, written synchronously, and the server's copy, written
    by a background thread (the newest document only). ``fenced`` is set when
    the server says another host runs this job's master now."""

    def __init__(self, local: FileBackend, remote: StateBackend) -> None:
        self.local, self.remote = local, remote
        self.seq = 0
        self.fenced = threading.Event()
        self._pending: dict[str, Any] | None = None
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._push_loop, name="tidal-state-mirror", daemon=True)
        self._thread.start()

    def save(self, snapshot: dict[str, Any]) -> None:
        with self._cond:
            self.seq += 1
            doc = {**snapshot, SEQ: self.seq}
            self._pending = doc
            self._cond.notify()
        self.local.save(doc)

    def load(self) -> dict[str, Any] | None:
        """The newer of the two copies (the server's may be the only one: a
        master restarted on another host)."""
        docs = [d for d in (self.local.load(), self._remote_load()) if d]
        if not docs:
            return None
        best = max(docs, key=lambda d: int(d.get(SEQ, 0)))
        self.seq = max(self.seq, int(best.get(SEQ, 0)))
        return best

    def _remote_load(self) -> dict[str, Any] | None:
        try:
            return self.remote.load()
        except (Unavailable, RuntimeError) as e:
            log.warning("no server copy of the master state (%s); using the local one", e)
            return None

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until the newest document reached the server; False on time-out."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending is None, timeout=timeout_s)

    def _push_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending is not None or self._closed)
                if self._pending is None:
                    return
                doc = self._pending
            try:
                self.remote.save(doc)
            except Fenced as e:
                log.error("the server runs this job's master elsewhere now: %s", e)
                self.fenced.set()
                with self._cond:
                    self._pending = None
                    self._cond.notify_all()
                return
            except (Unavailable, RuntimeError, OSError) as e:  # the server is away: keep the newest, retry
                log.warning("master state not mirrored to the server yet: %s", e)
                with self._cond:
                    self._cond.wait(timeout=1.0)
                continue
            with self._cond:
                if self._pending is doc:
                    self._pending = None
                    self._cond.notify_all()

    def close(self) -> None:
        self.flush()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=5)
        self.remote.close()
