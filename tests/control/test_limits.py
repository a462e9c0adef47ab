"""Per-worker resource limits (docs/resources.md): the spec field, the three
enforcement backends (cgroup v2 against a fake cgroupfs directory, cgroup v1
and the RSS watchdog for real where this machine allows), the agent's
out-of-memory report reaching the server as ``worker.oom``, and end to end:
a worker that runs out of memory is replaced with 1.5x the limit, the job
finishes by itself with every sample used once and no step lost."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tidal import settings
from tidal.agent import limits
from tidal.agent.agent import start_limited
from tidal.agent.limits import Backend, CgroupV1, CgroupV2, Limiter, Limits, Placement, detect, node_memory
from tidal.agent.proctable import Child, Proc, ProcTable
from tidal.control.db import Store
from tidal.control.server import create_app
from tidal.control.spec import JobSubmission, load_spec_file, parse_memory
from tidal.core.errors import InputError

MiB = 2**20
pytestmark = pytest.mark.timeout(180)


def run_limited(limiter: Limiter, pl: Placement | None, code: str, timeout: float = 60) -> tuple[int, str]:
    """``python -c code`` started inside ``pl`` as the agent starts a worker; its exit code and output."""
    argv = limiter.wrap(pl, [sys.executable, "-c", code])
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    h = Child(proc)
    limiter.started(pl, h)
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, out


# -- the spec -----------------------------------------------------------------------------------
def test_memory_sizes_parse_and_a_bad_resource_names_its_field(tmp_path):
    assert parse_memory("2Gi") == 2 * 2**30 and parse_memory("512Mi") == 512 * MiB
    assert parse_memory("1.5G") == 1_500_000_000 and parse_memory(64 * MiB) == 64 * MiB
    for bad in ("2Zi", "lots", "-1Gi", "1Ki", True, 1.5):
        with pytest.raises(ValueError):
            parse_memory(bad)
    ok = JobSubmission(name="a", script="t.py", gpus=1, iterations=1, resources={"memory": "2Gi", "cpus": 1.5})
    assert ok.resources is not None and ok.resources.limits() == {"memory": 2 * 2**30, "cpus": 1.5}
    for resources, field in (({"memory": "2Zi"}, "resources.memory"), ({"cpus": 0}, "resources.cpus"),
                             ({"gpu_memory": "1Gi"}, "resources.gpu_memory")):
        spec = tmp_path / "job.yaml"
        spec.write_text(f"name: a\nscript: t.py\ngpus: 1\niterations: 5\nresources: {resources}\n")
        with pytest.raises(InputError) as e:
            load_spec_file(spec)
        assert e.value.field == field, e.value


# -- cgroup v2 (not available on this machine: a fake cgroupfs directory) -----------------------------
class FakeFs:
    """A cgroupfs stand-in: the agent's v2 cgroup with memory and cpu offered."""

    def __init__(self, tmp: Path, controllers: str = "cpu io memory pids") -> None:
        self.root = tmp / "cgroup"
        self.parent = self.root / "system.slice" / "tidal-agent.service"
        self.parent.mkdir(parents=True)
        (self.parent / "cgroup.controllers").write_text(controllers + "\n")
        (self.parent / "cgroup.subtree_control").write_text("")
        self.proc = tmp / "proc-self-cgroup"
        self.proc.write_text("0::/system.slice/tidal-agent.service\n")


def fake_rmdir(monkeypatch) -> list[Path]:
    """A cgroupfs removes a cgroup's directory with its files; a plain directory needs rmtree."""
    removed: list[Path] = []

    def remove(d: Path, timeout_s: float = 3.0) -> bool:
        removed.append(Path(d))
        shutil.rmtree(d)
        return True

    monkeypatch.setattr(limits, "remove_cgroup", remove)
    return removed


def test_cgroup_v2_writes_the_limits_and_reads_an_oom_kill(tmp_path, monkeypatch):
    fs = FakeFs(tmp_path)
    backend = detect("auto", fs.root, fs.proc)
    assert isinstance(backend, CgroupV2) and backend.parent == fs.parent
    limiter = Limiter(backend)
    pl = limiter.place("j-w1", Limits(memory=300 * MiB, cpus=1.5))
    d = fs.parent / "tidal-j-w1"
    assert pl is not None and pl.backend == "cgroup2" and pl.memory_dir == str(d) and pl.cpu == "cpu.max"
    assert (d / "memory.max").read_text() == str(300 * MiB)
    assert (d / "memory.swap.max").read_text() == "0" and (d / "memory.oom.group").read_text() == "1"
    assert (d / "cpu.max").read_text() == "150000 100000"
    # memory, then cpu handed down to the children (each written in turn; a plain file keeps the last)
    assert backend.enabled == {"memory", "cpu"} and (fs.parent / "cgroup.subtree_control").read_text() == "+cpu"
    # the process enters the cgroup before running anything: sh writes its own pid, then execs it
    code, out = run_limited(limiter, pl, "import os; print(os.getpid())")
    assert code == 0 and (d / "cgroup.procs").read_text().split() == [out.strip()]
    (d / "cgroup.procs").write_text("")  # the process is gone (a real cgroupfs empties this itself)
    (d / "memory.events").write_text("low 0\nhigh 0\nmax 12\noom 1\noom_kill 1\noom_group_kill 1\n")
    (d / "memory.peak").write_text(str(300 * MiB))
    removed = fake_rmdir(monkeypatch)
    assert limiter.finished(pl, -9) == {"limit": 300 * MiB, "peak": 300 * MiB, "backend": "cgroup2"}
    assert removed == [d] and not d.exists()


def test_cgroup_v2_without_the_memory_controller_is_not_used(tmp_path):
    fs = FakeFs(tmp_path, controllers="hugetlb")  # what this machine's /sys/fs/cgroup/unified offers
    assert CgroupV2.find(fs.root, fs.proc) is None
    assert type(detect("auto", fs.root, fs.proc)) is Backend  # no v1 memory hierarchy there either: the watchdog
    assert detect("off", fs.root, fs.proc) is None
    with pytest.raises(ValueError, match="limits mode"):
        detect("lxc", fs.root, fs.proc)


def test_a_normal_exit_under_cgroup_v2_is_no_oom(tmp_path, monkeypatch):
    fs = FakeFs(tmp_path, controllers="memory")
    limiter = Limiter(CgroupV2(fs.parent))
    pl = limiter.place("j-w2", Limits(memory=100 * MiB, cpus=1))
    d = fs.parent / "tidal-j-w2"
    assert pl is not None and pl.cpu == "none" and not (d / "cpu.max").exists()  # no cpu controller offered
    (d / "memory.events").write_text("oom 0\noom_kill 0\n")
    fake_rmdir(monkeypatch)
    assert limiter.finished(pl, 0) is None and not d.exists()


# -- cgroup v1 (this machine: a writable memory hierarchy) -----------------------------------------
def v1_or_skip() -> CgroupV1:
    found = CgroupV1.find()
    if found is None:
        pytest.skip("no writable cgroup v1 memory hierarchy here")
    return found


# grows to 1 GiB (then exits 0: a limit that does not hold fails the test instead of eating the machine)
HOG = "b = []\nfor _ in range(64):\n    b.append(bytearray(16 << 20))\n"


def test_cgroup_v1_kills_a_process_over_its_limit_and_reports_oom():
    backend = v1_or_skip()
    limiter = Limiter(backend)
    pl = limiter.place(f"test-{os.getpid()}-hog", Limits(memory=128 * MiB))
    assert pl is not None and pl.backend == "cgroup1"
    d = Path(pl.memory_dir)
    assert d.parent == backend.memory_parent and (d / "memory.limit_in_bytes").read_text().strip() == str(128 * MiB)
    try:
        code, _ = run_limited(limiter, pl, "import time; time.sleep(0.3)\n" + HOG)
        assert code == -signal.SIGKILL
        oom = limiter.finished(pl, code)
    finally:
        limiter.release(pl)
    assert oom is not None and oom["limit"] == 128 * MiB and oom["backend"] == "cgroup1"
    assert 100 * MiB < oom["peak"] <= 128 * MiB
    assert not d.exists()  # removed


def test_cgroup_v1_process_within_limits_is_no_oom_and_its_cgroup_goes():
    limiter = Limiter(v1_or_skip())
    pl = limiter.place(f"test-{os.getpid()}-ok", Limits(memory=256 * MiB))
    assert pl is not None
    code, out = run_limited(limiter, pl, "b = bytearray(32 << 20); print(open('/proc/self/cgroup').read())")
    assert code == 0 and f"memory:/{Path(pl.memory_dir).relative_to(Path('/sys/fs/cgroup/memory'))}" in out
    assert limiter.finished(pl, code) is None and not Path(pl.memory_dir).exists()


def test_cgroup_v1_cpu_quota_holds_a_busy_process_to_its_share():
    backend = v1_or_skip()
    if backend.cpu_parent is None:
        pytest.skip("no writable cgroup v1 cpu hierarchy here")
    limiter = Limiter(backend)
    pl = limiter.place(f"test-{os.getpid()}-cpu", Limits(cpus=0.25))
    assert pl is not None and pl.cpu == "cfs_quota" and not pl.memory_dir
    busy = ("import os, time\nt = time.time()\nwhile time.time() - t < 1.5: pass\n"
            "print(sum(os.times()[:2]))")
    try:
        code, out = run_limited(limiter, pl, busy)
    finally:
        limiter.release(pl)
    assert code == 0
    assert float(out.strip()) < 0.6, f"{out.strip()} s of CPU in 1.5 s at 0.25 CPUs"  # unlimited: about 1.5
    assert not Path(pl.cpu_dir).exists()


def test_a_failed_launch_leaves_no_cgroup(tmp_path):
    limiter = Limiter(v1_or_skip())

    def broken(*_a, **_k):
        raise OSError("no such interpreter")

    row = {"id": 7, "job": "j", "name": "w0", "kind": "worker", "resources": {"memory": 64 * MiB}}
    before = set(Path(limiter.backend.memory_parent).iterdir())
    with pytest.raises(OSError):
        start_limited(limiter, broken, row, ["nope"], {}, None, tmp_path / "w0.log")
    assert set(Path(limiter.backend.memory_parent).iterdir()) == before


# -- the watchdog (everywhere) ---------------------------------------------------------------------
def test_watchdog_kills_a_process_tree_over_its_limit():
    """The worker itself stays small; the child it started grows. Their sum is over the limit: both die."""
    limiter = Limiter(Backend(), poll_s=0.05)
    pl = limiter.place("hog", Limits(memory=200 * MiB))
    assert pl is not None and pl.backend == "watchdog" and pl.procs_files() == []
    child = "import time; time.sleep(0.2)\nb = []\nfor _ in range(128):\n    b.append(bytearray(8 << 20)); time.sleep(0.01)\n"
    code = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}]); print('survived')"
    try:
        rc, out = run_limited(limiter, pl, code)
        oom = limiter.finished(pl, rc)
    finally:
        limiter.close()
    assert rc == -signal.SIGKILL and "survived" not in out
    assert oom is not None and oom["backend"] == "watchdog" and oom["limit"] == 200 * MiB
    assert oom["peak"] > 200 * MiB


def test_watchdog_leaves_a_process_within_its_limit_alone():
    limiter = Limiter(Backend(), poll_s=0.05)
    pl = limiter.place("ok", Limits(memory=300 * MiB, cpus=1))
    try:
        rc, out = run_limited(limiter, pl, "import os, time; b = bytearray(64 << 20); time.sleep(0.5); "
                                           "print(len(os.sched_getaffinity(0)))")
        assert limiter.finished(pl, rc) is None
    finally:
        limiter.close()
    assert rc == 0 and out.strip() == "1"  # no cpu controller: pinned to ceil(1) CPU
    assert pl.cpu == "affinity" and 64 * MiB < pl.peak < 300 * MiB


def test_placements_survive_an_agent_restart_in_its_process_table(tmp_path):
    """The process table keeps a worker's placement: a restarted agent
    adopts the worker with its limits and the cgroups to watch and remove."""
    limiter = Limiter(Backend(), poll_s=0.05)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        pl = limiter.place("j-w0", Limits(memory=100 * MiB))
        table = ProcTable(tmp_path / "procs.json")
        table.save({1: Proc(1, "j", "w0", "worker", Child(sleeper), tmp_path / "w0.log", limits=pl)}, {})
        procs, _ = ProcTable(tmp_path / "procs.json").load()
        assert procs[1].limits == pl and procs[1].handle.poll() is None
    finally:
        sleeper.kill()
        sleeper.wait()


def test_node_memory_is_the_lower_of_memtotal_and_the_agents_cgroup(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       8000000 kB\nMemFree: 1 kB\n")
    fs = FakeFs(tmp_path)
    assert node_memory(meminfo, fs.root, fs.proc) == 8000000 * 1024
    (fs.root / "system.slice" / "tidal-agent.service" / "memory.max").write_text(str(2 * 2**30))
    assert node_memory(meminfo, fs.root, fs.proc) == 2 * 2**30
    assert node_memory() > 0  # this machine


# -- the server: the agent's report -------------------------------------------------------------
def test_an_oom_report_becomes_a_worker_oom_event(tmp_path):
    store = Store(f"sqlite:///{tmp_path / 't.db'}")
    client = TestClient(create_app(store, admin_token="adm", home=tmp_path, start_loop=False))
    hdr = {"Authorization": "Bearer adm"}
    client.post("/internal/agents/register", json={"name": "n0", "num_gpus": 1, "memory": 8 * 2**30}, headers=hdr)
    from tidal.control.db import Event, Node, Process

    with store.session() as s:
        s.add(Process(id=5, job_id="j", name="w1", kind="worker", node="n0", gpu=0, state="running",
                      resources={"memory": 256 * MiB}))
    oom = {"limit": 256 * MiB, "peak": 300 * MiB, "backend": "watchdog"}
    body = {"procs": [{"id": 5, "state": "failed", "pid": 9, "exit_code": -9, "oom": oom}]}
    for _ in range(2):  # an agent repeats a report until it is acknowledged: one event
        assert client.post("/internal/agents/n0/heartbeat", json=body, headers=hdr).status_code == 200
    with store.session() as s:
        events = [e for e in s.query(Event).filter(Event.kind == "worker.oom")]
        assert len(events) == 1 and events[0].job_id == "j"
        assert events[0].detail["worker"] == "w1" and events[0].detail["limit"] == 256 * MiB
        assert events[0].detail["peak"] == 300 * MiB
        assert s.get(Process, 5).resources == {"memory": 256 * MiB, "oom": oom}
        assert s.get(Node, "n0").memory == 8 * 2**30


# -- end to end -----------------------------------------------------------------------------------
#: the demo job, whose worker $APP_OOM_WORKER allocates without end at step $APP_OOM_AT_STEP (only
#: that worker id: the one that replaces it has another id, as every new worker of a job has)
OOM_JOB = '''
import os, runpy, time
import tidal.runtime
from tidal import settings

_init = tidal.runtime.init


def init(*args, **kwargs):
    job = _init(*args, **kwargs)
    if settings.WORKER_ID.get() == os.environ.get("APP_OOM_WORKER"):
        at, step = int(os.environ["APP_OOM_AT_STEP"]), job.step

        def step_or_hog(*a, **k):
            if job.step_count >= at:
                print(f"step {job.step_count}: allocating past the limit", flush=True)
                hog = [bytearray(16 << 20) for _ in range(256) if not time.sleep(0.005)]  # up to 4 GiB
                raise SystemExit(f"the memory limit did not hold: {len(hog) * 16} MiB allocated")
            return step(*a, **k)

        job.step = step_or_hog
    return job


tidal.runtime.init = init
runpy.run_module("tidal.control.demo_job", run_name="__main__")
'''


def own_v1_cgroups() -> set[str]:
    found = CgroupV1.find()
    return {d.name for d in found.memory_parent.glob("tidal-*")} if found else set()


def oom_recovers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """One node with 4 virtual GPUs, the job on all 4 with 768 MiB per worker;
    w1 runs out of memory at step 15. The job goes on with 3, grows back to 4
    with a new worker at 1152 MiB, and completes: every sample once, every step once."""
    from test_e2e import check_exactly_once, job, procs, wait
    from tidal.control.local import LocalCluster

    monkeypatch.setenv(settings.LIMITS.name, mode)  # the agents inherit it
    script = tmp_path / "oom_job.py"
    script.write_text(textwrap.dedent(OOM_JOB))
    rec, samples, epochs = tmp_path / "records", 2048, 3
    spec = {**job("a", rec, samples, epochs, "1-4", 3600), "script": str(script),
            "env": {"APP_OOM_WORKER": "w1", "APP_OOM_AT_STEP": "15"}, "resources": {"memory": "768Mi"}}
    before = own_v1_cgroups()
    with LocalCluster(tmp_path / "home", nodes=1, gpus_per_node=4, policy="edf", tick_s=1.0) as c:
        user = c.api(c.api().add_user("alice"))
        a = user.submit(spec)["id"]
        wait(lambda: any(e["kind"] == "job.memory_raised" for e in user.job(a)["events"]), 120, "an OOM", user)
        wait(lambda: user.job(a)["state"] in ("completed", "failed"), 120, "A to finish", user)
        final, workers = user.job(a), procs(user, a, kind="worker")
        from typer.testing import CliRunner

        from tidal.cli.main import app

        shown = CliRunner().invoke(app, ["job", a, "--server", c.url, "--token", user.token, "-o", "wide"]).stdout
    assert final["state"] == "completed", final["exit_info"]
    ev = {e["kind"]: e for e in final["events"]}
    oom, raised = ev["worker.oom"], ev["job.memory_raised"]
    assert oom["worker"] == "w1" and oom["limit"] == 768 * MiB and oom["peak"] >= 700 * MiB, oom
    assert oom["backend"] == (mode if mode != "auto" else detect().name)
    assert (raised["memory_from"], raised["memory_to"]) == (768 * MiB, 1152 * MiB) and "w1" in raised["reason"]
    kinds = [e["kind"] for e in final["events"]]
    assert kinds.count("worker.oom") == 1 and "job.scale_out" in kinds[kinds.index("job.memory_raised"):]
    new = [p for p in workers if p["name"] not in ("w0", "w1", "w2", "w3")]
    assert new and all(p["resources"]["memory"] == 1152 * MiB for p in new)
    assert final["resources"] == {"memory": 1152 * MiB, "ooms": 1}
    assert "worker.oom" in shown and "job.memory_raised" in shown
    check_exactly_once(rec / "a", samples, epochs)
    steps = {int(line.split()[1]) for f in (rec / "a").glob("*.ranges") for line in f.read_text().splitlines()}
    assert sorted(steps) == list(range(samples * epochs // 64)), "a step lost or repeated"
    assert own_v1_cgroups() == before, "cgroups left behind"


@pytest.mark.slow
def test_a_worker_out_of_memory_is_replaced_with_more_and_the_job_completes(tmp_path, monkeypatch):
    """This machine's best backend (cgroup v1 here)."""
    oom_recovers(tmp_path, monkeypatch, "auto")


@pytest.mark.slow
def test_the_watchdog_catches_an_oom_end_to_end(tmp_path, monkeypatch):
    oom_recovers(tmp_path, monkeypatch, "watchdog")
