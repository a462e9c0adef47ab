"""A worker lost before its first step is dropped like any lost worker.

A worker of ``tidal run`` (or a newcomer of a scale-out) that dies while it
starts (importing torch), after it registered, or at the gate before its
generation's process group forms is dropped: the first generation forms with
the live workers, a generation that cannot form is formed again without it,
and a scale-out continues without its lost newcomer (or is abandoned); one
that dies after its group formed but before the first step is recovered from
like any failure. The job exits 0, names the lost worker and why, uses every
sample exactly once and ends with the fixed-size run's parameters.

The master's side is tested alone first (a recording spawner reports exit
codes), then in real jobs: the training script of the other runtime tests,
started through a wrapper that SIGKILLs one chosen worker at one point of
its start-up (``$VICTIM``, ``$KILL_AT``)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from master_helpers import RecordingSpawner
from runtime_helpers import HERE, check_exactly_once, env, finish, master_url, read_steps
from test_runtime_elastic import TOL, max_rel_diff, reference_run
from tidal.runtime.change import Change, ChangeKind, ChangeStatus, Drop, Join, Publish, advance
from tidal.runtime.client import MasterClient
from tidal.runtime.master import JobMaster

N, BATCH, EPOCHS = 120, 12, 2
STEPS = EPOCHS * (-(-N // BATCH))

# Runs tests/runtime/elastic_train.py; worker $VICTIM kills itself (SIGKILL) at $KILL_AT:
# "import" (after importing torch, before registering), "register" (right after its
# registration was answered), "gate" (assigned a generation, before its process group forms)
# or "group" (its process group formed, before the state broadcast and the first step).
WRAPPER = '''
import os, signal, sys
sys.path.insert(0, {here!r})
if os.environ.get("TIDAL_WORKER_ID") == os.environ.get("VICTIM"):
    import torch
    from tidal.runtime import membership
    die = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    at = os.environ["KILL_AT"]
    if at == "import":
        die()
    elif at == "register":
        register = membership.Membership.register
        membership.Membership.register = lambda self, **k: (register(self, **k), die())[0]
    elif at == "gate":
        membership.Gate.arrive = die
    elif at == "group":
        init_group = membership.Membership.init_group
        membership.Membership.init_group = lambda self, g: (init_group(self, g), die())
import elastic_train
elastic_train.main()
'''


# ----------------------------------------------------------------------------- the master alone


def test_drop_takes_lost_newcomers_out_of_a_change() -> None:
    c = Change(ChangeKind.SCALE_OUT, 1.0, expect=("w3", "w4"))
    c = advance(advance(advance(c, Join("w3")), Join("w4")), Publish(2.0))
    d = advance(c, Drop(("w4",)))
    assert d.status is ChangeStatus.WAITING and d.expect == ("w3",) and d.joiners == ("w3",) and d.ready
    assert d.published_at is None and d.agreed_step is None
    assert advance(c, Drop(())).status is ChangeStatus.WAITING  # its target could not form: plan it again


def test_first_generation_forms_without_a_worker_lost_before_registering() -> None:
    sp = RecordingSpawner()
    sp.codes = {"w0": None, "w1": None, "w2": None}
    m = JobMaster("j", 3, spawner=sp, first_worker=3)
    m.register("w0")
    sp.codes["w1"] = -9  # killed while importing torch
    m.check_health()
    assert m.status().state == "forming"  # w2 may still come
    m.register("w2")
    st = m.status()
    assert st.state == "running" and st.members == ("w0", "w2")
    assert [(d["worker_id"], d["reason"]) for d in st.dropped] == [
        ("w1", "died before it registered (its process failed)")]
    assert m.assignment("w1")["status"] == "finished"


def test_a_generation_whose_member_died_before_its_gate_is_formed_again() -> None:
    sp = RecordingSpawner()
    m = JobMaster("j", 3, spawner=sp, first_worker=3)
    for w in ("w0", "w1", "w2"):
        sp.codes[w] = None
        m.register(w)
    g1 = m.group.gen
    assert g1 is not None and g1.members == ("w0", "w1", "w2")
    m.group.store.add(g1.prefix + "arrived", 2)  # w0 and w2 wait at the gate
    sp.codes["w1"] = -9  # registered, died before it arrived
    m.check_health()
    assert m.group.store.get(g1.prefix + "state") == b"abort"
    st = m.status()
    assert st.gen == 2 and st.members == ("w0", "w2") and st.changes[-1]["kind"] == "recover"
    assert "died before generation 1 formed" in st.dropped[0]["reason"]
    assert m.assignment("w0")["generation"]["gen"] == 2 and m.assignment("w1")["status"] == "finished"
    m.group.store.compare_set(m.group.gen.prefix + "state", "", "commit")  # type: ignore[union-attr]
    sp.codes["w2"] = -9  # after the gate: a normal failure, reported by the survivors
    m.check_health()
    assert m.status().gen == 2


def test_a_scale_out_goes_on_without_its_lost_newcomer_or_is_abandoned() -> None:
    sp = RecordingSpawner()
    m = JobMaster("j", 2, spawner=sp, first_worker=2)
    m.register("w0")
    m.register("w1")
    assert m.scale_out(2).accepted and sp.started == ["w2", "w3"]
    m.register("w3")
    sp.codes["w2"] = -9  # never registered
    m.check_health()
    plan = m.group.plan
    assert plan is not None and plan.joiners == ("w3",) and plan.target.members == ("w0", "w1", "w3")
    target = plan.target
    sp.codes["w3"] = -9  # registered and planned, died before joining: the target is stopped at its gate
    m.check_health()
    st = m.status()
    assert not st.changing and st.world_size == 2 and m.group.plan is None
    store = m.group.store
    assert store.get(target.prefix + "state") == b"abort" and store.get(target.prefix + "go") == b"cancel"
    assert [d["worker_id"] for d in st.dropped] == ["w2", "w3"]
    assert "before it joined generation" in st.dropped[1]["reason"]
    assert m.scale_out(1).accepted  # nothing is stuck


# ----------------------------------------------------------------------------- real jobs


def _launch(tmp: Path, job: str, workers: int, victim: str, kill_at: str, epochs: int, sleep: float,
            max_workers: int | None = None) -> tuple[subprocess.Popen[str], Path]:
    out, home = tmp / "out", tmp / "home"
    out.mkdir()
    script = tmp / "wrapped_train.py"
    script.write_text(WRAPPER.format(here=str(HERE)))
    extra = ["--max-workers", str(max_workers)] if max_workers else []
    cmd = [sys.executable, "-m", "tidal.runtime.launch", "run", "--workers", str(workers), "--job", job,
           "--timeout", "100", *extra, str(script), "--out", str(out), "--n", str(N), "--batch", str(BATCH),
           "--epochs", str(epochs), "--seed", "0", "--sleep", str(sleep)]
    proc = subprocess.Popen(cmd, env=dict(env(home), VICTIM=victim, KILL_AT=kill_at), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    return proc, out


def _check_job(out: Path, text: str, victim: str, epochs: int) -> dict[str, list[dict[str, object]]]:
    """Exactly-once data, every step applied, and the fixed-size run's
    parameters on every worker that finished (the victim took no step)."""
    assert f"worker {victim} was lost before its first step and dropped" in text, text
    assert f"dropped worker {victim}: " in text, text
    steps = read_steps(out)
    assert check_exactly_once(steps, N, BATCH, epochs) == epochs * (-(-N // BATCH))
    assert not steps.get(victim)
    finals = sorted(p.stem[len("final-"):] for p in out.glob("final-*.pt"))
    assert victim not in finals and finals
    ref = reference_run(n=N, batch=BATCH, epochs=epochs)
    for w in finals:
        assert max_rel_diff(torch.load(out / f"final-{w}.pt"), ref) <= TOL, w
    return steps


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kill_at,reason", [
    pytest.param("import", "died before it registered", marks=pytest.mark.slow),  # (a) before registering
    pytest.param("gate", "died before generation 1 formed", marks=pytest.mark.slow),  # (b) before the rendezvous
])
def test_initial_worker_lost_before_its_first_step(tmp_path: Path, kill_at: str, reason: str) -> None:
    proc, out = _launch(tmp_path, f"start-{kill_at}", 3, "w1", kill_at, EPOCHS, 0.0)
    text = finish(proc, 80)
    assert proc.returncode == 0, text
    assert f"dropped worker w1: {reason}" in text, text
    steps = _check_job(out, text, "w1", EPOCHS)
    assert {r["world"] for recs in steps.values() for r in recs} == {2}  # every step ran on the two others


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_initial_worker_lost_right_after_registering(tmp_path: Path) -> None:
    # before or after the first generation formed, depending on who registered last
    proc, out = _launch(tmp_path, "start-register", 3, "w0", "register", EPOCHS, 0.0)
    text = finish(proc, 80)
    assert proc.returncode == 0, text
    _check_job(out, text, "w0", EPOCHS)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_initial_worker_lost_after_its_group_formed(tmp_path: Path) -> None:
    """Too late for the gate: the first state broadcast fails, the others
    report the failed generation and recover without it, before any step."""
    proc, out = _launch(tmp_path, "start-group", 3, "w1", "group", EPOCHS, 0.0)
    text = finish(proc, 80)
    assert proc.returncode == 0, text
    assert "worker w1 failed with exit code -9" in text and "recover 3->2 at step 0" in text, text
    steps = read_steps(out)
    assert check_exactly_once(steps, N, BATCH, EPOCHS) == STEPS and not steps.get("w1")
    ref = reference_run(n=N, batch=BATCH, epochs=EPOCHS)
    finals = sorted(p.stem[len("final-"):] for p in out.glob("final-*.pt"))
    assert finals == ["w0", "w2"]
    for w in finals:
        assert max_rel_diff(torch.load(out / f"final-{w}.pt"), ref) <= TOL, w


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kill_at", [pytest.param(k, marks=pytest.mark.slow) for k in ("gate", "import")])
def test_newcomer_lost_before_joining_a_scale_out(tmp_path: Path, kill_at: str) -> None:
    """(c) the newcomer w2 of a scale-out 2->3 dies; the change ends without
    it, the two others lose no step, and a second scale-out (w3) then works."""
    epochs = 40  # slow steps (0.05 s) until the test lifts them: about 20 s for two scale-outs, one losing its newcomer
    proc, out = _launch(tmp_path, f"newcomer-{kill_at}", 2, "w2", kill_at, epochs, 0.05, max_workers=3)
    try:
        c = MasterClient(master_url(f"newcomer-{kill_at}", tmp_path / "home", proc), patience_s=10)
        c.wait_for(2, timeout_s=60)
        while c.status().step < 3:
            time.sleep(0.02)
        assert c.scale_out(1).accepted
        deadline = time.monotonic() + 60
        while (st := c.status()).changing or not st.dropped:
            assert time.monotonic() < deadline, st
            time.sleep(0.05)
        assert st.world_size == 2 and [d["worker_id"] for d in st.dropped] == ["w2"]
        assert c.scale_out(1).accepted  # w3
        st = c.wait_for(3, timeout_s=60)
        assert sorted(st.members) == ["w0", "w1", "w3"]
        assert [ch["kind"] for ch in st.changes] == ["scale_out"]  # nothing to recover: no member failed
        (out / "fast").touch()
    finally:
        text = finish(proc, 90)
    assert proc.returncode == 0, text
    steps = _check_job(out, text, "w2", epochs)
    assert any(r["world"] == 3 for r in steps["w3"])
    assert "scale_out 2->3" in text, text
    if kill_at == "gate":  # both survivors were at the new group's gate when it was aborted, and stayed
        assert text.count("gen 2 was aborted (a member was lost before it formed); staying in gen 1") == 2, text
