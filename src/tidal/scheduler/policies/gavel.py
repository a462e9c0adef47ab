"""Gavel: heterogeneity-aware max-min fairness with a round-based mechanism.

Narayanan et al., "Heterogeneity-Aware Cluster Scheduling Policies for Deep
Learning Workloads", OSDI'20. Written from the paper:

1. **Effective throughput** (§3.1): ``T[m][j]``, job ``m``'s progress rate
   on its requested count of GPUs of type ``j``, consolidated on that type.
   Jobs are rigid: they run at their requested count (the scale factor
   ``z_m``), as in Gavel.
2. **Allocation** (§4.1, the heterogeneity-aware LAS / max-min fairness
   policy): time fractions ``X[m][j]`` maximising
   ``min_m throughput(m, X) / throughput(m, X^equal)`` subject to
   ``sum_j X[m][j] <= 1`` (a job runs on one type at a time) and
   ``sum_m z_m X[m][j] <= G_j`` (type ``j``'s GPUs). ``X^equal`` gives every
   job the same share of every type: ``min(1, G_j / sum_m z_m)`` of type
   ``j`` spread evenly over the types. A linear programme (HiGHS through
   :func:`scipy.optimize.linprog`); a small secondary term (the sum of the
   normalised throughputs) picks a Pareto-efficient optimum among the
   max-min ones, as Gavel's water-filling does.
3. **Mechanism** (§5): rounds of ``round_s`` seconds (Sia's study of Gavel,
   SOSP'23 §6, used 360 s). At each round boundary the (job, type) pairs are
   taken in decreasing priority ``X[m][j] / f[m][j]`` — ``f`` the fraction of
   rounds since the job arrived that it ran on type ``j`` (``f = 0``: served
   first) — and a job is given ``z_m`` GPUs of that type if they are free and
   it has none yet. A job placed again on its type keeps its GPUs; each job
   sits on nodes of one type, consolidated. Between boundaries nothing
   changes: a job that arrives, or GPUs that a finished job frees, wait for
   the next round (Gavel leases GPUs per round). The round boundaries are the
   multiples of ``round_s``; the executor is asked to call again at the next
   one (``Plan.wake_at``), and its slot should divide ``round_s``.

A job whose count no single type can hold (only possible when it exceeds
every type's GPUs) runs on GPUs of several of its allowed types, at the
slowest type's pace, when enough are free after the round's assignment.
"""

from __future__ import annotations

import logging
import math

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import coo_matrix

from tidal.scheduler.api import JobView, Plan, Policy, Snapshot, schedulable
from tidal.scheduler.estimate import rigid_count
from tidal.scheduler.typed import allowed_types, cluster_types, place_typed, typed_rate

log = logging.getLogger(__name__)

_EPS = 1e-3  # weight of the secondary (efficiency) term


def gavel_fractions(tput: np.ndarray, scale: np.ndarray, capacity: np.ndarray) -> np.ndarray:
    """Gavel's heterogeneity-aware max-min fair time fractions (OSDI'20 §4.1).

    ``tput``: jobs x types effective throughput (0: the job cannot run
    there); ``scale``: GPUs per job; ``capacity``: GPUs per type. Returns
    ``X`` (jobs x types), each row summing to at most 1, with
    ``sum_m scale[m] X[m][j] <= capacity[j]``. Rows of zeros stay zero.

    Jobs with the same throughputs and scale are interchangeable, and the
    programme is convex, so some optimum gives them the same fractions: the
    LP is solved over classes of identical jobs (one variable per class and
    type, a class's GPUs weighted by its size) — exact, and a few dozen
    classes where hundreds of jobs share a few models and counts."""
    n_jobs, n_types = tput.shape
    X = np.zeros((n_jobs, n_types))
    ok = (tput > 0) & (scale[:, None] <= capacity[None, :])
    rows = np.flatnonzero(ok.any(axis=1))
    if rows.size == 0:
        return X
    keys = np.column_stack([np.where(ok[rows], tput[rows], 0.0), scale[rows]])
    uniq, inverse, size = np.unique(keys, axis=0, return_inverse=True, return_counts=True)
    X[rows] = _class_fractions(uniq[:, :-1], uniq[:, -1], size.astype(float), capacity.astype(float))[inverse.ravel()]
    return X


def _class_fractions(T: np.ndarray, z: np.ndarray, size: np.ndarray, capacity: np.ndarray) -> np.ndarray:
    """The max-min LP over classes: ``size[c]`` jobs each with throughputs
    ``T[c]`` on ``z[c]`` GPUs; the fraction of each type each of them gets."""
    C, K = T.shape
    allow = T > 0
    share = np.minimum(1.0, capacity / max(float(z @ size), 1.0)) / K  # X^equal, the same for every job
    equal = (T * share[None, :]).sum(axis=1)
    norm = T / equal[:, None]  # throughput(m, X) / throughput(m, X^equal) per unit of X
    nv = C * K + 1  # fractions row-major, then t
    idx = np.arange(C * K)
    r_class = np.repeat(np.arange(C), K)
    data = np.concatenate([-norm.ravel(), np.ones(C * K), np.repeat(z * size, K), np.ones(C)])
    r = np.concatenate([r_class, C + r_class, 2 * C + np.tile(np.arange(K), C), np.arange(C)])
    col = np.concatenate([idx, idx, idx, np.full(C, nv - 1)])
    A = coo_matrix((data, (r, col)), shape=(2 * C + K, nv)).tocsr()
    b = np.concatenate([np.zeros(C), np.ones(C), capacity])
    c = np.concatenate([-_EPS * (norm * size[:, None]).ravel() / size.sum(), [-1.0]])
    bounds = np.column_stack([np.zeros(nv), np.append(allow.ravel().astype(float), np.inf)])
    res = linprog(c, A_ub=A, b_ub=b, bounds=bounds, method="highs")
    if res.status != 0:
        log.warning("Gavel LP not solved (%s); equal shares instead", res.message)
        return allow * share[None, :]
    return np.clip(res.x[:-1].reshape(C, K), 0.0, 1.0)


def gavel_round(
    X: np.ndarray, received: np.ndarray, elapsed: np.ndarray, scale: np.ndarray, free: np.ndarray
) -> list[int]:
    """Gavel's round-based mechanism (OSDI'20 §5): the type index each job
    runs on this round (-1: none). Pairs go in decreasing priority
    ``X / (received / elapsed)`` (never-served pairs first, by ``X``); ties by
    job order, then type order. ``free`` (GPUs per type) is not changed."""
    left = free.astype(int).copy()
    frac = received / np.maximum(elapsed, 1.0)[:, None]
    prio = np.where(frac > 0, X / np.maximum(frac, 1e-12), 0.0)
    unserved = (frac <= 0) & (X > 1e-9)
    key_unserved, key_prio = -unserved.astype(float), -prio
    m_idx, t_idx = np.nonzero(X > 1e-9)
    order = np.lexsort((t_idx, m_idx, -X[m_idx, t_idx], key_prio[m_idx, t_idx], key_unserved[m_idx, t_idx]))
    out = [-1] * X.shape[0]
    for k in order:
        m, t = int(m_idx[k]), int(t_idx[k])
        if out[m] < 0 and scale[m] <= left[t]:
            out[m] = t
            left[t] -= int(scale[m])
    return out


class Gavel(Policy):
    """``round_s``: the round length (seconds; 0: every call is a round)."""

    def __init__(self, round_s: float = 360.0) -> None:
        if round_s < 0:
            raise ValueError(f"round_s must be >= 0, got {round_s}")
        self.round_s = float(round_s)

    def _round_index(self, now: float) -> int:
        return math.floor(now / self.round_s + 1e-9) if self.round_s > 0 else 0

    def allocation(self, snap: Snapshot, plan: Plan) -> None:
        jobs = schedulable(snap, plan)
        idx = self._round_index(snap.now)
        if self.round_s > 0:
            view_of = snap.view_of
            if any(view_of[jid].tags.get("gavel_round") == idx for jid in snap.held if jid in view_of):
                # mid-round: the round's leases hold
                for j in jobs:
                    if j.gpus:
                        plan.allocation[j.job_id] = len(j.gpus)
                plan.wake_at = (idx + 1) * self.round_s
                return
        self._new_round(snap, plan, jobs, idx)
        if jobs and self.round_s > 0:
            plan.wake_at = (idx + 1) * self.round_s

    def _new_round(self, snap: Snapshot, plan: Plan, jobs: list[JobView], idx: int) -> None:
        ct = cluster_types(snap.cluster)
        types = list(ct.capacity)
        capacity = np.array([ct.capacity[t] for t in types])
        total = snap.cluster.num_gpus
        scale = np.array([rigid_count(j.spec, total) for j in jobs], dtype=int)
        tput = np.zeros((len(jobs), len(types)))
        received = np.zeros_like(tput)
        for m, j in enumerate(jobs):
            ok = allowed_types(j.spec, snap.cluster)
            got = j.tags.get("gavel_rx", {})
            for k, t in enumerate(types):
                if t in ok and scale[m] <= capacity[k]:
                    tput[m, k] = typed_rate(snap, j.spec, t, int(scale[m]))
                received[m, k] = got.get(t, 0)
        elapsed = np.array([(snap.now - j.spec.submit_time) / self.round_s if self.round_s > 0 else 1.0
                            for j in jobs]) + 1.0
        X = gavel_fractions(tput, scale, capacity)
        chosen = gavel_round(X, received, elapsed, scale, capacity)
        left = capacity.copy()
        for m, k in enumerate(chosen):
            if k >= 0:
                left[k] -= scale[m]
        for m, (j, k) in enumerate(zip(jobs, chosen)):
            jid = j.job_id
            if k >= 0:
                rx = dict(j.tags.get("gavel_rx", {}))
                rx[types[k]] = rx.get(types[k], 0) + 1
                plan.allocation[jid] = int(scale[m])
                plan.tags[jid] = {"gavel_rx": rx, "gavel_round": idx, "gavel_types": (types[k],)}
            elif not tput[m].any():  # fits no single type: several, if enough are free
                ok = allowed_types(j.spec, snap.cluster)
                ks = [i for i, t in enumerate(types) if t in ok]
                if 0 < scale[m] <= sum(left[i] for i in ks):
                    need = int(scale[m])
                    for i in ks:
                        use = min(need, int(left[i]))
                        left[i] -= use
                        need -= use
                    plan.allocation[jid] = int(scale[m])
                    plan.tags[jid] = {"gavel_round": idx, "gavel_types": tuple(types[i] for i in ks)}

    def placement(self, snap: Snapshot, plan: Plan) -> None:
        held = snap.held
        want = {}
        for jid, n in plan.allocation.items():
            tags = plan.tags.get(jid)
            if tags is not None and "gavel_types" in tags:
                want[jid] = (tags["gavel_types"], n)
            else:  # a lease that holds mid-round: its GPUs' types
                gpus = held.get(jid, ())
                want[jid] = (tuple({snap.cluster.gpu_type_of(g) for g in gpus}), n)
        plan.placement = place_typed(snap, want)
        for jid in [j for j in plan.allocation if j not in plan.placement]:
            del plan.allocation[jid]
            plan.tags.pop(jid, None)
