"""The job master process of the control plane: its spawner starts nothing
(the coordinator starts the job's workers) and its reporter ends the master
when the job finished, or when it was suspended and its workers left."""

from __future__ import annotations

import pytest

from tidal.control.jobproc import ControlPlaneSpawner, Reporter
from tidal.httpjson import JsonHttp
from tidal.runtime.messages import Status
from tidal.runtime.spawner import Spawner, WorkerLaunch


def status(state: str) -> Status:
    return Status(job="j", state=state, gen=1, world_size=2, members=("w0", "w1"), step=5, cursor=0, epoch=0,
                  step_time_s=0.1, changing=False, pending=None)


class Server:
    def __init__(self) -> None:
        self.posts: list[tuple[str, dict]] = []

    def call(self, method, path, body=None, params=None, patience_s=None):
        self.posts.append((path, body))
        return 200, {"ok": True}


def test_the_masters_spawner_refuses_to_spawn_and_kills_through_the_server():
    server = Server()
    sp = ControlPlaneSpawner(server, "j")  # type: ignore[arg-type]
    assert isinstance(sp, Spawner)
    with pytest.raises(RuntimeError, match="the coordinator starts its workers"):
        sp.spawn([WorkerLaunch("w2")])
    sp.kill("w1")
    assert server.posts == [("/internal/jobs/j/kill", {"name": "w1"})]
    assert sp.exit_codes() == {}
    down = ControlPlaneSpawner(JsonHttp("http://127.0.0.1:9", patience_s=0), "j")
    with pytest.raises(Exception):
        down.kill("w1")


def test_the_reporter_posts_status_and_stops_when_the_job_is_over():
    server, left, t = Server(), [False], [0.0]
    r = Reporter(server, "j", lambda: left[0], clock=lambda: t[0])  # type: ignore[arg-type]
    assert not r.done()
    r.report(status("running"))
    assert server.posts[-1][0] == "/internal/jobs/j/status" and server.posts[-1][1]["world_size"] == 2
    assert not r.done()
    r.report(status("suspended"))
    assert not r.done()  # its workers are still posting /left
    t[0] = 5.0
    left[0] = True
    assert r.done()
    r2 = Reporter(server, "j", lambda: False, clock=lambda: t[0])  # type: ignore[arg-type]
    r2.report(status("suspended"))
    assert not r2.done()
    t[0] = 16.0
    assert r2.done()  # they did not report in time: stop anyway
    r3 = Reporter(server, "j", lambda: False)  # type: ignore[arg-type]
    r3.report(status("finished"))
    assert r3.done()


def test_the_status_answer_tells_the_master_which_workers_ended():
    """A worker that died before it registered is known to the master from
    the server's answer to its next status report (its spawner's exit codes),
    so the master drops it at once instead of waiting for it."""

    class Answers(Server):
        def call(self, method, path, body=None, params=None, patience_s=None):
            self.posts.append((path, body))
            return 200, {"ok": True, "ended": {"w1": -9, "w3": 1, "w4": 0, "bad": "x"}}

    sp = ControlPlaneSpawner(Answers(), "j", lost=["w0"])  # type: ignore[arg-type]
    r = Reporter(sp.server, "j", lambda: False, on_ended=sp.note_ended)
    r.report(status("forming"))
    assert sp.exit_codes() == {"w0": -9, "w1": -9, "w3": 1}


def test_the_reporter_sends_the_goodput_numbers_as_plain_json():
    """A job measuring its gradient noise scale reports it (with its batch and
    LR factor) to the control plane; a non-finite number is sent as null, since
    the server refuses a report that is not plain JSON (and would lose its step)."""
    import dataclasses
    import json

    server = Server()
    r = Reporter(server, "j", lambda: False)  # type: ignore[arg-type]
    r.report(status("running"))
    assert "goodput" not in server.posts[-1][1]  # no estimator: nothing sent
    st = dataclasses.replace(status("running"), goodput={"batch": 128, "lr_factor": 3.5, "noise_scale": float("nan"),
                                                         "efficiency": 0.8})
    r.report(st)
    body = server.posts[-1][1]
    assert body["goodput"] == {"batch": 128, "lr_factor": 3.5, "noise_scale": None, "efficiency": 0.8}
    json.dumps(body, allow_nan=False)
