"""The fast paths of the free-GPU timeline and of ElasticFlow's plan check
give the same numbers as the general code, on random timelines and plans."""

from __future__ import annotations

import numpy as np
import pytest

from tidal.core.job import JobSpec, JobState
from tidal.core.overhead import OverheadModel
from tidal.scheduler.api import JobView, Snapshot
from tidal.scheduler.policies.elasticflow import plan_check, plan_delivers, plan_needs
from tidal.scheduler.timeline import (
    Costs,
    Levels,
    Share,
    Timeline,
    commit,
    fill,
    reserve_all,
    share_segments,
    take_share,
)

LV = Levels(np.array([0, 1, 2, 4, 8]), np.array([0.0, 1.0, 1.9, 3.5, 6.0]), (0, 1, 2, 4, 8), (0.0, 1.0, 1.9, 3.5, 6.0))
COSTS = Costs.of(OverheadModel())


def _random_timeline(rng: np.random.Generator) -> Timeline:
    tl = Timeline(30.0, 16, 60.0)
    for _ in range(int(rng.integers(0, 6))):
        share = fill(tl, LV, float(rng.uniform(10, 4000)), 30.0 + float(rng.uniform(100, 5000)),
                     int(rng.choice([0, 1, 2, 4])), bool(rng.integers(2)), COSTS)
        if share is not None:
            commit(tl, share)
    return tl


@pytest.mark.parametrize("seed", range(40))
def test_a_steady_share_is_stored_and_reserved_as_the_general_code_does(seed: int) -> None:
    rng = np.random.default_rng(seed)
    tl = _random_timeline(rng)
    share = fill(tl, LV, float(rng.uniform(10, 3000)), 30.0 + float(rng.uniform(200, 6000)), 0, False, COSTS)
    if share is None:
        return
    general = Share(share.cap, share.alloc.copy(), share.finish)  # the same share, not marked steady
    ref = Timeline(30.0, 16, 60.0)
    ref.t, ref.free = tl.t.copy(), tl.free.copy()
    segs_ref = share_segments(ref, general)
    commit(ref, general)
    segs = take_share(tl, share)
    assert segs == segs_ref
    assert tl.t.tolist() == ref.t.tolist() and tl.free.tolist() == ref.free.tolist()


@pytest.mark.parametrize("seed", range(20))
def test_reserve_all_counts_every_plan_at_every_breakpoint(seed: int) -> None:
    rng = np.random.default_rng(seed)
    plans = []
    for _ in range(int(rng.integers(1, 8))):
        start = float(rng.choice([0.0, 30.0, 60.0, 120.0]))
        end = start + 60.0 * int(rng.integers(1, 5))
        segs = [(start, int(rng.choice([0, 1, 2])))]
        if rng.random() < 0.3:
            segs.append((end, int(rng.choice([1, 2]))))
            end += 60.0
        plans.append((*segs, (end, 0)))
    tl = Timeline(30.0, 64, 60.0)
    assert reserve_all(tl, plans)
    for t, free in zip(tl.t.tolist(), tl.free.tolist()):  # the GPUs in use at each breakpoint add up
        used = sum(c for segs in plans for (a, c), (b, _) in zip(segs, segs[1:]) if max(a, 30.0) <= t < b and c)
        assert free == 64 - used


@pytest.mark.parametrize("seed", range(60))
def test_plan_check_equals_plan_delivers_and_plan_needs(seed: int) -> None:
    rng = np.random.default_rng(seed)
    now = 600.0
    held = int(rng.choice([0, 1, 2, 4]))
    spec = JobSpec("j", 0.0, "m", 32, float(rng.uniform(100, 5000)), requested_gpus=max(held, 1), elastic=True,
                   deadline=now + float(rng.uniform(-10, 3000)))
    tags = {"ef_busy_until": now + float(rng.uniform(-30, 60))} if rng.random() < 0.4 else {}
    state = JobState.RESIZING if held and rng.random() < 0.3 else (JobState.RUNNING if held else JobState.PENDING)
    j = JobView(spec, state, tuple(range(held)), done=float(rng.uniform(0, 200)), executed=float(rng.choice([0, 50])),
                tags=tags)
    s0 = now + float(rng.choice([-120.0, 0.0, 60.0]))
    segs = ((s0, int(rng.choice([0, 1, 2, 4, 8, 3]))), (s0 + 60.0 * int(rng.integers(1, 40)), 0))
    snap = Snapshot(now=now, cluster=None, jobs=(j,), profiles=None)  # type: ignore[arg-type]
    got, need, need_slack = plan_check(snap, j, segs, LV, COSTS, 10.5, COSTS.worst_change)
    assert got == plan_delivers(snap, j, segs, LV, COSTS)
    assert [need, need_slack] == plan_needs(snap, j, segs, LV, (0.0, 10.5))
