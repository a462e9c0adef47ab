"""The coordinator of a parameter-server job.

It owns the layout (which server holds which rows), the servers (started
through a launcher), the workers (registered, beating, their clocks for
bounded staleness) and the data shards (TODO / DOING / DONE). Workers reach it
over :mod:`tidal.ps.wire`; the job's owner calls :meth:`PSMaster.scale_servers`,
:meth:`replace_server`, :meth:`restore_server` directly, and :meth:`tick` (run by the
master's loop every ``tick_s``) restores dead servers, replaces a hot one and
drops silent workers. One change of servers runs at a time (``_change``);
worker requests keep being answered meanwhile (``_lock`` guards the state).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from tidal.ps import checkpoint as ckpt_files
from tidal.ps.launch import Launcher, PSHandle
from tidal.ps.layout import Layout, TableSpec
from tidal.ps.repartition import HotDetector, repartition
from tidal.ps.shards import ShardQueue
from tidal.ps.wire import Conn, ConnectionLost, Server, Tensors

log = logging.getLogger(__name__)


class PSMaster:
    """One PS job's master; ``start()`` launches ``servers`` parameter servers and listens."""

    def __init__(self, tables: list[TableSpec], ckpt_dir: str, launcher: Launcher, *, servers: int = 2,
                 threads: int = 2, shards: ShardQueue | None = None, worker_timeout_s: float = 5.0,
                 hot: HotDetector | None = None, auto: bool = True, tick_s: float = 0.25, seed: int = 0) -> None:
        self.tables, self.ckpt_dir, self.launcher = tables, ckpt_dir, launcher
        self.initial_servers, self.threads, self.seed = servers, threads, seed
        self.shards = shards
        self.worker_timeout_s, self.hot, self.auto, self.tick_s = worker_timeout_s, hot, auto, tick_s
        self.handles: dict[str, PSHandle] = {}
        self.layout = Layout(0, {t.name: t for t in tables}, [])
        self.workers: dict[str, dict[str, Any]] = {}
        self.replaying: dict[str, dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []
        self.retired_marks: dict[str, dict[str, list[int]]] = {}
        self._next_ps = 0
        self._lock = threading.RLock()
        self._change = threading.Lock()
        self._conns: dict[str, Conn] = {}
        self._stop = threading.Event()
        self._loop_thread: threading.Thread | None = None
        self.server: Server | None = None

    # -- life ------------------------------------------------------------------------
    def start(self) -> str:
        """Launches the servers, gives them their rows and listens; returns the master's address."""
        if ckpt_files.any_checkpoint(self.ckpt_dir):
            raise ValueError(f"{self.ckpt_dir} holds checkpoints of another job; give each job its own directory")
        try:
            ids = [self._launch(self.threads) for _ in range(self.initial_servers)]
            layout = Layout(1, self.layout.tables, ids, {i: self.handles[i].addr for i in ids})
            for ps in ids:
                self._ok(self._call(ps, "init", {"layout": layout.to_json(), "seed": self.seed}, layout), ps)
            self.layout = layout
            self.server = Server(self.handle, threads=4)
        except BaseException:
            self.close()
            raise
        self._loop_thread = threading.Thread(target=self._loop, daemon=True, name="ps-master")
        self._loop_thread.start()
        return self.server.addr

    def close(self) -> None:
        """Stops the loop, the master's server and every parameter server; joins their threads."""
        self._stop.set()
        if self._loop_thread is not None and self._loop_thread is not threading.current_thread():
            self._loop_thread.join(60)
        if self.server:
            self.server.close()
        for ps in list(self.handles):
            self._stop_server(self.handles.pop(ps))
        with self._lock:
            conns, self._conns = list(self._conns.values()), {}
        for c in conns:
            c.close()
        self.launcher.close()

    def _stop_server(self, h: PSHandle) -> None:
        """Asks a server to shut down and waits for it to end."""
        try:
            self._conn(h.addr).call("shutdown")
        except ConnectionLost:
            pass
        h.stop()
        with self._lock:
            conn = self._conns.pop(h.addr, None)
        if conn:
            conn.close()

    def _loop(self) -> None:
        while not self._stop.wait(self.tick_s):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - the loop must outlive one bad tick
                log.exception("ps master tick failed")

    def _launch(self, threads: int) -> str:
        ps = f"p{self._next_ps}"
        self._next_ps += 1
        self.handles[ps] = self.launcher.start(ps, threads, self.ckpt_dir)
        return ps

    def _conn(self, addr: str) -> Conn:
        with self._lock:
            return self._conns.setdefault(addr, Conn(addr))

    def _call(self, ps: str, op: str, body: dict[str, Any], layout: Layout | None = None) -> dict[str, Any]:
        addr = (layout.addrs.get(ps) if layout else None) or self.handles[ps].addr
        return self._conn(addr).call(op, body)[0]

    @staticmethod
    def _ok(answer: dict[str, Any], ps: str) -> dict[str, Any]:
        if answer.get("status") != "ok":
            raise RuntimeError(f"{ps}: {answer}")
        return answer

    # -- changes of servers ----------------------------------------------------------------
    def scale_servers(self, n: int) -> dict[str, float]:
        """Repartitions onto ``n`` servers (new ones appended, the last ones removed)."""
        with self._change:
            servers = list(self.layout.servers)
            while len(servers) < n:
                servers.append(self._launch(self.threads))
            return self._switch(servers[:n], "scale_servers")

    def replace_server(self, ps: str, threads: int) -> dict[str, float]:
        """Moves ``ps``'s rows to a new server with ``threads`` handler threads."""
        with self._change:
            new = self._launch(threads)
            servers = [new if s == ps else s for s in self.layout.servers]
            return self._switch(servers, "replace_server", old=ps, new=new, threads=threads)

    def _switch(self, servers: list[str], kind: str, **info: Any) -> dict[str, float]:
        old = self.layout
        try:
            if self.replaying:
                raise RuntimeError(f"a server is still being restored: {sorted(self.replaying)}")
            new = old.with_servers(servers)
            new.addrs = {s: self.handles[s].addr for s in servers}
            both = Layout(new.version, new.tables, servers, {**old.addrs, **new.addrs})
            timing, marks = repartition(old, new, lambda ps, op, body: self._call(ps, op, body, both))
        except BaseException:
            for ps in set(servers) - set(old.servers):  # launched for this change: not needed now
                self._stop_server(self.handles.pop(ps))
            raise
        with self._lock:
            self.layout = new
            self.retired_marks.update(marks)
        for gone in set(old.servers) - set(servers):
            self._retire(gone)
        self.events.append(dict(kind=kind, version=new.version, servers=servers, **info, **timing))
        log.info("ps layout %d: %s (%s, pause %.0f ms)", new.version, servers, kind, timing["pause_ms"])
        return timing

    def _retire(self, ps: str) -> None:
        self._stop_server(self.handles.pop(ps))
        if self.hot:
            self.hot.forget(ps)

    def restore_server(self, ps: str) -> int:
        """Starts ``ps`` again from its newest checkpoint; live workers replay
        their logged pushes to it before it serves. Returns the checkpoint number."""
        with self._change:
            if ps not in self.layout.servers:
                raise RuntimeError(f"{ps} is not a serving server of layout {self.layout.version}")
            old = self.handles[ps]
            old.kill()
            h = self.launcher.start(ps, old.threads, self.ckpt_dir)
            self.handles[ps] = h
            new = self.layout.with_servers(self.layout.servers)
            new.addrs[ps] = h.addr
            number = int(self._ok(self._call(ps, "restore", {"layout": new.to_json()}, new), ps)["checkpoint"])
            with self._lock:
                self.layout = new
                waiting = set(self.workers)
                self.replaying[ps] = {"n": new.version, "ckpt": number, "waiting": waiting}
                self.events.append({"kind": "restore_server", "ps": ps, "checkpoint": number, "version": new.version})
                self._maybe_ready(ps)
            log.info("ps %s restored from checkpoint %d; %d workers replay", ps, number, len(waiting))
            return number

    def _maybe_ready(self, ps: str) -> None:
        r = self.replaying.get(ps)
        if r is not None and not (r["waiting"] & set(self.workers)):
            self._ok(self._call(ps, "ready", {}), ps)
            del self.replaying[ps]

    def checkpoint(self) -> dict[str, int]:
        """Every server writes a checkpoint now; their numbers."""
        return {ps: int(self._ok(self._call(ps, "checkpoint", {}), ps)["durable"]) for ps in self.layout.servers}

    # -- the loop ---------------------------------------------------------------------------
    def tick(self) -> None:
        """Drops silent workers, restores dead servers, replaces a hot one (``auto``)."""
        now = time.monotonic()
        with self._lock:
            for w in [w for w, v in self.workers.items() if now - v["beat"] > self.worker_timeout_s]:
                self._drop_worker(w, "silent")
        if self._change.locked():
            return
        for ps in list(self.layout.servers):
            try:
                stats = self._call(ps, "stats", {})
            except (ConnectionLost, KeyError):
                if self.auto:
                    try:
                        self.restore_server(ps)
                    except RuntimeError as e:  # retired meanwhile by a concurrent change
                        log.info("no restore of %s: %s", ps, e)
                continue
            if self.hot:
                self.hot.observe(ps, stats)
        hot = self.hot.hot() if self.hot and self.auto and not self.replaying else None
        if hot:
            threads = self.handles[hot].threads * 2
            log.warning("ps %s is hot (%s); replacing it with %d threads", hot, self.hot.window[hot], threads)
            self.replace_server(hot, threads)
            self.hot.window.clear()

    def _drop_worker(self, w: str, why: str) -> None:
        self.workers.pop(w, None)
        back = self.shards.release(w) if self.shards else []
        self.events.append({"kind": "worker_gone", "worker": w, "why": why, "requeued": back})
        for ps in list(self.replaying):
            self._maybe_ready(ps)

    def _min_clock(self, mine: int) -> int:
        """The lowest clock of the workers training a shard (SSP's bound); ``mine`` if none is."""
        return min([v["clock"] for v in self.workers.values() if v["active"]], default=mine)

    def request_leave(self, w: str) -> None:
        """Asks worker ``w`` to leave after its current shard (a scale-in)."""
        with self._lock:
            if w in self.workers:
                self.workers[w]["leave"] = True

    # -- worker requests ------------------------------------------------------------------------
    def handle(self, op: str, h: dict[str, Any], t: Tensors) -> tuple[dict[str, Any], Tensors]:
        with self._lock:
            w = h.get("worker", "")
            if op == "register":
                if w in self.workers:  # a new incarnation: the old one's shards are not being trained
                    self._drop_worker(w, "registered again")
                self.workers[w] = {"beat": time.monotonic(), "clock": int(h.get("clock", 0)), "leave": False,
                                   "active": True}
                return {"status": "ok", "layout": self.layout.to_json()}, {}
            if op == "layout":
                return {"status": "ok", "layout": self.layout.to_json()}, {}
            if w not in self.workers:
                return {"status": "unknown_worker"}, {}
            return _worker_op(self, op, w, h), {}


def _worker_op(m: PSMaster, op: str, w: str, h: dict[str, Any]) -> dict[str, Any]:
    """The master's answer to a registered worker's request (called under its lock)."""
    me = m.workers[w]
    me["beat"] = time.monotonic()
    if op == "beat":
        me["clock"] = int(h.get("clock", me["clock"]))
        replay = {ps: [r["n"], r["ckpt"]] for ps, r in m.replaying.items() if w in r["waiting"]}
        return {"status": "ok", "version": m.layout.version, "replay": replay, "leave": me["leave"],
                "min_clock": m._min_clock(me["clock"])}
    if op == "replay_done":
        r = m.replaying.get(h["ps"])
        if r is not None and r["n"] == int(h["n"]):
            r["waiting"].discard(w)
            m._maybe_ready(h["ps"])
        return {"status": "ok"}
    if op == "next_shard":
        s = None if me["leave"] or m.shards is None else m.shards.next(w)
        me["active"] = s is not None  # a worker without a shard does not hold others back (SSP)
        if s is None:
            if me["leave"] or m.shards is None:
                return {"status": "leave" if me["leave"] else "finished"}
            return {"status": "finished" if m.shards.finished else "wait"}
        return {"status": "ok", "shard": [s.id, s.epoch, s.start, s.end]}
    if op == "applied":
        marks = m.retired_marks.get(h["ps"])
        if marks is None:
            return {"status": "unknown"}
        return {"status": "ok", "applied": [int(h["seq"]), int(h["k"])] <= marks.get(w, [-1, -1])}
    if op == "shard_done":
        accepted = m.shards.complete(w, int(h["shard"])) if m.shards else False
        return {"status": "ok", "accepted": accepted}
    if op == "leave":
        m._drop_worker(w, "left")
        return {"status": "ok"}
    if op == "suspect":
        return {"status": "ok"}
    return {"status": "error", "error": f"unknown op {op!r}"}
