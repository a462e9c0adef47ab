"""Tidal's own policy: ElasticFlow's deadline guarantees plus Elastic-Tiresias'
responsiveness for best-effort jobs, aware of the measured rescale cost.

1. **Admission** — ElasticFlow's Minimum Satisfactory Share (ASPLOS'23 §4.2,
   Algorithm 1): a job with a deadline is admitted only if it and every
   admitted job still meet their deadlines; best-effort jobs are admitted.
2. **Allocation**, per scheduling event:
   a. every guaranteed job gets its share for this slot (Algorithm 2, step 1);
   b. *floors* — best-effort jobs, in least-attained-service order
      (Tiresias' discretised 2D-LAS queues, thresholds 500 and 10,000 GPU·s as
      in EDL §5.1; running jobs first within a queue), each get their smallest
      runnable count while GPUs remain, so a short job starts at once instead
      of waiting behind long ones;
   c. the remaining GPUs go one buddy step at a time to the largest marginal
      return net of rescale cost (Algorithm 2 with the overheads the
      snapshot carries — in the live cluster, the runtime's measured pauses),
      a best-effort job's return weighted by ``2 ** -queue`` so young (likely
      short) jobs grow first — Elastic-Tiresias' expansion, which favours
      jobs by relative gain, turned towards least attained service.
3. **Placement** — buddy allocation with Best-Fit and defragmenting
   migration (ElasticFlow §4.3).

Guarantees are ElasticFlow's: floors and weights only touch what the shares
leave. docs/results.md compares it with every seed policy on each one's metric.
"""

from __future__ import annotations

from tidal.scheduler.api import JobView, Snapshot
from tidal.scheduler.policies.elasticflow import ElasticFlow
from tidal.scheduler.policies.tiresias import queue_of
from tidal.scheduler.timeline import Levels


class Tidal(ElasticFlow):
    def __init__(self, slot: float = 60.0, thresholds: tuple[float, ...] = (500.0, 10_000.0), **kw) -> None:
        super().__init__(slot=slot, **kw)
        self.thresholds = tuple(thresholds)

    def _best_effort(self, job: JobView) -> bool:
        return job.spec.deadline is None or job.tags.get("ef_class") in ("best-effort", "late")

    def _floors(self, snap: Snapshot, jobs: list[JobView], base: dict[str, int], levels: dict[str, Levels],
                free: int) -> int:
        order = sorted(
            (j for j in jobs if self._best_effort(j) and base.get(j.job_id, 0) == 0),
            key=lambda j: (queue_of(j, self.thresholds), not j.running, j.spec.submit_time, j.job_id),
        )
        for j in order:
            counts = levels[j.job_id].count_list
            smallest = next((c for c in counts if c > 0), 0)
            if 0 < smallest <= free:
                base[j.job_id] = smallest
                free -= smallest
        return free

    def _weight(self, snap: Snapshot, job: JobView) -> float:
        if not self._best_effort(job):
            return 1.0
        return 2.0 ** -queue_of(job, self.thresholds)
