"""Plan validation and diffing (tidal.scheduler.diff), on hand-built snapshots.

Cluster n2g4: node 0 holds GPUs 0-3, node 1 GPUs 4-7."""

from __future__ import annotations

import pytest

from tidal.core.job import JobSpec, JobState
from tidal.core.topology import parse_cluster
from tidal.scheduler.api import JobView, Plan, Snapshot
from tidal.scheduler.diff import JobDelta, PlanError, changing, diff_plan, validate_plan


def view(jid: str, gpus: tuple[int, ...] = (), *, elastic: bool = True, n: int = 1, admitted: bool = True,
         state: JobState | None = None, allowed: tuple[int, ...] | None = None) -> JobView:
    spec = JobSpec(jid, 0.0, "lin", 32, 100.0, requested_gpus=n, elastic=elastic, allowed_gpus=allowed)
    if state is None:
        state = JobState.RUNNING if gpus else (JobState.PENDING if admitted else JobState.SUBMITTED)
    return JobView(spec, state, gpus, admitted=admitted)


def snap(*jobs: JobView, toy_profiles) -> Snapshot:
    return Snapshot(now=0.0, cluster=parse_cluster("n2g4"), jobs=tuple(jobs), profiles=toy_profiles)


def plan(placement: dict[str, tuple[int, ...]], **kw) -> Plan:
    return Plan(allocation={j: len(g) for j, g in placement.items()}, placement=dict(placement), **kw)


# -- JobDelta ----------------------------------------------------------------


@pytest.mark.parametrize("have,want,kind,added,removed", [
    ((), (0, 1), "start", (0, 1), ()),
    ((0, 1), (), "stop", (), (0, 1)),
    ((0, 1), (0, 1, 2, 3), "grow", (2, 3), ()),
    ((0, 1, 2, 3), (2, 3), "shrink", (), (0, 1)),
    ((0, 1), (4, 5), "move", (4, 5), (0, 1)),
    ((0, 1), (1, 4, 5), "move", (4, 5), (0,)),  # grows, but also gives GPU 0 back
])
def test_delta_kinds(have, want, kind, added, removed):
    d = JobDelta("a", have, want)
    assert (d.kind, d.added, d.removed) == (kind, added, removed)


# -- diff_plan -----------------------------------------------------------------


def test_diff_lists_every_change_and_only_changes(toy_profiles):
    s = snap(
        view("keep", (0, 1)), view("grow", (2,)), view("shrink", (4, 5, 6, 7)), view("stop", (3,)),
        view("start"), view("wait"), toy_profiles=toy_profiles,
    )
    p = plan({"keep": (0, 1), "grow": (2, 3), "shrink": (5, 4), "start": (6, 7)})
    d = diff_plan(s, p)
    assert d == {
        "grow": JobDelta("grow", (2,), (2, 3)),
        "shrink": JobDelta("shrink", (4, 5, 6, 7), (4, 5)),  # placement order does not matter
        "stop": JobDelta("stop", (3,), ()),
        "start": JobDelta("start", (), (6, 7)),
    }
    assert [x.kind for x in d.values()] == ["grow", "shrink", "stop", "start"]  # snapshot order
    validate_plan(s, p)


def test_diff_move_and_swap(toy_profiles):
    s = snap(view("a", (0, 1)), view("b", (4, 5)), toy_profiles=toy_profiles)
    p = plan({"a": (4, 5), "b": (0, 1)})
    validate_plan(s, p)  # a swap is legal: each GPU goes to one job
    d = diff_plan(s, p)
    assert d["a"] == JobDelta("a", (0, 1), (4, 5)) and d["a"].kind == "move"
    assert d["b"].kind == "move" and d["b"].added == (0, 1)


def test_allocated_zero_is_a_stop_and_nothing_is_no_change(toy_profiles):
    s = snap(view("a", (0,)), toy_profiles=toy_profiles)
    p = Plan(allocation={"a": 0})
    assert diff_plan(s, p) == {"a": JobDelta("a", (0,), ())}
    validate_plan(s, p)
    assert diff_plan(snap(view("p"), toy_profiles=toy_profiles), Plan()) == {}


def test_unsorted_holdings_compare_as_sets(toy_profiles):
    s = snap(view("a", (1, 0)), toy_profiles=toy_profiles)
    p = plan({"a": (0, 1)})
    assert diff_plan(s, p) == {}
    validate_plan(s, p)


# -- validate_plan: every PlanError ---------------------------------------------


def check_error(s: Snapshot, p: Plan, job: str, words: str) -> None:
    with pytest.raises(PlanError, match=words) as err:
        validate_plan(s, p)
    assert err.value.job_id == job and job in str(err.value)
    assert isinstance(err.value, ValueError)


def test_a_gpu_given_to_two_changing_jobs(toy_profiles):
    s = snap(view("a"), view("b"), toy_profiles=toy_profiles)
    check_error(s, plan({"a": (0, 1), "b": (1, 2)}), "b", "GPU 1 is placed for both a and b")


def test_a_gpu_taken_from_a_job_that_keeps_it(toy_profiles):
    s = snap(view("a", (0, 1)), view("b"), toy_profiles=toy_profiles)
    check_error(s, plan({"a": (0, 1), "b": (1, 2)}), "b", "GPU 1 is placed for both a and b")


def test_a_gpu_freed_by_a_stopping_or_moving_job_may_be_taken(toy_profiles):
    s = snap(view("a", (0, 1)), view("b", (2, 3)), view("c"), toy_profiles=toy_profiles)
    validate_plan(s, plan({"b": (4, 5), "c": (0, 1, 2, 3)}))  # a stops, b moves away


def test_a_gpu_outside_the_cluster(toy_profiles):
    s = snap(view("a"), toy_profiles=toy_profiles)
    check_error(s, plan({"a": (7, 8)}), "a", "GPU 8 is not in the cluster")
    check_error(s, plan({"a": (-1,)}), "a", "GPU -1 is not in the cluster")


@pytest.mark.parametrize("placement", [(0,), (0, 1, 2), (0, 0), None])
def test_a_placement_that_does_not_match_the_allocation(toy_profiles, placement):
    s = snap(view("a"), toy_profiles=toy_profiles)
    p = Plan(allocation={"a": 2}, placement={} if placement is None else {"a": placement})
    check_error(s, p, "a", "does not match its allocation of 2 GPUs")


def test_a_kept_job_whose_count_changes_without_its_placement(toy_profiles):
    s = snap(view("a", (0, 1)), toy_profiles=toy_profiles)
    p = Plan(allocation={"a": 4}, placement={"a": (0, 1)})
    check_error(s, p, "a", "does not match its allocation of 4 GPUs")


def test_a_count_the_spec_does_not_allow(toy_profiles):
    rigid = view("r", elastic=False, n=2)
    check_error(snap(rigid, toy_profiles=toy_profiles), plan({"r": (0, 1, 2, 3)}), "r", "cannot run at 4 GPUs")
    validate_plan(snap(rigid, toy_profiles=toy_profiles), plan({"r": (0, 1)}))
    odd = view("o", allowed=(1, 4))
    check_error(snap(odd, toy_profiles=toy_profiles), plan({"o": (0, 1)}), "o", "cannot run at 2 GPUs")


def test_a_job_not_in_the_snapshot(toy_profiles):
    s = snap(view("a"), toy_profiles=toy_profiles)
    check_error(s, plan({"a": (0,), "ghost": (1,)}), "ghost", "not in the snapshot")


def test_a_job_dropped_by_the_same_plan(toy_profiles):
    s = snap(view("a", admitted=False), toy_profiles=toy_profiles)
    check_error(s, plan({"a": (0,)}, drop={"a": "no"}), "a", "dropped by the same plan")


def test_a_job_never_admitted(toy_profiles):
    s = snap(view("a", admitted=False), toy_profiles=toy_profiles)
    check_error(s, plan({"a": (0,)}), "a", "never admitted")
    validate_plan(s, plan({"a": (0,)}, admit={"a"}))  # admitted by this very plan


@pytest.mark.parametrize("batch", [0, -32, 1.5, "64"])
def test_a_bad_global_batch(toy_profiles, batch):
    s = snap(view("a", (0,)), toy_profiles=toy_profiles)
    check_error(s, plan({"a": (0,)}, batch={"a": batch}), "a", "must be a positive integer")


def test_jobs_that_keep_their_gpus_are_not_checked_again(toy_profiles):
    # a rigid job running at a count its spec would not allow now (pinned earlier) keeps running
    s = snap(view("r", (0, 1, 2, 3), elastic=False, n=2), toy_profiles=toy_profiles)
    validate_plan(s, plan({"r": (3, 2, 1, 0)}))


# -- changing ------------------------------------------------------------------


def _plainly_changing(s: Snapshot, p: Plan) -> set[str]:
    """The definition, job by job: placed on another tuple than the one held,
    allocated another count, holding GPUs but unallocated, or allocated but unplaced."""
    held, sizes = s.held, s.sizes
    out = {j for j, g in p.placement.items() if held.get(j) is not g}
    out |= {j for j, n in p.allocation.items() if sizes.get(j) != n}
    return out | (held.keys() - p.allocation.keys()) | (p.allocation.keys() - p.placement.keys())


@pytest.mark.parametrize("seed", range(4))
def test_changing_is_the_plain_definition(toy_profiles, seed):
    """The fast paths (nothing held changes; only new jobs placed) give the
    same set as the definition on random plans that mostly keep jobs as they are."""
    import random

    rng = random.Random(seed)
    for _ in range(300):
        jobs = [view(f"r{i}", (2 * i, 2 * i + 1)) for i in range(rng.randint(0, 4))]
        jobs += [view(f"p{i}") for i in range(rng.randint(0, 3))]
        s = snap(*jobs, toy_profiles=toy_profiles)
        alloc, placement = {}, {}
        for j in jobs:
            jid, r = j.job_id, rng.random()
            if j.gpus and r < 0.7:  # kept on the very tuple it holds
                alloc[jid], placement[jid] = len(j.gpus), s.held[jid]
            elif j.gpus and r < 0.8:  # the same GPUs, a new tuple
                alloc[jid], placement[jid] = len(j.gpus), tuple(j.gpus)
            elif j.gpus and r < 0.85:  # another count
                alloc[jid], placement[jid] = 1, j.gpus[:1]
            elif j.gpus and r < 0.9:  # its count, but not placed
                alloc[jid] = len(j.gpus)
            elif not j.gpus and r < 0.5:  # started, placed or not (None: unplaced)
                alloc[jid] = 1
                if rng.random() < 0.8:
                    placement[jid] = None if rng.random() < 0.2 else (7,)
            # else: stopped / still waiting
        p = Plan(allocation=alloc, placement=placement)
        assert changing(s, p) == _plainly_changing(s, p)
