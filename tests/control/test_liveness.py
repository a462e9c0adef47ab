"""The liveness contract (docs/control.md, "Liveness"), one rule a test, on
the real coordinator and store with scripted agents and masters: every job
that holds GPUs makes progress or reaches a state that frees them, with the
reason, within a bound."""

from __future__ import annotations

import time

from sqlalchemy import select
from test_coordinator_reconcile import (  # noqa: F401 - env is a fixture
    agent, check_gpus_never_held_twice, env, gpus, job, kinds, procs, report, run, submit,
)

from tidal.control.db import Job, Process
from tidal.control.phases import NEVER_INIT


def formed(store, jid, step=10, members=("w0", "w1"), step_at=None):
    """The master reports a generation training at ``step``."""
    with store.session() as s:
        j = s.get(Job, jid)
        j.progress = {**(j.progress or {}), "state": "running", "gen": 1, "world_size": len(members),
                      "members": list(members), "step": step, "changing": False,
                      "step_at": time.time() if step_at is None else step_at}


def tag(store, jid, **tags):
    with store.session() as s:
        j = s.get(Job, jid)
        j.tags = {**(j.tags or {}), **tags}


def write_log(coord, jid, name, text):
    d = coord.cx.home / "logs" / jid
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{name}.log").write_text(text)


def test_the_same_error_is_replaced_after_a_back_off_then_fails_the_job(env):
    store, policy, masters, coord = env
    a = run(store, policy, coord, submit(store, "a"), (0, 1)) or "a"
    formed(store, a)
    worker = "w1"
    for n in (1, 2, 3):
        write_log(coord, a, worker, f"Traceback (most recent call last):\nValueError: bad batch at step {4 + n}\n")
        agent(store, a, "failed", names={worker}, exit_code=1)
        coord.round()
        j = job(store, a)
        if n < 3:
            assert j.state == "running" and j.tags["_crash"]["count"] == n
            assert 1 not in gpus(store, a)  # its GPU went back at once
            masters.asked.clear()
            coord.round()  # the plan still wants 2 GPUs: no grow during the back-off
            assert not any(i == "grow" for i, _ in masters.asked)
            assert j.tags["_backoff_until"] - time.time() > 0
            tag(store, a, _backoff_until=0.0)  # the back-off ends
            coord.round()
            assert job(store, a).phase == "joining"
            worker = procs(store, a)[-1].name
            report(store, a, state="running", world_size=2)
            coord.round()
    j = job(store, a)
    assert j.phase in ("ending", "failed")
    coord.round()
    agent(store, a, "exited", kind="master", exit_code=-15)
    agent(store, a, "exited", exit_code=-15)
    coord.round()
    j = job(store, a)
    assert j.state == "failed" and "the same error 3 times" in j.exit_info and "ValueError: bad batch" in j.exit_info
    assert gpus(store, a) == []
    check_gpus_never_held_twice(store)


def test_a_different_error_starts_the_count_again(env):
    store, policy, masters, coord = env
    a = run(store, policy, coord, submit(store, "a"), (0, 1)) or "a"
    formed(store, a)
    write_log(coord, a, "w1", "KeyError: 'x'\n")
    agent(store, a, "failed", names={"w1"}, exit_code=1)
    coord.round()
    assert job(store, a).tags["_crash"]["count"] == 1
    tag(store, a, _backoff_until=0.0)
    coord.round()
    report(store, a, state="running", world_size=2)
    coord.round()
    w = procs(store, a)[-1].name
    write_log(coord, a, w, "OSError: disk full\n")
    agent(store, a, "failed", names={w}, exit_code=1)
    coord.round()
    assert job(store, a).tags["_crash"]["count"] == 1 and job(store, a).state == "running"


def test_workers_that_exit_0_without_init_fail_the_job_at_once(env):
    store, policy, masters, coord = env
    a = run(store, policy, coord, submit(store, "a"), (0, 1)) or "a"
    report(store, a, state="forming", world_size=0)
    agent(store, a, "exited", kind="worker", exit_code=0)
    coord.round()
    assert job(store, a).exit_info == NEVER_INIT
    assert all(p.desired == "stop" for p in procs(store, a, "master"))
    agent(store, a, "exited", kind="master", exit_code=-15)
    coord.round()
    assert job(store, a).state == "failed" and gpus(store, a) == []


def test_a_job_that_never_forms_fails_after_the_start_time_out(env):
    store, policy, masters, coord = env
    a = run(store, policy, coord, submit(store, "a"), (0, 1)) or "a"
    report(store, a, state="forming", world_size=0)
    coord.round()
    assert job(store, a).state == "running"  # within the bound: nothing happens
    tag(store, a, _started_at=time.time() - coord.cx.bounds.start_s - 1)
    coord.round()
    j = job(store, a)
    assert "TIDAL_START_TIMEOUT_S" in j.exit_info and j.phase == "ending"
    assert all(p.desired == "stop" for p in procs(store, a))


def test_a_job_left_without_a_live_worker_restarts_from_its_checkpoint(env):
    store, policy, masters, coord = env
    a = run(store, policy, coord, submit(store, "a"), (0, 1)) or "a"
    formed(store, a)
    agent(store, a, "failed", kind="worker", exit_code=-9)  # every worker killed (OOM killer, kill -9)
    coord.round()
    j = job(store, a)
    assert j.state == "restarting" and j.tags["_restarts"] == 1 and "killed or lost" in j.tags["_reason"]
    assert all(p.desired == "stop" for p in procs(store, a, "master"))
    agent(store, a, "exited", kind="master", exit_code=-15)
    coord.round()
    j = job(store, a)
    assert j.state == "pending" and gpus(store, a) == [] and "_resume_step" not in j.tags
    run(store, policy, coord, a, (0, 1))  # the policy starts it again: new worker ids, a resume
    assert [p.name for p in procs(store, a)][-2:] == ["w2", "w3"] and "job.resume" in kinds(store, a)


def test_a_stalled_job_restarts(env):
    store, policy, masters, coord = env
    a = run(store, policy, coord, submit(store, "a"), (0, 1)) or "a"
    formed(store, a, step_at=time.time() - coord.cx.bounds.stall_s - 5)
    coord.round()
    j = job(store, a)
    assert j.state == "restarting" and "stalled" in j.tags["_reason"]


def test_a_launch_error_fails_the_job_at_once_with_it(env):
    store, policy, masters, coord = env
    a = run(store, policy, coord, submit(store, "a"), (0, 1)) or "a"
    with store.session() as s:
        p = s.scalars(select(Process).where(Process.job_id == a, Process.name == "w0")).one()
        p.state, p.error = "failed", "launch failed: [Errno 13] Permission denied: 'train.py'"
    coord.round()
    j = job(store, a)
    assert j.exit_info == "w0 could not start: launch failed: [Errno 13] Permission denied: 'train.py'"
    agent(store, a, "exited", exit_code=-15)
    coord.round()
    assert job(store, a).state == "failed" and gpus(store, a) == []


def test_a_finished_job_frees_each_gpu_as_its_worker_ends_and_stops_late_newcomers(env):
    store, policy, masters, coord = env
    a = run(store, policy, coord, submit(store, "a"), (0, 1)) or "a"
    formed(store, a)
    policy.place[a] = (0, 1, 2)
    coord.round()  # a newcomer w2 on GPU 2, racing the end
    assert job(store, a).phase == "joining"
    with store.session() as s:
        j = s.get(Job, a)
        j.progress = {**j.progress, "state": "finished"}
    agent(store, a, "exited", kind="master", exit_code=0)
    agent(store, a, "exited", names={"w0"}, exit_code=0)
    coord.round()
    assert {p.name: p.desired for p in procs(store, a)} == {"w0": "run", "w1": "run", "w2": "stop"}
    coord.round()
    assert gpus(store, a) == [1, 2]  # w0's GPU is free while w1 still writes its output
    agent(store, a, "exited", exit_code=0)
    coord.round()
    assert job(store, a).state == "completed" and gpus(store, a) == []


def test_workers_that_all_end_after_training_complete_the_job(env):
    store, policy, masters, coord = env
    a = run(store, policy, coord, submit(store, "a"), (0, 1)) or "a"
    formed(store, a, step=42)
    agent(store, a, "exited", kind="worker", exit_code=0)  # the script's own loop ended first
    coord.round()
    assert all(p.desired == "stop" for p in procs(store, a, "master"))
    agent(store, a, "exited", kind="master", exit_code=-15)
    coord.round()
    assert job(store, a).state == "completed" and job(store, a).progress["step"] == 42


def test_a_grow_whose_newcomers_all_died_ends_without_waiting(env):
    store, policy, masters, coord = env
    a = run(store, policy, coord, submit(store, "a"), (0, 1)) or "a"
    formed(store, a)
    policy.place[a] = (0, 1, 2)
    coord.round()
    assert job(store, a).phase == "joining"
    agent(store, a, "failed", names={"w2"}, exit_code=-9)
    coord.round()
    assert job(store, a).phase == "running" and "job.change_failed" in kinds(store, a)


def test_cancel_ends_within_its_bound_even_if_an_agent_never_answers(env):
    store, policy, masters, coord = env
    a = run(store, policy, coord, submit(store, "a"), (0, 1)) or "a"
    agent(store, a, "running")
    with store.session() as s:
        s.get(Job, a).state = "cancelling"
    coord.round()
    assert job(store, a).phase == "cancelling"
    agent(store, a, "exited", names={"w0"}, exit_code=-15)  # w1's and the master's agent is away
    with store.session() as s:
        j = s.get(Job, a)
        j.change = {"since": time.time() - coord.cx.bounds.cancel_s - 1}
    coord.round()
    assert job(store, a).state == "cancelled"
    assert gpus(store, a) == [1]  # w1 may still run on GPU 1: held until its agent reports it gone
    agent(store, a, "exited", exit_code=-15)
    coord.round()
    assert gpus(store, a) == []
    check_gpus_never_held_twice(store)


def test_drain_suspends_every_running_job_and_starts_none(env):
    store, policy, masters, coord = env
    a = run(store, policy, coord, submit(store, "a"), (0, 1)) or "a"
    formed(store, a)
    policy.place["b"] = (2, 3)
    submit(store, "b")
    coord.drain()
    coord.round()
    assert [i for i, _ in masters.asked] == ["suspend"]  # a only: b is not started
    assert job(store, a).state == "suspending" and job(store, "b").state in ("submitted", "pending")
    assert coord.draining_left() == ["a"]


def test_a_pinned_job_is_never_suspended_until_released(env):
    store, policy, masters, coord = env
    a = run(store, policy, coord, submit(store, "a"), (0, 1)) or "a"
    formed(store, a)
    with store.session() as s:
        j = s.get(Job, a)
        j.spec = {**j.spec, "pinned": 2}
    policy.place[a] = ()  # the policy would preempt it (EDF for an earlier deadline)
    masters.asked.clear()
    coord.round()
    assert job(store, a).state == "running" and not masters.asked and gpus(store, a) == [0, 1]
    with store.session() as s:  # tidal scale a 0: released
        j = s.get(Job, a)
        j.spec = {k: v for k, v in j.spec.items() if k != "pinned"}
    coord.round()
    assert [i for i, _ in masters.asked] == ["suspend"] and job(store, a).state == "suspending"


def test_no_survivor_to_give_a_newcomer_the_state_restarts_or_fails(env):
    store, policy, masters, coord = env
    a = run(store, policy, coord, submit(store, "a"), (0, 1)) or "a"
    formed(store, a)
    policy.place[a] = (0, 1, 2)
    coord.round()  # a newcomer w2 is starting
    report(store, a, state="running", world_size=2)
    agent(store, a, "failed", names={"w0", "w1"}, exit_code=-9)  # every member killed; w2 still pending
    for _ in range(2):
        coord.round()
    j = job(store, a)
    assert j.state == "restarting" and [p.desired for p in procs(store, a) if p.state == "pending"] == ["stop"]

    policy.place[a] = ()
    b = run(store, policy, coord, submit(store, "b"), (3,)) or "b"
    formed(store, b, members=("w0",))
    write_log(coord, b, "w0", "ZeroDivisionError: division by zero\n")
    agent(store, b, "failed", names={"w0"}, exit_code=1)  # its only member erred
    coord.round()
    assert "ZeroDivisionError" in job(store, b).exit_info


def test_a_job_that_reported_its_end_completes_although_its_host_went_silent(env):
    store, policy, masters, coord = env
    a = run(store, policy, coord, submit(store, "a"), (0, 2)) or "a"  # w0 on n0 with the master, w1 on n1
    formed(store, a, step=300)
    with store.session() as s:
        j = s.get(Job, a)
        j.progress = {**j.progress, "state": "finished"}
    agent(store, a, "exited", names={"w1"}, exit_code=0)
    with store.session() as s:  # then n0 went silent past the grace: its processes are lost
        for p in s.scalars(select(Process).where(Process.job_id == a, Process.node == "n0")):
            p.state = "lost"
    for _ in range(3):
        coord.round()
    j = job(store, a)
    assert j.state == "completed", (j.state, j.exit_info)
    assert len(procs(store, a, "master")) == 1  # not moved: the job was done
