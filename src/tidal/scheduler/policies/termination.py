"""termination: the SideCar paper's second baseline, Optimus-like growth by restart.

Wang et al., SC'20, §IV (evaluation baselines), after Optimus (Peng et al.,
EuroSys'18, §4): a new job starts on its smallest optional count; while GPUs
are idle, running jobs grow one optional count at a time, each growth a stop
(checkpoint, terminate) and restart at the larger count; the job whose
predicted completion time drops most per added GPU, net of the restart
overhead, grows first (Optimus' marginal gain). At most one growth per job per
round; the policy asks to be woken every ``interval`` seconds while a job could
still grow. Jobs are never shrunk or preempted ("no reshaping down"). Remaining
work is predicted as in :mod:`reshaping` (online accuracy-curve fit for jobs
with a target accuracy).
"""

from __future__ import annotations

from tidal.scheduler.api import Plan, Policy, Snapshot, schedulable
from tidal.scheduler.policies.reshaping import Predictor, options


def termination_allocation(snap: Snapshot, plan: Plan, interval: float = 600.0) -> None:
    pred = Predictor(snap)
    free = snap.cluster.num_gpus
    queue, running = [], []
    for j in schedulable(snap, plan):
        if j.running:
            plan.allocation[j.job_id] = j.size
            free -= j.size
            running.append(j)
        else:
            queue.append(j)
    for j in sorted(queue, key=lambda j: (j.spec.submit_time, j.job_id)):
        n = options(snap, j)[0]
        if n <= free:
            plan.allocation[j.job_id] = n
            free -= n
    opts = {j.job_id: options(snap, j) for j in running}
    # each job grows at most once, by a gain fixed within the round, and free
    # GPUs only shrink: take the candidates in order of (gain, id), best first,
    # skipping those that no longer fit (the same picks as rescanning them all)
    cands = []
    for j in running:
        bigger = [c for c in opts[j.job_id] if c > j.size]
        if not bigger:
            continue
        c = bigger[0]
        if c - j.size > free:
            continue
        gain = (pred.keep(j) - pred.resize(j, c)) / (c - j.size)
        if gain > 0:
            cands.append((gain, j.job_id, j, c))
    cands.sort(key=lambda x: (x[0], x[1]), reverse=True)
    for _, jid, j, c in cands:
        if free <= 0:
            break
        if c - j.size <= free:
            free -= c - j.size
            plan.allocation[jid] = c
    if free > 0 and any(_top(snap, opts, queue, jid) > n for jid, n in plan.allocation.items()):
        plan.wake_at = snap.now + interval  # a job could still grow: look again


def _top(snap: Snapshot, opts: dict[str, list[int]], queue: list, jid: str) -> int:
    if jid not in opts:
        opts.update({j.job_id: options(snap, j) for j in queue if j.job_id not in opts})
    return opts[jid][-1]


class Termination(Policy):
    def __init__(self, interval: float = 600.0) -> None:
        self.interval = interval

    def allocation(self, snap: Snapshot, plan: Plan) -> None:
        termination_allocation(snap, plan, self.interval)
