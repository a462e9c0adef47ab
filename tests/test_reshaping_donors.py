"""Reshaping's donor choice through its delay index equals the plain loop over
every donor row (random rows, touched sets, ties, makespan jobs and rounding)."""

from __future__ import annotations

import random

import pytest

from tidal.scheduler.policies.reshaping import _donor_loop, _DonorIndex


def _rows(rng: random.Random, n: int) -> list[tuple[str, int, float, float]]:
    rows = []
    for i in range(n):
        done = rng.choice([rng.uniform(10, 5e4), 1000.0, 2000.0])  # repeated values make exact ties
        t_d = done + rng.choice([rng.uniform(0, 3e3), 0.0, rng.uniform(-50, 0)])
        if rng.random() < 0.5:  # a family of equal delays: their sums differ, if at all, by rounding
            done = rng.uniform(10, 5e4)
            t_d = done + 500.0 + rng.choice([0.0, 1e-12 * done, -1e-12 * done])
        rows.append((f"j{i:03d}", rng.randint(1, 8), t_d, done))
    return rows


def _query(rows, touched, t_w, top, second, total):
    cand = _DonorIndex(rows).candidates(touched, t_w, top, second, total)
    if cand is None:
        return _donor_loop(rows, touched, t_w, top, second, total)
    return _donor_loop([rows[i] for i in cand], (), t_w, top, second, total)


@pytest.mark.parametrize("seed", [*range(300), 2034])  # 2034: sums ordered otherwise than delays by rounding
def test_the_index_picks_the_loops_donor(seed: int) -> None:
    rng = random.Random(seed)
    rows = _rows(rng, rng.randint(1, 80))
    touched = {r[0] for r in rows if rng.random() < rng.choice([0.0, 0.2, 0.6])}
    ends = sorted(r[3] for r in rows)
    top_t = max(ends[-1], rng.uniform(0, 6e4))
    top_id = rng.choice([r[0] for r in rows] + ["elsewhere"])
    second = rng.choice([ends[-2] if len(ends) > 1 else -float("inf"), top_t, rng.uniform(0, top_t)])
    total = sum(ends) + rng.uniform(0, 1e5)
    t_w = rng.choice([rng.uniform(0, 2 * top_t), top_t, 0.0, float("inf")])
    assert _query(rows, touched, t_w, (top_t, top_id), second, total) == \
        _donor_loop(rows, touched, t_w, (top_t, top_id), second, total)


def test_rows_ending_after_the_makespan_only_decide_when_no_other_can() -> None:
    rows = [("a", 1, 900.0, 100.0), ("b", 1, 300.0, 250.0)]
    # b ends by the makespan 500: it scores (500, ...) and wins over a (900)
    assert _query(rows, set(), 10.0, (500.0, "x"), 400.0, 1000.0)[2] == "b"
    # b touched: only a is left, although it ends after the makespan
    assert _query(rows, {"b"}, 10.0, (500.0, "x"), 400.0, 1000.0)[2] == "a"
