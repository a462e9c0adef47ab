"""GPU-type constraints (a job's ``gpu_types`` / ``exclude_gpu_types``),
enforced for every policy after it plans.

A job may restrict the GPU types it runs on, as a Kubernetes node selector
(and anti-affinity) or Slurm's ``--constraint`` do. Policies size jobs by
GPU counts and place them with their own placers; rather than teach each
one about types, :func:`enforce_types` runs after every policy's
``schedule`` (:class:`tidal.scheduler.api.Policy` wraps it) and

- drops at admission a job whose allowed types can never hold its smallest
  count ("needs 4 GPUs of type A100, the cluster has 2");
- repairs a placement that puts a constrained job on a GPU of a type it does
  not allow: the job keeps its allowed GPUs and takes free allowed ones
  (nodes it uses first, then the nodes with the most free allowed GPUs),
  else trades GPUs with a job that is placed anew in the same plan and
  allows the type; an elastic job may shrink to a count it can hold; a job
  that still cannot be placed keeps the GPUs it holds (when they are all
  free of others) or waits this round, with a reason in ``Plan.waiting``.

Unconstrained jobs and one-type clusters pay one check per round: a plan
that admits no job, on a cluster of one GPU type with no node away, is
returned untouched (the live coordinator's :func:`strip_breaks` still
guards against a job whose types were removed from the cluster). A job whose types only nodes that are down have
(``Snapshot.away``) is not dropped: it waits for them, with a reason.
"""

from __future__ import annotations

from itertools import compress
from operator import is_not
from typing import TYPE_CHECKING, Sequence

from tidal.core.job import JobSpec
from tidal.core.topology import Cluster, Node

if TYPE_CHECKING:
    from tidal.scheduler.api import JobView, Plan, Snapshot


def type_phrase(spec: JobSpec) -> str:
    """How a job's constraint reads in a reason: ``of type A100``,
    ``of type A100 or V100``, ``of a type other than T4``."""
    if spec.gpu_types is not None:
        allowed = [t for t in spec.gpu_types if t not in spec.exclude_gpu_types]
        return "of type " + " or ".join(allowed)
    return "of a type other than " + ", ".join(spec.exclude_gpu_types)


def allowed_gpus(cluster: Cluster, spec: JobSpec, away: Sequence[Node] = ()) -> int:
    """How many GPUs of the cluster (and of the nodes ``away`` from it now)
    the job's types allow."""
    return sum(n.gpus for n in (*cluster.nodes, *away) if spec.allows_type(n.gpu_type))


def never_fits(cluster: Cluster, spec: JobSpec, away: Sequence[Node] = ()) -> str | None:
    """Why a constrained job can never run on ``cluster`` (None: it can).
    Nodes ``away`` (registered, not up now) count: they may come back, and
    until they do the job waits with a reason instead of being dropped."""
    if not spec.constrained:
        return None
    cap = allowed_gpus(cluster, spec, away)
    if spec.fits(cap):
        return None
    types = ", ".join(sorted({t or "untyped" for t in (*cluster.gpu_types, *(n.gpu_type for n in away))}))
    return f"needs {spec.lo} GPUs {type_phrase(spec)}, the cluster has {cap} (its types: {types})"


def breaks(cluster: Cluster, spec: JobSpec, gpus: tuple[int, ...] | list[int]) -> int | None:
    """The first GPU of ``gpus`` whose type ``spec`` does not allow (None: none)."""
    if not spec.constrained:
        return None
    type_of = cluster.gpu_type_of
    for g in gpus:
        if not spec.allows_type(type_of(g)):
            return g
    return None


def enforce_types(snap: Snapshot, plan: Plan) -> Plan:
    """Make ``plan`` keep every job's GPU-type constraint (see the module
    docstring); returns ``plan``, changed in place."""
    if plan.admit:
        _admission(snap, plan)
    if plan.placement and (len(snap.cluster.gpu_types) > 1 or snap.away):
        _placement(snap, plan)  # one type up: only a job whose types are away can be placed wrong
    return plan


def strip_breaks(snap: Snapshot, plan: Plan) -> dict[str, int]:
    """Take out of ``plan`` every job it would move onto a GPU whose type the
    job does not allow (an executor's guard against a faulty policy); returns
    those jobs and the first such GPU of each. The jobs then hold nothing."""
    if len(snap.cluster.gpu_types) < 2 and not plan.placement:
        return {}
    placement, held = plan.placement, snap.held
    moved = set(compress(placement, map(is_not, map(held.get, placement), placement.values())))
    out: dict[str, int] = {}
    for v in snap.in_order(moved):
        g = breaks(snap.cluster, v.spec, placement[v.job_id])
        if g is not None:
            out[v.job_id] = g
            placement.pop(v.job_id)
            plan.allocation.pop(v.job_id, None)
    return out


def _admission(snap: Snapshot, plan: Plan) -> None:
    admit = plan.admit
    for j in snap.submitted:
        if j.spec.constrained and j.job_id in admit:
            why = never_fits(snap.cluster, j.spec, snap.away)
            if why is not None:
                admit.discard(j.job_id)
                plan.drop[j.job_id] = why
                plan.allocation.pop(j.job_id, None)
                plan.placement.pop(j.job_id, None)


def _placement(snap: Snapshot, plan: Plan) -> None:
    placement, held = plan.placement, snap.held
    moved = set(compress(placement, map(is_not, map(held.get, placement), placement.values())))
    if not moved:
        return
    views = snap.in_order(moved)
    bad = [v for v in views if breaks(snap.cluster, v.spec, placement[v.job_id]) is not None]
    if not bad:
        return
    _Repair(snap, plan, views).run(bad)


class _Repair:
    """The plan's free GPUs, and the jobs placed anew in it (trade partners)."""

    def __init__(self, snap: Snapshot, plan: Plan, moved: list[JobView]) -> None:
        self.snap, self.plan, self.cluster = snap, plan, snap.cluster
        taken = {g for jid, gpus in plan.placement.items() if plan.allocation.get(jid, 0) > 0 for g in gpus}
        self.free = set(range(self.cluster.num_gpus)) - taken
        self.moved = {v.job_id: v for v in moved}

    def run(self, bad: list[JobView]) -> None:
        for v in bad:
            if not self._fix(v):
                self._hold_back(v)

    def _fix(self, v: JobView) -> bool:
        spec, plan, c = v.spec, self.plan, self.cluster
        gpus = plan.placement[v.job_id]
        n = len(gpus)
        good = [g for g in gpus if spec.allows_type(c.gpu_type_of(g))]
        wrong = [g for g in gpus if not spec.allows_type(c.gpu_type_of(g))]
        got = self._trades(v, wrong)  # GPUs traded for wrong ones (those left the list)
        good += got
        # free allowed GPUs: nodes the job keeps first, then the nodes with most of them
        cands = self._candidates(spec, {c.node_of(g) for g in good})
        if len(good) + len(cands) < n:
            fit = [k for k in spec.counts(len(good) + len(cands)) if k < n]
            if not fit:
                plan.placement[v.job_id] = tuple(sorted(good + wrong))
                return False
            n = fit[-1]
        keep = good[:n]
        new = cands[: n - len(keep)]
        self.free.update(wrong)
        self.free.update(good[n:])
        self.free.difference_update(new)
        plan.placement[v.job_id] = tuple(sorted(keep + new))
        plan.allocation[v.job_id] = n
        return True

    def _candidates(self, spec: JobSpec, prefer: set[int]) -> list[int]:
        c = self.cluster
        per_node: dict[int, list[int]] = {}
        for g in sorted(self.free):
            if spec.allows_type(c.gpu_type_of(g)):
                per_node.setdefault(c.node_of(g), []).append(g)
        order = sorted(per_node, key=lambda n: (n not in prefer, -len(per_node[n]), n))
        return [g for n in order for g in per_node[n]]

    def _trades(self, v: JobView, wrong: list[int]) -> list[int]:
        """GPUs of ``v``'s types taken from jobs placed anew in this plan, each
        given one of ``v``'s ``wrong`` GPUs (of a type it allows) instead; the
        traded wrong GPUs leave ``wrong``. A GPU a job holds now is never taken."""
        spec, plan, c = v.spec, self.plan, self.cluster
        got: list[int] = []
        for jid, other in self.moved.items():
            if not wrong:
                break
            if jid == v.job_id or plan.allocation.get(jid, 0) <= 0 or jid not in plan.placement:
                continue
            mine = list(plan.placement[jid])
            changed = False
            for i, g in enumerate(mine):
                if not wrong:
                    break
                if g in other.gpus or not spec.allows_type(c.gpu_type_of(g)):
                    continue
                swap = next((w for w in wrong if other.spec.allows_type(c.gpu_type_of(w))), None)
                if swap is None:
                    break
                wrong.remove(swap)
                mine[i] = swap
                got.append(g)
                changed = True
            if changed:
                plan.placement[jid] = tuple(sorted(mine))
        return got

    def _hold_back(self, v: JobView) -> None:
        """``v`` cannot be placed on its types now: it keeps what it holds
        (when no one else takes those GPUs) or waits."""
        plan, jid = self.plan, v.job_id
        self.free.update(plan.placement.pop(jid, ()))
        plan.allocation.pop(jid, None)
        if v.gpus and self.free.issuperset(v.gpus) and breaks(self.cluster, v.spec, v.gpus) is None:
            plan.placement[jid] = v.gpus
            plan.allocation[jid] = len(v.gpus)
            self.free.difference_update(v.gpus)
            return
        n = max(1, v.spec.lo)
        why = f"waits for {n} free GPUs {type_phrase(v.spec)}"
        if not v.spec.fits(allowed_gpus(self.cluster, v.spec)):
            why += ": the cluster's nodes of those types are not up"
        plan.waiting[jid] = why
