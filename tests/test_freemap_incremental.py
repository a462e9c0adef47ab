"""FreeMap (tidal.scheduler.placement) keeps its changed nodes bucketed by
free count; its best-node search and free counts equal the plain scans over
random sequences of takes and gives."""

from __future__ import annotations

import random

import pytest

from tidal.core.topology import parse_cluster
from tidal.scheduler.placement import FreeMap


def reference_best_node(fm: FreeMap, need: int) -> int | None:
    """The fullest node with at least ``need`` free GPUs, lowest id on ties."""
    free = {n: len(fm._free(n)) for n in range(fm.cluster.num_nodes)}
    fits = [(k, n) for n, k in free.items() if k >= need]
    return min(fits)[1] if fits else None


def reference_by_node(fm: FreeMap) -> list[tuple[int, int]]:
    """(node, free count) of nodes with free GPUs: those free at first and
    never emptied, ascending, then the others in the order they became free
    again."""
    out = {n: len(fm._free(n)) for n in range(fm.cluster.num_nodes) if fm._base[n] and n not in fm._gone}
    out.update((n, len(fm._free(n))) for n in fm._tail)
    return list(out.items())


@pytest.mark.parametrize("seed", range(5))
def test_best_node_and_counts_match_the_scans(seed: int) -> None:
    rng = random.Random(seed)
    c = parse_cluster("n16g8s2")
    taken = {g for g in range(c.num_gpus) if rng.random() < 0.5}
    fm = FreeMap(c, used=taken)
    out: list[int] = []
    for _ in range(300):
        if rng.random() < 0.5 or not out:
            node = rng.randrange(c.num_nodes)
            if fm.has(node):
                out += fm.take(node, rng.randint(1, 8))
        else:
            rng.shuffle(out)
            k = rng.randint(1, len(out))
            fm.give(out[:k])
            del out[:k]
        for need in range(1, 9):
            assert fm._best_node(need) == reference_best_node(fm, need)
        assert list(fm.counts().items()) == reference_by_node(fm)
        assert all(fm.counts().values())
        assert fm.total() == sum(len(fm._free(n)) for n in range(c.num_nodes))
