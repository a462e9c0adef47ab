"""Single-process tests of the pure pieces: the data cursor, shard bookkeeping,
batch/LR policies and master-state persistence."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidal.runtime.data import ShardManager, epoch_permutation, split_sizes, step_slice
from tidal.runtime.persistence import FileBackend, SQLiteBackend, open_backend
from tidal.runtime.scaling import HybridScaling, StrongScaling, WeakScaling, make_policy


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
