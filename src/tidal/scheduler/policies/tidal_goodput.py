"""Tidal's policy planning in goodput (``tidal-goodput``).

The same decisions as :class:`~tidal.scheduler.policies.tidal.Tidal`
(ElasticFlow's admission and Algorithm 2, least-attained-service floors and
weights for best-effort jobs, buddy placement), with one change for *goodput
jobs* (:func:`~tidal.scheduler.goodput.is_goodput_job`, on a
:class:`~tidal.scheduler.goodput.GoodputProfile`): a job's rate at each GPU
count is its goodput at the best batch for that count (Pollux, OSDI'21,
§3-4.1: ``max_M THROUGHPUT x E(M)``, noise scale as the job measures it now
at its current batch), in the same progress units as its remaining work, so
Algorithm 2's marginal returns are goodput speedups; and the executor is told
that best batch (``Plan.batch``) for the count the job gets. Other jobs, and
every job on a plain profile, get exactly Tidal's decisions.
"""

from __future__ import annotations

import numpy as np

from tidal.scheduler.api import JobView, Plan, Snapshot
from tidal.scheduler.estimate import rigid_count
from tidal.scheduler.goodput import phi_bucket
from tidal.scheduler.policies.elasticflow import _Context, _Memo, job_levels
from tidal.scheduler.policies.tidal import Tidal
from tidal.scheduler.timeline import Levels


def goodput_levels(snap: Snapshot, j: JobView, cache: dict) -> tuple[Levels, float]:
    """(levels, noise scale) of goodput job ``j``: powers of two up to the
    cluster (its own count if rigid), rate = best goodput at that count, kept
    while it rises. ``cache`` memoises by application, allowed counts and
    noise-scale bucket."""
    gp = snap.profiles.goodput  # type: ignore[attr-defined]
    spec = j.spec
    cap = snap.cluster.num_gpus
    phi = gp.phi(spec.model, j.done, j.batch or spec.batch_size)
    key = (spec.model, spec.elastic, spec.lo, spec.hi(cap), spec.allowed_gpus, phi_bucket(phi),
           None if spec.elastic else (spec.requested_gpus, spec.batch_size))
    hit = cache.get(key)
    if hit is None:
        if spec.elastic:
            counts = [c for c in spec.counts(cap) if c & (c - 1) == 0]
        else:
            counts = [rigid_count(spec, cap)]
        cs, rs = [0], [0.0]
        for c in counts:
            r = gp.best(spec.model, c, phi)[1] if spec.elastic else snap.progress_rate(j, c)
            if r > rs[-1] * (1 + 1e-9):
                cs.append(c)
                rs.append(r)
        hit = cache[key] = Levels(np.array(cs, dtype=np.int64), np.array(rs, dtype=float), tuple(cs), tuple(rs))
    return hit, phi


class _GoodputMemo(_Memo):
    """ElasticFlow's memo, with goodput jobs' levels from :func:`goodput_levels`
    (their noise scale moves as they train, so they are looked up every call)."""

    def __init__(self, *args, **kw) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kw)
        self.goodput_cache: dict = {}
        self.phis: dict[str, float] = {}

    def levels_of(self, snap: Snapshot) -> dict[str, Levels]:
        owns = getattr(snap.profiles, "owns", None)
        if owns is None or getattr(snap.profiles, "goodput", None) is None:
            return super().levels_of(snap)
        out = {}
        if len(self.goodput_cache) > 100_000:
            self.goodput_cache.clear()
        for j in snap.jobs:
            if owns(j.spec):
                out[j.job_id], self.phis[j.job_id] = goodput_levels(snap, j, self.goodput_cache)
            else:
                out[j.job_id] = job_levels(snap, j, self.by_key)
        return out


class TidalGoodput(Tidal):
    """:class:`Tidal` with goodput levels and best batches for goodput jobs."""

    name = "tidal-goodput"

    def _memo_for(self, snap, costs):  # type: ignore[no-untyped-def]
        memo = getattr(self, "_memo", None)
        if not isinstance(memo, _GoodputMemo) or not memo.valid(snap, costs, self.slot):
            memo = self._memo = _GoodputMemo(snap, costs, self.slot)
        return memo

    def allocate(self, snap: Snapshot, plan: Plan, ctx: _Context) -> None:
        super().allocate(snap, plan, ctx)
        owns = getattr(snap.profiles, "owns", None)
        gp = getattr(snap.profiles, "goodput", None)
        if owns is None or gp is None:
            return
        phis = self._memo.phis
        views = snap.view_of
        for jid, n in plan.allocation.items():
            j = views[jid]
            if not (j.spec.elastic and owns(j.spec)):
                continue
            phi = phis.get(jid)
            if phi is None:
                phi = gp.phi(j.spec.model, j.done, j.batch or j.spec.batch_size)
            b = gp.best(j.spec.model, n, phi)[0]
            if b and b != (j.batch or j.spec.batch_size):
                plan.batch[jid] = b
