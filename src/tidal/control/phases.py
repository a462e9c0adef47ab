"""The phase machine of a live job, as pure functions.

The coordinator is level-triggered (Kubernetes-style): every tick it compares
what the policy wants (the plan) with what the store says (process rows the
agents report, the progress the job master reports) and moves each job ONE
step. A step is a transition ``(phase, event) -> phase``; the event is either
observed (:func:`judge`: a process exited, a GPU became free, a change timed
out) or wanted by the plan (:func:`intent`: start, grow, shrink, suspend).
Nothing here does I/O or reads a clock: the effects of each transition live in
:mod:`tidal.control.effects`, the tick in :mod:`tidal.control.reconcile`.

Phases (the job's ``state`` as users and policies see it in brackets)::

    submitted [submitted] --admit--> pending [pending]
    pending --start--> starting [running]        GPUs assigned, master launched
    pending --prestart--> prestarting [pending]  SideCar §III-C: GPUs reserved while a
                                                 donor gives them up; workers warm up gated
    starting --master_up--> running              worker rows written
    prestarting --taken / gate_open--> starting / running
    running --grow_accepted--> joining [resizing]       newcomers on free GPUs
    running --grow_early_accepted--> warming [resizing] newcomers gated on a donor's GPUs
    warming --gate_open--> joining --joined--> running
    running --shrink_accepted--> shrinking [resizing] --left--> running
    running --suspend_accepted--> suspending [suspending] --suspended--> pending
    running --workers_failed--> ending           every worker exited with an error (a bug in
                                                 the script, a stale checkpoint): nothing to re-form
    starting, running, warming, joining, shrinking --out_of_memory--> ending: workers ran out of
                                                 memory too often, or the raised limit exceeds
                                                 every node (docs/resources.md)
    starting, running, warming, joining, shrinking --give_up--> ending: the liveness contract
                                                 (docs/control.md, "Liveness") ends the job: a
                                                 process could not launch, the same error came
                                                 back too often, the script never called
                                                 tidal.runtime.init(), no generation formed in time
    running --workers_done--> ending             every worker exited 0 after training: the
                                                 script's own loop ended first (completed)
    running --restart--> restarting [restarting] no live worker is left (all killed), or no step
                                                 for the stall time-out: every process stops (also
                                                 starting, whose master's node went down)
    restarting --restarted--> pending            the job starts again from its checkpoint
    joining --newcomers_gone--> running          every newcomer of the grow ended before joining
    ending, cancelling --overdue--> the same     processes still running past the bound are stopped
    running, warming, joining, shrinking --master_lost--> the same phase: the master's host
                                                 died, the master restarts on another host of
                                                 the job from the store's copy of its state
    any live phase --master_exit--> ending [running] --finished / failed--> completed / failed
    any live phase --cancel--> cancelling [cancelling] --gone--> cancelled
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from tidal import settings

SUBMITTED, PENDING, PRESTARTING, STARTING, RUNNING = "submitted", "pending", "prestarting", "starting", "running"
WARMING, JOINING, SHRINKING, SUSPENDING = "warming", "joining", "shrinking", "suspending"
ENDING, CANCELLING, RESTARTING = "ending", "cancelling", "restarting"
COMPLETED, FAILED, CANCELLED, DROPPED = "completed", "failed", "cancelled", "dropped"

TERMINAL = frozenset({COMPLETED, FAILED, CANCELLED, DROPPED})

#: the job state users and policies see in each phase
STATE_OF: Mapping[str, str] = {
    SUBMITTED: "submitted", PENDING: "pending", PRESTARTING: "pending", STARTING: "running", RUNNING: "running",
    WARMING: "resizing", JOINING: "resizing", SHRINKING: "resizing", SUSPENDING: "suspending", ENDING: "running",
    RESTARTING: "restarting",
    CANCELLING: "cancelling", COMPLETED: "completed", FAILED: "failed", CANCELLED: "cancelled", DROPPED: "dropped",
}

#: phases in which the job's master process runs (or is being launched)
WITH_MASTER = frozenset({PRESTARTING, STARTING, RUNNING, WARMING, JOINING, SHRINKING})

#: phases whose master is restarted on another host of the job when its own host dies
RELOCATABLE = frozenset({RUNNING, WARMING, JOINING, SHRINKING})

#: phases in which a job whose workers keep running out of memory is failed
OOM_FAILS = RELOCATABLE | {STARTING}

#: phases that wait for a remote change to finish (the loop ticks faster meanwhile)
IN_FLIGHT = frozenset({PRESTARTING, STARTING, WARMING, JOINING, SHRINKING, SUSPENDING, ENDING, CANCELLING,
                       RESTARTING})

#: phases in which a job gives GPUs back (early initialisation may reserve them)
DONOR = frozenset({SHRINKING, SUSPENDING, RESTARTING})

_LIVE = frozenset(STATE_OF) - TERMINAL

TRANSITIONS: Mapping[tuple[str, str], str] = {
    **{(p, "cancel"): CANCELLING for p in _LIVE - {CANCELLING}},
    **{(p, "master_exit"): ENDING for p in WITH_MASTER},
    **{(p, "master_lost"): p for p in RELOCATABLE},
    (CANCELLING, "gone"): CANCELLED,
    (CANCELLING, "gone_late"): CANCELLED,  # past the cancel bound: GPUs still in use stay held until freed
    (ENDING, "finished"): COMPLETED,
    (ENDING, "failed"): FAILED,
    (SUBMITTED, "drop"): DROPPED,
    (PENDING, "drop"): DROPPED,
    (SUBMITTED, "admit"): PENDING,
    (PENDING, "start"): STARTING,
    (PENDING, "prestart"): PRESTARTING,
    (STARTING, "master_up"): RUNNING,
    (PRESTARTING, "master_up"): PRESTARTING,  # its newcomers start, gated
    (PRESTARTING, "taken"): STARTING,
    (PRESTARTING, "gate_open"): RUNNING,
    (PRESTARTING, "lapsed"): PENDING,
    **{(p, "workers_failed"): ENDING for p in RELOCATABLE},
    **{(p, "out_of_memory"): ENDING for p in OOM_FAILS},
    **{(p, "give_up"): ENDING for p in OOM_FAILS},
    (RUNNING, "workers_done"): ENDING,
    **{(p, "restart"): RESTARTING for p in RELOCATABLE | {STARTING}},
    (RESTARTING, "restarted"): PENDING,
    (RESTARTING, "overdue"): RESTARTING,
    (RESTARTING, "finished"): COMPLETED,
    (JOINING, "newcomers_gone"): RUNNING,
    (ENDING, "overdue"): ENDING,
    (CANCELLING, "overdue"): CANCELLING,
    (RUNNING, "grow_accepted"): JOINING,
    (RUNNING, "grow_early_accepted"): WARMING,
    (RUNNING, "shrink_accepted"): SHRINKING,
    (RUNNING, "released"): RUNNING,  # a shrink without live workers on the GPUs
    (RUNNING, "suspend_accepted"): SUSPENDING,
    (RUNNING, "grow_refused"): RUNNING,
    (RUNNING, "shrink_refused"): RUNNING,
    (RUNNING, "suspend_refused"): RUNNING,
    (WARMING, "gate_open"): JOINING,
    (WARMING, "lapsed"): RUNNING,
    (JOINING, "joined"): RUNNING,
    (JOINING, "timeout"): RUNNING,
    (SHRINKING, "left"): RUNNING,
    (SHRINKING, "overdue"): SHRINKING,  # the leavers are stopped
    (SHRINKING, "timeout"): RUNNING,  # their node does not answer: the GPUs stay with the job
    (SUSPENDING, "overdue"): SUSPENDING,
    (SUSPENDING, "suspended"): PENDING,
    (SUSPENDING, "finished"): COMPLETED,
}

#: the master requests behind the plan's intents
REQUESTS: Mapping[str, str] = {"grow": "scale_out", "grow_early": "scale_out", "shrink": "scale_in",
                               "suspend": "suspend"}


class IllegalTransition(ValueError):
    pass


def advance(phase: str, event: str) -> str:
    """The phase after ``event``; raises :class:`IllegalTransition` if the
    machine has no such edge."""
    try:
        return TRANSITIONS[(phase, event)]
    except KeyError:
        raise IllegalTransition(f"no transition from {phase!r} on {event!r}") from None


def answer_event(intent_: str, status: str) -> str | None:
    """The event a master's answer to the request of ``intent_`` means: None
    for *retry* (busy, EDL §3.1: ask again next tick)."""
    if status == "retry":
        return None
    if status == "accepted":
        return f"{intent_}_accepted"
    return f"{intent_.split('_')[0]}_refused"


@dataclass(frozen=True)
class JobObs:
    """What the store says about one job at the start of a tick."""

    phase: str
    change: Mapping[str, Any] = field(default_factory=dict)  # the change in flight (see effects)
    cancel_requested: bool = False  # the API set the job's state to cancelling
    master: str | None = None  # state of this incarnation's master process; None: not launched
    master_exit_code: int | None = None
    master_url: str = ""
    progress: Mapping[str, Any] = field(default_factory=dict)  # the master's last status report
    live: int = 0  # the job's processes that are pending or running (master included)
    live_workers: int = 0
    leavers_live: int = 0  # of a shrink's leaving workers
    change_gpus: str = ""  # "free" | "donated" | "blocked": the GPUs of the change in flight
    unsuspendable: bool = False  # its master refused a suspension once
    relocate_to: str = ""  # an up node running the job's workers, where a lost master can restart
    workers_erred: bool = False  # every worker of this incarnation ended, the failed ones with an error
    members_gone: str = ""  # no member of the last generation runs: "erred" (one with an error) | "killed"
    oom_failed: str = ""  # why the job gives up after out-of-memory kills ("": it does not)
    give_up: str = ""  # why the liveness contract ends the job now: a launch error, a crash loop ("": no)
    workers_seen: int = 0  # workers of this incarnation, ended or not
    workers_clean: bool = False  # every worker of the incarnation ended, each with exit code 0
    newcomers_gone: bool = False  # every newcomer of the grow in flight ended before joining
    started_at: float = 0.0  # when this incarnation's workers were written (0: unknown)
    restarts: int = 0  # restarts of the job from its checkpoint so far
    backoff: bool = False  # a worker exited with an error lately: no grow before its back-off ends
    script_ended: bool = False  # every worker exited 0 after training: the script's own loop ended

    @property
    def since(self) -> float:
        return float(self.change.get("since", 0.0))

    @property
    def master_gone(self) -> bool:
        return self.master in ("exited", "failed", "lost")

    @property
    def finished_ok(self) -> bool:
        """The master exited 0 after the job reported it finished (or the
        script's own loop ended and the master was stopped)."""
        if self.script_ended and self.master_gone:
            return True
        if self.master == "lost" and self.progress.get("state") == "finished":
            return True  # it reported the job finished, then its host went silent: the job is done
        # exit code None: a relocated master stopped before it ran (the old one finished the job meanwhile)
        return (self.master == "exited" and self.master_exit_code in (0, None)
                and self.progress.get("state") == "finished")

    @property
    def ever_formed(self) -> bool:
        """The master formed a generation in this incarnation (workers called init and trained)."""
        return (int(self.progress.get("gen") or 0) > 0
                or self.progress.get("state") in ("running", "changing", "finished", "suspended"))

    @property
    def step_at(self) -> float:
        """When the reported step last advanced (server time; 0: unknown)."""
        return float(self.progress.get("step_at") or 0.0)

    @property
    def formed(self) -> bool:
        """The master is up and its job trains: it can take a change."""
        return bool(self.master_url) and self.progress.get("state") in ("running", "changing")

    @property
    def joined(self) -> bool:
        """The master reached the size of the grow in flight."""
        if self.progress.get("state") == "finished":
            return True
        return (int(self.progress.get("world_size", 0)) == int(self.change.get("target", -1))
                and self.progress.get("state") == "running" and not self.progress.get("changing", False))


NEVER_INIT = ("the script never called tidal.runtime.init(): every worker exited 0 without registering "
              "with the job master")


@dataclass(frozen=True)
class Bounds:
    """The liveness contract's time bounds, seconds (docs/control.md,
    "Liveness"; the settings behind them are in :mod:`tidal.settings`)."""

    change_s: float = 120.0  # a change in flight (grow, shrink, suspension, restart)
    start_s: float = 90.0  # a started job's workers form their first generation
    stall_s: float = 900.0  # a formed job commits a step (0: never judged)
    restarts: int = 3  # restarts from the checkpoint before the job fails
    cancel_s: float = 30.0  # a cancellation ends
    ending_s: float = 30.0  # a finished job's last workers exit


def restart_reason(obs: JobObs, now: float, b: Bounds) -> str:
    """Why the job must start again from its checkpoint, or "": no live
    worker is left (every one was killed, none exited with an error), its
    master was lost with a host and no host of the job is left, or no step
    was committed for the stall time-out."""
    if obs.phase == STARTING and obs.master == "lost":
        return "its master's node went down before the job started"
    if obs.phase not in RELOCATABLE or obs.progress.get("state") == "finished":
        return ""
    if obs.master == "lost" and not obs.relocate_to:
        return "its master was lost with its host and no other host of the job is left"
    if obs.master_gone:
        return ""
    if obs.members_gone == "killed":
        return "no member of the job's generation is left to carry its state (every one was killed or lost)"
    if obs.phase != RUNNING or obs.change:
        return ""
    if obs.workers_seen and not obs.live_workers and not obs.workers_clean and not obs.workers_erred:
        return "no live worker is left (every worker was killed or lost)"
    idle = stalled_for(obs.step_at, now, b.stall_s)
    if obs.formed and idle:
        return stall_reason(idle, b.stall_s)
    return ""


def stalled_for(step_at: float, now: float, stall_s: float) -> float:
    """How long a formed job's step has not advanced (``step_at``: when it
    last did, 0 unknown), if that is past the stall bound ``stall_s``; 0: not
    stalled (or ``stall_s`` 0: never judged). The API and the dashboard mark
    a job stalled by this too."""
    return now - step_at if stall_s > 0 and step_at > 0 and now > step_at + stall_s else 0.0


def stall_reason(idle_s: float, stall_s: float) -> str:
    return f"stalled: no step committed for {idle_s:.0f} s ({settings.STALL_TIMEOUT_S.name}={stall_s:g})"


def give_up_reason(obs: JobObs, now: float, b: Bounds) -> str:
    """Why the liveness contract ends the job as failed now, or "" (the
    reason is what ``tidal job ID`` shows)."""
    if obs.give_up:
        return obs.give_up
    if obs.phase != RUNNING or obs.ever_formed or obs.master_gone:
        return ""
    if obs.workers_seen and not obs.live_workers and obs.workers_clean:
        return NEVER_INIT
    if obs.started_at and now > obs.started_at + b.start_s:
        return (f"no generation formed within {b.start_s:g} s of the start ({settings.START_TIMEOUT_S.name}): the workers "
                f"did not call tidal.runtime.init() or could not reach the job master; {obs.live_workers} of "
                f"{obs.workers_seen} workers still running")
    return ""


def _restart_or_give_up(obs: JobObs, now: float, b: Bounds) -> str | None:
    why = restart_reason(obs, now, b)
    if why:
        return "restart" if obs.restarts < b.restarts else "give_up"
    return "give_up" if give_up_reason(obs, now, b) else None


def ended_reason(obs: JobObs, now: float, b: Bounds) -> str:
    """The failure reason behind a ``give_up`` event."""
    why = give_up_reason(obs, now, b)
    if why:
        return why
    why = restart_reason(obs, now, b)
    return f"{why}; restarted {obs.restarts} times already ({settings.RESTART_LIMIT.name}={b.restarts})" if why else ""


def _ended_well(obs: JobObs) -> bool:
    """A job whose master is still being stopped past the ending bound (its
    agent is slow or away) ended well when its script's loop ended or its
    master reported the job finished."""
    return not obs.master_gone and (obs.script_ended or obs.progress.get("state") == "finished")


def judge(obs: JobObs, now: float, timeout_s: float, bounds: Bounds | None = None) -> str | None:
    """The observed event of this tick for ``obs.phase``, or None (then the
    plan may ask for something, see :func:`intent`)."""
    b = bounds if bounds is not None else Bounds(change_s=timeout_s)
    p = obs.phase
    if p in TERMINAL:
        return None
    if obs.cancel_requested and p != CANCELLING:
        return "cancel"
    if p == CANCELLING:
        if obs.live == 0:
            return "gone"
        return "gone_late" if now > obs.since + b.cancel_s else None
    if p in (SUSPENDING, RESTARTING):
        if obs.live == 0:
            return "finished" if obs.finished_ok else ("suspended" if p == SUSPENDING else "restarted")
        return "overdue" if now > obs.since + timeout_s else None
    if p in RELOCATABLE and obs.master == "lost" and obs.relocate_to and not obs.finished_ok:
        return "master_lost"
    if p in OOM_FAILS and obs.give_up:
        return "give_up"
    ev = _restart_or_give_up(obs, now, b) if p in RELOCATABLE or p == STARTING else None
    if ev is not None:
        return ev
    if p in WITH_MASTER and obs.master_gone:
        return "master_exit"
    if p in OOM_FAILS and obs.oom_failed:
        return "out_of_memory"
    if p == ENDING:
        late = now > obs.since + b.ending_s
        if obs.live_workers or not (obs.master_gone or obs.master is None or late):
            return "overdue" if late else None  # its last workers, or its master (being stopped), still run
        return "finished" if obs.finished_ok or _ended_well(obs) else "failed"
    if (p == RUNNING and obs.workers_erred or p in RELOCATABLE and obs.members_gone == "erred") \
            and obs.progress.get("state") != "finished":
        return "workers_failed"
    if p == RUNNING and obs.ever_formed and obs.workers_seen and not obs.live_workers and obs.workers_clean \
            and not obs.master_gone:
        return "workers_done"
    late = now > obs.since + timeout_s
    if p == STARTING:
        return "master_up" if obs.master_url else None
    if p == PRESTARTING:
        if obs.change_gpus == "free":
            return "gate_open" if obs.change.get("spawned") else "taken"
        if obs.change_gpus == "blocked" or late:
            return "lapsed"
        return "master_up" if obs.master_url and not obs.change.get("spawned") else None
    if p == WARMING:
        if obs.change_gpus == "free":
            return "gate_open"
        return "lapsed" if obs.change_gpus == "blocked" or late else None
    if p == JOINING:
        if obs.joined:
            return "joined"
        return "newcomers_gone" if obs.newcomers_gone else ("timeout" if late else None)
    if p == SHRINKING:
        if obs.leavers_live == 0:
            return "left"
        if now > obs.since + 2 * timeout_s:
            return "timeout"
        return "overdue" if late else None
    return None


def intent(obs: JobObs, kind: str | None, gpus: str) -> str | None:
    """What the plan's change for this job (``kind`` from
    :class:`tidal.scheduler.diff.JobDelta`) asks of it this tick, or None.
    ``gpus`` is the availability of the GPUs it would take: "free", "donated"
    (held by a donor that is giving them up) or "blocked"."""
    if kind is None:
        return None
    if obs.phase in (SUBMITTED, PENDING):
        if kind != "start" or obs.live:  # a stopped incarnation's processes are still leaving
            return None
        return {"free": "start", "donated": "prestart"}.get(gpus)
    if obs.phase != RUNNING or not obs.formed:
        return None  # one change at a time; a master that is not formed cannot take one
    if kind == "stop":
        return None if obs.unsuspendable else "suspend"
    if kind in ("shrink", "move"):
        return "shrink"  # a move shrinks first; the plan of a later tick grows it
    if kind == "grow":
        return None if obs.backoff else {"free": "grow", "donated": "grow_early"}.get(gpus)
    return None
