"""`tidal up`: impossible options are refused at once (one line, exit 2,
nothing started), and a Ctrl-C suspends the running jobs with a checkpoint
before the cluster stops, so that the next `tidal up` on the same home
resumes them where they stopped (a real `tidal up` process, a real job)."""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

import tidal.control.demo_job as demo_job
from tidal.cli.main import app
from tidal.control.client import Api
from tidal.control.db import Event, Job, Node, Store
from tidal.control.local import free_port
from test_e2e import check_exactly_once

runner = CliRunner()


def _up_fails(args: list[str], message: str, home: Path) -> None:
    res = runner.invoke(app, ["up", *args, "--home", str(home)])
    assert res.exit_code == 2, (args, res.output)
    assert res.exception is None or isinstance(res.exception, SystemExit), (args, repr(res.exception))
    text = " ".join(res.output.split())
    assert message in text, (args, res.output)
    assert len(res.output.strip().splitlines()) == 1, res.output  # one line
    assert not (home / "tidal.db").exists() and not (home / "server.json").exists()  # nothing started


@pytest.mark.parametrize("args, message", [
    (["--gpus", "0"], "error: --gpus 0: need at least 1"),
    (["--gpus", "-4"], "error: --gpus -4: need at least 1"),
    (["--gpus", "100000"], "error: --gpus 100000: at most 1024 per node, so at most 2048 with 2 node(s)"),
    (["--nodes", "0"], "error: --nodes 0: need at least 1"),
    (["--nodes", "-1"], "error: --nodes -1: need at least 1"),
    (["--nodes", "500", "--gpus", "500"], "error: --nodes 500: the embedded cluster runs at most 64"),
    (["--gpus", "3", "--nodes", "2"], "error: --gpus 3 does not divide into 2 nodes"),
    (["--gpus", "1", "--nodes", "2"], "error: --gpus 1 does not divide into 2 nodes"),
    (["--port", "0"], "error: --port 0: a port is 1-65535"),
    (["--port", "70000"], "error: --port 70000: a port is 1-65535"),
    (["--policy", "nope"], "error: --policy nope: unknown policy (known: "),
    (["--cluster", "1xT4:4", "--gpus", "4"], "error: --cluster gives every node's GPUs: leave out --gpus and --nodes"),
    (["--cluster", "1xT4:4", "--nodes", "1"], "error: --cluster gives every node's GPUs: leave out --gpus"),
    (["--cluster", "1xT4:0"], "error: --cluster 1xT4:0: '1xT4:0' needs at least one node and one GPU"),
    (["--cluster", "65x2"], "error: --cluster 65x2: 65 nodes; the embedded cluster runs at most 64"),
    (["--cluster", "1xT4:2000"], "error: --cluster 1xT4:2000: at most 1024 GPUs per node"),
    (["--cluster", "T4"], "error: --cluster T4: not a cluster spec like"),
    (["--cluster", "1xT4:4", "--policy", "nope"], "error: --policy nope: unknown policy"),
])
def test_impossible_up_options_fail_at_once(args, message, tmp_path):
    _up_fails(args, message, tmp_path / "home")


def test_up_refuses_a_taken_port_a_busy_home_and_a_file_as_home(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        _up_fails(["--port", str(port)], f"error: --port {port}: in use", tmp_path / "a")
    home = tmp_path / "b"
    home.mkdir()
    with open(home / "up.lock", "w") as held:  # another `tidal up` holds this home
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("4242")
        held.flush()
        _up_fails(["--port", str(free_port())], f"--home {home}: another `tidal up` (pid 4242) runs on it", home)
    (tmp_path / "f").write_text("")
    _up_fails([], f"error: --home {tmp_path / 'f'}: exists and is not a directory", tmp_path / "f")


def test_up_refuses_a_home_whose_nodes_had_other_gpu_counts(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    store = Store(f"sqlite:///{home / 'tidal.db'}")
    with store.session() as s:
        s.add(Node(name="node-0", ordinal=1, num_gpus=4, state="down"))
    store.engine.dispose()
    res = runner.invoke(app, ["up", "--gpus", "4", "--nodes", "2", "--port", str(free_port()), "--home", str(home)])
    assert res.exit_code == 2, res.output
    assert "node-0 has 4 GPU(s), not 2" in " ".join(res.output.split()), res.output
    assert "same --gpus and --nodes" in " ".join(res.output.split())


def test_up_refuses_a_cluster_whose_node_sizes_changed(tmp_path):
    """A home made by `--cluster 1xT4:4,1xA100:2` cannot come back with node-1 of 4 GPUs."""
    home = tmp_path / "home"
    home.mkdir()
    store = Store(f"sqlite:///{home / 'tidal.db'}")
    with store.session() as s:
        s.add(Node(name="node-0", ordinal=1, num_gpus=4, state="down"))
        s.add(Node(name="node-1", ordinal=2, num_gpus=2, state="down"))
    store.engine.dispose()
    res = runner.invoke(app, ["up", "--cluster", "2xT4:4", "--port", str(free_port()), "--home", str(home)])
    assert res.exit_code == 2, res.output
    assert "node-1 has 2 GPU(s), not 4" in " ".join(res.output.split()), res.output


# -- a real `tidal up`: Ctrl-C, then again ------------------------------------------------


@pytest.mark.timeout(120)
def test_up_with_nodes_of_different_sizes_and_types(tmp_path):
    """`tidal up --cluster 1xT4:4,1xA100:2`: two agents, of 4 T4 and 2 A100
    virtual GPUs, each node labelled with its type, all 6 GPUs in the
    cluster; Ctrl-C stops it with exit 0."""
    home, port = tmp_path / "home", free_port()
    up = Up(home, port, nodes=["--cluster", "1xT4:4,1xA100:2"])
    try:
        up.wait_up()
        assert "1 node(s) × 4 T4, 1 node(s) × 2 A100" in up.text(), up.text()
        admin = Api(up.url, (home / "admin.token").read_text().strip())
        end = time.time() + 60
        while len([n for n in admin.cluster()["nodes"] if n["state"] == "up"]) < 2:
            assert time.time() < end, admin.cluster()
            time.sleep(0.3)
        nodes = {n["name"]: n for n in admin.cluster()["nodes"]}
        assert {k: (len(n["gpus"]), n["labels"].get("gpu-type")) for k, n in nodes.items()} == {
            "node-0": (4, "T4"), "node-1": (2, "A100")}
        assert up.stop(signal.SIGINT, 60) == 0, up.text()
    finally:
        if up.proc.poll() is None:
            os.killpg(up.proc.pid, signal.SIGKILL)
    assert "Traceback" not in up.text(), up.text()


class Up:
    """A `tidal up` process on ``home``, its output in ``home/../up-N.out``."""

    count = 0

    def __init__(self, home: Path, port: int, gpus: int = 0, nodes: list[str] | None = None) -> None:
        Up.count += 1
        self.out = home.parent / f"up-{Up.count}.out"
        env = {**os.environ, "TIDAL_HOME": str(home), "OMP_NUM_THREADS": "1"}
        shape = nodes or ["--gpus", str(gpus), "--nodes", "1"]
        with open(self.out, "w") as fh:
            self.proc = subprocess.Popen([sys.executable, "-m", "tidal", "up", *shape,
                                          "--port", str(port), "--home", str(home)], env=env, stdout=fh,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        self.home, self.url = home, f"http://127.0.0.1:{port}"

    def text(self) -> str:
        return self.out.read_text()

    def wait_up(self, timeout_s: float = 90.0) -> Api:
        """The API with the user token `tidal up` wrote, once it is up."""
        end = time.time() + timeout_s
        while f"Tidal cluster up: {self.url}" not in self.text():
            assert self.proc.poll() is None, self.text()
            assert time.time() < end, "`tidal up` did not come up:\n" + self.text()
            time.sleep(0.3)
        return Api(self.url, (self.home / "token").read_text().strip())

    def stop(self, sig: int, timeout_s: float) -> int:
        os.kill(self.proc.pid, sig)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise AssertionError(f"`tidal up` did not stop within {timeout_s} s:\n{self.text()}")


def _wait(pred, timeout_s: float, what: str, up: Up) -> None:
    end = time.time() + timeout_s
    while not pred():
        assert up.proc.poll() is None, up.text()
        assert time.time() < end, f"timed out waiting for {what}"
        time.sleep(0.5)


def _steps(rec: Path, workers: set[str]) -> list[int]:
    return sorted({int(line.split()[1]) for w in workers for line in (rec / f"{w}.ranges").read_text().splitlines()})


def _submit(api: Api, name: str, gpus: str, args: list[str], iterations: int, **extra) -> str:
    body = {"name": name, "script": demo_job.__file__, "gpus": gpus, "iterations": iterations, "deadline": 3600,
            "args": args}
    body.update(extra)
    return api.submit(body)["id"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ctrl_c_suspends_running_jobs_and_the_next_up_resumes_them(tmp_path):
    """One node with 3 virtual GPUs. Job A (elastic, 1-2 GPUs, checkpoints)
    and job B (1 GPU, no checkpoint directory: its master refuses to
    suspend) train. SIGINT to `tidal up`: A is suspended with a checkpoint
    (pending, its step recorded), B is named as not suspended, `up` exits 0.
    The next `tidal up` on the home resumes A from exactly that step (no step
    redone or skipped) and A completes with every sample used once per epoch;
    B, stopped without a checkpoint, fails."""
    home, rec, port = tmp_path / "home", tmp_path / "rec", free_port()
    samples, epochs = 2048, 3
    up = Up(home, port, gpus=3)
    try:
        api = up.wait_up()
        # B's workers keep no checkpoint (the script drops the directory its agent gives it)
        no_ckpt = tmp_path / "no_checkpoint.py"
        no_ckpt.write_text(f"import os, runpy\nos.environ.pop('TIDAL_CHECKPOINT_DIR', None)\n"
                           f"runpy.run_path({demo_job.__file__!r}, run_name='__main__')\n")
        b = _submit(api, "b", "1", ["--samples", "100000", "--epochs", "5", "--sample-time", "0.01"], 100000,
                    script=str(no_ckpt))
        a = _submit(api, "a", "1-2", ["--samples", str(samples), "--epochs", str(epochs), "--sample-time", "0.01",
                                        "--record", str(rec)], samples * epochs // 64)
        _wait(lambda: api.job(a)["step"] > 15 and api.job(b)["step"] > 2, 240, "A and B to train", up)
        assert up.stop(signal.SIGINT, 120) == 0, up.text()
    finally:
        if up.proc.poll() is None:
            os.killpg(up.proc.pid, signal.SIGKILL)
    said = up.text()
    assert "stopping: suspending 2 running job(s) with a checkpoint" in said and "Ctrl-C again to stop at once" in said
    assert f"{b} cannot be suspended (its master refused:" in said, said
    assert f"suspended 1 job(s) with a checkpoint: {a};" in said and f"not suspended (their master refused): {b}" in said
    assert "Traceback" not in said, said

    store = Store(f"sqlite:///{home / 'tidal.db'}")
    with store.session(write=False) as s:
        job_a = s.get(Job, a)
        assert job_a.state == "pending", job_a.state
        suspended_at = int(job_a.tags["_resume_step"])
        kinds = [e.kind for e in s.query(Event).filter(Event.job_id == a).order_by(Event.id)]
    store.engine.dispose()
    assert kinds[-1] == "job.suspended" and "job.suspend" in kinds, kinds
    assert (home / "checkpoints" / a / f"ckpt-{suspended_at:09d}.pt").exists(), list((home / "checkpoints" / a).iterdir())
    first_workers = {f.stem for f in rec.glob("*.ranges")}
    assert _steps(rec, first_workers)[-1] == suspended_at - 1  # the first incarnation stopped at the agreed step

    up = Up(home, port, gpus=3)
    try:
        api = up.wait_up()
        _wait(lambda: "submit with:" in up.text(), 30, "`tidal up`'s last line", up)  # printed after the resumes
        assert f"suspended job(s) resume from their checkpoints: {a}" in up.text(), up.text()
        _wait(lambda: api.job(a)["state"] in ("completed", "failed", "cancelled"), 300, "A to complete", up)
        final = api.job(a)
        assert final["state"] == "completed", final
        kinds = [e["kind"] for e in final["events"]]
        assert kinds.index("job.suspended") < kinds.index("job.resume"), kinds
        # B lost its processes when the cluster stopped: it fails, as `up` said
        _wait(lambda: api.job(b)["state"] == "failed", 60, "B to fail", up)
        assert up.stop(signal.SIGTERM, 120) == 0, up.text()
    finally:
        if up.proc.poll() is None:
            os.killpg(up.proc.pid, signal.SIGKILL)
    second_workers = {f.stem for f in rec.glob("*.ranges")} - first_workers
    assert second_workers, "no worker of the resumed job recorded a step"
    assert _steps(rec, second_workers)[0] == suspended_at  # resumed at the suspended step: none redone
    check_exactly_once(rec, samples, epochs)
