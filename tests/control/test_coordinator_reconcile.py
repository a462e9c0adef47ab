"""The coordinator's rounds against a real store, without processes: a
scripted policy says what it wants, the test plays the agents (process
states) and the job masters (their answers and status reports). Checked: one
step per round, the process rows the spawner writes, early initialisation,
suspend/resume with fresh worker ids, time-outs judged from the store, cancel,
the plan's wake_at and batch, and that no GPU is ever held twice."""

from __future__ import annotations

from dataclasses import asdict

import pytest
from sqlalchemy import select

from tidal import settings
from tidal.control import intents
from tidal.control.coordinator import Coordinator
from tidal.control.db import GPU, Event, Job, Node, Process, Store
from tidal.control.snapshot import build_snapshot
from tidal.control.spec import JobSubmission
from tidal.runtime.messages import ScaleAnswer
from tidal.scheduler.api import Plan, Policy


class Scripted(Policy):
    """Places each job where the test says (policy GPU index = store gid here)."""

    name = "scripted"

    def __init__(self) -> None:
        self.place: dict[str, tuple[int, ...]] = {}
        self.wake_at: float | None = None
        self.batch: dict[str, int] = {}
        self.seen: list = []

    def allocation(self, snap, plan: Plan) -> None:
        self.seen.append(snap)
        plan.allocation = {j: len(g) for j, g in self.place.items() if g}

    def placement(self, snap, plan: Plan) -> None:
        plan.placement = {j: g for j, g in self.place.items() if g}
        plan.wake_at, plan.batch = self.wake_at, dict(self.batch)


class Masters:
    """The job masters' answers: a queue of statuses per request kind."""

    def __init__(self) -> None:
        self.answers: dict[str, list[str]] = {}
        self.asked: list[tuple[str, tuple[str, ...]]] = []

    def __call__(self, p: intents.Prepared) -> ScaleAnswer | None:
        self.asked.append((p.intent, p.workers))
        queue = self.answers.get(p.intent.split("_")[0], [])
        status = queue.pop(0) if queue else "accepted"
        if status == "down":
            return None
        return ScaleAnswer(status, "refused: no checkpoint directory" if status == "error" else status)


@pytest.fixture
def env(tmp_path, monkeypatch):
    store = Store(f"sqlite:///{tmp_path / 't.db'}")
    with store.session() as s:
        for n, node in enumerate(("n0", "n1")):
            s.add(Node(name=node, ordinal=n + 1, num_gpus=2, virtual=True, last_heartbeat=0.0))
            s.flush()
            for i in range(2):
                s.add(GPU(gid=2 * n + i, node=node, index=i))
    policy, masters = Scripted(), Masters()
    monkeypatch.setattr(intents, "ask", masters)
    coord = Coordinator(store, policy, server_url="http://server", tick_s=1.0,
                        home=tmp_path / "home", change_timeout_s=60.0)
    return store, policy, masters, coord


def submit(store, name, gpus="1-4", env=None, resources=None):
    sub = JobSubmission(name=name, script="train.py", gpus=gpus, iterations=100, env=env or {}, resources=resources)
    with store.session() as s:
        s.add(Job(id=name, user="alice", name=name, state="submitted", submit_time=1.0, waiting_since=1.0,
                  spec={"submission": sub.model_dump(), "jobspec": asdict(sub.to_jobspec(name, 1.0, "alice"))}))
    return name


def job(store, jid) -> Job:
    with store.session() as s:
        return s.get(Job, jid)


def procs(store, jid, kind="worker"):
    with store.session() as s:
        return list(s.scalars(select(Process).where(Process.job_id == jid, Process.kind == kind)
                              .order_by(Process.id)))


def gpus(store, jid):
    with store.session() as s:
        return store.job_gpus(s, jid)


def report(store, jid, *, url=None, state=None, world_size=None, changing=False):
    """The job's master reports its URL and status (what jobproc posts)."""
    with store.session() as s:
        j = s.get(Job, jid)
        if url is not None:
            j.master_url = url
        if state is not None:
            j.progress = {**(j.progress or {}), "state": state, "world_size": world_size, "changing": changing}


def agent(store, jid, state, *, kind=None, names=None, exit_code=None):
    """The agents report processes of ``jid`` in ``state``."""
    with store.session() as s:
        for p in s.scalars(select(Process).where(Process.job_id == jid)):
            if (kind is None or p.kind == kind) and (names is None or p.name in names) \
                    and p.state in ("pending", "running"):
                p.state, p.exit_code = state, exit_code


def kinds(store, jid):
    with store.session() as s:
        return [e.kind for e in s.scalars(select(Event).where(Event.job_id == jid).order_by(Event.id))]


def check_gpus_never_held_twice(store):
    holder: dict[int, str] = {}
    with store.session() as s:
        for e in s.scalars(select(Event).order_by(Event.id)):
            if e.kind == "gpu.assign":
                assert e.gpu not in holder, f"GPU {e.gpu} given to {e.job_id} while held by {holder[e.gpu]}"
                holder[e.gpu] = e.job_id
            elif e.kind == "gpu.release":
                assert holder.pop(e.gpu) == e.job_id


def run(store, policy, coord, jid, place, url="http://m-a"):
    """Start ``jid`` on ``place`` and bring it to running with its workers up."""
    policy.place[jid] = place
    coord.round()
    report(store, jid, url=url)
    agent(store, jid, "running", kind="master")
    coord.round()
    agent(store, jid, "running")
    report(store, jid, state="running", world_size=len(place))


def test_start_writes_the_master_then_its_workers(env):
    store, policy, masters, coord = env
    a = submit(store, "a", env={"EXTRA": "1"})
    policy.place[a] = (0, 1)
    coord.round()  # admitted and started in one round
    j = job(store, a)
    assert (j.state, j.phase, j.admitted, gpus(store, a)) == ("running", "starting", True, [0, 1])
    (m,) = procs(store, a, "master")
    assert m.node == "n0" and m.argv[-4:] == ["--size", "2", "--first-worker", "0"]
    # the job's own variables; no credential is stored with the row (the agent gets the job's from the server)
    assert m.env == {"EXTRA": "1"}
    assert procs(store, a) == []  # the workers need the master's URL
    coord.round()
    assert job(store, a).phase == "starting"
    report(store, a, url="http://m-a")
    coord.round()
    ws = procs(store, a)
    assert [(w.name, w.gpu, w.node, w.gated) for w in ws] == [("w0", 0, "n0", False), ("w1", 1, "n0", False)]
    assert ws[0].env[settings.MASTER_URL.name] == "http://m-a" and ws[1].env[settings.WORKER_ID.name] == "w1"
    assert ws[0].env[settings.CHECKPOINT_DIR.name].endswith("checkpoints/a") and ws[0].argv[-1] == "train.py"
    assert job(store, a).phase == "running" and len(coord.decision_latencies) == 1
    assert coord.decision_latencies.maxlen is not None
    assert masters.asked == []


def test_grow_asks_the_master_then_writes_the_newcomers(env):
    store, policy, masters, coord = env
    a = run(store, policy, coord, submit(store, "a"), (0, 1)) or "a"
    policy.place[a] = (0, 1, 2)
    masters.answers["grow"] = ["retry"]
    coord.round()  # busy: nothing taken, asked again next round
    assert job(store, a).phase == "running" and gpus(store, a) == [0, 1] and len(procs(store, a)) == 2
    coord.round()
    assert masters.asked == [("grow", ("w2",)), ("grow", ("w2",))]
    j = job(store, a)
    assert (j.state, j.phase, j.target, gpus(store, a)) == ("resizing", "joining", 3, [0, 1, 2])
    assert [(w.name, w.gpu, w.gated) for w in procs(store, a)][-1] == ("w2", 2, False)
    coord.round()
    assert job(store, a).phase == "joining"  # the master is not there yet
    report(store, a, state="running", world_size=3)
    coord.round()
    assert job(store, a).phase == "running" and job(store, a).rescales == 1
    assert "job.scale_out" in kinds(store, a) and "job.scale_out_failed" not in kinds(store, a)


def test_a_refused_grow_takes_nothing(env):
    store, policy, masters, coord = env
    a = run(store, policy, coord, submit(store, "a"), (0, 1)) or "a"
    policy.place[a] = (0, 1, 2)
    masters.answers["grow"] = ["error"]
    coord.round()
    assert job(store, a).phase == "running" and gpus(store, a) == [0, 1]
    assert "job.scale_out_failed" in kinds(store, a)


def test_shrink_with_early_initialisation_of_the_taker(env):
    store, policy, masters, coord = env
    a = run(store, policy, coord, submit(store, "a"), (0, 1, 2, 3)) or "a"
    b = submit(store, "b")
    policy.place.update({a: (0, 1), b: (2, 3)})
    coord.round()
    assert masters.asked[-1] == ("shrink", ("w2", "w3"))
    assert job(store, a).phase == "shrinking" and gpus(store, a) == [0, 1, 2, 3]
    jb = job(store, b)  # the taker reserved the donor's GPUs and launched its master
    assert (jb.state, jb.phase, gpus(store, b)) == ("pending", "prestarting", [])
    with store.session() as s:
        assert {g.gid for g in s.scalars(select(GPU).where(GPU.reserved_for == b))} == {2, 3}
    report(store, b, url="http://m-b")
    coord.round()
    assert [(w.name, w.gpu, w.gated) for w in procs(store, b)] == [("w0", 2, True), ("w1", 3, True)]
    agent(store, a, "exited", names={"w2", "w3"}, exit_code=0)
    coord.round()  # the donor releases, then the taker takes the GPUs in the same round: the gate opens
    assert job(store, a).phase == "running" and gpus(store, a) == [0, 1] and job(store, a).target == 2
    jb = job(store, b)
    assert (jb.state, jb.phase, gpus(store, b)) == ("running", "running", [2, 3])
    assert [w.gated for w in procs(store, b)] == [False, False]
    assert kinds(store, b).count("job.start") == 1
    check_gpus_never_held_twice(store)


def test_an_early_start_lapses_when_the_donor_keeps_its_gpus(env):
    store, policy, masters, coord = env
    a = run(store, policy, coord, submit(store, "a"), (0, 1, 2, 3)) or "a"
    b = submit(store, "b")
    policy.place.update({a: (0, 1), b: (2, 3)})
    coord.round()
    assert job(store, b).phase == "prestarting"
    def began(ago):
        with store.session() as s:  # the change in flight began ``ago`` seconds before
            s.get(Job, a).change = {**s.get(Job, a).change, "since": __import__("time").time() - ago}

    began(61)
    coord.round()  # overdue: its leavers are stopped
    assert {w.desired for w in procs(store, a) if w.name in ("w2", "w3")} == {"stop"}
    assert job(store, a).phase == "shrinking" and job(store, b).phase == "prestarting"
    policy.place = {a: (0, 1, 2, 3)}  # the policy changes its mind meanwhile
    began(121)
    coord.round()  # the donor gives up (its node does not answer): back to running with 4 GPUs
    assert job(store, a).phase == "running" and gpus(store, a) == [0, 1, 2, 3]
    coord.round()  # the taker's reservation is blocked now: it lapses
    jb = job(store, b)
    assert (jb.phase, jb.state) == ("pending", "pending")
    assert {p.desired for p in procs(store, b, "master")} == {"stop"}
    assert "job.early_init_lapsed" in kinds(store, b)
    with store.session() as s:
        assert s.scalars(select(GPU).where(GPU.reserved_for.is_not(None))).all() == []


def test_suspend_and_resume_with_new_worker_ids(env):
    store, policy, masters, coord = env
    a = run(store, policy, coord, submit(store, "a"), (0, 1)) or "a"
    policy.place = {}
    coord.round()
    assert masters.asked[-1] == ("suspend", ()) and job(store, a).state == "suspending"
    coord.round()
    assert job(store, a).state == "suspending"
    with store.session() as s:  # the master's last status: suspended, its checkpoint of step 5 written
        s.get(Job, a).progress = {"state": "suspended", "step": 5, "suspended_step": 5}
    agent(store, a, "exited", exit_code=0)
    coord.round()
    j = job(store, a)
    assert (j.state, j.phase, j.master_url, gpus(store, a)) == ("pending", "pending", "", [])
    assert j.tags["_suspended"] == 1 and j.progress["state"] == "suspended"
    assert j.tags["_resume_step"] == 5
    policy.place = {a: (2, 3)}
    coord.round()
    assert procs(store, a, "master")[-1].argv[-4:] == ["--size", "2", "--first-worker", "2"]
    report(store, a, url="http://m-a2")
    coord.round()
    assert [w.name for w in procs(store, a)] == ["w0", "w1", "w2", "w3"]
    # the resumed workers check that they load the checkpoint of the step the job was suspended at
    assert all(w.env[settings.RESUME_STEP.name] == "5" for w in procs(store, a)[2:])
    assert settings.RESUME_STEP.name not in procs(store, a)[0].env
    ks = kinds(store, a)
    assert ks.index("job.suspend") < ks.index("job.suspended") < ks.index("job.resume")
    check_gpus_never_held_twice(store)


def test_a_master_that_refuses_to_suspend_is_not_asked_again(env):
    store, policy, masters, coord = env
    a = run(store, policy, coord, submit(store, "a"), (0, 1)) or "a"
    policy.place = {}
    masters.answers["suspend"] = ["down", "error"]
    coord.round()  # unreachable: asked again next round
    assert job(store, a).phase == "running" and "job.suspend_failed" not in kinds(store, a)
    coord.round()
    assert job(store, a).tags["_unsuspendable"] and "job.suspend_failed" in kinds(store, a)
    coord.round()
    assert len(masters.asked) == 2 and job(store, a).phase == "running" and gpus(store, a) == [0, 1]


def test_dead_worker_returns_its_gpu_and_a_failed_master_fails_the_job(env):
    store, policy, masters, coord = env
    a = run(store, policy, coord, submit(store, "a"), (0, 1)) or "a"
    agent(store, a, "failed", names={"w1"}, exit_code=-9)
    coord.round()
    assert gpus(store, a) == [0] and kinds(store, a).count("job.worker_lost") == 1
    coord.round()
    assert kinds(store, a).count("job.worker_lost") == 1
    agent(store, a, "failed", kind="master", exit_code=1)
    coord.round()
    assert job(store, a).phase == "ending" and {w.desired for w in procs(store, a) if w.state == "running"} == {"stop"}
    agent(store, a, "failed", exit_code=-15)
    coord.round()
    j = job(store, a)
    assert (j.state, j.exit_info, gpus(store, a)) == ("failed", "master exit code 1", [])


def test_a_finished_job_completes_after_its_last_worker(env):
    store, policy, masters, coord = env
    a = run(store, policy, coord, submit(store, "a"), (0, 1)) or "a"
    report(store, a, state="finished", world_size=2)
    agent(store, a, "exited", kind="master", exit_code=0)
    agent(store, a, "exited", names={"w0"}, exit_code=0)
    coord.round()
    coord.round()
    assert job(store, a).phase == "ending" and {w.desired for w in procs(store, a)} == {"run"}
    agent(store, a, "exited", exit_code=0)
    coord.round()
    assert job(store, a).state == "completed" and gpus(store, a) == []


def test_cancel_stops_everything_then_frees_the_gpus(env):
    store, policy, masters, coord = env
    a = run(store, policy, coord, submit(store, "a"), (0, 1)) or "a"
    with store.session() as s:
        s.get(Job, a).state = "cancelling"  # what the API does
    coord.round()
    assert job(store, a).phase == "cancelling"
    assert {p.desired for p in procs(store, a) + procs(store, a, "master")} == {"stop"}
    agent(store, a, "exited", exit_code=0)
    coord.round()
    assert job(store, a).state == "cancelled" and gpus(store, a) == []


def test_a_change_in_flight_survives_a_restart(env, tmp_path):
    store, policy, masters, coord = env
    a = run(store, policy, coord, submit(store, "a"), (0, 1, 2)) or "a"
    policy.place[a] = (0, 1)
    coord.round()
    assert job(store, a).phase == "shrinking"
    with store.session() as s:
        s.get(Job, a).state = "running"  # an older server's restart reset
    again = Coordinator(store, policy, tick_s=1.0, home=tmp_path / "home")
    again.round()
    assert job(store, a).state == "resizing" and job(store, a).phase == "shrinking"
    agent(store, a, "exited", names={"w2"}, exit_code=0)
    again.round()
    assert job(store, a).phase == "running" and gpus(store, a) == [0, 1]


def test_wake_at_batch_and_pins(env):
    store, policy, masters, coord = env
    a = submit(store, "a")
    policy.place[a] = (0,)
    policy.batch = {a: 64}
    t0 = __import__("time").time()
    policy.wake_at = t0 + 0.3
    coord.round()
    assert job(store, a).batch == 64
    assert coord.wake_at == t0 + 0.3 and 0 < coord.next_wait(t0) <= 0.3
    policy.wake_at = None
    coord.round()
    assert coord.next_wait(t0) == coord.busy_tick_s  # a change is in flight (the master starts)
    with store.session() as s:
        snap, _, _ = build_snapshot(s, t0, coord.overheads)
    assert [v.batch for v in snap.jobs] == [64]
    with store.session() as s:
        s.get(Job, a).spec = {**s.get(Job, a).spec, "pinned": 3}
    coord.round()
    assert policy.seen[-1].jobs[0].spec.allowed_gpus == (3,)


def test_without_a_node_up_jobs_wait(env):
    store, policy, masters, coord = env
    a = submit(store, "a", gpus="2-4")
    with store.session() as s:
        for n in s.scalars(select(Node)):
            n.state = "down"
    policy.place[a] = (0, 1)
    assert coord.round() is None
    assert job(store, a).state == "submitted"


def test_the_agent_spawner_writes_rows_only_on_the_jobs_gpus(env):
    from tidal.control.spawner import AgentSpawner
    from tidal.runtime.spawner import WorkerLaunch, failed_workers, make_spawner

    store, policy, masters, coord = env
    a = submit(store, "a")
    with store.session() as s:
        store.assign_gpus(s, a, [0])
        store.reserve_gpus(s, a, [3])
        j = s.get(Job, a)
        sp = make_spawner("agents", s=s, job=j)
        assert isinstance(sp, AgentSpawner)
        with pytest.raises(ValueError, match="neither assigned nor reserved"):
            sp.spawn([WorkerLaunch("w0", host="n0", device=0), WorkerLaunch("w1", host="n0", device=1)])
        assert sp.exit_codes() == {}  # all or none
        sp.spawn([WorkerLaunch("w0", host="n0", device=0), WorkerLaunch("w1", host="n1", device=1)])
        s.flush()
        assert [(p.name, p.gpu, p.gated) for p in sp._rows()] == [("w0", 0, False), ("w1", 3, True)]
        for p in sp._rows():
            p.state, p.exit_code = ("failed", -9) if p.name == "w1" else ("running", None)
        assert sp.exit_codes() == {"w0": None, "w1": -9} and failed_workers(sp) == {"w1"}
        sp.kill("w0")
        assert [p.desired for p in sp._rows()] == ["stop", "run"]


def _host_dies(store, node: str) -> None:
    """What the server does when a node stops heart-beating: the node is
    down, its live processes lost and to be stopped."""
    with store.session() as s:
        s.get(Node, node).state = "down"
        for p in s.scalars(select(Process).where(Process.node == node, Process.state.in_(("pending", "running")))):
            p.state, p.desired = "lost", "stop"


def test_a_master_lost_with_its_host_restarts_on_the_jobs_other_host(env):
    store, policy, masters, coord = env
    a = submit(store, "a")
    run(store, policy, coord, a, (0, 1, 2, 3))
    assert procs(store, a, "master")[0].node == "n0"
    _host_dies(store, "n0")
    policy.place[a] = (2, 3)  # the policy sees only n1's GPUs now
    coord.round()
    m = procs(store, a, "master")
    assert [(p.node, p.state, p.relocated) for p in m] == [("n0", "lost", False), ("n1", "pending", True)]
    argv = m[1].argv
    assert "--resume" in argv and argv[argv.index("--lost") + 1] == "w0,w1"  # the workers that died with n0
    assert job(store, a).state == "running" and job(store, a).master_url == ""  # no change until it reports
    assert "job.master_relocated" in kinds(store, a)
    coord.round()
    assert masters.asked == [] and len(procs(store, a, "master")) == 2  # relocated once, nothing asked meanwhile
    # the relocated master reports from n1; the surviving workers are still this incarnation's
    report(store, a, url="http://n1-master", state="running", world_size=2)
    agent(store, a, "running", kind="master")
    agent(store, a, "exited", kind="worker", names={"w2", "w3"}, exit_code=0)
    report(store, a, state="finished", world_size=2)
    agent(store, a, "exited", kind="master", exit_code=0)
    for _ in range(3):
        coord.round()
    assert job(store, a).state == "completed", job(store, a).exit_info
    assert gpus(store, a) == []
    check_gpus_never_held_twice(store)


def test_a_master_lost_with_the_jobs_only_host_restarts_the_job(env):
    store, policy, masters, coord = env
    a = submit(store, "a")
    run(store, policy, coord, a, (0, 1))
    _host_dies(store, "n0")
    policy.place[a] = ()
    for _ in range(3):
        coord.round()
    # no host of the job is left: it starts again from its checkpoint (a new incarnation), not failed
    j = job(store, a)
    assert j.state == "pending" and j.tags["_restarts"] == 1 and "no other host" in j.tags["_reason"]
    assert len(procs(store, a, "master")) == 1
    with store.session() as s:  # the GPUs of its lost processes stay with it until their node reports them
        assert {p.state for p in s.scalars(select(Process).where(Process.job_id == a))} <= {"lost", "exited"}


def test_a_master_moves_at_most_three_times(env):
    store, policy, masters, coord = env
    a = submit(store, "a")
    run(store, policy, coord, a, (0, 1, 2, 3))
    for n in range(4):
        with store.session() as s:  # the current master's host "dies"; its workers there are spared
            m = s.scalars(select(Process).where(Process.job_id == a, Process.kind == "master")
                          .order_by(Process.id.desc())).first()
            m.state, m.desired = "lost", "stop"
        coord.round()
    m = procs(store, a, "master")
    assert sum(p.relocated for p in m) == 3
    coord.round()
    # no fourth move: the job restarts from its checkpoint, every process stops
    assert job(store, a).phase in ("restarting", "pending")
    assert all(p.desired == "stop" for p in procs(store, a))


def test_every_worker_failing_with_an_error_fails_the_job_with_its_last_log_line(env, tmp_path):
    store, policy, masters, coord = env
    a = run(store, policy, coord, submit(store, "a"), (0, 1)) or "a"
    logs = tmp_path / "home" / "logs" / a
    logs.mkdir(parents=True)
    (logs / "w1.log").write_text("Traceback (most recent call last):\nFileNotFoundError: data.csv\n\n")
    agent(store, a, "failed", names={"w0"}, exit_code=-9)  # killed: a scale-in, the job goes on
    policy.place[a] = (1,)
    coord.round()
    assert job(store, a).phase == "running"
    agent(store, a, "failed", names={"w1"}, exit_code=1)
    coord.round()
    j = job(store, a)
    assert j.phase in ("ending", "failed") and all(p.desired == "stop" for p in procs(store, a, "master"))
    agent(store, a, "exited", kind="master", exit_code=0)
    coord.round()
    j = job(store, a)
    assert j.state == "failed" and j.exit_info == "every worker failed; w1: FileNotFoundError: data.csv", j.exit_info
    assert gpus(store, a) == []


def test_a_master_that_exits_with_an_error_fails_the_job_with_its_last_log_line(env, tmp_path):
    store, policy, masters, coord = env
    a = run(store, policy, coord, submit(store, "a"), (0, 1)) or "a"
    master = next(p.name for p in procs(store, a, "master"))
    logs = tmp_path / "home" / "logs" / a
    logs.mkdir(parents=True)
    (logs / f"{master}.log").write_text("Traceback (most recent call last):\n  File \"jobproc.py\"\n"
                                        "ValueError: $TIDAL_JOB_TOKEN_FILE='/x/token': Permission denied\n")
    agent(store, a, "failed", kind="master", exit_code=1)
    coord.round()
    agent(store, a, "failed", exit_code=-15)
    coord.round()
    j = job(store, a)
    assert (j.state, j.exit_info, gpus(store, a)) == (
        "failed", f"master exit code 1; {master}: ValueError: $TIDAL_JOB_TOKEN_FILE='/x/token': Permission denied",
        []), j.exit_info


def test_attained_service_counts_gpu_seconds_of_running_jobs(env):
    """Attained service (Tiresias' 2D-LAS input) = GPUs held x seconds
    running; a waiting job attains nothing."""
    store, policy, masters, coord = env
    a = run(store, policy, coord, submit(store, "a"), (0, 1)) or "a"
    b = submit(store, "b")  # nowhere to run: no placement
    before = job(store, a).attained, job(store, a).executed
    start = coord._last_account = coord._last_account - 10.0  # ten seconds pass between rounds
    coord.round()
    dt = coord._last_account - start  # by the round's own clock: the ten seconds and the test's own time
    ja = job(store, a)
    assert 10.0 <= dt < 60.0
    assert ja.attained - before[0] == pytest.approx(2 * dt) and ja.executed - before[1] == pytest.approx(dt)
    assert job(store, b).attained == 0.0


MiB = 2**20


def out_of_memory(store, jid, name):
    """Worker ``name``'s agent reports it killed for running out of its limit (what the heartbeat API records)."""
    with store.session() as s:
        p = s.scalar(select(Process).where(Process.job_id == jid, Process.name == name))
        limit = int(p.resources["memory"])
        p.state, p.exit_code = "failed", -9
        p.resources = {**p.resources, "oom": {"limit": limit, "peak": limit, "backend": "cgroup1"}}


def memory_of(store, jid):
    return {w.name: (w.resources or {}).get("memory") for w in procs(store, jid)}


def regrow(store, policy, coord, jid, place):
    """The policy gives the freed GPU back: the job grows onto it (new worker id)."""
    policy.place[jid] = place
    coord.round()
    coord.round()
    agent(store, jid, "running")
    report(store, jid, state="running", world_size=len(place))
    coord.round()
    assert job(store, jid).phase == "running"


def test_a_worker_out_of_memory_comes_back_with_more_until_the_job_gives_up(env):
    """OOM at 256 MiB: the freed GPU's next worker gets 384 MiB, then 576;
    kills of several workers at one limit count once; the third OOM fails
    the job with the reason."""
    store, policy, masters, coord = env
    with store.session() as s:
        for n in s.scalars(select(Node)):
            n.memory = 4096 * MiB
    a = submit(store, "a", resources={"memory": "256Mi", "cpus": 1})
    run(store, policy, coord, a, (0, 1))
    assert memory_of(store, a) == {"w0": 256 * MiB, "w1": 256 * MiB}
    assert procs(store, a)[0].resources["cpus"] == 1.0
    out_of_memory(store, a, "w1")
    coord.round()
    assert gpus(store, a) == [0] and job(store, a).phase == "running"
    with store.session() as s:
        ev = {e.kind: e.detail for e in s.scalars(select(Event).where(Event.job_id == a))}
    assert ev["job.memory_raised"]["memory_from"] == 256 * MiB and ev["job.memory_raised"]["memory_to"] == 384 * MiB
    assert "w1 ran out of 256 MiB" in ev["job.memory_raised"]["reason"] and ev["job.worker_lost"]["reason"]
    regrow(store, policy, coord, a, (0, 1))
    assert memory_of(store, a)["w2"] == 384 * MiB
    out_of_memory(store, a, "w0")  # at the old limit, raised already: no second raise
    coord.round()
    assert kinds(store, a).count("job.memory_raised") == 1 and job(store, a).tags["_ooms"] == 1
    regrow(store, policy, coord, a, (0, 1))
    assert memory_of(store, a)["w3"] == 384 * MiB
    out_of_memory(store, a, "w2")
    coord.round()
    assert kinds(store, a).count("job.memory_raised") == 2
    assert job(store, a).tags["_memory"] == 576 * MiB and job(store, a).tags["_ooms"] == 2
    regrow(store, policy, coord, a, (0, 1))
    out_of_memory(store, a, "w3")  # 384 MiB < 576: counted with w2's kill
    coord.round()
    regrow(store, policy, coord, a, (0, 1))
    assert memory_of(store, a)["w4"] == memory_of(store, a)["w5"] == 576 * MiB
    assert job(store, a).tags["_ooms"] == 2 and kinds(store, a).count("job.memory_raised") == 2
    out_of_memory(store, a, "w4")
    coord.round()
    j = job(store, a)
    assert j.phase == "ending" and "out of memory 3 times" in j.exit_info and "w4 at 576 MiB" in j.exit_info
    assert {p.desired for p in procs(store, a) + procs(store, a, "master") if p.state == "running"} == {"stop"}
    agent(store, a, "failed", exit_code=-15)
    coord.round()
    j = job(store, a)
    assert (j.state, gpus(store, a)) == ("failed", []) and "out of memory 3 times" in j.exit_info
    check_gpus_never_held_twice(store)


def test_a_raise_beyond_the_largest_node_fails_the_job_at_once(env):
    store, policy, masters, coord = env
    with store.session() as s:
        for n in s.scalars(select(Node)):
            n.memory = 300 * MiB
    a = submit(store, "a", resources={"memory": "256Mi"})
    run(store, policy, coord, a, (0, 1))
    out_of_memory(store, a, "w0")
    coord.round()
    j = job(store, a)
    assert j.phase == "ending" and "384 MiB would exceed the largest node's 300 MiB" in j.exit_info
    assert "job.memory_raised" not in kinds(store, a) and "job.oom_failed" in kinds(store, a)
