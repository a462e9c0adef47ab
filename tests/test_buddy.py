"""Buddy placement (ElasticFlow §4.3): aligned blocks, Best-Fit, no double
allocation, and defragmentation by migration. GPU numbering: node k holds
GPUs k*g .. k*g+g-1 (tidal.core.topology)."""

from __future__ import annotations

import numpy as np
import pytest

from tidal.core.job import JobSpec, JobState
from tidal.core.topology import parse_cluster
from tidal.scheduler.api import JobView, Snapshot
from tidal.scheduler.buddy import BuddyAllocator, is_aligned_block, pieces, place_buddy


def snap_with(cluster: str, held: dict[str, tuple[int, ...]], toy_profiles) -> Snapshot:
    jobs = []
    for jid, gpus in held.items():
        spec = JobSpec(jid, 0.0, "lin", 32, 100.0, requested_gpus=max(1, len(gpus)), elastic=True)
        state = JobState.RUNNING if gpus else JobState.PENDING
        jobs.append(JobView(spec, state, tuple(gpus), admitted=True))
    return Snapshot(now=0.0, cluster=parse_cluster(cluster), jobs=tuple(jobs), profiles=toy_profiles)


def test_pieces_and_alignment():
    assert pieces(10) == [8, 2] and pieces(8) == [8] and pieces(7) == [4, 2, 1]
    assert is_aligned_block((4, 5, 6, 7)) and is_aligned_block((3,))
    assert not is_aligned_block((2, 3, 4, 5))  # size 4 must start at a multiple of 4
    assert not is_aligned_block((0, 1, 2))


def test_best_fit_prefers_the_fullest_subtree(toy_profiles):
    # n2g4: node 0 = GPUs 0-3, node 1 = GPUs 4-7. GPU 0 and GPUs 4,5 are used.
    snap = snap_with("n2g4", {"u0": (0,), "u1": (4, 5), "one": (), "two": ()}, toy_profiles)
    out = place_buddy(snap, {"u0": 1, "u1": 2, "one": 1, "two": 2})
    # a single GPU goes next to GPU 0 (its buddy pair already split), not into a whole pair
    assert out["one"] == (1,)
    # a pair goes to node 1 (2 free) rather than node 0 (3 free): fill the tighter node
    assert out["two"] == (6, 7)
    assert out["u0"] == (0,) and out["u1"] == (4, 5)  # nobody moved


def test_grow_in_place_and_shrink_keeps_part(toy_profiles):
    snap = snap_with("n2g4", {"a": (4, 5), "b": (0, 1, 2, 3)}, toy_profiles)
    out = place_buddy(snap, {"a": 4, "b": 2})
    assert out["a"] == (4, 5, 6, 7)  # grew into its buddy
    assert out["b"] in ((0, 1), (2, 3))  # kept an aligned half of its block


def test_defragmentation_by_migration(toy_profiles):
    # Four 1-GPU jobs on GPUs 0, 2, 4, 6: four GPUs are free but no aligned
    # pair, let alone a node. A new 4-GPU job forces a re-pack.
    held = {"s0": (0,), "s1": (2,), "s2": (4,), "s3": (6,), "big": ()}
    snap = snap_with("n2g4", held, toy_profiles)
    out = place_buddy(snap, {"s0": 1, "s1": 1, "s2": 1, "s3": 1, "big": 4})
    assert is_aligned_block(out["big"]) and len({g // 4 for g in out["big"]}) == 1
    used = [g for gpus in out.values() for g in gpus]
    assert len(used) == len(set(used)) == 8
    moved = [j for j in ("s0", "s1", "s2", "s3") if out[j] != held[j]]
    assert len(moved) == 2  # only the two jobs in the big job's node move


def test_defragmentation_multi_node_job(toy_profiles):
    # n4g2 (4 nodes x 2 GPUs): one GPU used on every node; a 4-GPU job needs
    # two whole neighbouring nodes, which a re-pack makes.
    held = {f"s{k}": (2 * k,) for k in range(4)} | {"big": ()}
    snap = snap_with("n4g2", held, toy_profiles)
    out = place_buddy(snap, {**{f"s{k}": 1 for k in range(4)}, "big": 4})
    assert is_aligned_block(out["big"])
    used = [g for gpus in out.values() for g in gpus]
    assert len(used) == len(set(used)) == 8


@pytest.mark.parametrize("seed", range(20))
def test_no_double_allocation_and_alignment_random(seed, toy_profiles):
    """Random clusters states and random power-of-two allocations: every
    placement is disjoint, has the asked count and is one aligned block."""
    rng = np.random.default_rng(seed)
    cluster = parse_cluster("n4g8")
    buddy = BuddyAllocator(cluster)
    held: dict[str, tuple[int, ...]] = {}
    for i in range(int(rng.integers(3, 12))):
        got = buddy.alloc(int(rng.choice([1, 2, 4, 8])))
        if got is not None:
            held[f"r{i}"] = got
    # some running jobs keep, grow, shrink or stop; new jobs arrive
    want: dict[str, int] = {}
    for jid, gpus in held.items():
        want[jid] = int(rng.choice([0, len(gpus), max(1, len(gpus) // 2), min(8, 2 * len(gpus))]))
    for i in range(int(rng.integers(0, 6))):
        want[f"n{i}"] = int(rng.choice([1, 2, 4, 8, 16]))
    # trim to what fits
    total = 0
    for jid in sorted(want):
        if total + want[jid] > cluster.num_gpus:
            want[jid] = 0
        total += want[jid]
    snap = snap_with("n4g8", {**held, **{j: () for j in want if j not in held}}, toy_profiles)
    out = place_buddy(snap, want)
    assert set(out) == {j for j, n in want.items() if n > 0}
    used = [g for gpus in out.values() for g in gpus]
    assert len(used) == len(set(used))
    for jid, gpus in out.items():
        assert len(gpus) == want[jid]
        assert is_aligned_block(gpus), (jid, gpus)
        assert all(0 <= g < cluster.num_gpus for g in gpus)
        if jid in held and want[jid] == len(held[jid]) and not _forced_repack(held, want):
            assert gpus == tuple(sorted(held[jid]))  # unchanged jobs stay put


def _forced_repack(held, want) -> bool:
    """True if phase 1 (keep everyone) may have failed: we only assert that
    jobs stay put when no re-pack could have happened."""
    cluster = parse_cluster("n4g8")
    b = BuddyAllocator(cluster, {g for j, gpus in held.items() if want.get(j, 0) == len(gpus) for g in gpus})
    for jid in sorted((j for j in want if want[j] > 0 and not (j in held and want[j] == len(held[j]))),
                      key=lambda j: -want[j]):
        if b.alloc(want[jid], prefer=tuple(held.get(jid, ()))) is None:
            return True
    return False


def test_count_that_is_not_a_power_of_two_keeps_pieces_together(toy_profiles):
    # a rigid 6-GPU job on n2g8 with node 0 half used: 4 + 2 go to node 1 together
    snap = snap_with("n2g8", {"u": (0, 1, 2, 3), "six": ()}, toy_profiles)
    out = place_buddy(snap, {"u": 4, "six": 6})
    assert {g // 8 for g in out["six"]} == {1}
    assert len(set(out["six"]) | set(out["u"])) == 10


def test_local_defragmentation_moves_the_cheapest_occupant(toy_profiles):
    # n1g8: 1-GPU jobs on GPUs 0, 2, 4, 6 ("a" and "c" cost 100 to move, "b"
    # and "d" cost 1). A new 2-GPU job needs an aligned pair: it takes the pair
    # of a cheap job, which moves to a free GPU; nobody else moves.
    held = {"a": (0,), "b": (2,), "c": (4,), "d": (6,), "new": ()}
    snap = snap_with("n1g8", held, toy_profiles)
    want = {"a": 1, "b": 1, "c": 1, "d": 1, "new": 2}
    out = place_buddy(snap, want, weights={"a": 100, "b": 1, "c": 100, "d": 1})
    moved = [j for j in "abcd" if out[j] != held[j]]
    assert len(moved) == 1 and moved[0] in "bd"
    assert is_aligned_block(out["new"])
    used = [g for gpus in out.values() for g in gpus]
    assert len(used) == len(set(used)) == 6


def test_fallback_counts_avoid_a_migration(toy_profiles):
    # same fragmented node; the 2-GPU request may fall back to 1 GPU: no move
    held = {"a": (0,), "b": (2,), "c": (4,), "d": (6,), "new": ()}
    snap = snap_with("n1g8", held, toy_profiles)
    out = place_buddy(snap, {"a": 1, "b": 1, "c": 1, "d": 1, "new": 2}, fallback={"new": [1]})
    assert len(out["new"]) == 1 and all(out[j] == held[j] for j in "abcd")


@pytest.mark.parametrize("cluster", ["n4g8", "n3g8", "n4g2", "n16g8"])
def test_best_fit_matches_the_lexicographic_rule(cluster):
    """best_fit_block picks the free aligned block with the smallest (off
    the pieces' nodes, GPUs held there, free GPUs in its buddy pair, node,
    switch, offset), as a plain sort of those keys does."""
    c = parse_cluster(cluster)
    rng = np.random.default_rng(0)
    for _ in range(100):
        b = BuddyAllocator(c)
        b.used[: c.num_gpus] = rng.random(c.num_gpus) < rng.random()
        if rng.random() < 0.3:
            b.held[:] = rng.integers(0, 3, b.size) * rng.choice([1, 100], b.size)
        free, per, sw = ~b.used, c.gpus_per_node, c.gpus_per_node * c.nodes_per_switch
        for s in (1, 2, 4, 8, 16):
            if s > b.size:
                continue
            near = tuple(rng.choice(c.num_gpus, int(rng.integers(0, 3)), replace=False).tolist())
            offs = [o for o in range(0, b.size, s) if not b.used[o : o + s].any()]
            keys = [(bool(near) and o // per not in {g // per for g in near}, int(b.held[o : o + s].sum()),
                     int(free[o // min(2 * s, b.size) * min(2 * s, b.size):][: min(2 * s, b.size)].sum()),
                     int(free[o // per * per:][:per].sum()) if s < per else 0,
                     int(free[o // sw * sw:][:sw].sum()) if b.size % sw == 0 else 0, o) for o in offs]
            assert b.best_fit_block(s, near=near) == (min(keys)[-1] if keys else None)
