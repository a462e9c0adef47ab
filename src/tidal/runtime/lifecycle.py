"""A worker's life in its job, at batch boundaries: joining, the agreed
switch, recovery after a failed collective, periodic checkpoints and the
end (EDL §4.2, Elan §V-B).

Everything here runs on the training thread, at the boundary before a batch
is handed to the script, after all of the script's per-step code ran, so the
state a switch sends to newcomers (and a checkpoint holds) is exactly the
state the next step starts from. A switch never happens inside an
accumulation window, nor at the boundary that ends an epoch: it waits for the
first batch of the next epoch, after the script's per-epoch code, which
newcomers then run too.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import TYPE_CHECKING

from tidal import settings
from tidal.runtime.checkpoint import node_local
from tidal.runtime.heartbeat import StoreEndpoint

if TYPE_CHECKING:
    from tidal.runtime.loader import ElasticLoader
    from tidal.runtime.worker import Job

log = logging.getLogger(__name__)


def leave_process(worker_id: str, why: str) -> None:
    """A worker the job no longer has ends here, at its batch boundary, as a
    preempted process does (EDL's graceful exit): no user code after the
    loop runs (it would see a job it is no longer part of), ``finally``
    blocks and ``atexit`` handlers do, and the exit code is 0."""
    print(f"tidal: worker {worker_id} {why}; exiting", file=sys.stderr, flush=True)
    raise SystemExit(0)


class Lifecycle:
    """The boundary logic of one :class:`~tidal.runtime.worker.Job`."""

    def __init__(self, job: "Job") -> None:
        self.job = job
        self.started = False

    # ------------------------------------------------------------------ joining
    def start(self) -> None:
        """Join the job: wait for a generation, rendezvous, receive state."""
        if self.started:
            return
        self.started = True
        j = self.job
        t = j.train
        if t.elastic is None:
            raise RuntimeError("register the model before training: model = job.wrap(model) "
                               "(or job.register_state(model, optimizer))")
        j.runner.attach()
        if j.client is None:  # local mode: a single process, no master
            self.resume_from_checkpoint()
            t.global_batch_size = t.policy.start(1)
            return
        # Register only now, when model and data pipeline are built: a newcomer
        # is "ready" and the others have not waited for its imports (EDL §4.2).
        info = j.membership.register(checkpoints=j.checkpointer.directory is not None,
                                     checkpoint_local=node_local(j.checkpointer.directory))
        j.heartbeat.phase = ("join", 0)
        j.heartbeat.start_beats(StoreEndpoint.from_json(info))
        if not j.membership.join(t, self.resume_from_checkpoint):
            j.finished = True
            return
        j.heartbeat.phase = ("idle", t.step)
        j.heartbeat.start()

    # ------------------------------------------------------------------ boundaries
    def boundary(self, loader: "ElasticLoader", epoch: int) -> bool:
        """Before a batch of ``epoch``: recover, commit, switch, checkpoint.
        False: no batch (the epoch is over, or this worker is done)."""
        j = self.job
        r = j.runner
        if j.finished or j.left:
            return False
        if r.window.failed and not self.recover():
            return False
        r.commit()
        live = r.live_cursor
        if live // loader.n != epoch or loader.epoch_over(epoch, live):
            r.commit(epoch_end=(epoch + 1) * loader.n)
            return False
        if r.window.open:  # inside an accumulation window
            return True
        if j.membership.agreement.due(j.train.step):
            self.switch()
            if j.left or (r.window.failed and not self.recover()):
                return False
        if j.rank == 0 and j.checkpointer.due(j.train.step):
            self.write_checkpoint()
        return True

    def switch(self) -> None:
        """The agreed switch (EDL §4.2)."""
        j = self.job
        assert j.client is not None
        t0, wall0 = time.perf_counter(), time.time()
        plan = j.membership.take_plan()
        if plan.kind == "suspend":  # the whole job stops here and resumes from this checkpoint later
            if j.rank == 0:
                self.write_checkpoint()
                j.client.post("/suspended", {"step": j.step_count, "cursor": j.cursor,
                                             "path": j.checkpoints[-1]["path"]})
            j.suspended = True
        for c in j.carriers:  # every stream's carried state, gathered while the leavers are still here
            c.before_switch()
        if j.worker_id in plan.leavers:
            j.membership.leave()
            j.left = True
            j.close()
            log.info("worker %s left at step %d", j.worker_id, j.step_count)
            leave_process(j.worker_id, "suspended" if j.suspended else "removed by a scale-in")
        pause = j.membership.switch(plan, j.train, t0, wall0)
        if pause is None:  # the state transfer failed; the last step was applied in full: nothing to undo
            j.runner.window.failed = True
            return
        j.runner.timing.last_step_end = None  # do not count the switch in step-time statistics
        if j.rank == 0:  # reported by the heartbeat thread, off the critical path
            j.heartbeat.report_switched({"gen": pause["gen"], "step": pause["step"], "pause_s": pause["pause_s"]})
        log.info("worker %s switched to gen %d rank %d/%d at step %d in %.1f ms", j.worker_id, pause["gen"],
                 j.rank, j.world_size, j.step_count, 1e3 * pause["pause_s"])

    def recover(self) -> bool:
        """A peer died during a collective: undo the user-side effects of the
        dropped step and re-form with the survivors (:meth:`Membership.
        recover`). False: the job finished meanwhile."""
        j = self.job
        assert j.train.elastic is not None
        t0, wall0 = time.perf_counter(), time.time()
        snap = j.runner.window.snapshot
        if snap is not None:
            j.train.elastic.restore_step_snapshot(snap)
        j.runner.close_window()
        pause = j.membership.recover(j.train, t0, wall0)
        if pause is None:
            j.finished = True
            j.close()
            return False
        for c in j.carriers:
            c.after_recovery()
        j.runner.timing.last_step_end = None
        if j.rank == 0:  # the master's record of the recovery gets the pause the workers measured
            j.heartbeat.report_switched({"gen": pause["gen"], "step": pause["step"], "pause_s": pause["pause_s"]})
        log.warning("worker %s recovered in gen %d as rank %d/%d at step %d (%.0f ms)", j.worker_id, pause["gen"],
                    j.rank, j.world_size, j.step_count, 1e3 * pause["pause_s"])
        return True

    def finish(self) -> None:
        """The last epoch ended: rank 0 tells the master; everyone leaves the group."""
        j = self.job
        if j.finished or j.left:
            return
        j.finished = True
        if j.client is not None and j.rank == 0:
            j.client.post("/done", {"step": j.step_count, "cursor": j.cursor, "epoch": j.epoch})
        j.close()

    # ------------------------------------------------------------------ checkpoints
    def write_checkpoint(self) -> None:
        j = self.job
        path = j.checkpointer.write(j.train, world_size=j.world_size, worker=j.worker_id)
        j.runner.timing.last_step_end = None  # do not count the write in step-time statistics
        log.info("worker %s: checkpoint of step %d written to %s", j.worker_id, j.step_count, path)

    def resume_from_checkpoint(self) -> None:
        """A (re)started job: continue from the newest checkpoint, if any."""
        j = self.job
        if j.checkpointer.resume(j.train, expect_step=settings.RESUME_STEP.get()):
            log.warning("worker %s: resumed from the checkpoint of step %d (cursor %d)", j.worker_id,
                        j.step_count, j.cursor)
