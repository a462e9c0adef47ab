"""The event-driven estimate of Elan's admission test (§VI-C) against the
exact paired fluid estimate, on random job sets: the sums agree up to
rounding, a verdict it gives is the exact one, and the starts it keeps on the
step order for the next test change nothing."""

from __future__ import annotations

import random

import pytest

from tidal.scheduler.elan_event import decided, event_pair
from tidal.scheduler.elan_order import OrderJob, StepOrder
from tidal.scheduler.elan_pair import fluid_pair


def _jobs(rng: random.Random, n: int) -> list[OrderJob]:
    out = []
    for i in range(n):
        lo = rng.choice([1, 1, 2, 4])
        counts = tuple(range(lo, lo + rng.randint(1, 12)))
        one = rng.uniform(0.5, 3.0)
        rates, gain = [one * lo], one
        for _ in counts[1:]:  # concave: each GPU gains less, as measured curves mostly do
            gain *= rng.uniform(0.55, 0.95)
            rates.append(rates[-1] + gain)
        running = rng.random() < 0.6
        size = rng.choice(counts) if running else 0
        out.append(OrderJob(f"j{i}", rng.uniform(0, 100), counts, tuple(rates), one,
                            rng.uniform(1e3, 1e6), running, size))
    return out


def _case(seed: int) -> tuple[StepOrder, list[int], int, int]:
    rng = random.Random(seed)
    jobs = _jobs(rng, rng.randint(3, 60))
    order = StepOrder(jobs, lookahead=8)
    xs = list(range(len(jobs)))
    rng.shuffle(xs)
    lows = [j.counts[0] for j in jobs]
    total = max(sum(lows[x] for x in xs[:-1]) + lows[xs[-1]], rng.randint(8, 4 * len(jobs)))
    members = xs[: rng.randint(1, len(xs) - 1)]
    w = xs[len(members)]
    return order, members, w, total


@pytest.mark.parametrize("seed", range(120))
def test_event_pair_matches_the_exact_estimate(seed: int) -> None:
    order, members, w, total = _case(seed)
    cost = random.Random(seed).choice([0.0, 30.0])
    got = event_pair(order, members, w, total, cost)
    exact = fluid_pair(order, members, w, total, cost)
    if got is None:  # capped steps: the policy runs the exact estimate
        return
    for g, e in zip(got, exact):
        assert g == pytest.approx(e, rel=1e-9)
    verdict = decided(*got)
    if verdict is not None:
        assert verdict == (exact[0] <= exact[1] * (1 + 1e-9))


@pytest.mark.parametrize("seed", range(40))
def test_tests_in_a_row_equal_fresh_ones(seed: int) -> None:
    """Consecutive tests on one order (the admitted set growing by one job,
    or staying) reuse the run starts kept on it: the sums are those of a
    fresh order."""
    order, members, w, total = _case(seed)
    rng = random.Random(seed)
    rest = [x for x in range(len(order.jobs)) if x not in members]
    for _ in range(4):
        if not rest:
            break
        w = rest.pop(rng.randrange(len(rest)))
        fresh = StepOrder(order.jobs, lookahead=8)
        assert event_pair(order, members, w, total, 10.0) == event_pair(fresh, members, w, total, 10.0)
        if rng.random() < 0.7:
            members = members + [w]


@pytest.mark.parametrize("seed", range(30))
def test_the_step_order_is_the_sorted_steps(seed: int) -> None:
    """The order built by one numpy sort (from per-job arrays, shared by jobs
    of one shape) is the jobs' step tuples sorted (ties: submit time, then
    the job id as a string, then the step number), and a job's count and
    rate after each step are read off its own tables."""
    from tidal.scheduler.elan_order import job_steps, step_arrays

    rng = random.Random(seed)
    base = _jobs(rng, rng.randint(0, 40))
    jobs = []
    for i, j in enumerate(base):  # copies of one shape, equal submit times, ids that sort as strings
        jobs.append(j._replace(job_id=f"j{rng.randint(0, 200)}-{i}", submit=float(rng.randint(0, 3))))
        if rng.random() < 0.3:
            jobs.append(j._replace(job_id=f"k{i}", submit=jobs[-1].submit))
    look = rng.choice([8, 3, 5])
    steps = [job_steps(j, look) for j in jobs]
    ref = sorted(st for seq in steps for st in seq)
    for order in (StepOrder(jobs, look), StepOrder(jobs, look, parts=[step_arrays(s) for s in steps])):
        index = {j.job_id: x for x, j in enumerate(jobs)}
        assert order.oj == [index[st[2]] for st in ref]
        assert order.ot == [st[4] for st in ref] and order.og == [st[5] for st in ref]
        assert order.on == [st[6] for st in ref]
        assert order.oc == [jobs[index[st[2]]].counts[st[4]] for st in ref]
        assert order.os == [jobs[index[st[2]]].rates[st[4]] for st in ref]
        assert order.lows_np.tolist() == [j.counts[0] for j in jobs]
        for x, j in enumerate(jobs):
            assert order.rate2d[x, : len(j.rates)].tolist() == list(j.rates)
            assert order.counts2d[x, : len(j.counts)].tolist() == list(j.counts)
