"""Auto-configuration (docs/autoconf.md): the throughput model and its NNLS
fit, the plan's rules, the stage machine against a real store with the
master's reports faked, and end to end: a job submitted without any GPU
count on an embedded cluster samples, settles, and runs within 90% of the
best hand-picked size measured in the same run."""

from __future__ import annotations

import time
from dataclasses import asdict

import pytest

import tidal.control.demo_job as demo_job
from tidal.control import autoconf as A
from tidal.control.autoconf import AutoConf, ThroughputModel, choose, measure, memory_limit
from tidal.control.db import GPU, Event, Job, Node, Store
from tidal.control.spec import JobSubmission

# -- model, plan, measurement ---------------------------------------------------------


def test_nnls_fit_recovers_a_model_and_stays_non_negative():
    truth = ThroughputModel((0.004, 0.01, 0.02))
    pts = [(n, 64, truth.step_time(n, 64)) for n in (1, 2, 4)]
    fit = ThroughputModel.fit(pts)
    for n in range(1, 9):
        assert fit.step_time(n, 64) == pytest.approx(truth.step_time(n, 64), rel=1e-6)
    # a point that would need a negative cost gets none
    fit = ThroughputModel.fit([(1, 64, 0.2), (2, 64, 0.05), (4, 64, 0.2)])
    assert min(fit.theta) >= 0
    assert ThroughputModel.fit([]) is None


def test_choose_knee_and_deadline():
    m = ThroughputModel((0.004, 0.01, 0.02))  # 1: 0.266 s, 2: 0.158, 3: 0.135, 4: 0.134 s per 64-sample step
    plan = choose(m, 64, 8)
    rates = {int(k): v for k, v in plan["predicted"].items()}
    best = max(rates.values())
    assert plan["min"] == 1 and plan["gpus"] == plan["max"]
    assert rates[plan["gpus"]] >= 0.9 * best and rates[plan["gpus"] - 1] < 0.9 * best
    # a deadline that 1 GPU meets: 1; one that needs more: the smallest that meets it
    assert choose(m, 64, 8, remaining_steps=100, time_left=100)["gpus"] == 1
    tight = choose(m, 64, 8, remaining_steps=100, time_left=20)
    assert tight["gpus"] == tight["min"] == 2 and "deadline" in tight["reason"]
    assert choose(m, 64, 8, remaining_steps=1000, time_left=1)["reason"].startswith("deadline: no count")


def test_measure_skips_warmup_and_restarts_on_change():
    def rep(step, wall, n=2, gen=1, **kw):
        return {"state": "running", "changing": False, "last_step": [step, wall, n], "world_size": n, "gen": gen, **kw}

    win, res = measure(None, rep(10, 100.0), (2,), 1.0, 0.0)
    assert res is None and win["s0"] == 10 + A.WARMUP_STEPS and win["w0"] is None
    win, res = measure(win, rep(14, 101.0), (2,), 1.0, 0.0)
    assert win["s0"] == 14 and win["w0"] == 101.0
    win, res = measure(win, rep(30, 104.2), (2,), 1.0, 0.0)
    assert win is None and res == (2, pytest.approx(0.2), 16)
    assert measure({"n": 2, "gen": 1, "s0": 3, "w0": 1.0}, rep(30, 9.0, gen=2), (2,), 1.0, 0.0)[0]["gen"] == 2
    assert measure(None, rep(30, 9.0, changing=True), (2,), 1.0, 0.0) == (None, None)
    assert measure(None, rep(30, 9.0, n=3), (2,), 1.0, 0.0) == (None, None)
    # a report without rank 0's clock: the coordinator's own
    plain = {"state": "running", "changing": False, "step": 20, "world_size": 2, "gen": 1}
    assert measure({"n": 2, "gen": 1, "s0": 10, "w0": 50.0}, plain, (2,), 1.0, 52.0)[1] == (2, pytest.approx(0.2), 10)


def test_memory_limit_rounds_up_with_headroom():
    assert memory_limit(0) is None
    assert memory_limit(200 * 2**20) == 320 * 2**20  # 300 MiB -> next 64 MiB
    assert memory_limit(1) == 64 * 2**20  # at least one rounding step (and MIN_MEMORY)


def test_spec_auto_forms():
    base = {"name": "j", "script": "t.py", "iterations": 10}
    assert JobSubmission(**base).auto  # no GPU count at all: allowed now, and auto
    assert JobSubmission(**base, resources="auto").auto
    assert JobSubmission(**base, gpus=2, resources={"auto": True, "cpus": 1}).auto
    assert not JobSubmission(**base, gpus="1-4").auto
    assert JobSubmission(**base, resources="auto").resources.limits() == {}


# -- the stage machine against a store ---------------------------------------------------


@pytest.fixture
def store(tmp_path):
    st = Store(f"sqlite:///{tmp_path / 't.db'}")
    with st.session() as s:
        s.add(Node(name="n0", ordinal=0, num_gpus=4))
        s.flush()
        for i in range(4):
            s.add(GPU(gid=i, node="n0", index=i))
    return st


def _submit(store, jid, **extra):
    sub = JobSubmission(name=jid, script="t.py", iterations=10**6, global_batch_size=64, **extra)
    spec = sub.to_jobspec(jid, time.time(), "u")
    with store.session() as s:
        s.add(Job(id=jid, user="u", name=jid, state="running", submit_time=time.time(),
                  spec={"submission": sub.model_dump(), "jobspec": asdict(spec)}, autoconf=A.new_state()))


def _drive(store, jid, truth: ThroughputModel, steps=400, world=None):
    """Fake a master's reports: the job runs at the size autoconf asks for
    (as a policy with free GPUs would), at ``truth``'s step time."""
    ac = AutoConf(store)
    with store.session(write=False) as s:
        step, wall = (s.get(Job, jid).progress or {}).get("last_step", [0, 1000.0])[:2]  # a master never goes back
    for _ in range(steps):
        with store.session() as s:
            j = s.get(Job, jid)
            st = j.autoconf
            n = world or (st["plan"]["gpus"] if st["stage"] == "planned" else st.get("target", 1))
            step += 1
            wall += truth.step_time(n, 64)
            j.progress = {"state": "running", "changing": False, "gen": n, "world_size": n,
                          "last_step": [step, wall, n]}
        ac.tick(wall)
    with store.session(write=False) as s:
        j = s.get(Job, jid)
        evs = [(e.kind, e.detail) for e in s.query(Event).filter(Event.job_id == jid).order_by(Event.id)]
        return dict(j.autoconf), dict(j.tags or {}), evs


def test_samples_fits_plans_then_history_skips_sampling(store, monkeypatch):
    monkeypatch.setattr(A, "MIN_WINDOW_S", 0.5)
    truth = ThroughputModel((0.004, 0.01, 0.02))
    _submit(store, "a")
    st, _, evs = _drive(store, "a", truth)
    kinds = [k for k, _ in evs]
    assert kinds[0] == "autoconf.initial" and evs[0][1]["source"] == "default" and evs[0][1]["gpus"] == 1
    assert [d["gpus"] for k, d in evs if k == "autoconf.sampled"] == [1, 2, 4]
    assert "autoconf.plan" in kinds and "autoconf.adjust" not in kinds  # the model fits: nothing to adjust
    want = choose(truth, 64, 4)["gpus"]
    assert st["stage"] == "planned" and st["plan"]["gpus"] == want
    # a similar job (same script and args) starts from that history and measures one size only
    _submit(store, "b")
    st, _, evs = _drive(store, "b", truth, steps=150)
    assert evs[0][1]["source"] == "history:a" and evs[0][1]["gpus"] == want and evs[0][1]["sizes"] == [want]
    assert [d["gpus"] for k, d in evs if k == "autoconf.sampled"] == [want]
    assert st["plan"]["gpus"] == want


def test_adjusts_when_the_job_runs_off_the_model(store, monkeypatch):
    monkeypatch.setattr(A, "MIN_WINDOW_S", 0.5)
    monkeypatch.setattr(A, "ADJUST_WINDOW_S", 1.0)
    _submit(store, "a")
    _drive(store, "a", ThroughputModel((0.004, 0.01, 0.02)))
    # the job gets 3x slower at its size (e.g. a neighbour): re-fitted and re-planned
    st, _, evs = _drive(store, "a", ThroughputModel((0.012, 0.03, 0.06)), steps=60)
    adj = [d for k, d in evs if k == "autoconf.adjust"]
    assert adj and adj[0]["deviation"] > 0.2 and "re-fitted" in adj[0]["reason"]
    assert st["stage"] == "planned"


def test_policy_view_is_narrowed_and_a_pin_still_wins(store):
    from tidal.control.coordinator import apply_pins
    from tidal.control.snapshot import build_snapshot
    from tidal.core.overhead import OverheadModel

    _submit(store, "a")
    AutoConf(store).tick(time.time())
    with store.session(write=False) as s:
        snap, _, jobs = build_snapshot(s, time.time(), OverheadModel())
        v = A.apply_autoconf(snap, jobs).jobs[0]
        assert v.spec.allowed_gpus == (1,) and v.spec.requested_gpus == 1
    with store.session() as s:
        j = s.get(Job, "a")
        j.spec = {**j.spec, "pinned": 3}
    with store.session(write=False) as s:
        snap, _, jobs = build_snapshot(s, time.time(), OverheadModel())
        assert apply_pins(A.apply_autoconf(snap, jobs), jobs).jobs[0].spec.allowed_gpus == (3,)


# -- end to end ------------------------------------------------------------------------------


def _rate(user, jid, secs):
    """Samples/s of a running job over ``secs`` (the master's reported step,
    every second; None if the group changed meanwhile)."""
    a, ta = user.job(jid)["progress"], time.time()
    time.sleep(secs)
    b, tb = user.job(jid)["progress"], time.time()
    if a["gen"] != b["gen"] or b.get("changing"):
        return None
    return 64 * (b["step"] - a["step"]) / (tb - ta)


def _measure(user, jid, n, secs=15.0):
    from tests.control.test_e2e import wait

    wait(lambda: (user.job(jid)["world_size"] == n and not user.job(jid)["progress"].get("changing")
                  and user.job(jid)["step"] > 5), 180, f"{jid} to train at {n}", user)
    time.sleep(2.0)
    for _ in range(3):
        r = _rate(user, jid, secs)
        if r is not None:
            return r
    raise AssertionError(f"{jid} kept changing size")


def _demo(name, **extra):
    args = ["--samples", str(64 * 100000), "--epochs", "1", "--sample-time", "0.004"]
    return {"name": name, "script": demo_job.__file__, "iterations": 100000, "global_batch_size": 64, "args": args,
            **extra}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_auto_job_settles_within_90_percent_of_the_best_hand_picked_size(tmp_path):
    from tests.control.test_e2e import wait
    from tidal.control.local import LocalCluster

    with LocalCluster(tmp_path / "home", nodes=1, gpus_per_node=4, policy="edf", tick_s=0.5) as c:
        admin = c.api()
        user = c.api(admin.add_user("alice"))
        t0 = time.time()
        a = user.submit(_demo("auto"))["id"]  # no gpus, no deadline, no resources
        wait(lambda: (user.job(a).get("autoconf") or {}).get("stage") == "planned", 300, "a plan", user)
        settle_s = time.time() - t0
        st = user.job(a)["autoconf"]
        n_auto = st["plan"]["gpus"]
        auto = _measure(user, a, n_auto)
        evs = [e for e in user.job(a)["events"] if e["kind"].startswith("autoconf.")]
        user.cancel(a)
        wait(lambda: user.job(a)["state"] == "cancelled", 60, "the auto job to end", user)
        hand = {}
        for n in (1, 2, 4):
            h = user.submit(_demo(f"hand{n}", gpus=n, elastic=False))["id"]
            hand[n] = _measure(user, h, n)
            user.cancel(h)
            wait(lambda h=h: user.job(h)["state"] == "cancelled", 60, f"hand{n} to end", user)
        report = {"settle_s": round(settle_s, 1), "auto_gpus": n_auto, "auto_samples_per_s": round(auto, 1),
                  "hand_samples_per_s": {n: round(r, 1) for n, r in hand.items()},
                  "plan": {k: st["plan"][k] for k in ("gpus", "min", "max", "memory", "predicted")},
                  "events": [(e["kind"], e.get("gpus"), e.get("step_time_s")) for e in evs]}
        print("AUTOCONF", report)
        (tmp_path.parent / "autoconf-report.txt").write_text(repr(report))
        kinds = [e["kind"] for e in evs]
        assert kinds[0] == "autoconf.initial" and "autoconf.plan" in kinds
        assert kinds.count("autoconf.sampled") >= 2
        assert 1 <= n_auto <= 4 and st["plan"]["memory"]  # a memory limit from the measured peak
        assert auto >= 0.9 * max(hand.values()), report


# -- measured throughput, per GPU type --------------------------------------------------


def test_measured_step_times_are_stored_per_gpu_type_and_profile_that_type(tmp_path, monkeypatch):
    """A job of a named model sampled on a node of T4s: each measured size is a
    throughput row typed T4; the policy's profiles then have a T4 profile with
    those values at the measured counts and the default curve scaled by the
    measured ratio elsewhere, while the default (untyped) curve is unchanged."""
    from tidal.control.db import ThroughputRow
    from tidal.control.snapshot import profiles_from_store
    from tidal.core.profile import load_profiles

    monkeypatch.setattr(A, "MIN_WINDOW_S", 0.5)
    st = Store(f"sqlite:///{tmp_path / 't.db'}")
    with st.session() as s:
        s.add(Node(name="n0", ordinal=0, num_gpus=4, labels={"gpu-type": "T4"}))
        s.flush()
        for i in range(4):
            s.add(GPU(gid=i, node="n0", index=i))
    _submit(st, "a", model="bert")
    truth = ThroughputModel((0.004, 0.01, 0.02))
    ac = AutoConf(st)
    step, wall = 0, 1000.0
    for _ in range(400):
        with st.session() as s:
            j = s.get(Job, "a")
            n = j.autoconf["plan"]["gpus"] if j.autoconf["stage"] == "planned" else j.autoconf.get("target", 1)
            for g in s.query(GPU).all():  # the job holds its first n GPUs, as a policy would give them
                g.job_id = "a" if g.gid < n else None
            step, wall = step + 1, wall + truth.step_time(n, 64)
            j.progress = {"state": "running", "changing": False, "gen": n, "world_size": n, "last_step": [step, wall, n]}
        ac.tick(wall)
    with st.session(write=False) as s:
        rows = {(r.model, r.batch, r.gpus, r.gpu_type): r.value for r in s.query(ThroughputRow).all()}
        prof = profiles_from_store(s)
    assert set(rows) == {("bert", 64, n, "T4") for n in (1, 2, 4)}, rows
    for n in (1, 2, 4):
        assert rows[("bert", 64, n, "T4")] == pytest.approx(1 / truth.step_time(n, 64), rel=0.05)
    t4 = prof.typed("T4", "bert")
    assert t4 is not prof and t4.throughput("bert", 64, 2) == pytest.approx(rows[("bert", 64, 2, "T4")])
    default = load_profiles().curves["bert"][64]
    ratio = sorted(rows[("bert", 64, n, "T4")] / default.at(n) for n in (1, 2, 4))[1]
    assert t4.throughput("bert", 64, 16) == pytest.approx(default.at(16) * ratio)
    assert prof.throughput("bert", 64, 16) == pytest.approx(default.at(16))  # untyped: the shipped curve
    assert prof.throughput_on("bert", 64, 2, False, ["T4"]) == pytest.approx(rows[("bert", 64, 2, "T4")])


def test_the_throughput_migration_keeps_measured_rows(tmp_path):
    """A store made before throughput had a GPU type keeps its rows (untyped)."""
    from pathlib import Path

    import tidal.control.db as db
    from alembic import command
    from alembic.config import Config
    from sqlalchemy import text

    from tidal.control.db import ThroughputRow

    url = f"sqlite:///{tmp_path / 'old.db'}"
    cfg = Config()
    cfg.set_main_option("script_location", str(Path(db.__file__).with_name("migrations")))
    cfg.set_main_option("sqlalchemy.url", url)
    command.upgrade(cfg, "0010")
    st = Store(url, run_migrations=False)
    with st.engine.begin() as c:
        c.execute(text("INSERT INTO throughput (model, batch, gpus, value, source) VALUES ('bert', 64, 2, 3.5, 'x')"))
    st.engine.dispose()
    st = Store(url)  # migrates to the head
    with st.session(write=False) as s:
        rows = [(r.model, r.batch, r.gpus, r.gpu_type, r.value) for r in s.query(ThroughputRow).all()]
    assert rows == [("bert", 64, 2, "", 3.5)]
