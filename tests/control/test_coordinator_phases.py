"""The coordinator's phase machine as pure functions: every transition, the
events observations mean, and what a plan's change asks of a job."""

from __future__ import annotations

import pytest

from tidal.control import phases as P
from tidal.control.phases import JobObs, advance, answer_event, intent, judge

T = 120.0  # change time-out
NOW = 1000.0
FORMED = {"state": "running", "world_size": 2}


def obs(phase, **kw):
    kw.setdefault("change", {"since": NOW - 1})
    return JobObs(phase=phase, **kw)


def test_every_phase_has_a_state_and_every_edge_ends_in_a_phase():
    assert set(P.STATE_OF) == {P.SUBMITTED, P.PENDING, P.PRESTARTING, P.STARTING, P.RUNNING, P.WARMING, P.JOINING,
                               P.SHRINKING, P.SUSPENDING, P.ENDING, P.CANCELLING, P.RESTARTING, *P.TERMINAL}
    for (src, _ev), dst in P.TRANSITIONS.items():
        assert src in P.STATE_OF and dst in P.STATE_OF
        assert src not in P.TERMINAL
    assert P.STATE_OF[P.PRESTARTING] == "pending" and P.STATE_OF[P.STARTING] == "running"
    assert {P.STATE_OF[p] for p in (P.WARMING, P.JOINING, P.SHRINKING)} == {"resizing"}


@pytest.mark.parametrize("src,ev,dst", [
    ("submitted", "admit", "pending"), ("pending", "start", "starting"), ("pending", "prestart", "prestarting"),
    ("starting", "master_up", "running"), ("prestarting", "master_up", "prestarting"),
    ("prestarting", "taken", "starting"), ("prestarting", "gate_open", "running"),
    ("prestarting", "lapsed", "pending"), ("running", "grow_accepted", "joining"),
    ("running", "grow_early_accepted", "warming"), ("warming", "gate_open", "joining"),
    ("warming", "lapsed", "running"), ("joining", "joined", "running"), ("joining", "timeout", "running"),
    ("running", "shrink_accepted", "shrinking"), ("shrinking", "left", "running"),
    ("shrinking", "timeout", "running"), ("running", "suspend_accepted", "suspending"),
    ("suspending", "suspended", "pending"), ("suspending", "finished", "completed"),
    ("running", "master_exit", "ending"), ("joining", "master_exit", "ending"), ("ending", "finished", "completed"),
    ("ending", "failed", "failed"), ("pending", "cancel", "cancelling"), ("joining", "cancel", "cancelling"),
    ("cancelling", "gone", "cancelled"), ("submitted", "drop", "dropped"), ("running", "released", "running"),
])
def test_transitions(src, ev, dst):
    assert advance(src, ev) == dst


@pytest.mark.parametrize("src,ev", [("running", "start"), ("pending", "grow_accepted"), ("completed", "cancel"),
                                    ("suspending", "master_exit"), ("running", "drop"), ("cancelling", "cancel")])
def test_illegal_transitions_raise(src, ev):
    with pytest.raises(P.IllegalTransition):
        advance(src, ev)


def test_answers():
    assert answer_event("grow", "accepted") == "grow_accepted"
    assert answer_event("grow_early", "accepted") == "grow_early_accepted"
    assert answer_event("grow_early", "error") == "grow_refused"
    assert answer_event("shrink", "error") == "shrink_refused"
    assert answer_event("suspend", "error") == "suspend_refused"
    for i in ("grow", "grow_early", "shrink", "suspend"):
        assert answer_event(i, "retry") is None  # busy: ask again next tick


def test_a_cancel_wins_over_everything_and_ends_when_every_process_is_gone():
    assert judge(obs("joining", cancel_requested=True, master="exited"), NOW, T) == "cancel"
    assert judge(obs("cancelling", cancel_requested=True, live=1), NOW, T) is None
    assert judge(obs("cancelling", cancel_requested=True, live=0), NOW, T) == "gone"
    assert judge(obs("completed", cancel_requested=True), NOW, T) is None


def test_a_master_that_exits_ends_the_job_once_its_workers_are_gone():
    for phase in ("prestarting", "starting", "running", "warming", "joining", "shrinking"):
        assert judge(obs(phase, master="failed", live=1), NOW, T) == "master_exit"
        # lost with its host and no host of the job left: a restart from the checkpoint (RELOCATABLE
        # phases), or the end (a job still starting); at the restart limit the job gives up
        lost = judge(obs(phase, master="lost"), NOW, T)
        assert lost == ("restart" if phase in P.RELOCATABLE | {P.STARTING} else "master_exit")
        if phase in P.RELOCATABLE | {P.STARTING}:
            assert judge(obs(phase, master="lost", restarts=3), NOW, T) == "give_up"
    done = dict(master="exited", master_exit_code=0, progress={"state": "finished"})
    assert judge(obs("ending", live_workers=1, **done), NOW, T) is None
    assert judge(obs("ending", **done), NOW, T) == "finished"
    # the job finished while its master was thought lost: the relocated master, stopped before it ran,
    # has no exit code; the job still completed
    moved = dict(master="exited", master_exit_code=None, progress={"state": "finished"})
    assert judge(obs("ending", **moved), NOW, T) == "finished"
    assert judge(obs("ending", master="exited", master_exit_code=0, progress={"state": "running"}), NOW, T) == "failed"
    assert judge(obs("ending", master="failed", master_exit_code=1), NOW, T) == "failed"
    # the script's loop ended (every worker exited 0): the job waits for its master, being stopped, to
    # exit, and completes; judged while the master still ran, it failed ("master exit code None")
    ended = dict(script_ended=True, progress={"state": "finished"}, change={"since": NOW - 1})
    assert judge(obs("ending", master="running", **ended), NOW, T) is None
    assert judge(obs("ending", master="exited", master_exit_code=-15, **ended), NOW, T) == "finished"
    # its agent is away: past the ending bound the job ends as its script did
    late = NOW + P.Bounds().ending_s
    assert judge(obs("ending", master="running", **ended), late, T) == "finished"
    assert judge(obs("ending", master="running", progress={"state": "running"}, change={"since": NOW - 1}),
                 late, T) == "failed"
    assert judge(obs("ending", master="running", live_workers=1, **ended), late, T) == "overdue"


def test_a_master_lost_with_its_host_moves_where_the_job_still_runs():
    for phase in ("running", "warming", "joining", "shrinking"):
        assert judge(obs(phase, master="lost", relocate_to="n1"), NOW, T) == "master_lost"
        assert advance(phase, "master_lost") == phase
    # never up: nothing to continue from; a starting job starts again, a prestarting one ends its warm-up
    assert judge(obs("starting", master="lost", relocate_to="n1"), NOW, T) == "restart"
    assert judge(obs("prestarting", master="lost", relocate_to="n1"), NOW, T) == "master_exit"
    assert judge(obs("running", master="failed", relocate_to="n1"), NOW, T) == "master_exit"  # crashed: its agent


def test_every_worker_failing_with_an_error_ends_a_running_job():
    assert judge(obs("running", master="running", workers_erred=True, progress=FORMED), NOW, T) == "workers_failed"
    assert advance("running", "workers_failed") == "ending"
    finished = {"state": "finished"}
    assert judge(obs("running", master="running", workers_erred=True, progress=finished), NOW, T) is None
    assert judge(obs("joining", master="running", workers_erred=True), NOW, T) is None


def test_starting_waits_for_the_masters_url():
    assert judge(obs("starting", master="pending"), NOW, T) is None
    assert judge(obs("starting", master="running", master_url="http://m"), NOW, T) == "master_up"


def test_early_start_warms_up_then_takes_its_gpus_or_lapses():
    early = {"since": NOW - 1, "gids": [0, 1], "early": True}
    assert judge(obs("prestarting", change=early, change_gpus="donated"), NOW, T) is None
    assert judge(obs("prestarting", change=early, change_gpus="donated", master_url="u"), NOW, T) == "master_up"
    spawned = {**early, "spawned": True}
    assert judge(obs("prestarting", change=spawned, change_gpus="donated", master_url="u"), NOW, T) is None
    assert judge(obs("prestarting", change=early, change_gpus="free"), NOW, T) == "taken"
    assert judge(obs("prestarting", change=spawned, change_gpus="free"), NOW, T) == "gate_open"
    assert judge(obs("prestarting", change=early, change_gpus="blocked"), NOW, T) == "lapsed"
    late = {**early, "since": NOW - T - 1}
    assert judge(obs("prestarting", change=late, change_gpus="donated"), NOW, T) == "lapsed"


def test_early_grow_opens_the_gate_or_lapses():
    ch = {"since": NOW - 1, "gids": [3], "early": True}
    assert judge(obs("warming", change=ch, change_gpus="donated"), NOW, T) is None
    assert judge(obs("warming", change=ch, change_gpus="free"), NOW, T) == "gate_open"
    assert judge(obs("warming", change=ch, change_gpus="blocked"), NOW, T) == "lapsed"
    assert judge(obs("warming", change={**ch, "since": NOW - T - 1}, change_gpus="donated"), NOW, T) == "lapsed"


def test_joining_ends_at_the_target_size_or_times_out():
    ch = {"since": NOW - 1, "target": 4}
    assert judge(obs("joining", change=ch, progress={"state": "changing", "world_size": 2}), NOW, T) is None
    assert judge(obs("joining", change=ch, progress={"state": "running", "world_size": 4}), NOW, T) == "joined"
    assert judge(obs("joining", change=ch, progress={"state": "finished", "world_size": 2}), NOW, T) == "joined"
    stuck = {**ch, "since": NOW - T - 1}
    assert judge(obs("joining", change=stuck, progress={"state": "running", "world_size": 2}), NOW, T) == "timeout"


def test_shrinking_waits_for_the_leavers_then_stops_them_then_gives_up():
    ch = {"since": NOW - 1, "leavers": [7]}
    assert judge(obs("shrinking", change=ch, leavers_live=1), NOW, T) is None
    assert judge(obs("shrinking", change=ch, leavers_live=0), NOW, T) == "left"
    assert judge(obs("shrinking", change={**ch, "since": NOW - T - 1}, leavers_live=1), NOW, T) == "overdue"
    assert judge(obs("shrinking", change={**ch, "since": NOW - 2 * T - 1}, leavers_live=1), NOW, T) == "timeout"


def test_suspending_ends_when_every_process_is_gone():
    assert judge(obs("suspending", live=2, master="exited"), NOW, T) is None  # not a master exit
    assert judge(obs("suspending", live=0, master="exited", progress={"state": "suspended"}), NOW, T) == "suspended"
    assert judge(obs("suspending", live=0, master="exited", master_exit_code=0, progress={"state": "finished"}),
                 NOW, T) == "finished"
    assert judge(obs("suspending", change={"since": NOW - T - 1}, live=1), NOW, T) == "overdue"


def test_steady_phases_have_no_observed_event():
    for phase in ("submitted", "pending", "running"):
        assert judge(obs(phase, master="running"), NOW, T) is None


def test_intents_of_a_pending_job():
    assert intent(obs("pending"), "start", "free") == "start"
    assert intent(obs("submitted"), "start", "free") == "start"  # admitted in the same round
    assert intent(obs("pending"), "start", "donated") == "prestart"
    assert intent(obs("pending"), "start", "blocked") is None
    assert intent(obs("pending", live=1), "start", "free") is None  # its old processes are still leaving
    assert intent(obs("pending"), None, "") is None


def test_intents_of_a_running_job_need_a_formed_master_and_no_change_in_flight():
    up = dict(master="running", master_url="http://m", progress=FORMED)
    assert intent(obs("running", **up), "grow", "free") == "grow"
    assert intent(obs("running", **up), "grow", "donated") == "grow_early"
    assert intent(obs("running", **up), "grow", "blocked") is None
    assert intent(obs("running", **up), "shrink", "") == "shrink"
    assert intent(obs("running", **up), "move", "") == "shrink"  # shrink first, grow in a later round
    assert intent(obs("running", **up), "stop", "") == "suspend"
    assert intent(obs("running", unsuspendable=True, **up), "stop", "") is None
    assert intent(obs("running", master="running", master_url="http://m", progress={"state": "forming"}),
                  "grow", "free") is None
    assert intent(obs("running", master="running"), "grow", "free") is None  # no URL yet
    for phase in ("starting", "joining", "shrinking", "warming", "suspending", "ending"):
        assert intent(obs(phase, **up), "shrink", "") is None


@pytest.mark.parametrize("phase", [P.STARTING, P.RUNNING, P.JOINING, P.SHRINKING, P.WARMING])
def test_a_job_giving_up_on_memory_ends(phase):
    o = obs(phase, master="running", master_url="http://m", progress=FORMED, oom_failed="out of memory 3 times")
    assert judge(o, NOW, T) == "out_of_memory" and advance(phase, "out_of_memory") == P.ENDING
    assert judge(obs(phase, master="running", master_url="http://m", progress=FORMED), NOW, T) != "out_of_memory"
    # a master already gone ends the job by its own edge
    assert judge(obs(phase, master="failed", oom_failed="x"), NOW, T) == "master_exit"
