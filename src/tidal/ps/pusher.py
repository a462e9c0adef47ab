"""A worker's push thread and its log of acknowledged pushes.

A push is cut by the layout into one part per server; each part is sent as
``(worker, seq, k)``, ``k`` the routing round (a part refused with ``retry`` or
``moved`` is routed again under the new layout with ``k+1``). A part whose
connection broke keeps its ``(seq, k)`` and goes to the same server until it
gets an answer, so the server's deduplication sees a resend as one (if that
server has left the layout meanwhile, the master answers from the marks it
returned when it retired). Each
acknowledged part is logged with the server's ``ckpt`` stamp (the first
checkpoint that will hold it) until the server reports that checkpoint
written; after a restore the log's newer parts are replayed (docs/ps.md).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from tidal.ps.wire import ConnectionLost

if TYPE_CHECKING:
    from tidal.ps.client import PSClient

log = logging.getLogger(__name__)
Part = dict[str, tuple[torch.Tensor, torch.Tensor]]  # table -> (ids, grads)


class Aborted(RuntimeError):
    """The worker stopped (``PSClient.crash`` or a stop that timed out) with pushes unsent."""


def part_tensors(part: Part) -> dict[str, torch.Tensor]:
    out = {}
    for name, (ids, g) in part.items():
        out[f"{name}/ids"], out[f"{name}/g"] = ids, g
    return out


class PushLog:
    """Per server: ``[stamp, seq, k, lr, part]`` of acknowledged parts not yet in a written checkpoint."""

    def __init__(self) -> None:
        self.entries: dict[str, list[list[Any]]] = {}

    def add(self, ps: str, stamp: int, seq: int, k: int, lr: float, part: Part) -> None:
        self.entries.setdefault(ps, []).append([stamp, seq, k, lr, part])

    def trim(self, ps: str, durable: int) -> None:
        """Forgets the parts checkpoint ``durable`` holds."""
        if ps in self.entries:
            self.entries[ps] = [e for e in self.entries[ps] if e[0] > durable]

    def keep_only(self, servers: list[str]) -> None:
        """Forgets servers that left the layout (their rows' new holders checkpointed them)."""
        for ps in [p for p in self.entries if p not in servers]:
            del self.entries[ps]

    def size(self) -> int:
        return sum(len(v) for v in self.entries.values())


class Pusher:
    """Sends a worker's pushes in order on its own thread (``pending`` counts the unsent)."""

    def __init__(self, client: "PSClient") -> None:
        self.client = client
        self.log = PushLog()
        self._queue: queue.Queue[tuple[int, Part, float] | None] = queue.Queue()
        self._cond = threading.Condition()
        self.pending = 0
        self.acked_rounds = 0
        self.error: BaseException | None = None
        self._abort = threading.Event()
        self.replayed = 0
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"ps-push-{client.worker}")
        self._thread.start()

    def submit(self, seq: int, part: Part, lr: float) -> None:
        with self._cond:
            self.pending += 1
        self._queue.put((seq, part, lr))

    def wait_below(self, n: int, timeout_s: float | None = None) -> None:
        """Blocks until at most ``n`` pushes are unsent (``n=0``: all sent)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.pending <= n or self.error is not None, timeout_s):
                raise TimeoutError(f"{self.pending} pushes still unsent")
        if self.error is not None:
            raise RuntimeError("the push thread failed") from self.error

    @property
    def aborted(self) -> bool:
        return self._abort.is_set()

    def abort(self) -> None:
        """Stops sending at once (what is unsent is dropped) and joins the thread."""
        self._abort.set()
        self._queue.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(10)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Sends what is queued, then ends the thread (aborting after ``timeout_s``)."""
        self._queue.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("push thread of %s still sending after %.0f s; aborting", self.client.worker, timeout_s)
            self.abort()

    def _run(self) -> None:
        try:
            while not self.aborted:
                try:
                    item = self._queue.get(timeout=0.05)
                except queue.Empty:
                    self._idle_replay()
                    continue
                if item is None:
                    return
                self._push_one(item)
                if self.error is not None:
                    return
        finally:
            with self._cond:  # nobody waits forever on a push that will not be sent
                if self.error is None and self.pending:
                    self.error = Aborted(f"{self.pending} pushes of {self.client.worker} were not sent")
                self._cond.notify_all()

    def _push_one(self, item: tuple[int, Part, float]) -> None:
        try:
            self._push(*item)
        except Aborted:
            pass
        except BaseException as e:  # noqa: BLE001 - reported to the training thread
            log.exception("push failed")
            self.error = e
        with self._cond:
            self.pending -= 1
            self._cond.notify_all()

    def _idle_replay(self) -> None:
        try:
            self.replay_if_asked()
        except Aborted:
            pass
        except BaseException as e:  # noqa: BLE001 - reported to the training thread
            log.exception("replay failed")
            self.error = e

    def _push(self, seq: int, part: Part, lr: float) -> None:
        k, remaining = 0, part
        while remaining:
            self.replay_if_asked()
            routed = self.client.route(remaining)
            refused: Part = {}
            for ps, sub in routed.items():
                ans = self._send(ps, seq, k, sub, lr)
                if ans["status"] in ("ok", "dup"):  # dup: applied before, its answer was lost
                    if int(ans.get("ckpt", 0)) > 0:
                        self.log.add(ps, int(ans["ckpt"]), seq, k, lr, sub)
                    self.log.trim(ps, int(ans.get("durable", 0)))
                else:
                    refused = self._merge(refused, sub)
            remaining, k = refused, k + 1
            if remaining:
                time.sleep(0.005)
                self.client.refresh_layout()
                self.log.keep_only(self.client.layout.servers)

    @staticmethod
    def _merge(into: Part, sub: Part) -> Part:
        out = dict(into)
        for name, (ids, g) in sub.items():
            if name in out:
                out[name] = (torch.cat([out[name][0], ids]), torch.cat([out[name][1], g]))
            else:
                out[name] = (ids, g)
        return out

    def _send(self, ps: str, seq: int, k: int, part: Part, lr: float) -> dict[str, Any]:
        """One part to ``ps``; after a broken connection, the same ``(seq, k)`` to the same
        server, or, once it has left the layout, the master's word on whether it applied it."""
        header = {"worker": self.client.worker, "seq": seq, "k": k, "lr": lr, "tables": list(part)}
        sticky, delay = False, 0.01
        while True:
            if self.aborted:
                raise Aborted(f"push {seq} of {self.client.worker} not sent")
            try:
                ans = self.client.conn(ps, "push").call("push", header, part_tensors(part))[0]
            except KeyError:  # ps has left the layout
                if not sticky:
                    return {"status": "moved"}
                known = self.client.master("applied", {"ps": ps, "seq": seq, "k": k})
                if known["status"] == "ok":  # its rows moved (and were checkpointed) with the update, or not
                    return {"status": "dup"} if known["applied"] else {"status": "moved"}
            except ConnectionLost as e:
                sticky = True
                log.info("push to %s lost (%s); resending after a layout refresh", ps, e)
            else:
                if not (sticky and ans["status"] == "retry"):
                    if ans["status"] == "error":
                        raise RuntimeError(f"{ps} refused a push: {ans}")
                    return ans
            time.sleep(delay)
            delay = min(0.2, delay * 2)
            self.client.refresh_layout()
            self.replay_if_asked()

    def replay_if_asked(self) -> None:
        """Replays to each restored server the logged parts its checkpoint lacks."""
        for ps, (n, ckpt) in self.client.take_replays().items():
            try:
                self._replay(ps, ckpt)
            except ConnectionLost:
                log.warning("replay to %s broke; the master will ask again", ps)
                continue
            self.client.master("replay_done", {"ps": ps, "n": n})

    def _replay(self, ps: str, ckpt: int) -> None:
        self.log.trim(ps, ckpt)
        self.client.refresh_layout()
        for entry in self.log.entries.get(ps, []):
            _, seq, k, lr, part = entry
            header = {"worker": self.client.worker, "seq": seq, "k": k, "lr": lr, "tables": list(part)}
            ans = self.client.conn(ps, "push").call("replay", header, part_tensors(part))[0]
            if ans["status"] != "ok":
                raise RuntimeError(f"replay to {ps} refused: {ans}")
            entry[0] = int(ans["ckpt"])
            self.replayed += 1
        log.info("replayed %d pushes to %s", len(self.log.entries.get(ps, [])), ps)
