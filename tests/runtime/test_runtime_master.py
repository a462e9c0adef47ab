"""The job master alone (no training processes): serialised scaling with a
retry answer during a change, plans with the switch step t_cur + k, the HTTP
protocol and its client, resume from saved state, and handover."""

from __future__ import annotations

from pathlib import Path

import pytest

from tidal.runtime.client import MasterClient
from tidal.runtime.data import ShardManager, ShardReader
from master_helpers import RecordingSpawner
from tidal.runtime.master import JobMaster
from tidal.runtime.server import MasterServer
from tidal.runtime.messages import SwitchPlan
from tidal.runtime.persistence import open_backend

pytestmark = pytest.mark.timeout(60)


def formed(n: int = 2, **kw: object) -> JobMaster:
    m = JobMaster("j", n, first_worker=n, **kw)  # type: ignore[arg-type]
    for i in range(n):
        m.register(f"w{i}")
    return m


def test_forming_then_running() -> None:
    m = JobMaster("j", 2)
    m.register("w0")
    assert m.status().state == "forming" and m.assignment("w0")["status"] == "wait"
    assert m.scale_out(1).status == "retry"
    m.register("w1")
    st = m.status()
    assert st.state == "running" and st.world_size == 2 and st.members == ("w0", "w1")
    assert m.group.store.get(m.group.gen.prefix + "go") == b"go"  # type: ignore[union-attr]


def test_scale_out_plan_uses_k_from_step_time_and_requests_are_serialised() -> None:
    sp = RecordingSpawner()
    m = formed(2, spawner=sp, switch_lead_s=0.5)
    m.heartbeat({"gen": 1, "step": 40, "cursor": 40 * 32, "epoch": 0, "step_time_s": 0.12, "world_size": 2})
    ans = m.scale_out(2)
    assert ans.accepted and ans.size == 4 and sp.calls == [["w2", "w3"]]
    # a second request while the newcomers start gets "retry" (EDL §3.1)
    assert m.scale_in(1).status == "retry" and m.scale_out(1).status == "retry"
    assert m.heartbeat({"gen": 1, "step": 41, "cursor": 0, "epoch": 0, "step_time_s": 0.12})["plan"] is None
    m.register("w2")
    assert m.assignment("w2")["status"] == "wait"  # not published until every joiner is ready
    m.register("w3")
    plan = SwitchPlan.from_json(m.heartbeat({"gen": 1, "step": 41, "cursor": 0, "epoch": 0, "step_time_s": 0.12})["plan"])
    assert plan.k == 5 and plan.switch_step == 41 + 5  # k = ceil(0.5 / 0.12)
    assert plan.target.members == ("w0", "w1", "w2", "w3") and plan.joiners == ("w2", "w3")
    assert m.assignment("w3")["joining"] is True
    assert m.scale_in(1).status == "retry"
    m.switched(2, 46, 0.01)
    st = m.status()
    assert st.state == "running" and st.world_size == 4 and st.gen == 2
    assert st.changes[0]["from_size"] == 2 and st.changes[0]["to_size"] == 4


def test_a_joiner_that_registers_again_is_not_planned_twice() -> None:
    m = formed(2)
    assert m.scale_out(1).accepted
    m.register("w2")
    plan = m.group.plan
    assert plan is not None and plan.joiners == ("w2",)
    m.register("w2")  # its first answer was lost (e.g. the master restarted): it registers again
    assert m.group.plan == plan and m.group.queue == []
    m.switched(plan.target.gen, 10)
    st = m.status()
    assert st.state == "running" and st.members == ("w0", "w1", "w2")


def test_scale_out_and_scale_in_by_worker_ids() -> None:
    sp = RecordingSpawner()
    m = formed(2, spawner=sp)
    ans = m.scale_out(workers=["w7"])  # started by someone else: the master expects it
    assert ans.accepted and ans.size == 3 and sp.calls == []
    m.register("w7")
    assert m.group.plan is not None and m.group.plan.joiners == ("w7",)
    m.switched(m.group.plan.target.gen, 5)
    assert m.scale_out(workers=["w7"]).status == "error"  # a member already
    assert m.scale_in(workers=["w9"]).status == "error"
    assert m.scale_in(workers=["w0"]).accepted and m.group.plan is not None
    assert m.group.plan.leavers == ("w0",) and m.group.plan.target.members == ("w1", "w7")
    m.switched(m.group.plan.target.gen, 9)
    assert m.scale_out(1, hosts=None).accepted and sp.calls == [["w8"]]  # ids continue after w7


def test_scale_in_by_ranks_keeps_an_existing_rank_0() -> None:
    m = formed(3)
    assert m.scale_in(ranks=[0]).accepted
    plan = m.group.plan
    assert plan is not None and plan.leavers == ("w0",) and plan.target.members == ("w1", "w2")
    assert m.status().changing
    m.switched(2, 10)
    assert m.scale_in(2).status == "error"  # cannot remove every worker
    assert m.scale_in(ranks=[5]).status == "error"
    assert m.scale_in(1).accepted and m.group.plan is not None and m.group.plan.leavers == ("w2",)


def test_max_size_and_join_timeout() -> None:
    m = formed(2, max_size=3, join_timeout_s=0.0)
    assert m.scale_out(2).status == "error"
    assert m.scale_out(1).accepted
    assert m.status().state == "changing"  # reads never change state ...
    m.check_health()  # ... the periodic step does
    assert m.status().state == "running"  # nobody registered in time: the change is abandoned
    assert m.scale_out(1).accepted


def test_done_cancels_a_pending_switch() -> None:
    m = formed(2)
    m.scale_out(1)
    m.register("w2")
    assert m.group.plan is not None
    prefix = m.group.plan.target.prefix
    m.done(100, 3200)
    assert m.status().state == "finished" and m.assignment("w2")["status"] == "finished"
    assert m.group.store.get(prefix + "go") == b"cancel"
    assert m.scale_out(1).status == "error"


@pytest.mark.parametrize("kind", ["file", "sqlite"])
def test_restarted_master_resumes(tmp_path: Path, kind: str) -> None:
    url = f"{kind}://{tmp_path / 'master'}"
    m = formed(2, backend=open_backend(url), shard_manager=ShardManager(100, 25))
    m.heartbeat({"gen": 1, "step": 7, "cursor": 224, "epoch": 0, "step_time_s": 0.1})
    m.scale_in(1)
    m.switched(2, 9)
    m.shard_call("next", {"worker_id": "w0"})
    before = m.status()
    m2 = JobMaster("j", 2, backend=open_backend(url), resume=True)
    after = m2.status()
    assert (after.gen, after.members, after.step, after.state, after.changes) == (
        before.gen, before.members, before.step, before.state, before.changes)
    assert m2.core.shards is not None and m2.core.shards.snapshot() == m.core.shards.snapshot()  # type: ignore[union-attr]
    assert m2.scale_out(1).accepted and m2.core.spawned == 3  # worker ids are not reused


def test_http_protocol_client_retry_and_handover() -> None:
    m1 = formed(2)
    s1 = MasterServer(m1).start()
    try:
        c = MasterClient(s1.url, patience_s=5)
        st = c.status()
        assert st.world_size == 2 and st.master_url == s1.url
        assert c.scale_out(1).accepted
        code, body = c.request("POST", "/scale_in", {"n": 1})
        assert code == 409 and body["status"] == "retry"
        assert c.request("GET", "/nope")[0] == 404
        # the master's host leaves: hand the state to a new master, clients follow
        m2 = JobMaster.from_snapshot(c.post("/handover", {"url": "http://placeholder"}))
        s2 = MasterServer(m2).start()
        try:
            m1.moved_to = s2.url
            st2 = c.status()
            assert c.url == s2.url and st2.master_url == s2.url
            assert (st2.gen, st2.members, st2.changing) == (st.gen, st.members, True)
            m2.register("w2")  # the pending scale-out completes on the new master
            assert m2.group.plan is not None and m2.group.plan.target.store_port == m2.store_port
        finally:
            s2.stop()
    finally:
        s1.stop()


def test_shard_mode_over_http_exactly_once() -> None:
    m = formed(2, shard_manager=ShardManager(n=200, shard_size=50))
    s = MasterServer(m).start()
    try:
        c = MasterClient(s.url, patience_s=5)
        a, b = ShardReader(c, "w0", chunk=20), ShardReader(c, "w1", chunk=20)
        got: list[int] = []
        ita = iter(a)
        for _ in range(2):  # w0 reads two chunks of its shard, then leaves
            _, lo, hi = next(ita)
            got += range(lo, hi)
        a.release()
        for _, lo, hi in b:
            got += range(lo, hi)
        assert sorted(got) == list(range(200))
    finally:
        s.stop()


def test_failure_recovery_forms_a_generation_of_the_survivors() -> None:
    sp = RecordingSpawner()
    m = formed(3, spawner=sp, recovery_window_s=60)
    m.scale_out(1)
    m.register("w3")
    assert m.group.plan is not None
    cancelled = m.group.plan.target.prefix
    sp.codes["w1"] = 1  # its process failed
    m.failed("w2", gen=1, step=9)
    assert m.assignment("w2", after_gen=1)["status"] == "wait"  # w0 (alive) has not reported yet
    m.failed("w0", gen=1, step=8)
    a = m.assignment("w2", after_gen=1)
    assert a["status"] == "assigned" and a["generation"]["members"] == ["w0", "w2"]
    assert m.assignment("w1", after_gen=1)["status"] == "finished"
    assert m.group.store.get(cancelled + "go") == b"cancel"  # the newcomer stops waiting for the old plan ...
    st = m.status()
    assert st.gen == 3 and st.changes[-1]["kind"] == "recover"
    # ... and is planned into the survivors' generation right away (the scale-out is not lost)
    assert st.state == "changing" and st.pending == "scale_out:published"
    a3 = m.assignment("w3")
    assert a3["joining"] and a3["generation"]["members"] == ["w0", "w2", "w3"]
    assert m.scale_out(1).status == "retry"
    m.switched(a3["generation"]["gen"], 10)
    assert m.scale_out(1).accepted  # the job takes requests again


def test_failure_recovery_window_without_process_knowledge() -> None:
    m = formed(2, recovery_window_s=0.0)
    m.failed("w1", gen=1, step=3)
    assert m.status().members == ("w1",)


def test_a_master_with_a_credential_refuses_requests_without_it() -> None:
    """The attack: any local process POSTs /scale_in to a job's master. With
    the job's credential set, a request without it (or with another job's)
    gets 401 and changes nothing; with it, the request is served."""
    from tidal.control.credentials import Credentials

    creds = Credentials()
    m = formed(2)
    srv = MasterServer(m, token=creds.job_token("j")).start()
    try:
        for token in ("", creds.job_token("other-job"), "Bearer-less"):
            code, ans = MasterClient(srv.url, patience_s=0, token=token).request(
                "POST", "/scale_in", {"workers": ["w1"], "request_id": "x"})
            assert code == 401 and ans["status"] == "error", (token, ans)
            code, _ = MasterClient(srv.url, patience_s=0, token=token).request("GET", "/status")
            assert code == 401
        assert m.status().world_size == 2 and m.status().pending is None  # nothing changed
        ok = MasterClient(srv.url, patience_s=0, token=creds.job_token("j"))
        assert ok.status().world_size == 2
        assert ok.scale_in(workers=["w1"]).status == "accepted"
    finally:
        srv.stop()
