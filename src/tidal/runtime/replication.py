"""Topology-aware concurrent state replication (Elan §IV).

When newcomers join, each needs the full training state. Sending it from one
worker makes that worker's link the bottleneck: ``k`` newcomers take ``k``
transfer times. Elan instead lets every existing worker serve, and each
newcomer fetches from its *nearest* one: same host (PCIe/NVLink) before same
switch before remote. Transfers then run concurrently.

:func:`assign_sources` is the pure planning step the master runs when it
publishes a plan with joiners; the answer (joiner -> source worker id) travels
in :class:`~tidal.runtime.messages.SwitchPlan`, and the workers move the bytes with
:func:`tidal.runtime.transfer.send_state` / :func:`~tidal.runtime.transfer.recv_state`.

Modes (``JobMaster(replication=...)``, ``tidal run --replication``):

* ``topology`` (default): nearest source, least loaded among equals;
* ``single``: every newcomer from the new rank 0 (the one-source baseline);
* ``broadcast``: one ``dist.broadcast`` over the whole new group (what a
  collective library does; every rank takes part).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

MODES = ("topology", "single", "broadcast")

SAME_HOST, SAME_SWITCH, REMOTE = 0, 1, 2


@dataclass(frozen=True)
class Location:
    """Where a worker runs: its host and the switch (rack) of that host; an
    empty switch means unknown (only hosts are compared then)."""

    host: str = ""
    switch: str = ""


def distance(a: Location, b: Location) -> int:
    """0 same host, 1 same switch, 2 remote (Elan §IV's hierarchy)."""
    if a.host and a.host == b.host:
        return SAME_HOST
    if a.switch and a.switch == b.switch:
        return SAME_SWITCH
    return REMOTE


def assign_sources(
    sources: Sequence[str],
    joiners: Sequence[str],
    where: Mapping[str, Location],
    mode: str = "topology",
) -> dict[str, str]:
    """Joiner -> source worker for a scale-out or migration.

    ``sources`` are the workers that stay (in rank order; the first is the new
    rank 0). ``topology``: each joiner, in order, takes the source with the
    smallest ``(distance, transfers already assigned to it, rank)``, so a
    newcomer on a host with a live worker reads locally and the remote ones
    spread over all sources. ``single``: all from ``sources[0]``.
    ``broadcast``: ``{}`` (the workers fall back to a group broadcast).
    """
    if mode not in MODES:
        raise ValueError(f"unknown replication mode {mode!r}; known: {list(MODES)}")
    if not sources:
        raise ValueError("state replication needs at least one source")
    if mode == "broadcast" or not joiners:
        return {}
    if mode == "single":
        return {j: sources[0] for j in joiners}
    load = {s: 0 for s in sources}
    rank = {s: i for i, s in enumerate(sources)}
    out: dict[str, str] = {}
    # joiners with a same-host source first, so local sources are not taken
    # by remote joiners that could have used any source
    def best_distance(j: str) -> int:
        return min(distance(where.get(j, Location()), where.get(s, Location())) for s in sources)

    for j in sorted(joiners, key=lambda j: (best_distance(j), joiners.index(j))):
        lj = where.get(j, Location())
        src = min(sources, key=lambda s: (distance(lj, where.get(s, Location())), load[s], rank[s]))
        out[j] = src
        load[src] += 1
    return {j: out[j] for j in joiners}
