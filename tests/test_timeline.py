"""The free-GPU timeline and minimum satisfactory shares (tidal.scheduler.timeline,
ElasticFlow §4.2), on cases worked by hand.

Every case uses a job whose rate is its GPU count (1, 2 or 4 iterations/s on
1, 2 or 4 GPUs) and 60-second slots."""

from __future__ import annotations

import numpy as np
import pytest

from tidal.core.overhead import OverheadModel
from tidal.scheduler.timeline import (
    Costs,
    Levels,
    Timeline,
    commit,
    commit_segments,
    count_at,
    deliverable,
    fill,
    first_loss,
    reserve_all,
    share_segments,
)

LV = Levels(np.array([0, 1, 2, 4]), np.array([0.0, 1.0, 2.0, 4.0]), (0, 1, 2, 4), (0.0, 1.0, 2.0, 4.0))
FREE = Costs(start=0.0, resume=0.0, grow=0.0, warmup=0.0, shrink=0.0, migrate=0.0)
STOP_FREE = Costs.of(OverheadModel())  # launch 0, restart 50, pause 0.5, warm-up 10


def timeline(free: list[tuple[float, int]], now: float = 0.0, slot: float = 60.0) -> Timeline:
    tl = Timeline(now, 4, slot)
    tl.t, tl.free = np.array([t for t, _ in free], dtype=float), np.array([n for _, n in free], dtype=np.int64)
    return tl


def test_costs_from_the_overhead_model():
    assert STOP_FREE == Costs(start=0.0, resume=50.0, grow=0.5, warmup=10.0, shrink=0.5, migrate=10.5)
    assert STOP_FREE.worst_change == 50.0
    sr = Costs.of(OverheadModel(mode="stop-resume", stop_resume_s=30.0, launch_s=2.0))
    assert sr == Costs(start=2.0, resume=30.0, grow=30.0, warmup=0.0, shrink=30.0, migrate=30.0)
    assert Costs.of(OverheadModel(migrate_s=3.0)).migrate == 3.0


def test_levels_rate_of():
    assert (LV.rate_of(2), LV.rate_of(4), LV.rate_of(3), LV.rate_of(0)) == (2.0, 4.0, 0.0, 0.0)


def test_slot_alignment():
    tl = Timeline(0.0, 4, 60.0)
    assert (tl.align(61.0), tl.align(60.0), tl.align(60.00001), tl.align(0.0)) == (120.0, 60.0, 60.0, 0.0)
    assert tl.release(100.0) == 120.0
    assert Timeline(0.0, 4, 0.0).align(61.5) == 61.5


@pytest.mark.parametrize("c,r,held,r_held,started,lost", [
    (2, 2.0, 2, 2.0, True, 0.0),  # same count: nothing lost
    (0, 0.0, 2, 2.0, True, 0.0),  # stopping costs the job no progress it would make
    (2, 2.0, 0, 0.0, False, 0.0),  # first launch: launch_s = 0
    (2, 2.0, 0, 0.0, True, 100.0),  # resume: 50 s at 2 it/s
    (4, 4.0, 2, 2.0, True, 22.0),  # grow: 0.5 s pause at 4 it/s + 10 s warm-up at the 2 it/s gained
    (1, 1.0, 2, 2.0, True, 0.5),  # shrink: 0.5 s pause at 1 it/s
])
def test_first_loss(c, r, held, r_held, started, lost):
    assert first_loss(c, r, held, r_held, started, STOP_FREE) == pytest.approx(lost)


def test_fill_finds_the_smallest_cap_that_finishes_in_time():
    # 100 iterations by t=120 on an empty 4-GPU timeline: 1 GPU ends at t=100
    share = fill(Timeline(0.0, 4, 60.0), LV, 100.0, 120.0, 0, False, FREE)
    assert share.cap == 1 and share.alloc.tolist() == [1]
    assert share.finish == pytest.approx(100.0)
    # by t=90 it needs 2 GPUs (ends at 50)
    share = fill(Timeline(0.0, 4, 60.0), LV, 100.0, 90.0, 0, False, FREE)
    assert (share.cap, share.finish) == (2, pytest.approx(50.0))


def test_fill_needs_the_gpus_only_until_the_slot_after_it_ends():
    # all 4 GPUs are taken from t=120 on; a share ending at t=100 releases at 120
    share = fill(timeline([(0.0, 4), (120.0, 0)]), LV, 100.0, 120.0, 0, False, FREE)
    assert share.cap == 1 and share.finish == pytest.approx(100.0)


def test_progressive_filling_under_contention():
    # 1 GPU free until t=120, then 4. 300 iterations by t=240:
    # cap 1: 120 + 120 = 240 < 300; cap 2: 120 at 1 GPU, then 180 at 2 it/s -> t = 120 + 90 = 210
    share = fill(timeline([(0.0, 1), (120.0, 4)]), LV, 300.0, 240.0, 0, False, FREE)
    assert share.cap == 2
    assert share.alloc.tolist() == [1, 2]
    assert share.finish == pytest.approx(210.0)


def test_fill_returns_none_when_no_cap_finishes():
    # cap 4 delivers 120 + 480 = 600 < 1000 by t=240
    assert fill(timeline([(0.0, 1), (120.0, 4)]), LV, 1000.0, 240.0, 0, False, FREE) is None
    assert fill(Timeline(100.0, 4, 60.0), LV, 10.0, 100.0, 0, False, FREE) is None  # deadline now


def test_fill_pays_for_restarts_dead_time_and_slack():
    # a preempted job restarts (50 s): 1 GPU ends at 150 > 120; 2 GPUs: (100 + 2*50) / 2 = 100
    share = fill(Timeline(0.0, 4, 60.0), LV, 100.0, 120.0, 0, True, STOP_FREE)
    assert (share.cap, share.finish) == (2, pytest.approx(100.0))
    # holding 2 GPUs, still 20 s in a rescale: 1 GPU ends at 100.5 + 20 > 120; 2 GPUs at (100 + 40) / 2 = 70
    share = fill(Timeline(0.0, 4, 60.0), LV, 100.0, 120.0, 2, True, STOP_FREE, extra_dead=20.0)
    assert (share.cap, share.finish) == (2, pytest.approx(70.0))
    # plus 10 s of work as slack: (100 + 40 + 20) / 2 = 80
    share = fill(Timeline(0.0, 4, 60.0), LV, 100.0, 120.0, 2, True, STOP_FREE, extra_dead=20.0, margin=10.0)
    assert share.finish == pytest.approx(80.0)


def test_commit_reserves_until_the_release():
    tl = Timeline(0.0, 4, 60.0)
    share = fill(tl, LV, 100.0, 120.0, 0, False, FREE)
    assert share_segments(tl, share) == ((0.0, 1), (120.0, 0))
    commit(tl, share)
    assert tl.t.tolist() == [0.0, 120.0] and tl.free.tolist() == [3, 4]


def test_commit_a_filled_share_over_several_intervals():
    tl = timeline([(0.0, 1), (120.0, 4)])
    share = fill(tl, LV, 300.0, 240.0, 0, False, FREE)
    assert share_segments(tl, share) == ((0.0, 1), (120.0, 2), (240.0, 0))
    commit(tl, share)  # 1 GPU until 120, 2 until the release at 240
    assert tl.t.tolist() == [0.0, 120.0, 240.0] and tl.free.tolist() == [0, 2, 4]


def test_count_at():
    segs = ((0.0, 1), (60.0, 2), (180.0, 0))
    assert [count_at(segs, t) for t in (-1.0, 0.0, 59.0, 60.0, 179.0, 180.0)] == [0, 1, 1, 2, 2, 0]


def test_commit_segments_and_give_back():
    tl = Timeline(0.0, 4, 60.0)
    assert commit_segments(tl, ((0.0, 3), (120.0, 0)))
    assert tl.t.tolist() == [0.0, 120.0] and tl.free.tolist() == [1, 4]
    assert commit_segments(tl, ((0.0, 3), (120.0, 0)), sign=-1)
    assert tl.free.tolist() == [4, 4]
    # more than is free: refused, timeline unchanged
    assert not commit_segments(tl, ((0.0, 5), (60.0, 0)))
    assert tl.t.tolist() == [0.0, 120.0] and tl.free.tolist() == [4, 4]


def test_commit_segments_ignores_the_past():
    tl = Timeline(60.0, 4, 60.0)
    assert commit_segments(tl, ((0.0, 2), (120.0, 0)))
    assert tl.t.tolist() == [60.0, 120.0] and tl.free.tolist() == [2, 4]


def test_reserve_all():
    tl = Timeline(0.0, 4, 60.0)
    assert reserve_all(tl, [((0.0, 2), (120.0, 0)), ((60.0, 2), (180.0, 0))])
    assert tl.t.tolist() == [0.0, 60.0, 120.0, 180.0] and tl.free.tolist() == [2, 0, 2, 4]
    past = Timeline(60.0, 4, 60.0)
    assert reserve_all(past, [((0.0, 2), (120.0, 0))])
    assert past.t.tolist() == [60.0, 120.0] and past.free.tolist() == [2, 4]
    assert reserve_all(Timeline(0.0, 4, 60.0), [])


def test_deliverable():
    segs = ((0.0, 1), (60.0, 2), (180.0, 0))
    # 60 s at 1 it/s + 120 s at 2 it/s
    assert deliverable(segs, 0.0, 1000.0, LV, 1, True, FREE, 0.0) == pytest.approx(300.0)
    # the grow at t=60 costs 2 * 0.5 + 10 * (2 - 1) = 11 iterations
    assert deliverable(segs, 0.0, 1000.0, LV, 1, True, STOP_FREE, 0.0) == pytest.approx(289.0)
    # only until t=120: 60 + (120 - 11)
    assert deliverable(segs, 0.0, 120.0, LV, 1, True, STOP_FREE, 0.0) == pytest.approx(169.0)
    # 5 s still in a rescale at 1 it/s
    assert deliverable(segs, 0.0, 1000.0, LV, 1, True, STOP_FREE, 5.0) == pytest.approx(284.0)
    # from t=90, holding 2: 90 s at 2 it/s
    assert deliverable(segs, 90.0, 1000.0, LV, 2, True, STOP_FREE, 0.0) == pytest.approx(180.0)
