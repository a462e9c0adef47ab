"""The buddy allocator's per-node counts (tidal.scheduler.nodebits), kept up
to date as blocks are taken and released, give the same best-fit blocks as
the plain rule computed from the whole mask, over random sequences of
allocations and releases."""

from __future__ import annotations

import numpy as np
import pytest

from tidal.core.topology import parse_cluster
from tidal.scheduler.buddy import BuddyAllocator, _keep_part, pieces
from tidal.scheduler.nodebits import NodeBits


def reference_best(used: np.ndarray, s: int, per: int, sw: int) -> int | None:
    """The best-fit rule in plain Python: among free aligned blocks of ``s``,
    the fewest free GPUs in the buddy pair, then node (blocks smaller than a
    node), then switch (when the padded size splits into switches); the
    lowest offset on ties."""
    size = used.size
    free = [not u for u in used.tolist()]
    parent = min(2 * s, size)
    keys = []
    for o in range(0, size, s):
        if not all(free[o : o + s]):
            continue
        p0, n0, w0 = o // parent * parent, o // per * per, o // sw * sw
        keys.append((sum(free[p0 : p0 + parent]), sum(free[n0 : n0 + per]) if s < per else 0,
                     sum(free[w0 : w0 + sw]) if size % sw == 0 else 0, o))
    return min(keys)[-1] if keys else None


def assert_counts_current(b: BuddyAllocator) -> None:
    """The allocator's kept counts equal counts built afresh from its mask."""
    kept = b._node_bits()
    fresh = NodeBits(b.mask(), b.cluster.nodes_per_switch)
    assert kept.bytes.tolist() == fresh.bytes.tolist()
    assert kept.free8.tolist() == fresh.free8.tolist()
    assert (kept.swf is None) == (fresh.swf is None)
    if kept.swf is not None:
        assert kept.swf.tolist() == fresh.swf.tolist()


@pytest.mark.parametrize("cluster", ["n4g8", "n3g8", "n8g8", "n16g8s4", "n12g8s3", "n64g8s2"])
@pytest.mark.parametrize("seed", range(3))
def test_kept_counts_give_the_reference_block(cluster: str, seed: int) -> None:
    c = parse_cluster(cluster)
    rng = np.random.default_rng(seed)
    b = BuddyAllocator(c)
    per, sw = c.gpus_per_node, c.gpus_per_node * c.nodes_per_switch
    jobs: list[tuple[int, ...]] = []
    for _ in range(150):
        r = rng.random()
        if r < 0.55:
            got = b.alloc(int(rng.choice([1, 1, 2, 2, 3, 4, 5, 6, 8, 12, 16, 32])))
            if got is not None:
                jobs.append(got)
        elif r < 0.85 and jobs:
            b.release(jobs.pop(int(rng.integers(len(jobs)))))
        elif jobs:  # part of a job is given back, then taken again
            gpus = jobs[int(rng.integers(len(jobs)))]
            part = gpus[: max(1, len(gpus) // 2)]
            b.release(part)
            b.take(part)
        assert_counts_current(b)
        mask = b.mask()
        for s in (1, 2, 4, 8, 16, 32, 64):
            if s <= b.size:
                assert b.best_fit_block(s) == reference_best(mask, s, per, sw), (s, mask.astype(int).tolist())


@pytest.mark.parametrize("cluster", ["n4g8", "n16g8s4"])
def test_random_masks_give_the_reference_block(cluster: str) -> None:
    c = parse_cluster(cluster)
    rng = np.random.default_rng(1)
    per, sw = c.gpus_per_node, c.gpus_per_node * c.nodes_per_switch
    for _ in range(200):
        b = BuddyAllocator(c, {int(g) for g in np.flatnonzero(rng.random(c.num_gpus) < rng.random())})
        mask = b.mask()
        for s in (1, 2, 4, 8, 16, 32):
            if s <= b.size:
                assert b.best_fit_block(s) == reference_best(mask, s, per, sw)


def test_writes_through_used_are_seen() -> None:
    """A caller may write the mask ``used`` hands out, before or after a search."""
    b = BuddyAllocator(parse_cluster("n2g8"))
    used = b.used
    assert b.best_fit_block(8) == 0
    used[0] = True
    assert b.best_fit_block(8) == 8
    assert b.best_fit_block(1) == 1
    b.used = np.zeros(b.size, dtype=bool)
    assert b.best_fit_block(16) == 0


def reference_keep_part(gpus: tuple[int, ...], n: int) -> tuple[int, ...]:
    """For each piece of ``n`` (largest first), the lowest aligned block of the
    job's GPUs disjoint from the pieces kept before; empty if one has none."""
    kept: list[int] = []
    cur = sorted(gpus)
    for s in pieces(n):
        blocks = [g for g in cur if g % s == 0 and all(x in cur and x not in kept for x in range(g, g + s))]
        if not blocks:
            return ()
        kept.extend(range(blocks[0], blocks[0] + s))
    return tuple(kept)


def test_keep_part_matches_the_reference() -> None:
    rng = np.random.default_rng(2)
    for _ in range(3000):
        gpus = tuple(int(g) for g in rng.choice(64, int(rng.integers(1, 33)), replace=False))
        if rng.random() < 0.5:  # one aligned block, as buddy placements are
            s = int(rng.choice([2, 4, 8, 16, 32]))
            o = int(rng.integers(0, 64 // s)) * s
            gpus = tuple(range(o, o + s))
        n = int(rng.integers(1, len(gpus) + 1))
        assert _keep_part(gpus, n) == reference_keep_part(gpus, n), (gpus, n)


@pytest.mark.parametrize("cluster", ["n8g8", "n16g8s4", "n64g8s2"])
def test_copied_counts_stay_current_and_apart(cluster: str) -> None:
    """A placer that starts over works on a copy of the per-node counts: the
    copy follows its own marks (ranges and single GPUs, taken and freed) and
    the original is not touched by them."""
    c = parse_cluster(cluster)
    rng = np.random.default_rng(7)
    a = BuddyAllocator(c, {int(g) for g in np.flatnonzero(rng.random(c.num_gpus) < 0.4)})
    a.best_fit_block(8)  # builds a's counts
    before = a.mask()
    b = BuddyAllocator(c, start=(a.mask(), a.bits_copy()))
    for _ in range(200):
        lo = int(rng.integers(b.size // 8 - 1)) * 8  # room for two nodes
        if rng.random() < 0.5:
            b.mark(range(lo, lo + 8 * int(rng.choice([1, 2]))), bool(rng.random() < 0.5))
        else:
            b.mark({int(g) for g in rng.choice(c.num_gpus, 3, replace=False)}, bool(rng.random() < 0.5))
        assert_counts_current(b)
    assert_counts_current(a)
    assert a.mask().tolist() == before.tolist()


def test_placement_keeps_the_snapshot_order_through_restarts(monkeypatch) -> None:
    """The placer's output lists the jobs that keep their GPUs in snapshot
    order (then the placed ones), also after a failed job made it start over
    keeping its GPUs: checked on every placement of a contended run."""
    from tidal.core.topology import parse_cluster
    from tidal.scheduler import buddy
    from tidal.scheduler.registry import get_policy
    from tidal.sim.engine import simulate
    from tidal.sim.traces import poisson_jobs

    original_out, original_restart = buddy._Placer.out, buddy._Placer.restart
    seen = {"outs": 0, "restarts": 0}

    def out(self):
        got = original_out.fget(self)
        keep = self.keep
        want = {jid: keep[jid] for jid in self.current if jid in keep}
        want.update(self.placed)
        assert list(got.items()) == list(want.items())
        seen["outs"] += 1
        return got

    def restart(self, kept):
        seen["restarts"] += 1
        return original_restart(self, kept)

    monkeypatch.setattr(buddy._Placer, "out", property(out))
    monkeypatch.setattr(buddy._Placer, "restart", restart)
    simulate(poisson_jobs(200, rate_per_hour=90, seed=2).jobs, parse_cluster("n4g8"), get_policy("elasticflow"))
    assert seen["outs"] > 20 and seen["restarts"] > 0
