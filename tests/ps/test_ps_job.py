"""PS jobs end to end on loopback: scaling without a lost update, a hot server
replaced, a killed server restored, dynamic sharding with a dead worker."""

from __future__ import annotations

import pytest
import torch

from tidal.ps import HotDetector, ProcessLauncher, PSMaster, ShardQueue, ThreadLauncher
from tidal.ps.client import PSClient

from ps_helpers import (TABLES, Worker, assert_no_lost_update, lose_push_answers, no_thread_left, sample_grads,
                        wait_for)

assert no_thread_left  # an autouse fixture


def test_scaling_ps_2_3_2_and_workers_2_4_2_loses_no_update(tmp_path) -> None:
    shards = ShardQueue(samples=800, shard_size=20)
    m = PSMaster(TABLES, str(tmp_path), ThreadLauncher(), servers=2, shards=shards, auto=False)
    addr = m.start()
    try:
        workers = [Worker(addr, f"w{i}").start() for i in range(2)]
        done = lambda frac: lambda: len(shards.done) >= frac * shards.total  # noqa: E731
        wait_for(done(0.1), what="10% of the shards")
        workers += [Worker(addr, f"w{i}").start() for i in range(2, 4)]
        wait_for(done(0.3), what="30% of the shards")
        m.scale_servers(3)
        assert len(m.layout.servers) == 3
        wait_for(done(0.5), what="50% of the shards")
        for w in workers[2:]:
            m.request_leave(w.wid)
        for w in workers[2:]:
            w.join()
        m.scale_servers(2)
        for w in workers:
            w.join()
        assert shards.finished
        processed = sorted(i for w in workers for i in w.samples)
        assert processed == list(range(800)), "every sample trained once"
        assert all(w.samples for w in workers), "every worker, the late ones too, trained"
        assert_no_lost_update(m, workers)
        assert [e["servers"] for e in m.events if e["kind"] == "scale_servers"] == [["p0", "p1", "p2"], ["p0", "p1"]]
    finally:
        m.close()


def test_a_hot_server_is_replaced_by_a_bigger_one(tmp_path) -> None:
    launcher = ThreadLauncher(work_s={"p0": 0.01, "p2": 0.01})  # p0's host is slow; p2 replaces it
    shards = ShardQueue(samples=100_000, shard_size=50)
    m = PSMaster(TABLES, str(tmp_path), launcher, servers=2, threads=2, shards=shards,
                 hot=HotDetector(delay_s=0.005, ratio=3.0), tick_s=0.3)
    addr = m.start()
    workers = []
    try:
        # two workers keep up to 4 requests in flight: more than p0's 2 threads, not p2's 4
        workers = [Worker(addr, f"w{i}", pause_s=0.0).start() for i in range(2)]
        wait_for(lambda: any(e["kind"] == "replace_server" for e in m.events), 30, "a hot server replaced")
        event = next(e for e in m.events if e["kind"] == "replace_server")
        assert (event["old"], event["new"], event["threads"]) == ("p0", "p2", 4)
        assert m.layout.servers == ["p2", "p1"]
        m.hot.window.clear()
        wait_for(lambda: "p2" in m.hot.window, 10, "a window of the new server")
        assert m.hot.window["p2"]["served"] > 0 and m.hot.window["p2"]["delay_s"] < m.hot.delay_s
        for w in workers:
            m.request_leave(w.wid)
        for w in workers:
            w.join()
        assert len(m.events) == 1 + len(workers), "one replacement only, then the workers leaving"
        assert_no_lost_update(m, workers)
    finally:
        m.close()


@pytest.mark.slow  # a live PS job (11 s): the default suite stays within 5 min
def test_a_killed_server_is_restored_and_workers_replay(tmp_path, monkeypatch) -> None:
    lose_push_answers(monkeypatch, every=3)  # resent pushes too must be in the log or the checkpoint
    shards = ShardQueue(samples=600, shard_size=20)
    m = PSMaster(TABLES, str(tmp_path), ProcessLauncher(), servers=2, shards=shards, tick_s=0.2)
    addr = m.start()
    try:
        workers = [Worker(addr, f"w{i}").start() for i in range(2)]
        wait_for(lambda: len(shards.done) >= 5, what="5 shards")
        numbers = m.checkpoint()
        wait_for(lambda: len(shards.done) >= 10, what="10 shards")
        m.handles["p1"].kill()
        wait_for(lambda: any(e["kind"] == "restore_server" for e in m.events), 30, "the restore")
        restore = next(e for e in m.events if e["kind"] == "restore_server")
        assert restore["ps"] == "p1" and restore["checkpoint"] >= numbers["p1"]
        for w in workers:
            w.join(120)
        assert sum(w.client.pusher.replayed for w in workers) > 0, "pushes after the checkpoint were replayed"
        assert shards.finished
        assert_no_lost_update(m, workers)
    finally:
        m.close()


def test_each_shard_is_done_once_when_a_worker_dies_mid_shard(tmp_path) -> None:
    shards = ShardQueue(samples=200, shard_size=10)
    m = PSMaster(TABLES, str(tmp_path), ThreadLauncher(), servers=1, shards=shards, worker_timeout_s=0.5, tick_s=0.1)
    addr = m.start()
    try:
        dying = Worker(addr, "w0", crash_after=15).start()
        dying.thread.join(30)
        assert dying.client is not None and len(dying.samples) == 15
        held = [sid for sid, (_, w) in shards.doing.items() if w == "w0"]
        assert held == [1], "the dead worker holds its second shard"
        wait_for(lambda: any(e["kind"] == "worker_gone" for e in m.events), 10, "the dead worker dropped")
        assert shards.doing == {} and shards.todo[0].id == 1, "its shard is back in front of TODO"
        survivor = Worker(addr, "w1", pause_s=0.0).start()
        survivor.join()
        assert shards.finished and sorted(shards.done) == list(range(20))
        assert shards.done[1] == "w1" and shards.done[0] == "w0"
        assert sorted(set(survivor.samples)) == list(range(10, 200))
    finally:
        m.close()


def test_shard_queue_refuses_a_report_from_a_worker_that_lost_the_shard() -> None:
    q = ShardQueue(samples=30, shard_size=10, epochs=2)
    a = q.next("a")
    assert a is not None and q.release("a") == [a.id]
    b = q.next("b")
    assert b == a
    assert not q.complete("a", a.id) and q.complete("b", a.id) and not q.complete("b", a.id)
    assert q.total == 6 and q.counts() == {"todo": 5, "doing": 0, "done": 1}


def test_staleness_zero_reads_its_own_pushes(tmp_path) -> None:
    m = PSMaster(TABLES, str(tmp_path), ThreadLauncher(), servers=2)
    addr = m.start()
    c = PSClient(addr, "w0", staleness=0)
    try:
        total = torch.zeros(3, 4, dtype=torch.float64)
        for i in range(20):
            ids, g = sample_grads(i)["emb"]
            ids = torch.tensor([1, 2000, 2999])
            c.push({"emb": (ids, g)})
            total += g
            assert torch.equal(c.pull({"emb": ids})["emb"], -total)
    finally:
        c.close()
        m.close()
