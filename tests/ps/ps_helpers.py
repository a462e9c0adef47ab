"""A deterministic PS workload: each sample pushes integer-valued gradients,
so the sum of what was pushed must equal the parameters' change exactly."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import pytest
import torch

from tidal.ps import PSClient, PSMaster, TableSpec
from tidal.ps.wire import Conn, ConnectionLost

ROWS, DIM, DENSE = 3000, 4, 6
TABLES = [TableSpec("emb", ROWS, DIM, "float64"), TableSpec("dense", DENSE, 2, "float64")]


def sample_grads(i: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    ids = torch.tensor([(i * 7) % ROWS, (i * 13 + 1) % ROWS, i % ROWS])
    g = torch.full((3, DIM), float(i % 5 + 1))
    return {"emb": (ids, g), "dense": (torch.arange(DENSE), torch.full((DENSE, 2), float(i % 3)))}


@dataclass
class Worker:
    """A worker thread that trains on shards from the master and records what it pushed."""

    master_addr: str
    wid: str
    pause_s: float = 0.002
    staleness: int | None = None
    pushed: dict[str, torch.Tensor] = field(default_factory=lambda: {
        "emb": torch.zeros(ROWS, DIM, dtype=torch.float64), "dense": torch.zeros(DENSE, 2, dtype=torch.float64)})
    samples: list[int] = field(default_factory=list)
    error: BaseException | None = None
    client: PSClient | None = None
    crash_after: int | None = None

    def start(self) -> "Worker":
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        try:
            self.client = c = PSClient(self.master_addr, self.wid, staleness=self.staleness)
        except BaseException as e:  # noqa: BLE001 - the test reads it
            self.error = e
            return
        try:
            for shard in c.shards():
                for i in range(shard.start, shard.end):
                    if self.crash_after is not None and len(self.samples) >= self.crash_after:
                        c.crash()
                        return
                    grads = sample_grads(i)
                    c.pull({"emb": grads["emb"][0]})
                    c.push(grads, lr=1.0)
                    for name, (ids, g) in grads.items():
                        self.pushed[name].index_add_(0, ids, g.double())
                    self.samples.append(i)
                    time.sleep(self.pause_s)
            c.close()
        except BaseException as e:  # noqa: BLE001 - the test reads it
            self.error = e
            c.close(leave=False)

    def join(self, timeout_s: float = 60.0) -> None:
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), f"{self.wid} still running"
        assert self.error is None, f"{self.wid} failed: {self.error!r}"


def parameters(master: PSMaster) -> dict[str, torch.Tensor]:
    """Every table, read through a fresh client (which then leaves)."""
    c = PSClient(master.server.addr if master.server else "", "reader")
    try:
        return {t.name: c.pull_table(t.name) for t in TABLES}
    finally:
        c.close()


def wait_for(cond, timeout_s: float = 30.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


def assert_no_lost_update(master: PSMaster, workers: list[Worker]) -> None:
    got = parameters(master)
    for name in got:
        expected = -sum(w.pushed[name] for w in workers)
        assert torch.equal(got[name], expected), f"{name}: parameters differ from the pushed sum " \
            f"by {float((got[name] - expected).abs().max())}"


def lose_push_answers(monkeypatch: pytest.MonkeyPatch, every: int = 5) -> list[int]:
    """On every connection, every ``every``-th push is delivered (and applied) but
    its answer is lost; returns a counter of pushes sent."""
    real, calls, per_conn = Conn.call, [0], {}

    def lossy(self: Conn, op: str, header: dict[str, Any] | None = None, tensors: Any = None) -> Any:
        answer = real(self, op, header, tensors)
        if op == "push":
            calls[0] += 1
            per_conn[id(self)] = n = per_conn.get(id(self), 0) + 1
            if n % every == 0:
                self.close()
                raise ConnectionLost(f"{self.addr}: push: answer lost (test)")
        return answer

    monkeypatch.setattr(Conn, "call", lossy)
    return calls


@pytest.fixture(autouse=True)
def no_thread_left() -> Iterator[None]:
    """Every PS thread (servers, master, clients) a test started has ended when it returns."""
    before = set(threading.enumerate())

    def left() -> list[str]:
        return [t.name for t in threading.enumerate() if t not in before and t.name.startswith("ps-")]

    yield
    end = time.monotonic() + 5
    while left() and time.monotonic() < end:
        time.sleep(0.05)
    assert not left(), f"threads still running: {left()}"
