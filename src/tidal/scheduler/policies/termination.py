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
    grown: set[str] = set()
    while free > 0:
        best = None
        for j in running:
            if j.job_id in grown:
                continue
            bigger = [c for c in options(snap, j) if c > j.size]
            if not bigger:
                continue
            c = bigger[0]
            if c - j.size > free:
                continue
            gain = (pred.keep(j) - pred.resize(j, c)) / (c - j.size)
            if gain > 0 and (best is None or (gain, j.job_id) > best[:2]):
                best = (gain, j.job_id, j, c)
        if best is None:
            break
        _, jid, j, c = best
        free -= c - j.size
        plan.allocation[jid] = c
        grown.add(jid)
    by_id = {j.job_id: j for j in queue + running}
    if free > 0 and any(options(snap, by_id[jid])[-1] > n for jid, n in plan.allocation.items()):
        plan.wake_at = snap.now + interval  # a job could still grow: look again


class Termination(Policy):
    def __init__(self, interval: float = 600.0) -> None:
        self.interval = interval

    def allocation(self, snap: Snapshot, plan: Plan) -> None:
        termination_allocation(snap, plan, self.interval)
