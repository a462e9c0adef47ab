"""Plan validation and diffing, shared by the simulator engine and the coordinator.

:func:`validate_plan` checks a policy's :class:`~tidal.scheduler.api.Plan`
against the :class:`~tidal.scheduler.api.Snapshot` it was made from;
:func:`diff_plan` lists, per job, the GPUs it holds now and the GPUs the plan
places it on. Both run every scheduling round of the simulator, so they only
look closely at the jobs whose GPUs change: a job that keeps its GPUs was
checked when it got them.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import compress, repeat
from operator import is_not, ne

from tidal.scheduler.api import JobView, Plan, Snapshot
from tidal.scheduler.constraints import breaks


class PlanError(ValueError):
    """A plan breaks an invariant; names the job and the reason."""

    def __init__(self, job_id: str, reason: str) -> None:
        super().__init__(f"job {job_id}: {reason}")
        self.job_id = job_id
        self.reason = reason


@dataclass(frozen=True)
class JobDelta:
    """One job whose GPUs change: ``have`` now, ``want`` after the plan (both sorted)."""

    job_id: str
    have: tuple[int, ...]
    want: tuple[int, ...]

    @property
    def kind(self) -> str:
        """``start``, ``stop``, ``grow``, ``shrink`` or ``move`` (adds and removes GPUs)."""
        if not self.have:
            return "start"
        if not self.want:
            return "stop"
        added, removed = self.added, self.removed
        if added and removed:
            return "move"
        return "grow" if added else "shrink"

    @property
    def added(self) -> tuple[int, ...]:
        have = set(self.have)
        return tuple(g for g in self.want if g not in have)

    @property
    def removed(self) -> tuple[int, ...]:
        want = set(self.want)
        return tuple(g for g in self.have if g not in want)


def changing(snap: Snapshot, plan: Plan) -> set[str]:
    """A superset of the jobs whose GPUs may change under ``plan``: every other
    job is allocated its count and placed on a tuple equal to the one it holds,
    or holds none and is allocated none. Uses the snapshot's indexes, so that
    :func:`validate_plan` and :func:`diff_plan` look closely only at these;
    when no job holding GPUs changes (most rounds) only the others are looked at."""
    alloc, placement, held, sizes = plan.allocation, plan.placement, snap.held, snap.sizes
    if placement == held and alloc == sizes:
        return set()
    pget, aget = placement.get, alloc.get
    if held.items() <= placement.items() and sizes.items() <= alloc.items():
        # nothing held changes: only jobs without GPUs can be in the set
        new = alloc.keys() - sizes.keys()
        if len(placement) == len(held) + len(new) and all(map(placement.__contains__, new)):
            # the placed jobs are the held ones and the new ones: none is allocated but not placed
            return {jid for jid in new if pget(jid) is not None or aget(jid) is not None}
        out = {jid for jid in placement.keys() - held.keys() if placement[jid] is not None}
        out.update([jid for jid in new if aget(jid) is not None])
    else:
        out = set(compress(placement, map(is_not, map(held.get, placement), placement.values())))
        out.update(compress(alloc, map(ne, map(sizes.get, alloc), alloc.values())))
        out.update(held.keys() - alloc.keys())
    out.update(alloc.keys() - placement.keys())
    return out


def validate_plan(snap: Snapshot, plan: Plan, changed_ids: set[str] | None = None) -> None:
    """Raise :class:`PlanError` if ``plan`` cannot be executed from ``snap``.

    Checks every allocation (the job is in the snapshot, neither dropped nor
    unadmitted, its placement has as many distinct GPUs as its count) and, for
    the jobs whose GPUs change, that the count is one the job's spec allows,
    every GPU is in the cluster and of a type the job allows, and no GPU goes
    to two jobs. A new batch must
    be a positive integer. Jobs that keep their GPUs are only checked against
    the GPUs others take (they were checked when they got them).
    ``changed_ids``: :func:`changing` if the caller has it.
    """
    for jid, b in plan.batch.items():
        if not isinstance(b, int) or b <= 0:
            raise PlanError(jid, f"global batch {b!r} must be a positive integer")
    alloc = plan.allocation
    if not alloc:
        return
    placement, drop = plan.placement, plan.drop
    look = set(changing(snap, plan) if changed_ids is None else changed_ids)
    look.update(alloc.keys() & drop.keys())
    taken: dict[int, str] = {}  # new GPU -> the changing job that takes it
    changed: set[str] = set()
    found: set[str] = set()
    for view in snap.in_order(look):
        jid = view.spec.job_id
        n = alloc.get(jid)
        if n is None or n <= 0:
            continue
        found.add(jid)
        if jid in drop:
            raise PlanError(jid, "allocated GPUs but dropped by the same plan")
        gpus = placement.get(jid)
        have = view.gpus
        if not (have and gpus is not None and len(gpus) == n and (gpus is have or sorted(gpus) == sorted(have))):
            _check_change(snap, plan, view, n, gpus, taken)
            changed.add(jid)
    missing = [jid for jid in look if alloc.get(jid, 0) > 0 and jid not in found]
    if missing:
        raise PlanError(min(missing), "allocated GPUs but not in the snapshot")
    if taken:
        _check_kept(snap, plan, taken, look, changed)


def _check_kept(snap: Snapshot, plan: Plan, taken: dict[int, str], look: set[str], changed: set[str]) -> None:
    """No GPU taken by a changing job is held by a job that keeps its GPUs."""
    node_of, free, held, alloc = snap.cluster.node_of, snap.free, snap.held, plan.allocation
    busy = [g for g in taken if g not in free[node_of(g)]]
    if not busy:
        return
    freed: set[int] = set()  # GPUs of jobs that change or stop
    for jid in look:
        if jid in held and (jid in changed or alloc.get(jid, 0) <= 0):
            freed.update(held[jid])
    if freed.issuperset(busy):
        return
    owners = snap.owners
    clash = {owners[g] for g in taken if g in owners}
    clash = {jid for jid in clash if jid not in changed and alloc.get(jid, 0) > 0}
    if clash:
        view = snap.in_order(clash)[0]
        g = min(set(taken) & set(view.gpus))
        raise PlanError(taken[g], f"GPU {g} is placed for both {view.spec.job_id} and {taken[g]}")


def _check_change(
    snap: Snapshot, plan: Plan, view: JobView, n: int, gpus: tuple[int, ...] | None, taken: dict[int, str]
) -> None:
    """Check an allocation of ``n`` GPUs on ``gpus`` to ``view``'s job, which does
    not hold exactly those now; record its GPUs in ``taken``."""
    jid = view.spec.job_id
    if gpus is None or len(gpus) != n or len(set(gpus)) != n:
        raise PlanError(jid, f"placement {gpus!r} does not match its allocation of {n} GPUs")
    if not (view.admitted or jid in plan.admit):
        raise PlanError(jid, "allocated GPUs but never admitted")
    if not view.spec.can_run_at(n):
        raise PlanError(jid, f"cannot run at {n} GPUs")
    total = snap.cluster.num_gpus
    if view.spec.constrained:
        bad = breaks(snap.cluster, view.spec, [g for g in gpus if 0 <= g < total])
        if bad is not None:
            raise PlanError(jid, f"GPU {bad} is of type {snap.cluster.gpu_type_of(bad)!r}, which the job does not allow")
    if gpus and (min(gpus) < 0 or max(gpus) >= total or not taken.keys().isdisjoint(gpus)):
        for g in gpus:  # the first GPU at fault, in order
            if not 0 <= g < total:
                raise PlanError(jid, f"GPU {g} is not in the cluster")
            if g in taken:
                raise PlanError(jid, f"GPU {g} is placed for both {taken[g]} and {jid}")
    taken.update(zip(gpus, repeat(jid)))


def diff_plan(snap: Snapshot, plan: Plan, changed_ids: set[str] | None = None) -> dict[str, JobDelta]:
    """Every job of ``snap.jobs`` whose GPUs change under ``plan``, in snapshot
    order (a job left out of ``plan.allocation``, or allocated 0, holds none).
    ``changed_ids``: :func:`changing` if the caller has it."""
    alloc, placement = plan.allocation, plan.placement
    out: dict[str, JobDelta] = {}
    look = changing(snap, plan) if changed_ids is None else changed_ids
    for view in snap.in_order(look):
        have = view.gpus
        jid = view.spec.job_id
        n = alloc.get(jid, 0)
        if n > 0:
            gpus = placement.get(jid, ())
            if have and (gpus is have or gpus == have):
                continue
            want = tuple(sorted(gpus))
            have = tuple(sorted(have))
            if want != have:
                out[jid] = JobDelta(jid, have, want)
        elif have:
            out[jid] = JobDelta(jid, tuple(sorted(have)), ())
    return out
