"""The worker's side of a PS job: pull rows, push gradients, take data shards.

::

    ps = PSClient(master_addr, "w0", staleness=2)
    for shard in ps.shards():                       # dynamic sharding; DONE once pushes are applied
        for batch in batches(shard.start, shard.end):
            rows = ps.pull({"emb": ids})["emb"]     # bounded staleness waits here
            ...
            ps.push({"emb": (ids, grad)}, lr=0.1)   # asynchronous; rows -= lr * grad on the servers
    ps.close()

Pulls run on the calling thread; pushes on the client's push thread
(:mod:`tidal.ps.pusher`); a beat thread reports the worker's clock to the
master and brings back replay requests and scale-in requests.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Iterator

import torch

from tidal.ps.layout import Layout
from tidal.ps.pusher import Part, Pusher
from tidal.ps.shards import Shard
from tidal.ps.wire import Conn, ConnectionLost

log = logging.getLogger(__name__)


class PSClient:
    """One worker. ``staleness=k``: a pull waits until at most ``k`` of this
    worker's pushes are unapplied and no live worker is more than ``k`` steps
    behind; None: fully asynchronous (at most ``max_pending`` unsent pushes)."""

    def __init__(self, master_addr: str, worker: str, *, staleness: int | None = None,
                 beat_s: float = 0.1, max_pending: int = 64) -> None:
        self.worker, self.staleness, self.beat_s, self.max_pending = worker, staleness, beat_s, max_pending
        self._master = Conn(master_addr)
        self._lock = threading.Lock()
        self._conns: dict[tuple[str, str], Conn] = {}
        self._replays: dict[str, tuple[int, int]] = {}
        self._done_replays: set[tuple[str, int]] = set()
        self.clock, self.min_clock, self.leave = 0, 0, False
        self.layout = Layout.from_json(self.master("register", {"clock": 0})["layout"])
        self._stop = threading.Event()
        self.pusher = Pusher(self)
        self._beats = threading.Thread(target=self._beat_loop, daemon=True, name=f"ps-beat-{worker}")
        self._beats.start()

    # -- plumbing ----------------------------------------------------------------------
    def master(self, op: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        ans = self._master.call(op, dict(body or {}, worker=self.worker))[0]
        if ans.get("status") == "unknown_worker":
            raise RuntimeError(f"worker {self.worker} is no longer part of the job (declared dead)")
        return ans

    def refresh_layout(self) -> None:
        layout = Layout.from_json(self.master("layout")["layout"])
        with self._lock:
            if layout.version > self.layout.version:
                self.layout = layout

    def conn(self, ps: str, role: str) -> Conn:
        """The connection ``role`` ("pull", "push") uses to ``ps`` (KeyError: not in the layout)."""
        with self._lock:
            addr = self.layout.addrs[ps]
            return self._conns.setdefault((role, addr), Conn(addr))

    def route(self, part: Part) -> dict[str, Part]:
        """``part`` cut by the current layout: server -> its rows."""
        layout, out = self.layout, {}
        for name, (ids, g) in part.items():
            for ps, pos in layout.split(name, ids).items():
                out.setdefault(ps, {})[name] = (ids[pos], g[pos])
        return out

    def take_replays(self) -> dict[str, tuple[int, int]]:
        with self._lock:
            out, self._replays = self._replays, {}
            self._done_replays.update((ps, n) for ps, (n, _) in out.items())
            return out

    def _beat_loop(self) -> None:
        while not self._stop.wait(self.beat_s):
            if self.pusher.error is not None:
                log.warning("push thread of %s failed; no more beats, the master will drop it", self.worker)
                return
            try:
                self._beat()
            except (ConnectionLost, RuntimeError) as e:
                log.warning("beat of %s failed: %s", self.worker, e)

    def _beat(self) -> None:
        ans = self.master("beat", {"clock": self.clock})
        with self._lock:
            self.min_clock, self.leave = int(ans["min_clock"]), bool(ans["leave"])
            for ps, (n, ckpt) in ans.get("replay", {}).items():
                if (ps, int(n)) not in self._done_replays:
                    self._replays[ps] = (int(n), int(ckpt))
        if int(ans["version"]) > self.layout.version:
            self.refresh_layout()

    # -- the training API ----------------------------------------------------------------
    def _check_ids(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        spec = self.layout.tables.get(name)
        if spec is None:
            raise KeyError(f"no table {name!r} in this job")
        ids = ids.to(torch.int64).flatten()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= spec.rows):
            raise IndexError(f"table {name!r} has rows [0, {spec.rows}); asked {int(ids.min())}..{int(ids.max())}")
        return ids

    def pull(self, ids: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Rows ``ids[table]`` of each table, in the order asked."""
        ids = {n: self._check_ids(n, i) for n, i in ids.items()}
        self._wait_staleness()
        tables = self.layout.tables
        out = {n: torch.empty(i.numel(), tables[n].dim, dtype=tables[n].torch_dtype) for n, i in ids.items()}
        todo = {name: (i.to(torch.int64), torch.arange(i.numel())) for name, i in ids.items()}
        while todo:
            again: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
            for ps, part in self.route(todo).items():
                try:
                    ans, rows = self.conn(ps, "pull").call(
                        "pull", {"tables": list(part)}, {f"{n}/ids": i for n, (i, _) in part.items()})
                except (ConnectionLost, KeyError):
                    ans, rows = {"status": "retry"}, {}
                if ans["status"] == "error":
                    raise RuntimeError(f"{ps} failed a pull: {ans.get('error')}")
                for name, (i, pos) in part.items():
                    if ans["status"] == "ok":
                        out[name][pos] = rows[name]
                    else:
                        again.setdefault(name, []).append((i, pos))
            todo = {n: (torch.cat([a for a, _ in v]), torch.cat([b for _, b in v])) for n, v in again.items()}
            if todo:
                time.sleep(0.005)
                self.refresh_layout()
        return out

    def pull_table(self, name: str) -> torch.Tensor:
        """Every row of a table (a dense parameter)."""
        return self.pull({name: torch.arange(self.layout.tables[name].rows)})[name]

    def push(self, grads: dict[str, tuple[torch.Tensor, torch.Tensor]], lr: float = 1.0) -> int:
        """Queues ``rows[ids] -= lr * grad`` for each table; returns the push's sequence number.
        One push is one step of this worker's clock."""
        part = {}
        for n, (i, g) in grads.items():
            i = self._check_ids(n, i)
            g = g.detach().reshape(i.numel(), self.layout.tables[n].dim)
            part[n] = (i, g)
        self.pusher.wait_below(self.max_pending - 1)
        seq = self.clock
        self.pusher.submit(seq, part, lr)
        self.clock += 1
        return seq

    def flush(self, timeout_s: float | None = None) -> None:
        """Waits until every push is applied (acknowledged by its servers)."""
        self.pusher.wait_below(0, timeout_s)

    def _wait_staleness(self) -> None:
        k = self.staleness
        if k is None:
            return
        self.pusher.wait_below(k)
        while self.clock - self.min_clock > k and not self._stop.is_set():
            time.sleep(self.beat_s / 4)
            self._beat()

    def shards(self) -> Iterator[Shard]:
        """Data shards from the master until none is left or the master asks this worker to
        leave; a shard is reported DONE after its pushes are applied."""
        while True:
            ans = self.master("next_shard")
            if ans["status"] in ("finished", "leave"):
                return
            if ans["status"] == "wait":
                time.sleep(0.05)
                continue
            sid, epoch, start, end = ans["shard"]
            yield Shard(sid, epoch, start, end)
            self.flush()
            self.master("shard_done", {"shard": sid})

    def close(self, leave: bool = True) -> None:
        """Flushes, tells the master this worker leaves (``leave``), stops the threads."""
        try:
            if leave:
                self.flush()
                self.master("leave")
        finally:
            self._stop.set()
            self.pusher.stop()
            self._shut()

    def crash(self) -> None:
        """Stops beating and pushing at once, without a word to the master, as a dead
        process would (tests: a dead worker)."""
        self._stop.set()
        self.pusher.abort()
        self._shut()

    def _shut(self) -> None:
        if self._beats is not threading.current_thread():
            self._beats.join(10)
        with self._lock:
            conns, self._conns = list(self._conns.values()), {}
        for c in conns + [self._master]:
            c.close()
