"""Fault paths of PS jobs: a push whose answer is lost (resent after its rows
moved or its server retired), a failed repartition rolled back, bounded
staleness at the end of the data, a reused checkpoint directory."""

from __future__ import annotations

import pytest
import torch

from tidal.ps import PSMaster, ShardQueue, ThreadLauncher
from tidal.ps.client import PSClient
from tidal.ps.server import PSServer
from tidal.ps.wire import Conn

from ps_helpers import TABLES, Worker, assert_no_lost_update, lose_push_answers, no_thread_left, parameters, wait_for

assert no_thread_left  # an autouse fixture


def _push(conn: Conn, seq: int, row: int, value: float) -> dict:
    ids, g = torch.tensor([row]), torch.full((1, 4), value, dtype=torch.float64)
    return conn.call("push", {"worker": "w9", "seq": seq, "k": 0, "lr": 1.0, "tables": ["emb"]},
                     {"emb/ids": ids, "emb/g": g})[0]


def test_a_resent_push_counts_once_after_its_rows_moved_or_its_server_retired(tmp_path) -> None:
    m = PSMaster(TABLES, str(tmp_path), ThreadLauncher(), servers=2, auto=False)
    addr = m.start()
    c = PSClient(addr, "w9")  # registered, so the master answers its questions
    p1, p2 = Conn(m.handles["p1"].addr), None
    try:
        first = _push(p1, 0, 2500, 1.0)  # row 2500: p1's now, p2's after the scale-out
        assert first["status"] == "ok"
        m.scale_servers(3)
        again = _push(p1, 0, 2500, 1.0)  # its answer was "lost": the same (seq, k) again
        assert again["status"] == "dup" and again["ckpt"] == first["ckpt"], again
        p2 = Conn(m.handles["p2"].addr)
        assert _push(p2, 1, 2500, 2.0)["status"] == "ok"
        m.scale_servers(2)  # p2 retires and stops; its marks stay with the master
        assert c.master("applied", {"ps": "p2", "seq": 1, "k": 0}) == {"status": "ok", "applied": True}
        assert c.master("applied", {"ps": "p2", "seq": 2, "k": 0}) == {"status": "ok", "applied": False}
        c.close()
        assert torch.equal(parameters(m)["emb"][2500], torch.full((4,), -3.0, dtype=torch.float64))
    finally:
        for conn in (p1, p2):
            if conn:
                conn.close()
        m.close()


def test_lost_answers_during_scaling_lose_and_double_nothing(tmp_path, monkeypatch) -> None:
    calls = lose_push_answers(monkeypatch, every=5)
    shards = ShardQueue(samples=400, shard_size=20)
    m = PSMaster(TABLES, str(tmp_path), ThreadLauncher(), servers=2, shards=shards, auto=False)
    addr = m.start()
    try:
        workers = [Worker(addr, f"w{i}").start() for i in range(2)]
        wait_for(lambda: len(shards.done) >= 4, what="4 shards")
        m.scale_servers(3)
        wait_for(lambda: len(shards.done) >= 10, what="10 shards")
        m.scale_servers(2)
        for w in workers:
            w.join()
        assert calls[0] > 100
        assert_no_lost_update(m, workers)
    finally:
        m.close()


def test_a_failed_repartition_is_rolled_back_and_training_goes_on(tmp_path, monkeypatch) -> None:
    prepare = PSServer._prepare

    def failing(self: PSServer, h: dict, t: dict):
        if self.id == "p2":
            raise OSError("disk full (test)")
        return prepare(self, h, t)

    monkeypatch.setattr(PSServer, "_prepare", failing)
    shards = ShardQueue(samples=300, shard_size=20)
    m = PSMaster(TABLES, str(tmp_path), ThreadLauncher(), servers=2, shards=shards, auto=False)
    addr = m.start()
    try:
        workers = [Worker(addr, f"w{i}").start() for i in range(2)]
        wait_for(lambda: len(shards.done) >= 3, what="3 shards")
        with pytest.raises(RuntimeError, match="prepare on p2"):
            m.scale_servers(3)
        assert m.layout.version == 1 and m.layout.servers == ["p0", "p1"] and "p2" not in m.handles
        for w in workers:
            w.join()
        assert shards.finished
        assert_no_lost_update(m, workers)
    finally:
        m.close()


def test_bounded_staleness_does_not_wait_for_a_worker_without_a_shard(tmp_path) -> None:
    # 3 shards, 2 workers: the one that finishes first has no shard left while the
    # other trains the third; it must not hold the other back.
    shards = ShardQueue(samples=30, shard_size=10)
    m = PSMaster(TABLES, str(tmp_path), ThreadLauncher(), servers=1, shards=shards)
    addr = m.start()
    try:
        workers = [Worker(addr, f"w{i}", staleness=1).start() for i in range(2)]
        for w in workers:
            w.join(30)
        assert shards.finished
        assert_no_lost_update(m, workers)
    finally:
        m.close()


def test_a_checkpoint_directory_of_another_job_is_refused(tmp_path) -> None:
    m = PSMaster(TABLES, str(tmp_path), ThreadLauncher(), servers=1)
    m.start()
    m.close()
    again = PSMaster(TABLES, str(tmp_path), ThreadLauncher(), servers=1)
    with pytest.raises(ValueError, match="another job"):
        again.start()
