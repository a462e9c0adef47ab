"""A silent peer (a cut host; here a stopped process, which sends no reset
either) cannot hold its peers' collective until the collective timeout: the
master sees its beats stop and aborts the generation
(``<prefix>abort``), and a worker told to abort leaves its gradient
all-reduce at once, drops the step like one whose peer died, abandons the
old group without blocking on it, and can form a new group and exit.
(``tidal.runtime.abortable``; the multi-host test is
tests/multihost/test_multihost_cut.py.)"""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from master_helpers import RecordingSpawner
from runtime_helpers import exit_quietly
from tidal.runtime import abortable
from tidal.runtime.health import HealthMonitor
from tidal.runtime.master import JobMaster
from tidal.runtime.reducer import GradReducer

ABORT_AFTER_S = 1.0


def test_abort_signal_names_the_current_generation_only() -> None:
    s = abortable.AbortSignal()
    s.enter(3)
    assert s.pending() is None
    s.request(2, "old")  # an older generation's abort does not touch the current one
    assert s.pending() is None and not s.requested(2)
    s.request(3, "w1: no liveness beat for 10.2s")
    assert s.pending() == "w1: no liveness beat for 10.2s" and s.requested(3)
    s.request(3, "again")
    assert s.pending() == "w1: no liveness beat for 10.2s"
    s.enter(4)  # the survivors' generation starts clean
    assert s.pending() is None


def _beats(h: HealthMonitor, t: float, seconds: int, who: dict[str, bool]) -> None:
    for k in range(seconds):
        h.observe({w: (json.dumps([int(t) + k, 5, "sync"]).encode() if on else h._beats[w].raw
                       if w in h._beats else None) for w, on in who.items()}, t + k)


def test_a_member_is_cut_off_after_the_silent_timeout_while_a_peer_beats() -> None:
    h = HealthMonitor(hang_timeout_s=30.0, silent_timeout_s=10.0)
    assert h.no_beat_s == 10.0
    _beats(h, 100.0, 3, {"w0": True, "w1": True, "w2": True})
    _beats(h, 103.0, 10, {"w0": True, "w1": False, "w2": True})
    assert h.cut_off(["w0", "w1", "w2"], set(), 112.0) == {}  # 10 s: not yet
    _beats(h, 113.0, 2, {"w0": True, "w1": False, "w2": True})
    cut = h.cut_off(["w0", "w1", "w2"], set(), 114.0)
    assert list(cut) == ["w1"] and cut["w1"] > 10.0
    assert h.cut_off(["w0", "w1", "w2"], {"w1"}, 114.0) == {}  # a leaver of a pending switch is not judged
    assert [w for w, _ in h.hung(["w0", "w1", "w2"], set(), set(), 114.0)] == ["w1"]  # and killed, if possible
    # everyone quiet: the master's own view is stale, nobody is cut off
    _beats(h, 115.0, 1, {"w0": False, "w1": False, "w2": False})
    assert h.cut_off(["w0", "w1", "w2"], set(), 119.5) == {}
    assert HealthMonitor(30.0, silent_timeout_s=0).cut_off(["w0", "w1"], set(), 1e9) == {}  # 0: off


def _formed(n: int) -> tuple[JobMaster, RecordingSpawner]:
    sp = RecordingSpawner()
    m = JobMaster("j", n, spawner=sp, first_worker=n)
    for i in range(n):
        m.register(f"w{i}")
    g = m.group.gen
    assert g is not None
    m.group.store.set(g.prefix + "state", "commit")  # every member passed the gate: the group formed
    return m, sp


def _run(m: JobMaster, t0: float, seconds: int, silent: set[str]) -> None:
    assert m.group.gen is not None
    for k in range(seconds):
        for w in m.group.gen.members:
            if w not in silent:
                m.group.store.set(f"tidal/j/alive/{w}", json.dumps([int(t0) + k, 4, "sync"]))
        m.check_health(now=t0 + k)


def test_the_master_aborts_a_generation_with_a_silent_member_and_reforms_without_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDAL_SILENT_TIMEOUT_S", "5")
    m, sp = _formed(3)
    g = m.group.gen
    assert g is not None
    t = time.monotonic() - 9  # on the master's clock, which its failure reports read
    _run(m, t, 2, set())
    _run(m, t + 2, 5, {"w1"})
    assert not m.group.store.check([g.prefix + "abort"])  # 5 s: not yet
    _run(m, t + 7, 2, {"w1"})
    assert "w1: no liveness beat" in m.group.store.get(g.prefix + "abort").decode()
    assert sp.killed == ["w1"]  # killed too where the spawner can (a cut host's agent may not be reachable)
    # the survivors leave their collective and report as if a peer had died
    m.failed("w0", gen=g.gen, step=4)
    m.failed("w2", gen=g.gen, step=4)
    assert m.group.gen is not None and m.group.gen.members == ("w0", "w2")
    assert m.core.changes[-1]["kind"] == "recover"


def test_a_member_known_dead_without_a_report_aborts_its_generation() -> None:
    """After the master moved, the workers lost with its old host never beat
    on the new store; the spawner knows them dead, and no survivor reports
    (no reset reached them): the generation is aborted after a grace."""
    m, sp = _formed(3)
    g = m.group.gen
    assert g is not None
    sp.codes["w2"] = -9
    t = time.time()
    m.check_health(now=1000.0, wall=t)
    assert not m.group.store.check([g.prefix + "abort"])
    m.check_health(now=1004.0, wall=t + 4)
    assert "w2: its process is gone" in m.group.store.get(g.prefix + "abort").decode()


# ----------------------------------------------------------------------------- a real gloo group


class _Listener:
    def __init__(self) -> None:
        self.failed: list[str] = []

    def sync_begin(self) -> list[float]:
        return [0.0]

    def sync_done(self, reduced: list[float]) -> None:
        pass

    def sync_failed(self, error: Exception) -> None:
        self.failed.append(str(error))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))


def _worker(rank: int, port: int, out: Any) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    abortable.SIGNAL.enter(1)
    model, listener = _model(), _Listener()
    red = GradReducer(list(model.parameters()), listener=listener, bucket_cap_mb=0.0002, first_bucket_mb=0.0002)
    assert len(red.buckets) > 1  # a bucket is launched from a hook during backward, before the last one
    x = torch.randn(4, 6)
    red.arm(0.5, True)
    model(x).sum().backward()  # one good step
    assert not listener.failed and all(p.grad is not None for p in model.parameters())
    if rank == 1:
        out["pid"] = os.getpid()
        os.kill(os.getpid(), signal.SIGSTOP)  # silent from now on: no beat, no reset
        return
    while "pid" not in out:
        time.sleep(0.01)
    bufs = [b.buf.data_ptr() for b in red.buckets]
    threading.Timer(ABORT_AFTER_S, abortable.SIGNAL.request, (1, "w1: no liveness beat")).start()
    t0 = time.monotonic()
    red.arm(0.5, True)
    model(x).sum().backward()  # blocks on the stopped peer until the abort
    out["left_after_s"] = time.monotonic() - t0
    out["failed"] = listener.failed
    # a dropped step: zero gradients, new tensors (not the abandoned buckets' memory)
    out["grads_zero"] = all(p.grad is not None and not p.grad.any() and
                            all(p.grad.data_ptr() != b for b in bufs) for p in model.parameters())
    out["renewed"] = all(b.buf.data_ptr() != p for b, p in zip(red.buckets, bufs))
    t1 = time.monotonic()
    abortable.abandon_group("gloo")
    out["abandon_s"] = time.monotonic() - t1
    solo = dist.TCPStore("127.0.0.1", 0, 1, True)  # the survivors' next group forms
    dist.init_process_group("gloo", store=solo, rank=0, world_size=1)
    t = torch.ones(3)
    dist.all_reduce(t)
    out["next_group"] = t.tolist()
    dist.destroy_process_group()
    out["exiting_at"] = time.time()


@pytest.mark.timeout(90)
def test_a_worker_told_to_abort_leaves_an_all_reduce_its_stopped_peer_blocks() -> None:
    ctx = mp.get_context("spawn")
    with ctx.Manager() as mgr:
        out = mgr.dict()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = [ctx.Process(target=exit_quietly, args=(_worker, r, port, out)) for r in range(2)]
        for p in procs:
            p.start()
        try:
            procs[0].join(timeout=60)
            exited_at = time.time()
            res = dict(out)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()  # the stopped peer, after the assertions' data is in
                    p.join(timeout=10)
    assert procs[0].exitcode == 0, res
    print(f"left the blocked all-reduce {res['left_after_s'] - ABORT_AFTER_S:.3f}s after the abort; "
          f"abandoned the group in {res['abandon_s'] * 1e3:.2f} ms")
    assert ABORT_AFTER_S <= res["left_after_s"] < ABORT_AFTER_S + 1.0  # one wait slice (0.1 s) after the abort
    assert len(res["failed"]) == 1 and "GenerationAborted" in res["failed"][0]
    assert res["grads_zero"] and res["renewed"]  # a dropped step; the abandoned work keeps the old buffers
    assert res["abandon_s"] < 1.0 and res["next_group"] == [1.0, 1.0, 1.0]
    assert exited_at - res["exiting_at"] < 10.0  # not held at exit by the abandoned group (60 s timeout)
