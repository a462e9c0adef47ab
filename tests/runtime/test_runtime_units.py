"""Single-process tests of the pure pieces: the data cursor, shard bookkeeping,
batch/LR policies, master-state persistence, and the worker's parts that need
no process group (switch agreement, report outbox, checkpoint settings, the
undo of a dropped step)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tidal import settings as tidal_settings
from tidal.runtime.checkpoint import Checkpointer
from tidal.runtime.data import ShardManager, epoch_permutation, split_sizes, step_slice
from tidal.runtime.persistence import FileBackend, SQLiteBackend, open_backend
from tidal.runtime.heartbeat import Heartbeat, Outbox
from tidal.runtime.membership import Agreement, Membership, Seat, SwitchAgreement
from tidal.runtime.messages import Generation, SwitchPlan
from tidal.runtime.scaling import HybridScaling, StrongScaling, WeakScaling, make_policy
from tidal.runtime.state import ElasticState, TrainState


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 300),
    batch=st.integers(1, 64),
    worlds=st.lists(st.integers(1, 8), min_size=1, max_size=40),
)
def test_any_sequence_of_world_sizes_reads_each_position_once(n: int, batch: int, worlds: list[int]) -> None:
    """Whatever the world size at each step, an epoch's positions are covered
    exactly once and each step consumes [t*B, (t+1)*B) (cut at the epoch end)."""
    cursor, seen, t = 0, [], 0
    while cursor < n:
        w = worlds[t % len(worlds)]
        parts = [step_slice(cursor, n, batch, r, w) for r in range(w)]
        assert parts[0].start == t * batch and parts[0].stop == min((t + 1) * batch, n)
        for sl in parts:
            seen.extend(range(sl.lo, sl.hi))
        sizes = [sl.local_size for sl in parts]
        assert max(sizes) - min(sizes) <= 1
        cursor = parts[0].stop
        t += 1
    assert seen == list(range(n))


def test_permutation_is_seeded_per_epoch() -> None:
    a, b = epoch_permutation(100, 3, 0), epoch_permutation(100, 3, 1)
    assert sorted(a.tolist()) == list(range(100))
    assert a.tolist() == epoch_permutation(100, 3, 0).tolist()
    assert a.tolist() != b.tolist()
    assert a.tolist() != epoch_permutation(100, 4, 0).tolist()


def test_split_sizes_uneven() -> None:
    assert split_sizes(25, 4) == [7, 6, 6, 6]
    assert split_sizes(2, 4) == [1, 1, 0, 0]


def test_shards_exactly_once_with_a_leaving_worker() -> None:
    m = ShardManager(n=100, shard_size=30, epochs=2)
    consumed: list[int] = []
    a = m.next("a")
    b = m.next("b")
    assert a and b
    consumed += range(a.start, a.start + 10)
    m.progress(a.shard_id, a.start + 10)
    back = m.release("a")  # a leaves mid-shard: the rest goes back with its offset
    assert back[0].offset == a.start + 10
    consumed += range(b.start, b.stop)
    m.complete(b.shard_id)
    while (sh := m.next("b")) is not None and sh.epoch == 0:
        consumed += range(sh.offset, sh.stop)
        m.complete(sh.shard_id)
    assert sorted(consumed) == list(range(100))
    assert sh is not None and sh.epoch == 1 and sh.offset == 0  # the second epoch starts over
    snap = m.snapshot()
    again = ShardManager.from_snapshot(snap)
    assert again.snapshot() == snap


def test_strong_policy_keeps_batch_and_lr() -> None:
    p = StrongScaling(64)
    assert p.start(2) == 64 and p.rescale(10, 2, 4) == 64 and p.lr_factor(11) == 1.0


def test_weak_policy_scales_batch_and_lr_linearly() -> None:
    p = WeakScaling(16)
    assert p.start(2) == 32 and p.lr_factor(0) == 1.0
    assert p.rescale(5, 2, 4) == 64 and p.lr_factor(5) == 2.0


def test_hybrid_policy_is_algorithm_1_with_progressive_lr() -> None:
    p = HybridScaling(64, min_local=8, max_local=32, warmup_steps=10)
    assert p.start(2) == 64
    assert p.rescale(0, 2, 4) == 64 and p.lr_factor(1) == 1.0  # 16 per worker: keep B (strong)
    assert p.rescale(100, 4, 16) == 128  # 4 per worker < 8: grow B to 16*8
    assert p.lr_factor(100) == 1.0 and p.lr_factor(105) == pytest.approx(1.5) and p.lr_factor(110) == 2.0
    q = make_policy("hybrid", 64, min_local=8, max_local=32, warmup_steps=10)
    q.load_state_dict(p.state_dict())
    assert q.lr_factor(105) == pytest.approx(1.5)


@pytest.mark.parametrize("kind", ["file", "sqlite"])
def test_state_backends_roundtrip(tmp_path: Path, kind: str) -> None:
    url = f"{kind}://{tmp_path / 'state'}"
    b = open_backend(url)
    assert isinstance(b, FileBackend if kind == "file" else SQLiteBackend)
    assert b.load() is None
    b.save({"gen": 3, "members": ["w0", "w2"]})
    b.save({"gen": 4, "members": ["w0"]})
    assert open_backend(url).load() == {"gen": 4, "members": ["w0"]}
    with pytest.raises(ValueError):
        open_backend("etcd://x")


# --------------------------------------------------------------------------- worker parts (no process group)
def _plan(gen: int, switch_step: int) -> SwitchPlan:
    return SwitchPlan(Generation(gen, ("w0", "w1"), "127.0.0.1", 1, f"g{gen}/"), switch_step, 2)


def test_switch_agreement_rides_on_the_control_pair() -> None:
    a = SwitchAgreement()
    g1 = Generation(1, ("w0", "w1"), "127.0.0.1", 1, "g1/")
    rank0, rank1 = Seat(g1, 0, 2), Seat(g1, 1, 2)
    assert a.control(rank0) == (None, (0.0, 0.0))  # nothing seen yet
    a.see(_plan(1, 9))
    assert a.control(rank0) == (None, (0.0, 0.0))  # not newer than the current generation
    p = _plan(2, 9)
    a.see(p)
    assert a.control(rank0) == (p, (2.0, 9.0)) and a.control(rank1) == (None, (0.0, 0.0))
    assert a.settle(None, (0.0, 0.0), 5) is None and a.agreed is None
    ag = a.settle(p, (2.0, 9.0), 12)  # the planned step already passed: switch at the next one
    assert ag == Agreement(p, 2, 13) and a.agreed is ag
    assert a.settle(p, (2.0, 9.0), 12) is None  # agreed once
    assert a.control(rank0) == (None, (0.0, 0.0))  # nothing proposed while an agreement is pending
    assert not a.due(12) and a.due(13)
    a.complete(Agreement(None, 2, 13), _plan(3, 1))  # a stale prefetch is ignored
    assert a.agreed is ag
    assert a.take() is ag and a.agreed is None


def test_switch_agreement_prefetched_plan_and_cancel() -> None:
    a = SwitchAgreement()
    ag = a.settle(None, (4.0, 20.0), 3)  # a non-zero rank: the plan comes later
    assert ag == Agreement(None, 4, 20)
    p = _plan(4, 20)
    a.complete(ag, p)
    assert a.agreed == Agreement(p, 4, 20)
    a.clear()  # a failed step cancels it
    assert a.agreed is None and not a.due(100)


class _Recorder:
    def __init__(self, fail_on: str | None = None) -> None:
        self.posts: list[tuple[str, dict]] = []
        self.fail_on = fail_on

    def post(self, path: str, body: dict) -> dict:
        if path == self.fail_on:
            raise ConnectionError(path)
        self.posts.append((path, body))
        return {"status": "ok"}


def test_outbox_posts_in_order_and_keeps_a_switch_report_until_posted() -> None:
    box = Outbox()
    box.switched({"gen": 2})
    box.switched({"gen": 3})  # replaces the older report
    box.straggler({"worker_id": "w1"})
    box.straggler({"worker_id": "w2"})
    box.agreed(4, 17)
    with pytest.raises(ConnectionError):
        box.post(_Recorder(fail_on="/switched"))  # type: ignore[arg-type]
    c = _Recorder()
    box.post(c)  # type: ignore[arg-type]
    assert c.posts == [("/switched", {"gen": 3}), ("/straggler", {"worker_id": "w1"}),
                       ("/straggler", {"worker_id": "w2"}), ("/agreed", {"gen": 4, "switch_step": 17})]
    box.post(c)  # type: ignore[arg-type]
    box.flush_switched(c)  # type: ignore[arg-type]
    assert len(c.posts) == 4
    box.switched({"gen": 5})
    box.flush_switched(c)  # type: ignore[arg-type]
    assert c.posts[-1] == ("/switched", {"gen": 5})


class _CountingMembership(Membership):
    """A local-mode membership whose seat is a non-zero rank's and counts how
    often the heartbeat thread looks at it (once per wake-up)."""

    looks = 0

    @property
    def seat(self) -> Seat:
        self.looks += 1
        return self._seat

    @seat.setter
    def seat(self, value: Seat) -> None:
        self._seat = value


def test_step_ends_wake_the_heartbeat_once_per_interval_and_a_prefetch_at_once() -> None:
    """Step ends wake the heartbeat thread only once its interval is over (not
    at every step: a thread hand-off per step costs every rank CPU), and a
    non-zero rank's plan prefetch wakes it at once."""
    m = _CountingMembership("w1", None)
    m.seat = Seat(None, 1, 2)
    hb = Heartbeat(m, 0.25, lambda g: {})
    hb.start()
    try:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 1.0:  # 200 step ends of 5 ms in 1 s
            hb.wake()
            time.sleep(0.005)
        woken = m.looks
        assert 1 <= woken <= 1.0 / 0.25 + 3, woken  # the interval's, and the 0.5 s timeouts at most
        before = m.looks
        hb.wake_now()
        deadline = time.perf_counter() + 2.0
        while m.looks == before and time.perf_counter() < deadline:
            time.sleep(0.005)
        assert m.looks > before
    finally:
        hb.stop()


def test_checkpointer_arguments_then_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(tidal_settings.CHECKPOINT_DIR.name, raising=False)
    monkeypatch.delenv(tidal_settings.CHECKPOINT_EVERY.name, raising=False)
    assert Checkpointer.configure().every == 0 and Checkpointer.configure().directory is None
    c = Checkpointer.configure(tmp_path)
    assert c.directory == str(tmp_path) and c.every == 100  # a directory alone: every 100 steps
    monkeypatch.setenv(tidal_settings.CHECKPOINT_DIR.name, str(tmp_path / "env"))
    monkeypatch.setenv(tidal_settings.CHECKPOINT_EVERY.name, "7")
    c = Checkpointer.configure()
    assert c.directory == str(tmp_path / "env") and c.every == 7
    assert Checkpointer.configure(tmp_path, 3).every == 3
    assert [s for s in range(30) if c.due(s)] == [7, 14, 21, 28]
    t = TrainState(ElasticState(torch.nn.Linear(1, 1)), step=14, cursor=140)
    c.write(t, world_size=1, worker="w0")
    assert not c.due(14) and c.due(21) and [w["step"] for w in c.written] == [14]
    again, t2 = Checkpointer.configure(), TrainState(ElasticState(torch.nn.Linear(1, 1)))
    assert again.resume(t2) and (t2.step, t2.cursor, again.resumed_from) == (14, 140, 14) and not again.due(14)


def test_dropped_step_snapshot_undoes_user_side_effects() -> None:
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    st = ElasticState(model, opt, sched, {"best": 1.0})
    snap = st.step_snapshot()
    r0 = torch.rand(3)
    opt.step()
    sched.step()
    st.extras["best"] = 0.5
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    st.restore_step_snapshot(snap)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1) and sched.last_epoch == 0 and st.extras == {"best": 1.0}
    assert torch.equal(torch.rand(3), r0)  # the RNG is back where the step started
