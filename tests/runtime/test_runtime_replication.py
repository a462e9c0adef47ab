"""Topology-aware concurrent state replication (Elan §IV), migration as one
change and a smaller batch share for stragglers (EDL §5.2), and killing a
hung worker so its peers recover. The
multi-process runs check what users care about: every sample once per epoch
and the parameters of the fixed-size run."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime_helpers import check_exactly_once, exit_quietly_at, finish, launch, master_url, read_steps
from test_runtime_elastic import TOL, max_rel_diff, reference_run
from tidal.runtime.client import MasterClient
from tidal.runtime.data import split_weighted, step_slice
from master_helpers import RecordingSpawner
from tidal.runtime.master import JobMaster
from tidal.runtime.replication import Location, assign_sources


# ----------------------------------------------------------------------------- planning (pure)


def test_each_newcomer_reads_from_its_nearest_source_and_remote_ones_spread() -> None:
    where = {
        "a": Location("h1", "s1"), "b": Location("h2", "s1"), "c": Location("h3", "s2"),
        "x": Location("h2", "s1"),  # same host as b
        "y": Location("h4", "s2"),  # same switch as c
        "z": Location("h5", "s3"), "u": Location("h6", "s3"),  # remote from everyone
    }
    got = assign_sources(["a", "b", "c"], ["z", "x", "y", "u"], where)
    assert got["x"] == "b" and got["y"] == "c"
    # the remote ones go to the least loaded source: a (load 0), then a three-way tie broken by rank
    assert got["z"] == "a" and got["u"] == "a"
    assert list(got) == ["z", "x", "y", "u"]


def test_same_host_wins_over_load_and_modes() -> None:
    where = {"a": Location("h1"), "b": Location("h2"), "x": Location("h1"), "y": Location("h1")}
    assert assign_sources(["a", "b"], ["x", "y"], where) == {"x": "a", "y": "a"}
    # without locations (one machine): spread evenly over all sources
    assert assign_sources(["a", "b"], ["x", "y", "z"], {}) == {"x": "a", "y": "b", "z": "a"}
    assert assign_sources(["a", "b"], ["x", "y"], where, "single") == {"x": "a", "y": "a"}
    assert assign_sources(["a", "b"], ["x", "y"], where, "broadcast") == {}
    with pytest.raises(ValueError, match="unknown replication mode"):
        assign_sources(["a"], ["x"], where, "carrier-pigeon")
    with pytest.raises(ValueError, match="at least one source"):
        assign_sources([], ["x"], where)


@settings(max_examples=200, deadline=None)
@given(total=st.integers(0, 300), shares=st.lists(st.floats(0.01, 10.0), min_size=1, max_size=9))
def test_weighted_split_is_a_partition(total: int, shares: list[float]) -> None:
    sizes = split_weighted(total, shares)
    assert sum(sizes) == total and len(sizes) == len(shares) and min(sizes) >= 0
    if total >= len(shares):
        assert min(sizes) >= 1  # no rank gets an empty batch while there are enough samples
    # slices of a step are contiguous and cover [start, stop) exactly once
    n = 1000
    cover: list[int] = []
    for r in range(len(shares)):
        sl = step_slice(0, n, total, r, len(shares), shares)
        cover.extend(range(sl.lo, sl.hi))
    assert cover == list(range(min(total, n)))


def test_weighted_split_follows_the_shares() -> None:
    assert split_weighted(24, [1, 1, 0.5]) == [10, 9, 5]
    assert split_weighted(24, [1, 1, 1]) == [8, 8, 8]
    assert split_weighted(2, [1, 1, 0.1]) == [1, 1, 0]  # fewer samples than ranks


# ----------------------------------------------------------------------------- master


def _master(n: int, **kw: Any) -> tuple[JobMaster, RecordingSpawner]:
    sp = RecordingSpawner()
    m = JobMaster("j", n, spawner=sp, first_worker=n, **kw)
    for i in range(n):
        m.register(f"w{i}", host=f"h{i}", switch="s0")
    return m, sp


def test_migration_is_one_change_with_nearest_sources() -> None:
    m, sp = _master(3)
    assert m.migrate([5]).status == "error" and m.migrate([0, 1, 2]).status == "error"
    ans = m.migrate([0, 1])
    assert ans.accepted and ans.size == 3 and sp.started == ["w3", "w4"]
    assert m.scale_out(1).status == "retry"  # one change at a time (EDL §3.1)
    assert m.group.plan is None  # nothing is published until every replacement is ready
    m.register("w3", host="h2", switch="s0")  # on w2's host
    m.register("w4", host="h9", switch="s1")
    p = m.group.plan
    assert p is not None and p.kind == "migrate"
    assert p.leavers == ("w0", "w1") and p.joiners == ("w3", "w4")
    assert p.target.members == ("w2", "w3", "w4")  # the new rank 0 is a worker that holds the state
    assert dict(p.sources) == {"w3": "w2", "w4": "w2"}
    assert p.source_ranks() == {1: 0, 2: 0}
    m.switched(p.target.gen, 10)
    assert m.group.gen is not None and m.group.gen.members == ("w2", "w3", "w4")
    ch = m.core.changes
    assert ch[-1]["kind"] == "migrate" and (ch[-1]["from_size"], ch[-1]["to_size"]) == (3, 3)


def test_migrate_needs_a_spawner() -> None:
    m = JobMaster("j", 2)
    m.register("w0")
    m.register("w1")
    assert "spawner" in m.migrate([1]).message


def test_reshare_gives_a_generation_with_shares_that_later_changes_keep() -> None:
    m, _ = _master(3)
    assert m.reshare({"w9": 0.5}).status == "error" and m.reshare({"w1": 0.0}).status == "error"
    assert m.reshare({"w1": 0.5}).accepted
    p = m.group.plan
    assert p is not None and p.kind == "reshare" and p.target.members == m.group.gen.members  # type: ignore[union-attr]
    assert p.target.shares == (1.0, 0.5, 1.0) and not p.joiners and not p.leavers
    m.switched(p.target.gen, 5)
    m.scale_in(ranks=[0])
    assert m.group.plan is not None and m.group.plan.target.shares == (0.5, 1.0)  # w1 keeps its smaller share


def test_share_policy_divides_the_stragglers_share_by_its_slowdown() -> None:
    m, _ = _master(3, straggler_policy="share")
    assert m.straggler("w2", gen=1, step=20, ratio=2.0)["action"] == "smaller share"
    assert m.group.plan is not None and m.group.plan.target.shares == (1.0, 1.0, 0.5)


def test_replace_policy_migrates_the_straggler() -> None:
    m, sp = _master(3, straggler_policy="replace")
    assert m.straggler("w1", gen=1, step=20, ratio=2.0)["action"] == "replaced"
    assert sp.started == ["w3"] and m.core.change is not None and m.core.change.leavers == ("w1",)


def test_a_restarted_master_keeps_the_pending_plans_shares(tmp_path: Path) -> None:
    from tidal.runtime.persistence import open_backend

    url = f"file://{tmp_path / 'm.json'}"
    m = JobMaster("j", 3, backend=open_backend(url))
    for i in range(3):
        m.register(f"w{i}")
    assert m.reshare({"w1": 0.5}).accepted
    m2 = JobMaster("j", 3, backend=open_backend(url), resume=True)
    g2 = m2.group
    assert g2.plan is not None and g2.plan.target.shares == (1.0, 0.5, 1.0)
    assert json.loads(g2.store.get(g2.plan_key))["target"]["shares"] == [1.0, 0.5, 1.0]
    assert g2.store.get(g2.gen.prefix + "go") == b"go"  # type: ignore[union-attr]


def test_a_failure_in_the_generation_being_switched_to_completes_the_switch_first() -> None:
    """A newcomer dies while receiving its state: the survivors report the
    failure of the new generation, which the master adopts, then recovers."""
    m, _ = _master(2)
    assert m.scale_out(1).accepted
    m.register("w2")
    assert m.group.plan is not None
    new = m.group.plan.target.gen
    m.failed("w0", gen=new, step=12)
    assert m.group.gen is not None and m.group.gen.gen == new
    assert m.core.recovery is not None and m.core.recovery.gen == new
    assert [c["kind"] for c in m.core.changes] == ["scale_out"]


def _beat(m: JobMaster, w: str, n: int, step: int, phase: str) -> None:
    m.group.store.set(f"tidal/j/alive/{w}", json.dumps([n, step, phase]))


def _run(m: JobMaster, t0: float, seconds: int, beats: dict[str, tuple[int, str] | None]) -> list[str]:
    """Call check_health once a (virtual) second for ``seconds``; before each
    call every worker in ``beats`` beats (step, phase), unless None (silent)."""
    found: list[str] = []
    for k in range(seconds):
        for w, b in beats.items():
            if b is not None:
                _beat(m, w, int(t0) * 100 + k, *b)
        found += m.check_health(now=t0 + k)
    return found


def test_a_silent_worker_is_killed_once() -> None:
    m, sp = _master(3, hang_timeout_s=5.0)
    t = 1000.0
    assert _run(m, t, 2, {"w0": (4, "compute"), "w1": (4, "compute"), "w2": (4, "compute")}) == []
    # w1 stops beating; w0 and w2 wait in the all-reduce of step 4
    found = _run(m, t + 2, 8, {"w0": (4, "sync"), "w1": None, "w2": (4, "sync")})
    assert found == ["w1"] and sp.killed == ["w1"]
    h = m.status().hung[0]
    assert h["worker_id"] == "w1" and h["action"] == "killed" and "no liveness beat" in h["reason"]
    assert _run(m, t + 10, 10, {"w0": (4, "sync"), "w1": None, "w2": (4, "sync")}) == []  # not again


def test_a_worker_stuck_in_compute_while_a_peer_waits_is_killed() -> None:
    m, sp = _master(2, hang_timeout_s=5.0)
    t = 1000.0
    # both compute step 7 for 8 s (a long step is not a hang) ...
    assert _run(m, t, 8, {"w0": (7, "compute"), "w1": (7, "compute")}) == []
    # ... then w0 waits in the all-reduce; w1 is only killed once w0 waited longer than the timeout
    found = _run(m, t + 8, 5, {"w0": (7, "sync"), "w1": (7, "compute")})
    assert found == []
    found = _run(m, t + 13, 3, {"w0": (7, "sync"), "w1": (7, "compute")})
    assert found == ["w1"] and sp.killed == ["w1"]
    assert "while a peer waited" in m.core.hung[0]["reason"]


def test_health_check_does_not_judge_what_it_cannot_see() -> None:
    t = 1000.0
    # a member that never beat (e.g. a newcomer still receiving its state) is not judged
    m, sp = _master(2, hang_timeout_s=5.0)
    assert _run(m, t, 20, {"w0": (3, "idle"), "w1": None}) == [] and sp.killed == []
    # a master that did not check for a while (stalled host) restarts its clocks
    m2, sp2 = _master(2, hang_timeout_s=5.0)
    _run(m2, t, 3, {"w0": (1, "idle"), "w1": (1, "idle")})
    assert m2.check_health(now=t + 60) == [] and sp2.killed == []
    # 0 disables the check; a master that handed over does not check
    m3, sp3 = _master(2, hang_timeout_s=0)
    assert _run(m3, t, 20, {"w0": (3, "idle"), "w1": None}) == []
    _beat(m3, "w1", 1, 3, "idle")
    assert _run(m3, t + 20, 20, {"w0": (3, "idle"), "w1": None}) == []
    m4, sp4 = _master(2, hang_timeout_s=5.0)
    _run(m4, t, 2, {"w0": (3, "idle"), "w1": (3, "idle")})
    m4.moved_to = "http://127.0.0.1:1"
    assert _run(m4, t + 2, 20, {"w0": None, "w1": None}) == [] and sp4.killed == []


# ----------------------------------------------------------------------------- real runs


def _params_equal(out: Path, n: int, batch: int, epochs: int) -> list[str]:
    finals = sorted(p.name for p in out.glob("final-*.pt"))
    ref = reference_run(n=n, batch=batch, epochs=epochs)
    for f in finals:
        assert max_rel_diff(torch.load(out / f), ref) <= TOL, f
    return finals


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_scale_out_with_concurrent_replication_then_migration_including_rank_0(tmp_path: Path) -> None:
    """2 -> 4 with each newcomer fed by a different live worker at once, then
    ranks 0 and 2 move in one switch: the job never stops, uses every sample
    once and ends with the fixed-size run's parameters."""
    out, home = tmp_path / "out", tmp_path / "home"
    out.mkdir()
    n, batch, epochs = 300, 24, 40
    proc = launch("repl", 2, out, home, "--n", str(n), "--batch", str(batch), "--epochs", str(epochs),
                  "--sleep", "0.04", timeout=130)
    try:
        c = MasterClient(master_url("repl", home, proc), patience_s=10)
        c.wait_for(2, timeout_s=60)
        assert c.scale_out(2).accepted
        st = c.wait_for(4, timeout_s=60)
        assert st.state == "running", st
        grow = st.changes[-1]
        # one newcomer per live worker (which one first depends on who registered first)
        assert grow["kind"] == "scale_out" and sorted(j for j, _ in grow["sources"]) == ["w2", "w3"]
        assert sorted(s for _, s in grow["sources"]) == ["w0", "w1"]
        before = st.members  # e.g. (w0, w1, w2, w3); the initial order is the registration order
        ans = c.migrate([0, 2])
        assert ans.accepted, ans
        deadline = time.monotonic() + 60
        while not any(ch["kind"] == "migrate" for ch in c.status().changes):
            assert time.monotonic() < deadline and c.status().state != "finished"
            time.sleep(0.05)
        st = c.status()
        stay = (before[1], before[3])
        assert st.members[:2] == stay and sorted(st.members[2:]) == ["w4", "w5"] and st.world_size == 4, st
        mig = st.changes[-1]
        assert (mig["from_size"], mig["to_size"]) == (4, 4)
        assert {j for j, _ in mig["sources"]} == {"w4", "w5"} and {s for _, s in mig["sources"]} == set(stay)
        (out / "fast").touch()
        text = finish(proc, 100)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, text
    steps = read_steps(out)
    check_exactly_once(steps, n, batch, epochs)
    switch = min(r["step"] for r in steps["w4"])  # one switch step: the old ones leave as the new ones join
    assert min(r["step"] for r in steps["w5"]) == switch
    assert max(r["step"] for r in steps[before[0]]) == max(r["step"] for r in steps[before[2]]) == switch - 1
    assert _params_equal(out, n, batch, epochs) == sorted(f"final-{w}.pt" for w in (*stay, "w4", "w5"))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_straggler_gets_a_smaller_batch_share(tmp_path: Path) -> None:
    out, home = tmp_path / "out", tmp_path / "home"
    out.mkdir()
    n, batch, epochs = 120, 12, 10
    proc = launch("share", 3, out, home, "--n", str(n), "--batch", str(batch), "--epochs", str(epochs),
                  "--sleep", "0.02", timeout=100, extra_env={"TIDAL_FAULTS": "slow:w2@0=2000"},
                  launcher_args=("--straggler-policy", "share"))
    text = finish(proc, 100)
    assert proc.returncode == 0, text
    assert "straggler w2 in gen 1" in text and "smaller share" in text, text
    steps = read_steps(out)
    check_exactly_once(steps, n, batch, epochs)
    sizes = [len(r["idx"]) for r in steps["w2"]]
    assert sizes[0] == 4 and sizes[-1] < 4, sizes  # an even third at first, less afterwards
    assert all(len(r["idx"]) >= 4 for r in steps["w0"])
    assert _params_equal(out, n, batch, epochs) == ["final-w0.pt", "final-w1.pt", "final-w2.pt"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_hung_worker_is_killed_and_the_others_recover(tmp_path: Path) -> None:
    """w1 is stopped (SIGSTOP) for two minutes at step 6; with a 3 s hang
    timeout the master kills it, and the others re-form long before the
    process group's 60 s timeout."""
    out, home = tmp_path / "out", tmp_path / "home"
    out.mkdir()
    n, batch, epochs = 200, 20, 4
    t0 = time.monotonic()
    proc = launch("hang", 3, out, home, "--n", str(n), "--batch", str(batch), "--epochs", str(epochs),
                  timeout=100, extra_env={"TIDAL_FAULTS": "stop:w1@6=120"}, launcher_args=("--hang-timeout", "3"))
    text = finish(proc, 100)
    took = time.monotonic() - t0
    assert proc.returncode == 0, text
    assert "worker w1 is hung" in text and "recover 3->2" in text, text
    assert took < 50, f"recovery waited for a timeout ({took:.0f}s)"
    steps = read_steps(out)
    check_exactly_once(steps, n, batch, epochs)
    assert max(r["step"] for r in steps["w1"]) == 5
    assert _params_equal(out, n, batch, epochs) == ["final-w0.pt", "final-w2.pt"]


# ----------------------------------------------------------------------------- transfer (real gloo group)


def _transfer_worker(rank: int, world: int, store_path: str, cap: float) -> None:
    import datetime

    import torch.distributed as dist

    from tidal.runtime.transfer import replicate_state

    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    g = torch.Generator().manual_seed(7)
    state = {"w": torch.rand(1_200_003, generator=g), "b": torch.arange(11, dtype=torch.int64),
             "nested": [torch.rand(3, 5, generator=g, dtype=torch.float64), "text", 4], "step": 9}
    sources = {2: 0, 3: 1, 4: 0}  # two sources at once, one of them serving two newcomers
    got = replicate_state(state if rank < 2 else None, sources, max_bytes_per_s=cap)
    if rank >= 2:
        assert torch.equal(got["w"], state["w"]) and torch.equal(got["b"], state["b"])
        assert torch.equal(got["nested"][0], state["nested"][0]) and got["nested"][1:] == ["text", 4]
        assert got["step"] == 9 and got["w"].dtype == torch.float32 and got["nested"][0].shape == (3, 5)
    dist.destroy_process_group()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cap", [0.0, pytest.param(20e6, marks=pytest.mark.slow)])
def test_point_to_point_replication_delivers_the_exact_state(tmp_path: Path, cap: float) -> None:
    """Newcomers get a bit-exact copy (several dtypes, nesting, non-tensor
    values) from two sources at once, unpaced and paced in 4 MiB chunks (the 4.8 MB tensor takes two)."""
    import torch.multiprocessing as mp

    mp.start_processes(exit_quietly_at, args=(_transfer_worker, 5, str(tmp_path / "store"), cap), nprocs=5,
                       join=True, start_method="spawn")


def test_a_suspension_interrupted_by_a_failure_suspends_the_survivors() -> None:
    m, _ = _master(3)
    for w in ("w0", "w1", "w2"):
        m.group.workers[w]["checkpoints"] = True
    assert m.suspend().accepted and m.group.plan is not None and m.group.plan.kind == "suspend"
    assert m.scale_out(1).status == "retry"
    m.failed("w0", gen=1, step=7)
    m.failed("w2", gen=1, step=7)
    m.check_health()
    assert m.group.gen is not None and m.group.gen.members == ("w0", "w1", "w2")  # w1 may still report
    m.check_health(wall=time.time() + 60)  # w1 never reports: the window ends
    g = m.group
    assert g.gen is not None and g.gen.members == ("w0", "w2")
    assert g.plan is not None and g.plan.kind == "suspend" and set(g.plan.leavers) == {"w0", "w2"}
    m.suspended_at(8, 96, "/ck/ckpt-8.pt")
    st = m.status()
    assert st.state == "suspended" and st.changes[-1]["kind"] == "suspend"
    assert m.scale_out(1).status == "error"
    m2 = JobMaster("j", 2)
    m2.register("w0")
    m2.register("w1")
    assert "checkpoint directory" in m2.suspend().message
