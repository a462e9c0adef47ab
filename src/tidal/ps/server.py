"""A parameter server: holds row ranges of every table, answers pulls, applies
pushes exactly once, takes part in repartitions and checkpoints.

Status: ``idle`` (no rows yet) -> ``ready`` <-> ``frozen`` (a repartition in
flight: pushes and pulls get ``retry``) ; ``recovering`` (restored from a
checkpoint, only replays accepted until the master says ``ready``) ;
``retired`` (left the layout). Every push carries ``(worker, seq, k)``: the
server applies it only if that triple is newer than the worker's last one here
(a resent push whose answer was lost is acknowledged, not applied twice), and
answers ``ckpt``, the number of the first checkpoint that will contain it, and
``durable``, its newest written checkpoint (docs/ps.md, "Guarantees").

Run one as a process: ``python -m tidal.ps --id p0 --ckpt DIR`` prints
``PS_ADDR host:port`` once it listens.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time
from typing import Any

import torch

from tidal.ps import checkpoint
from tidal.ps.layout import Layout, moves
from tidal.ps.store import ShardStore
from tidal.ps.wire import Conn, Server, Tensors

log = logging.getLogger(__name__)
Answer = tuple[dict[str, Any], Tensors]


class PSServer:
    """One parameter server (``threads`` handler threads; ``work_s`` adds a
    fixed service time per pull/push, outside the lock, to model a slow host)."""

    def __init__(self, ps_id: str, ckpt_dir: str, threads: int = 2, host: str | None = None,
                 port: int = 0, work_s: float = 0.0) -> None:
        self.id, self.ckpt_dir, self.threads, self.work_s = ps_id, ckpt_dir, threads, work_s
        self.status = "idle"
        self.layout: Layout | None = None
        self.store = ShardStore()
        self.last: dict[str, list[int]] = {}
        self.next_ckpt, self.durable = 1, 0
        self._lock = threading.Lock()
        self._ckpt_lock = threading.Lock()
        self._ops = {"pull": self._pull, "push": self._push, "replay": self._replay, "init": self._init,
                     "freeze": self._freeze, "prepare": self._prepare, "send_rows": self._send_rows,
                     "put_rows": self._put_rows, "commit": self._commit, "checkpoint": self._checkpoint,
                     "restore": self._restore, "ready": self._ready, "stats": self._stats,
                     "read_range": self._read_range}
        self.server = Server(self.handle, threads=threads, host=host, port=port)
        self.addr = self.server.addr
        self.stopped = threading.Event()

    def handle(self, op: str, h: dict[str, Any], t: Tensors) -> Answer:
        if op == "shutdown":
            self.stopped.set()
            return {"status": "ok"}, {}
        fn = self._ops.get(op)
        if fn is None:
            return {"status": "error", "error": f"unknown op {op!r}"}, {}
        return fn(h, t)

    def close(self, abort: bool = False) -> None:
        """Stops serving and joins the server's threads (``abort``: queued requests are dropped)."""
        self.stopped.set()
        self.server.close(abort=abort)

    # -- data path ---------------------------------------------------------------------
    def _unavailable(self, tables: list[str], t: Tensors, allowed: tuple[str, ...] = ("ready",)) -> Answer | None:
        if self.status == "retired":
            return {"status": "moved", "version": self.layout.version if self.layout else 0}, {}
        if self.status not in allowed:
            return {"status": "retry", "why": self.status}, {}
        if not all(self.store.owns(n, t[f"{n}/ids"]) for n in tables):
            return {"status": "moved", "version": self.layout.version if self.layout else 0}, {}
        return None

    def _pull(self, h: dict[str, Any], t: Tensors) -> Answer:
        if self.work_s:
            time.sleep(self.work_s)
        with self._lock:
            bad = self._unavailable(h["tables"], t)
            if bad:
                return bad
            return {"status": "ok"}, {n: self.store.read(n, t[f"{n}/ids"]) for n in h["tables"]}

    def _push(self, h: dict[str, Any], t: Tensors) -> Answer:
        if self.work_s:
            time.sleep(self.work_s)
        with self._lock:
            # Deduplicate first: a resend whose first answer was lost must be
            # acknowledged even if its rows have left this server since (they
            # carried the update with them) or the server is frozen or retired.
            mark, prev = [int(h["seq"]), int(h["k"])], self.last.get(h["worker"])
            if prev is not None and mark <= prev[:2]:
                if mark != prev[:2]:
                    log.warning("ps %s: %s resent %s, older than its last part %s", self.id, h["worker"], mark, prev)
                # the stamp the part got when it was applied, so the worker can log it
                return {"status": "dup", "ckpt": prev[2] if mark == prev[:2] else 0, "durable": self.durable}, {}
            bad = self._unavailable(h["tables"], t)
            if bad:
                return bad
            self._apply(h, t)
            self.last[h["worker"]] = [*mark, self.next_ckpt]
            return {"status": "ok", "ckpt": self.next_ckpt, "durable": self.durable}, {}

    def _replay(self, h: dict[str, Any], t: Tensors) -> Answer:
        """A logged push the checkpoint does not hold, sent again after a restore."""
        with self._lock:
            bad = self._unavailable(h["tables"], t, allowed=("recovering", "ready"))
            if bad:
                return bad
            self._apply(h, t)
            mark = [int(h["seq"]), int(h["k"])]
            if mark > self.last.get(h["worker"], [-1, -1, 0])[:2]:
                self.last[h["worker"]] = [*mark, self.next_ckpt]
            return {"status": "ok", "ckpt": self.next_ckpt, "durable": self.durable}, {}

    def _apply(self, h: dict[str, Any], t: Tensors) -> None:
        for n in h["tables"]:
            self.store.apply(n, t[f"{n}/ids"], t[f"{n}/g"], float(h.get("lr", 1.0)))

    # -- control path (the master) -------------------------------------------------------
    def _init(self, h: dict[str, Any], t: Tensors) -> Answer:
        with self._lock:
            self.layout = Layout.from_json(h["layout"])
            self.store.init(self.layout, self.id, int(h.get("seed", 0)))
        self._write_checkpoint()
        with self._lock:
            self.status = "ready"
        return {"status": "ok"}, {}

    def _freeze(self, h: dict[str, Any], t: Tensors) -> Answer:
        with self._lock:
            was = self.status
            if was == "ready":
                self.status = "frozen"
            return {"status": "ok", "was": was}, {}

    def _prepare(self, h: dict[str, Any], t: Tensors) -> Answer:
        with self._lock:
            self.store.prepare(Layout.from_json(h["layout"]), self.id)
        return {"status": "ok"}, {}

    def _send_rows(self, h: dict[str, Any], t: Tensors) -> Answer:
        """Sends the rows that leave this server in the new layout to their new holders."""
        new, sent = Layout.from_json(h["layout"]), 0
        old = self.layout
        assert old is not None, "send_rows before init"
        conns: dict[str, Conn] = {}
        try:
            for table, src, dst, lo, hi in moves(old, new):
                if src != self.id:
                    continue
                conn = conns.setdefault(dst, Conn(new.addrs[dst]))
                spec = new.tables[table]
                step = max(1, (64 << 20) // max(1, spec.dim * spec.torch_dtype.itemsize))
                for a in range(lo, hi, step):
                    with self._lock:
                        rows = self.store.read_range(table, a, min(hi, a + step))
                    ans, _ = conn.call("put_rows", {"table": table, "lo": a}, {"rows": rows})
                    if ans.get("status") != "ok":
                        raise RuntimeError(f"{dst} refused rows: {ans}")
                    sent += rows.shape[0]
        finally:
            for c in conns.values():
                c.close()
        return {"status": "ok", "rows": sent}, {}

    def _put_rows(self, h: dict[str, Any], t: Tensors) -> Answer:
        with self._lock:
            self.store.put(h["table"], int(h["lo"]), t["rows"])
        return {"status": "ok"}, {}

    def _commit(self, h: dict[str, Any], t: Tensors) -> Answer:
        """Switches to the new layout's rows, checkpoints them, then serves again."""
        new = Layout.from_json(h["layout"])
        with self._lock:
            self.layout = new
            if self.id not in new.servers:
                # a retired server applies nothing more; its marks answer "was it applied?"
                self.status, self.store = "retired", ShardStore()
                return {"status": "ok", "last": {w: m[:2] for w, m in self.last.items()}}, {}
            self.store.commit()
        self._write_checkpoint()
        with self._lock:
            self.status = "ready"
        return {"status": "ok", "durable": self.durable}, {}

    def _checkpoint(self, h: dict[str, Any], t: Tensors) -> Answer:
        return {"status": "ok", "durable": self._write_checkpoint()}, {}

    def _write_checkpoint(self) -> int:
        """Copies the rows under the lock (pushes wait only for the copy), writes them outside it."""
        with self._ckpt_lock:
            with self._lock:
                number = self.next_ckpt
                self.next_ckpt += 1
                state = {"shards": self.store.snapshot(), "last": {k: list(v) for k, v in self.last.items()},
                         "version": self.layout.version if self.layout else 0}
            checkpoint.save(self.ckpt_dir, self.id, number, state)
            with self._lock:
                self.durable = max(self.durable, number)
            return number

    def _restore(self, h: dict[str, Any], t: Tensors) -> Answer:
        """Loads the newest checkpoint; the layout given must give this server the same rows."""
        layout = Layout.from_json(h["layout"])
        found = checkpoint.latest(self.ckpt_dir, self.id)
        if found is None:
            return {"status": "error", "error": f"no checkpoint of {self.id} in {self.ckpt_dir}"}, {}
        number, state = found
        for name, (lo, rows) in state["shards"].items():
            if layout.range_of(self.id, name) != (lo, lo + rows.shape[0]):
                return {"status": "error", "error": f"checkpoint {number} of {self.id} holds other rows "
                                                    f"of {name} than layout {layout.version}"}, {}
        with self._lock:
            self.layout, self.store.shards = layout, state["shards"]
            self.last = {k: list(v) for k, v in state["last"].items()}
            self.durable, self.next_ckpt = number, number + 1
            self.status = "recovering"
        log.info("ps %s restored from checkpoint %d", self.id, number)
        return {"status": "ok", "checkpoint": number}, {}

    def _ready(self, h: dict[str, Any], t: Tensors) -> Answer:
        with self._lock:
            if self.status in ("recovering", "frozen"):
                self.status = "ready"
        return {"status": "ok"}, {}

    def _stats(self, h: dict[str, Any], t: Tensors) -> Answer:
        s = self.server.stats()
        with self._lock:
            s.update(ps_status=self.status, threads=self.threads, durable=self.durable, bytes=self.store.nbytes(),
                     version=self.layout.version if self.layout else 0, cpu_s=time.process_time())
        return dict(s, status="ok"), {}

    def _read_range(self, h: dict[str, Any], t: Tensors) -> Answer:
        with self._lock:
            return {"status": "ok"}, {"rows": self.store.read_range(h["table"], int(h["lo"]), int(h["hi"]))}


def main(argv: list[str] | None = None) -> int:
    """Runs one server until a ``shutdown`` request (or a signal)."""
    p = argparse.ArgumentParser(description="one Tidal parameter server")
    p.add_argument("--id", required=True)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--host", default=None, help="address to listen on (default $TIDAL_BIND_ADDR, else loopback)")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--work-s", type=float, default=0.0)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s ps %(message)s")
    torch.set_num_threads(max(1, a.threads))
    srv = PSServer(a.id, a.ckpt, threads=a.threads, host=a.host, port=a.port, work_s=a.work_s)
    print(f"PS_ADDR {srv.addr}", flush=True)
    srv.stopped.wait()
    # Join every thread before the interpreter exits: a daemon thread still in a
    # torch call at exit is killed inside C++ and aborts the process
    # ("terminate called without an active exception").
    srv.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
