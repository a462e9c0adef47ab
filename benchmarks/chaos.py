"""Chaos on a live cluster: misbehaving jobs and failing hosts mixed with
well-behaved elastic jobs, measured against the liveness contract (every job
that holds GPUs makes progress or reaches a state that frees them, within a
bound, with the reason shown by ``tidal job ID``; docs/control.md).

    python benchmarks/chaos.py --json [--scenarios a,b,...] [--quick] [--keep]

Two single-host clusters at once, each a real ``tidal server`` and 3 ``tidal
agent`` processes with 2 virtual GPUs each (``LocalCluster``: ``python -m
tidal server`` / ``agent``, loopback, a temporary ``TIDAL_HOME``): one runs the
job scripts of ``benchmarks/chaos_jobs/`` a few at a time, the other stops
agents (SIGSTOP) one at a time; on both a pool of well-behaved elastic jobs
(tenant ``alice``) is kept running;
``tidal up`` is started and interrupted on a home of its own; the host-loss
scenarios run across Linux network namespaces (tests/multihost/netns.py,
root only). Every scenario has its own deadline and the whole run a global
one; every process started under the temporary home and every namespace is
removed at the end, also on an error or Ctrl-C.

Prints ONE JSON line (``--json``; else indented): ``jobs``, ``completed``,
``stuck`` (jobs holding GPUs without progress at the end), ``max_s_to_terminal``
(over the misbehaving jobs: from the fault to failed/completed/cancelled, or
to training again for faults the job should survive), ``lost_samples`` and
``duplicated_samples`` (every completed job whose script records its samples),
``gpu_held_by_ended_jobs``, ``gpu_given_twice`` (audit trail), the settings
used, and per scenario: name, expected, state, reason, seconds, ok.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from tidal.control.client import Api, ApiError
from tidal.control.local import LocalCluster, free_port

log = logging.getLogger("chaos")

ROOT = Path(__file__).resolve().parents[1]
JOBS = Path(__file__).resolve().parent / "chaos_jobs"
TERMINAL = frozenset({"completed", "failed", "cancelled", "dropped"})
LIVE_STATES = frozenset({"running", "resizing"})
#: events that interrupt a job's training (it is "training again" only after the last one)
DISRUPTIONS = frozenset({"job.worker_lost", "job.worker_crashed", "job.restart", "job.restarted", "job.resume",
                         "job.master_relocated", "job.workers_failed", "proc.lost"})
BOUND_S = 120.0  # the contract's bound from a fault to a terminal state or to training again
#: two GPUs, no more (a bare count lets an elastic job grow onto free GPUs)
FIXED2 = "2-2"
CANCEL_BOUND_S = 30.0


# ---------------------------------------------------------------- settings and results

@dataclass
class Settings:
    """The run's knobs; ``--quick`` makes the jobs and the waits small."""

    quick: bool = False
    start_timeout_s: float = 60.0  # TIDAL_START_TIMEOUT_S given to the servers (default 90)
    global_s: float = 900.0
    pool: int = 2  # well-behaved jobs kept running on the single-host cluster
    parallel: int = 2  # job-fault scenarios run at once
    away_long_s: float = 120.0

    def server_env(self) -> dict[str, str]:
        """The liveness settings the servers run with (the rest are defaults)."""
        return {"TIDAL_START_TIMEOUT_S": str(self.start_timeout_s)}


@dataclass
class Outcome:
    """One scenario's result."""

    name: str
    expected: str
    state: str = ""
    reason: str = ""
    seconds: float | None = None
    ok: bool = False
    job: str = ""
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def judge(self, ok: bool, note: str = "") -> "Outcome":
        self.ok = bool(ok)
        if note:
            self.note = (self.note + "; " if self.note else "") + note
        return self


class Deadline:
    """A point in time; ``left()`` never exceeds ``cap``."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self, cap: float = float("inf")) -> float:
        return max(0.0, min(cap, self.end - time.monotonic()))

    def passed(self) -> bool:
        return time.monotonic() >= self.end


#: set on Ctrl-C or an error: every wait ends at once, so the clean-up runs without delay
STOP = threading.Event()


def pause(seconds: float) -> None:
    """Sleep ``seconds`` unless the run is stopping; raise if it is."""
    if STOP.wait(max(0.0, seconds)):
        raise KeyboardInterrupt("the chaos run is stopping")


def wait_for(pred: Callable[[], Any], timeout: float, poll: float = 0.5) -> Any:
    """``pred()``'s first truthy value within ``timeout`` seconds, else None."""
    end = time.monotonic() + timeout
    while True:
        if STOP.is_set():
            raise KeyboardInterrupt("the chaos run is stopping")
        try:
            v = pred()
        except (ApiError, OSError, RuntimeError) as e:  # a server restarting, a cut link
            log.debug("wait_for: %s", e)
            v = None
        if v:
            return v
        if time.monotonic() >= end:
            return None
        pause(poll)


# ---------------------------------------------------------------- sample accounting

def audit_records(d: Path, samples: int, epochs: int) -> dict[str, int]:
    """Lost and duplicated samples of one job from its workers' records: the
    committed steps' global slices (``*.ranges``; a step redone after a
    checkpoint restart has the same slice and counts once) must
    cover every sample position of every epoch exactly once."""
    slices = {tuple(int(x) for x in ln.split()) for f in d.glob("*.ranges") for ln in f.read_text().splitlines()
              if ln.strip()}
    covered = collections.Counter(pos for _ep, _st, lo, hi in slices for pos in range(lo, hi))
    steps = collections.Counter((ep, st) for ep, st, _lo, _hi in slices)
    return {"lost": samples * epochs - len(covered), "duplicated": sum(c - 1 for c in covered.values()),
            "steps_with_two_slices": sum(c > 1 for c in steps.values())}


# ---------------------------------------------------------------- job specs

@dataclass
class Work:
    """How much a job trains: ``samples`` x ``epochs`` at ``batch`` a step."""

    samples: int
    epochs: int = 2
    batch: int = 32
    sample_time: float = 0.003

    @property
    def steps(self) -> int:
        return self.epochs * -(-self.samples // self.batch)

    def args(self) -> list[str]:
        return ["--samples", str(self.samples), "--epochs", str(self.epochs), "--batch-size", str(self.batch),
                "--sample-time", str(self.sample_time)]


def spec(name: str, script: str, work: Work, record: Path | None = None, gpus: Any = 2,
         extra: list[str] | None = None, **kw: Any) -> dict[str, Any]:
    """A job spec for a script of ``chaos_jobs`` (or an absolute path)."""
    args = work.args() + (["--record", str(record)] if record else []) + list(extra or [])
    path = script if os.path.isabs(script) else str(JOBS / script)
    return {"name": name, "script": path, "args": args, "gpus": gpus, "iterations": work.steps,
            "global_batch_size": work.batch, "deadline": 3600, **kw}


# ---------------------------------------------------------------- watching jobs

class Monitor(threading.Thread):
    """Samples every job's state, step and GPUs once a second (admin view)."""

    def __init__(self, api: Api, enter: Callable[[], contextlib.AbstractContextManager[Any]] | None = None) -> None:
        super().__init__(name="chaos-monitor", daemon=True)
        self.api, self.enter = api, enter or contextlib.nullcontext
        self.samples: dict[str, list[tuple[float, str, int, int, int]]] = collections.defaultdict(list)
        self.stop_ev = threading.Event()
        self.lock = threading.Lock()

    def run(self) -> None:
        with self.enter():
            while not self.stop_ev.is_set():
                try:
                    jobs = self.api.jobs()
                except (ApiError, OSError, RuntimeError):
                    jobs = []
                now = time.time()
                with self.lock:
                    for j in jobs:
                        self.samples[j["id"]].append((now, j["state"], int(j["step"] or 0), int(j["world_size"] or 0),
                                                      len(j["gpus"])))
                self.stop_ev.wait(1.0)

    def history(self, jid: str) -> list[tuple[float, str, int, int, int]]:
        with self.lock:
            return list(self.samples.get(jid, []))

    def last_progress(self, jid: str) -> float:
        """When the job's step last changed (its first sample if never)."""
        h = self.history(jid)
        t = h[0][0] if h else time.time()
        for (_t0, _s0, st0, *_), (t1, _s1, st1, *_) in zip(h, h[1:]):
            if st1 != st0:
                t = t1
        return t

    def stop(self) -> None:
        self.stop_ev.set()


def fault_time(api: Api, jid: str) -> float | None:
    """The earliest ``chaos-fault T`` line a job's script printed (chaos_jobs.train.fault)."""
    try:
        text = api.logs(jid)
    except (ApiError, OSError, RuntimeError):
        return None
    ts = [float(m) for m in re.findall(r"chaos-fault (\d+\.\d+)", text)]
    return min(ts) if ts else None


def disruptions(events: list[dict[str, Any]], jid: str, since: float) -> list[float]:
    """Times of the events that interrupted job ``jid``'s training after ``since``."""
    return [e["time"] for e in events if e.get("job") == jid and e["kind"] in DISRUPTIONS and e["time"] >= since]


def trained_again_at(history: list[tuple[float, str, int, int, int]], after: float, steps: int = 3) -> float | None:
    """The first sample after ``after`` at which the job is running and has
    made ``steps`` steps since its first sample after ``after``."""
    base = None
    for t, state, step, _w, _g in history:
        if t < after:
            continue
        if state in TERMINAL:
            return t if state == "completed" else None
        if base is None:
            base = step
        elif state in LIVE_STATES and step >= base + steps:
            return t
    return None


def finish(api: Api, jid: str, timeout: float) -> dict[str, Any]:
    """Job ``jid`` once terminal, or as it is after ``timeout`` seconds."""
    wait_for(lambda: api.job(jid)["state"] in TERMINAL, timeout, poll=1.0)
    return api.job(jid)


def settle(out: Outcome, j: dict[str, Any], t_fault: float | None, t_end: float | None = None) -> Outcome:
    """Fill the state, reason and seconds (fault to terminal, or to ``t_end``)."""
    out.job, out.state = j["id"], j["state"]
    out.reason = j.get("reason") or j.get("exit_info") or ""
    end = t_end if t_end is not None else (j.get("end_time") if j["state"] in TERMINAL else None)
    if t_fault is not None and end is not None:
        out.seconds = round(end - t_fault, 1)
    return out


# ---------------------------------------------------------------- the well-behaved pool

class GoodPool(threading.Thread):
    """Keeps ``slots`` well-behaved elastic jobs (tenant alice) running until
    :meth:`stop_refill`; remembers each job's record directory."""

    def __init__(self, api: Api, work_dir: Path, slots: int, work: Work) -> None:
        super().__init__(name="chaos-pool", daemon=True)
        self.api, self.dir, self.slots, self.work = api, work_dir, slots, work
        self.jobs: dict[str, Path] = {}
        self.refill = threading.Event()
        self.refill.set()
        self.error: str = ""

    def run(self) -> None:
        n = 0
        while self.refill.is_set() and not STOP.is_set():
            try:
                live = [j for j in self.jobs if self.api.job(j)["state"] not in TERMINAL]
                while len(live) < self.slots and self.refill.is_set():
                    rec = self.dir / f"good{n}"
                    jid = self.api.submit(spec(f"good{n}", "train.py", self.work, rec, gpus="1-2"))["id"]
                    self.jobs[jid], n = rec, n + 1
                    live.append(jid)
            except (ApiError, OSError, RuntimeError) as e:
                self.error = str(e)
                log.warning("pool: %s", e)
            STOP.wait(2.0)

    def stop_refill(self) -> None:
        self.refill.clear()


# ---------------------------------------------------------------- scenario context

@dataclass
class Ctx:
    """What a scenario needs: the single-host cluster, its tenants' tokens,
    the work directory, the settings and the run's deadline."""

    st: Settings
    work: Path
    deadline: Deadline
    url: str = ""
    admin_token: str = ""
    agents: list[subprocess.Popen[bytes]] = field(default_factory=list)  # node-i's agent is agents[i]
    monitor: Monitor | None = None
    tokens: dict[str, str] = field(default_factory=dict)
    records: dict[str, tuple[Path, Work]] = field(default_factory=dict)  # job -> its record dir (audited)

    def api(self, who: str = "admin") -> Api:
        return Api(self.url, self.tokens.get(who) or self.admin_token)

    def work_of(self, kind: str) -> Work:
        """Job sizes: ``pool`` (the well-behaved jobs), ``short``, ``medium``,
        ``long``; ``away`` / ``away_long`` train on through an agent's absence."""
        q = self.st.quick
        return {"pool": Work(1024 if q else 2048, 2 if q else 3),
                "short": Work(512, 2),
                "medium": Work(2048 if q else 4096, 2, sample_time=0.004),
                "long": Work(8192 if q else 16384, 2, sample_time=0.004),
                "away": Work(9600, 2, sample_time=0.004),
                "away_long": Work(24000, 2, sample_time=0.004)}[kind]


def node_of_master(j: dict[str, Any]) -> str | None:
    """The node of the job's live master process (``tidal job ID``), if any."""
    return next((p["node"] for p in j.get("processes", []) if p["kind"] == "master"
                 and p["state"] in ("pending", "running")), None)


def kinds_of(events: list[dict[str, Any]], jid: str) -> dict[str, int]:
    """How many events of each kind job ``jid`` has in the audit trail."""
    return dict(collections.Counter(e["kind"] for e in events if e.get("job") == jid))


def submit_named(ctx: Ctx, who: str, name: str, script: str, work: Work, record: bool = False,
                 **kw: Any) -> str:
    """Submit a job of ``chaos_jobs`` as tenant ``who``; with ``record`` its samples are audited."""
    api = ctx.api(who)
    rec = ctx.work / "records" / name if record else None
    jid = api.submit(spec(name, script, work, rec, **kw))["id"]
    if rec is not None:
        ctx.records[jid] = (rec, work)
    return jid


def training(api: Api, jid: str, steps: int, world: int | None = None) -> bool:
    """Whether the job is running past ``steps`` (on at least ``world`` workers)."""
    j = api.job(jid)
    return j["state"] in LIVE_STATES and j["step"] >= steps and (world is None or j["world_size"] >= world)


def recovered(ctx: Ctx, out: Outcome, jid: str, t_fault: float, timeout: float) -> dict[str, Any]:
    """Wait for job ``jid`` to end; ``out`` gets the seconds from ``t_fault``
    to its end, or, if it completed, to training again after its last
    disruption; also the job's events and (completed) its sample audit."""
    api = ctx.api("admin")
    j = finish(api, jid, timeout)
    events = api.events()
    last = max(disruptions(events, jid, t_fault), default=t_fault)
    again = trained_again_at(ctx.monitor.history(jid), last) if ctx.monitor else None
    settle(out, j, t_fault, t_end=again if j["state"] == "completed" and again is not None else None)
    out.extra["events"] = kinds_of(events, jid)
    out.extra["final_step"] = j["step"]
    if again is not None:
        out.extra["s_to_training_again"] = round(again - t_fault, 1)
    if j.get("end_time"):
        out.extra["s_to_terminal"] = round(j["end_time"] - t_fault, 1)
    if jid in ctx.records and j["state"] == "completed":
        d, w = ctx.records[jid]
        out.extra["samples"] = audit_records(d, w.samples, w.epochs)
    return j


def within(seconds: float | None, bound: float = BOUND_S) -> bool:
    """Whether a measured time exists and is within ``bound``."""
    return seconds is not None and seconds <= bound


# ---------------------------------------------------------------- job-fault scenarios

def sc_crash(ctx: Ctx, who: str) -> Outcome:
    """One rank (``one``) or every rank (``all``) raises RuntimeError at its 5th step."""
    out = Outcome(f"crash_{who}", "failed with the RuntimeError line within 120 s" + (
        " (or: the survivors train on and either complete or the crashing replacements end the job at the "
        "crash limit)" if who == "one" else ""))
    api = ctx.api("mallory")
    jid = submit_named(ctx, "mallory", f"crash-{who}", "crash_at_step.py", ctx.work_of("long"), gpus=FIXED2,
                       extra=["--who", who])
    j = finish(api, jid, ctx.deadline.left(300))
    t_fault = fault_time(api, jid)
    settle(out, j, t_fault)
    events = ctx.api().events()
    out.extra = {"events": kinds_of(events, jid), "final_step": j["step"],
                 "faults_printed": len(re.findall(r"chaos-fault", api.logs(jid)))}
    if who == "one" and j["state"] == "completed":
        return out.judge(within(out.seconds), "the survivors completed the job before the crash limit")
    return out.judge(j["state"] == "failed" and "RuntimeError" in out.reason and within(out.seconds))


def sc_never_init(ctx: Ctx) -> Outcome:
    """The script prints and exits 0 without calling tidal.runtime.init()."""
    out = Outcome("never_init", "failed 'the script never called tidal.runtime.init()' within seconds")
    api = ctx.api("mallory")
    jid = submit_named(ctx, "mallory", "never-init", "never_init.py", ctx.work_of("short"), gpus=FIXED2)
    j = finish(api, jid, ctx.deadline.left(120))
    settle(out, j, fault_time(api, jid))
    return out.judge(j["state"] == "failed" and "never called tidal.runtime.init()" in out.reason
                     and within(out.seconds, 30.0))


def sc_sleep_before_init(ctx: Ctx) -> Outcome:
    """The script sleeps 600 s before init: the start time-out must end it."""
    bound = ctx.st.start_timeout_s
    out = Outcome("sleep_before_init", f"failed after the start time-out (TIDAL_START_TIMEOUT_S={bound:g})")
    api = ctx.api("mallory")
    jid = submit_named(ctx, "mallory", "sleepy", "sleep_before_init.py", ctx.work_of("short"), gpus=FIXED2)
    j = finish(api, jid, ctx.deadline.left(bound + 150))
    settle(out, j, fault_time(api, jid))
    return out.judge(j["state"] == "failed" and within(out.seconds, bound + 30.0),
                     "" if "TIDAL_START_TIMEOUT_S" in out.reason else "the reason does not name the time-out")


def sc_kill_all(ctx: Ctx) -> Outcome:
    """Every worker of a training job is killed with SIGKILL (as by the OOM killer)."""
    out = Outcome("kill_all", "restarted from its checkpoint and completes (or fails with the reason at the "
                  "restart limit), training again within 120 s")
    api = ctx.api("mallory")
    work = ctx.work_of("medium")
    jid = submit_named(ctx, "mallory", "kill-all", "train.py", work, record=True, gpus=FIXED2)
    if not wait_for(lambda: training(api, jid, 25, world=2), ctx.deadline.left(180)):
        return settle(out, api.job(jid), None).judge(False, "never trained past step 25 on 2 workers")
    victims = [p for p in api.job(jid)["processes"] if p["kind"] == "worker" and p["state"] == "running"]
    out.extra["step_at_kill"] = api.job(jid)["step"]
    t_fault = time.time()
    for p in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p["pid"], signal.SIGKILL)
    out.extra["killed"] = len(victims)
    j = recovered(ctx, out, jid, t_fault, ctx.deadline.left(360))
    ok = (j["state"] == "completed" and out.extra.get("samples", {}).get("lost") == 0) or (
        j["state"] == "failed" and bool(out.reason))
    return out.judge(ok and within(out.seconds))


def sc_die_before_register(ctx: Ctx) -> Outcome:
    """The job's first two workers SIGKILL themselves before init."""
    out = Outcome("die_before_register", "recovers (trains and completes) or fails with the reason within 120 s")
    api = ctx.api("mallory")
    jid = submit_named(ctx, "mallory", "die-early", "die_before_register.py", ctx.work_of("short"), record=True,
                       gpus=FIXED2, extra=["--markers", str(ctx.work / "markers-die-early"), "--first", "2"])
    wait_for(lambda: fault_time(api, jid), ctx.deadline.left(120), poll=1.0)
    t_fault = fault_time(api, jid)
    j = recovered(ctx, out, jid, t_fault or time.time(), ctx.deadline.left(300))
    ok = j["state"] == "completed" or (j["state"] == "failed" and bool(out.reason))
    return out.judge(ok and within(out.seconds), "" if t_fault else "no fault line in the log")


# ---------------------------------------------------------------- unlaunchable specs

def sc_args_200k(ctx: Ctx) -> Outcome:
    """An ``args`` element of 200 KiB (over Linux's 128 KiB per argument: E2BIG at exec)."""
    out = Outcome("args_200k", "refused at submission with 422")
    api = ctx.api("mallory")
    t0 = time.time()
    try:
        huge = spec("huge-arg", "train.py", ctx.work_of("short"), gpus=1, extra=["--pad", "x" * 200 * 1024])
        jid = api.submit(huge)["id"]
    except ApiError as e:
        out.state, out.reason, out.seconds = f"refused {e.status}", str(e)[:300], round(time.time() - t0, 1)
        return out.judge(e.status == 422)
    j = finish(api, jid, ctx.deadline.left(120))
    settle(out, j, j.get("start_time") or t0)
    out.extra["events"] = kinds_of(ctx.api().events(), jid)
    return out.judge(False, f"accepted (not 422); then {j['state']} after {out.seconds} s")


def launch_fault(ctx: Ctx, out: Outcome, name: str, script: str, **kw: Any) -> Outcome:
    """Submit a job whose processes cannot start; then check that the node it
    used still takes work: a GPU of it serves another job (``node_took_a_job_of``
    names the tenant: alice, or mallory if only her other jobs got there first)."""
    api = ctx.api("mallory")
    jid = api.submit(spec(name, script, ctx.work_of("short"), gpus=FIXED2, **kw))["id"]
    j = finish(api, jid, ctx.deadline.left(150))
    settle(out, j, j.get("start_time"))
    nodes = sorted({p["node"] for p in j.get("processes", [])})
    out.extra = {"events": kinds_of(ctx.api().events(), jid), "nodes": nodes,
                 "process_errors": sorted({p["error"] for p in j.get("processes", []) if p["error"]})[:3]}
    if j["state"] not in TERMINAL:
        return out.judge(False, "not ended")
    # an elastic job that takes every free GPU, so some of the failed job's node if it still takes work
    other = ctx.api("alice").submit(spec(f"{name}-neighbour", "train.py", ctx.work_of("short"), gpus="1-6"))["id"]

    def used_after() -> str | None:  # a GPU of that node serves another job (alice's, preferably)
        alices = {j["id"] for j in ctx.api("alice").jobs()}
        held = {g["job"] for n in ctx.api().cluster()["nodes"] if n["name"] in nodes for g in n["gpus"]} - {None, jid}
        return "alice" if held & alices else ("mallory" if held else None)

    out.extra["node_took_a_job_of"] = wait_for(used_after, ctx.deadline.left(90), poll=1.0)
    with contextlib.suppress(ApiError):
        ctx.api("alice").cancel(other)  # it has shown what it had to
    return out


def sc_unreadable_script(ctx: Ctx) -> Outcome:
    """A script with mode 000 (EACCES for an unprivileged reader)."""
    out = Outcome("unreadable_script", "failed at once with the OS error (Permission denied); its node "
                  "still takes other jobs")
    path = ctx.work / "unreadable.py"
    path.write_text('print("an unreadable script ran anyway")\n')  # exits 0 without init if it runs
    path.chmod(0)
    launch_fault(ctx, out, "unreadable", str(path))
    if os.geteuid() == 0:
        out.note = "the agents run as root, which reads a mode-000 file: the script ran (it exits 0 without init)"
    ok = out.state == "failed" and "ermission denied" in out.reason and within(out.seconds, 30.0)
    return out.judge(ok and out.extra.get("node_took_a_job_of") is not None)


def sc_missing_workdir(ctx: Ctx) -> Outcome:
    """A ``workdir`` that does not exist: the agent's launch fails with ENOENT."""
    out = Outcome("missing_workdir", "failed at once with the OS error (No such file or directory); its "
                  "node still takes other jobs")
    try:
        launch_fault(ctx, out, "no-workdir", "train.py", workdir=str(ctx.work / "no" / "such" / "dir"))
    except ApiError as e:
        out.state, out.reason = f"refused {e.status}", str(e)[:300]
        return out.judge(e.status == 422, "refused at submission")
    ok = out.state == "failed" and "No such file" in out.reason and within(out.seconds, 30.0)
    return out.judge(ok and out.extra.get("node_took_a_job_of") is not None)


# ---------------------------------------------------------------- agents away

def away_run(ctx: Ctx, out: Outcome, work: Work, away_s: float) -> dict[str, Any] | None:
    """A 2-worker job of tenant alice trains; the agent of its master's node is
    stopped (SIGSTOP) for ``away_s``, then continued; the job once ended (None:
    it never trained). ``out`` gets the node, whether it was marked down and
    the job's lost processes."""
    api = ctx.api("alice")
    jid = submit_named(ctx, "alice", out.name.replace("_", "-"), "train.py", work, record=True, gpus=FIXED2)
    if not wait_for(lambda: training(api, jid, 10, world=2), ctx.deadline.left(180)):
        settle(out, api.job(jid), None).judge(False, "never trained on 2 workers")
        return None
    node = node_of_master(api.job(jid)) or "node-0"
    agent = ctx.agents[int(node.rsplit("-", 1)[1])]
    t_fault = time.time()
    os.kill(agent.pid, signal.SIGSTOP)
    try:
        pause(min(away_s, ctx.deadline.left()))
        out.extra["step_when_back"] = api.job(jid)["step"]
    finally:
        os.kill(agent.pid, signal.SIGCONT)
    j = recovered(ctx, out, jid, t_fault, ctx.deadline.left(400))
    down = [e for e in ctx.api().events() if e["kind"] == "node.down" and e["node"] == node and e["time"] >= t_fault]
    out.extra.update(node=node, away_s=away_s, node_down=bool(down),
                     lost_processes=sum(p["state"] == "lost" for p in j.get("processes", [])))
    return j


def sc_agent_away(ctx: Ctx, away_s: float) -> Outcome:
    """SIGSTOP the agent of a training job's master node for ``away_s``, then SIGCONT."""
    short = away_s < 60
    out = Outcome("agent_away_20" if short else "agent_away_120",
                  "its jobs keep running (nothing lost, no failure) and complete" if short else
                  "its processes are lost after the grace; the job restarts or relocates and completes, or fails "
                  "with a reason; nothing stuck")
    j = away_run(ctx, out, ctx.work_of("away" if short else "away_long"), away_s)
    if j is None:
        return out
    lost = out.extra.get("samples", {}).get("lost")
    if short:
        ok = j["state"] == "completed" and not out.extra["lost_processes"] and lost == 0
        return out.judge(ok and not out.extra["node_down"], "" if not out.extra["node_down"] else
                         "the node was marked down although its agent was away for less than the grace")
    ok = (j["state"] == "completed" and lost == 0) or (j["state"] == "failed" and bool(out.reason))
    return out.judge(ok and within(out.seconds))


def sc_agent_away_job_ends(ctx: Ctx) -> Outcome:
    """A short job finishes while its node's agent is away for 90 s (past the grace)."""
    out = Outcome("agent_away_job_ends", "completed (its master reported it finished before the node was "
                  "declared down), not failed; GPUs freed; within 120 s")
    j = away_run(ctx, out, Work(4800, 2, sample_time=0.004), 90.0)
    if j is None:
        return out
    ok = j["state"] == "completed" and out.extra.get("samples", {}).get("lost") == 0
    return out.judge(ok and within(out.seconds))


# ---------------------------------------------------------------- tidal up interrupted

def start_up(home: Path, port: int, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """``tidal up`` with one node of 2 virtual GPUs on ``home``."""
    with open(home / "up-console.log", "ab") as logf:
        return subprocess.Popen([sys.executable, "-m", "tidal", "up", "--gpus", "2", "--nodes", "1", "--port",
                                 str(port), "--home", str(home)], env=env, stdout=logf, stderr=subprocess.STDOUT,
                                start_new_session=True)


def stop_up(p: subprocess.Popen[bytes], timeout: float) -> int | None:
    """Ctrl-C to ``tidal up`` (SIGINT); SIGKILL of its group after ``timeout``."""
    if p.poll() is None:
        p.send_signal(signal.SIGINT)
    try:
        return p.wait(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        return None


def sc_up_interrupted(ctx: Ctx) -> Outcome:
    """``tidal up`` gets Ctrl-C while a job trains; the next ``up`` on the same home resumes it."""
    out = Outcome("up_interrupted", "the job is suspended with a checkpoint, resumes under the next tidal up "
                  "and completes (exactly once)")
    home = ctx.work / "up-home"
    home.mkdir()
    port = free_port()
    env = {**os.environ, "TIDAL_HOME": str(home), "OMP_NUM_THREADS": "1", **ctx.st.server_env()}
    url, work = f"http://127.0.0.1:{port}", ctx.work_of("medium")
    p = start_up(home, port, env)
    try:
        if not wait_for(lambda: (home / "admin.token").exists() and Api(url, "x").healthy(), ctx.deadline.left(90)):
            return out.judge(False, "tidal up did not come up")
        admin = Api(url, (home / "admin.token").read_text().strip())
        wait_for(lambda: any(n["state"] == "up" for n in admin.cluster()["nodes"]), ctx.deadline.left(60))
        user = Api(url, admin.add_user("carol"))
        rec = ctx.work / "records" / "up-job"
        jid = user.submit(spec("up-job", "train.py", work, rec, gpus="1-2"))["id"]
        if not wait_for(lambda: training(user, jid, 25), ctx.deadline.left(180)):
            return settle(out, user.job(jid), None).judge(False, "never trained past step 25")
        step, t_fault = user.job(jid)["step"], time.time()
        rc = stop_up(p, ctx.deadline.left(90))
        out.extra.update(step_at_ctrl_c=step, up_exit=rc, drain_s=round(time.time() - t_fault, 1))
        p = start_up(home, port, env)
        again = wait_for(lambda: training(user, jid, step + 3) and time.time(), ctx.deadline.left(180), poll=1.0)
        j = finish(user, jid, ctx.deadline.left(240))
        settle(out, j, t_fault, t_end=again)
        admin = Api(url, (home / "admin.token").read_text().strip())  # each `tidal up` writes a new one
        out.extra["events"] = kinds_of(admin.events(), jid)
        out.extra["ledger"] = ledger(admin, None)
        if j["state"] == "completed":
            out.extra["samples"] = audit_records(rec, work.samples, work.epochs)
        clean = out.extra.get("samples", {"lost": 1, "duplicated": 1})
        return out.judge(j["state"] == "completed" and clean["lost"] == clean["duplicated"] == 0
                         and within(out.seconds))
    finally:
        stop_up(p, 60)
        kill_home_processes(home)


# ---------------------------------------------------------------- several hosts (network namespaces)

def netns_module() -> Any:
    """tests/multihost/netns.py (the namespace harness), imported once."""
    d = str(ROOT / "tests" / "multihost")
    if d not in sys.path:
        sys.path.insert(0, d)
    import netns  # noqa: PLC0415 - a test helper, not a package

    return netns


def hosts_env(home: Path, st: Settings) -> dict[str, str]:
    """The environment of a server or agent inside a namespace host."""
    e = {k: v for k, v in os.environ.items() if k not in (
        "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TIDAL_BIND_ADDR", "TIDAL_ADVERTISE_ADDR", "TIDAL_SERVER")}
    e.update(OMP_NUM_THREADS="1", TIDAL_HOME=str(home), PYTHONUNBUFFERED="1", TIDAL_CHECKPOINT_SHARED="1",
             **st.server_env())
    return e


def hosts_plane(hs: Any, home: Path, st: Settings) -> tuple[str, str]:
    """The server on host 0, an agent with 2 virtual GPUs on hosts 1 and 2: (URL, admin token)."""
    import secrets

    home.mkdir(parents=True)
    token, port = secrets.token_urlsafe(16), 28471
    env = hosts_env(home, st)

    def tidal(h: Any, args: list[str], name: str) -> None:
        with open(home / f"{name}.log", "ab") as f:
            h.popen([sys.executable, "-m", "tidal", *args], env=env, stdout=f, stderr=subprocess.STDOUT)

    tidal(hs[0], ["server", "--host", "0.0.0.0", "--port", str(port), "--policy", "edf", "--tick", "1",
                  "--token", token], "server")
    url = f"http://{hs[0].addr}:{port}"
    for i in (1, 2):
        tidal(hs[i], ["agent", "--server", url, "--token", token, "--name", f"node-{i}", "--virtual-gpus", "2",
                      "--interval", "0.3"], f"agent-{i}")
    return url, token


def sc_master_host(ctx: Ctx, cut: bool) -> Outcome:
    """The host of a 4-worker job's master (and two of its workers) is lost:
    killed (the peers get resets) or first cut off, then killed (no reset)."""
    out = Outcome("master_host_cut" if cut else "master_host_reset",
                  "the master moves to the job's other host, the survivors follow and the job completes "
                  "(exactly once), training again within 120 s")
    nn = netns_module()
    ok, why = nn.netns_available()
    if not ok:
        out.state = f"skipped: {why}"
        return out
    with nn.Hosts(3) as hs:
        url, token = hosts_plane(hs, ctx.work / out.name, ctx.st)
        with hs[0].entered():
            admin = Api(url, token)
            monitor = Monitor(admin, enter=hs[0].entered)
            sub = Ctx(ctx.st, ctx.work / out.name, ctx.deadline, url=url, admin_token=token, monitor=monitor)
            try:
                monitor.start()
                return master_host_run(sub, out, hs, cut)
            finally:
                monitor.stop()
                monitor.join(5)


def master_host_run(ctx: Ctx, out: Outcome, hs: Any, cut: bool) -> Outcome:
    """The body of :func:`sc_master_host`, inside host 0's namespace."""
    admin = ctx.api()
    if not wait_for(lambda: sum(n["state"] == "up" for n in admin.cluster()["nodes"]) == 2, ctx.deadline.left(90)):
        return out.judge(False, "the two agents did not register")
    ctx.tokens["dave"] = admin.add_user("dave")
    api = ctx.api("dave")
    jid = submit_named(ctx, "dave", "spans-hosts", "train.py", ctx.work_of("medium"), record=True, gpus="1-4")
    if not wait_for(lambda: training(api, jid, 25, world=4), ctx.deadline.left(200)):
        return settle(out, api.job(jid), None).judge(False, "never trained on 4 workers")
    node = node_of_master(api.job(jid)) or "node-1"
    i = int(node.rsplit("-", 1)[1])
    t_fault = time.time()
    if cut:
        hs.cut(i)
        pause(1.0)
    hs.kill_host(i)
    j = recovered(ctx, out, jid, t_fault, ctx.deadline.left(300))
    out.extra.update(master_node=node, master_url=j.get("master_url"), ledger=ledger(admin, ctx.monitor))
    lost = out.extra.get("samples", {}).get("lost")
    return out.judge(j["state"] == "completed" and lost == 0 and within(out.seconds))


def sc_leader_silent(ctx: Ctx) -> Outcome:
    """The HA leader's host goes silent (its link cut, no reset), with two
    replicas over PostgreSQL: the harness of tests/multihost/test_leader_silent.py."""
    nn = netns_module()
    ls = None
    with contextlib.suppress(ImportError):
        import test_leader_silent as ls  # noqa: PLC0415 - another engineer's harness, reused as it is
    out = Outcome("leader_silent", f"a follower leads within the lease (TIDAL_LEADER_LEASE_S="
                  f"{getattr(ls, 'LEASE_S', 10):g}); the training job keeps training and completes exactly once; "
                  "a job submitted after the cut starts")
    ok, why = nn.netns_available()
    if ls is None or not ok or ls._pg_bin("initdb") is None:
        out.state = "skipped: " + (why or ("no PostgreSQL server binaries" if ls else
                                          "tests/multihost/test_leader_silent.py has not landed"))
        return out
    with nn.Hosts(3) as hs:
        pg = ls.NetnsPostgres(hs[0])
        try:
            return leader_run(ctx, out, hs, pg.url, ls)
        finally:
            hs.kill_host(1)
            hs.kill_host(2)
            pg.stop()


def leader_plane(ctx: Ctx, hs: Any, db_url: str, ls: Any) -> tuple[str, str, str]:
    """PostgreSQL and an agent (3 virtual GPUs) on host 0, replica A (leading)
    on host 1, B on host 2: (A's URL, B's URL, the admin token)."""
    import secrets

    work = ctx.work / "leader"
    work.mkdir(parents=True)
    url_a, url_b = f"http://{hs[1].addr}:{ls.PORT}", f"http://{hs[2].addr}:{ls.PORT}"
    admin, secret = secrets.token_urlsafe(16), work / "server.secret"
    secret.write_text(secrets.token_hex(32))
    secret.chmod(0o600)
    common = {"TIDAL_ADMIN_TOKEN": admin, "TIDAL_SECRET_FILE": str(secret), "TIDAL_LEADER_LEASE_S": str(ls.LEASE_S),
              "TIDAL_PUBLIC_URL": f"{url_a},{url_b}", **ctx.st.server_env()}
    server = ["server", "--host", "0.0.0.0", "--port", str(ls.PORT), "--db", db_url, "--policy", "edf",
              "--tick", str(ls.TICK_S)]
    ls._tidal(hs[1], server, work / "server-a", **common)
    if not wait_for(lambda: ls._leads(hs[0], url_a), ctx.deadline.left(90)):
        raise RuntimeError("replica A did not lead")
    ls._tidal(hs[2], server, work / "server-b", **common)
    wait_for(lambda: ls._leads(hs[0], url_b) is False, ctx.deadline.left(90))
    join = subprocess.run([sys.executable, "-m", "tidal", "agent-token"], env=ls._env(work / "server-a", **common),
                          capture_output=True, text=True, timeout=60).stdout.strip()
    ls._tidal(hs[0], ["agent", "--server", f"{url_b},{url_a}", "--name", "n0", "--virtual-gpus", "3",
                      "--interval", "0.3"], work / "agent", TIDAL_TOKEN=join)
    return url_a, url_b, admin


def leader_run(ctx: Ctx, out: Outcome, hs: Any, db_url: str, ls: Any) -> Outcome:
    """The body of :func:`sc_leader_silent`: a job trains, A's link is cut."""
    url_a, url_b, token = leader_plane(ctx, hs, db_url, ls)
    with hs[0].entered():
        monitor = Monitor(Api(f"{url_b},{url_a}", token), enter=hs[0].entered)
        sub = Ctx(ctx.st, ctx.work / "leader", ctx.deadline, url=f"{url_b},{url_a}", admin_token=token,
                  monitor=monitor, records=ctx.records)
        admin = sub.api()
        wait_for(lambda: any(n["state"] == "up" for n in admin.cluster()["nodes"]), ctx.deadline.left(60))
        sub.tokens["erin"] = admin.add_user("erin")
        monitor.start()
        try:
            user = sub.api("erin")
            jid = submit_named(sub, "erin", "under-ha", "train.py", sub.work_of("away"), record=True, gpus=FIXED2)
            if not wait_for(lambda: training(user, jid, 25), ctx.deadline.left(180)):
                return settle(out, user.job(jid), None).judge(False, "never trained past step 25")
            hs.cut(1)  # the leader's host goes silent
            t_fault = time.time()
            led = wait_for(lambda: ls._leads(hs[0], url_b) and time.time(), ctx.deadline.left(90), poll=0.2)
            out.extra["failover_s"] = round(led - t_fault, 1) if led else None
            t_sub = time.time()  # a submission after the failover (retried: the first may time out)
            after = wait_for(lambda: user.submit(spec("after-cut", "train.py", sub.work_of("short"), gpus=1))["id"],
                             ctx.deadline.left(120), poll=1.0)
            out.extra["after_cut_submit_s"] = round(time.time() - t_sub, 1)
            out.extra["after_cut_job_started"] = bool(after and wait_for(lambda: user.job(after)["gpus"],
                                                                         ctx.deadline.left(60)))
            out.extra["after_cut_jobs"] = sum(x["name"] == "after-cut" for x in user.jobs())
            j = recovered(sub, out, jid, t_fault, ctx.deadline.left(300))
            if after:
                finish(user, after, ctx.deadline.left(120))
            out.extra["ledger"] = ledger(admin, monitor)
        finally:
            monitor.stop()
    clean = out.extra.get("samples", {}).get("lost") == 0
    in_lease = led is not None and out.extra["failover_s"] <= ls.LEASE_S + 3
    return out.judge(j["state"] == "completed" and clean and in_lease and out.extra["after_cut_job_started"])


# ---------------------------------------------------------------- the end of a cluster

def gpu_given_twice(events: list[dict[str, Any]]) -> int:
    """Assignments of a GPU still held by a job, in the audit trail (the failover benchmark's count)."""
    from failover import gpu_twice  # noqa: PLC0415 - benchmarks/ is on the path of a script and of its tests

    return gpu_twice(events)


def ledger(admin: Api, monitor: Monitor | None, quiet_s: float = 60.0) -> dict[str, Any]:
    """A cluster's end state: job counts, jobs stuck (holding GPUs, not
    terminal, no step for ``quiet_s``), GPUs held by ended jobs, GPUs given twice."""
    jobs = wait_for(admin.jobs, 60) or []  # retried: a replica may be slow to answer right after a failover
    now = time.time()
    if monitor is None:  # no history: a job is stuck if its step does not move in 10 s
        before = {j["id"]: j["step"] for j in jobs}
        pause(10.0)
        jobs = wait_for(admin.jobs, 60) or []
        quiet = {j["id"] for j in jobs if before.get(j["id"]) == j["step"]}
    else:
        quiet = {j["id"] for j in jobs if now - monitor.last_progress(j["id"]) >= quiet_s}
    stuck = [j for j in jobs if j["state"] not in TERMINAL and j["gpus"] and j["id"] in quiet]
    return {"jobs": len(jobs), "completed": sum(j["state"] == "completed" for j in jobs),
            "failed": sum(j["state"] == "failed" for j in jobs),
            "stuck": [{"id": j["id"], "name": j["name"], "state": j["state"], "step": j["step"],
                       "reason": j.get("reason", "")} for j in stuck],
            "gpu_held_by_ended_jobs": sum(len(j["gpus"]) for j in jobs if j["state"] in TERMINAL),
            "gpu_given_twice": gpu_given_twice(wait_for(admin.events, 60) or [])}


def cancel_live(admin: Api, deadline: Deadline) -> float | None:
    """Cancel every job not yet ended; the longest time one took to end (None: none to cancel)."""
    live = [j["id"] for j in admin.jobs() if j["state"] not in TERMINAL]
    if not live:
        return None
    t0 = time.time()
    for jid in live:
        with contextlib.suppress(ApiError):
            admin.cancel(jid)
    wait_for(lambda: all(admin.job(j)["state"] in TERMINAL for j in live), deadline.left(60), poll=1.0)
    return round(time.time() - t0, 1)


def kill_home_processes(root: Path) -> int:
    """SIGKILL every process whose ``TIDAL_HOME`` (or checkpoint directory) is
    under ``root`` (this run's servers, agents, masters and workers, in any
    namespace); stopped ones are continued first. Returns how many."""
    marks = [f"TIDAL_HOME={root}".encode(), f"TIDAL_CHECKPOINT_DIR={root}".encode()]
    n = 0
    for d in Path("/proc").glob("[0-9]*"):
        pid = int(d.name)
        if pid == os.getpid():
            continue
        try:
            env = (d / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(v.startswith(m) for v in env for m in marks):
            for sig in (signal.SIGCONT, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
            n += 1
    return n


# ---------------------------------------------------------------- running scenarios

#: name -> (where it runs, the scenario, its own deadline in seconds). "jobs" run a few at once
#: on a single-host cluster (``up_interrupted`` on one of its own), "agents" one at a time on
#: another single-host cluster at the same time, "hosts" and "ha" in network namespaces.
SCENARIOS: dict[str, tuple[str, Callable[[Ctx], Outcome], float]] = {
    "crash_one": ("jobs", lambda c: sc_crash(c, "one"), 360),
    "crash_all": ("jobs", lambda c: sc_crash(c, "all"), 240),
    "never_init": ("jobs", sc_never_init, 150),
    "sleep_before_init": ("jobs", sc_sleep_before_init, 240),
    "kill_all": ("jobs", sc_kill_all, 420),
    "args_200k": ("jobs", sc_args_200k, 150),
    "unreadable_script": ("jobs", sc_unreadable_script, 240),
    "missing_workdir": ("jobs", sc_missing_workdir, 240),
    "die_before_register": ("jobs", sc_die_before_register, 360),
    "up_interrupted": ("jobs", sc_up_interrupted, 540),
    "agent_away_20": ("agents", lambda c: sc_agent_away(c, 20.0), 360),
    "agent_away_120": ("agents", lambda c: sc_agent_away(c, c.st.away_long_s), 540),
    "agent_away_job_ends": ("agents", sc_agent_away_job_ends, 360),
    "master_host_reset": ("hosts", lambda c: sc_master_host(c, cut=False), 480),
    "master_host_cut": ("hosts", lambda c: sc_master_host(c, cut=True), 480),
    "leader_silent": ("ha", sc_leader_silent, 420),
}
SINGLE_HOST = [n for n, (g, _f, _d) in SCENARIOS.items() if g in ("jobs", "agents")]
NAMESPACES = [n for n, (g, _f, _d) in SCENARIOS.items() if g in ("hosts", "ha")]


def run_one(ctx: Ctx, name: str) -> Outcome:
    """One scenario under its own deadline (and the run's); an exception is its result."""
    _group, fn, cap = SCENARIOS[name]
    if ctx.deadline.passed():
        return Outcome(name, "", state="skipped: the run's deadline passed")
    sub = Ctx(**{**ctx.__dict__, "deadline": Deadline(ctx.deadline.left(cap))})
    t0 = time.time()
    log.info("scenario %s: start", name)
    try:
        out = fn(sub)
    except KeyboardInterrupt:
        raise
    except Exception as e:  # noqa: BLE001 - the scenario's failure is its result
        log.exception("scenario %s", name)
        out = Outcome(name, "", state=f"error: {type(e).__name__}: {e}"[:400])
    out.name = name
    out.extra["wall_s"] = round(time.time() - t0, 1)
    log.info("scenario %s: %s %s after %s s (%s)", name, "ok" if out.ok else "NOT OK", out.state, out.seconds,
             out.reason[:200])
    return out


def run_parallel(ctx: Ctx, names: list[str], width: int) -> list[Outcome]:
    """Scenarios ``names``, ``width`` at a time; results in the order of ``names``."""
    if not names:
        return []
    ex = ThreadPoolExecutor(max_workers=max(1, width), thread_name_prefix="chaos")
    try:
        futures = [ex.submit(run_one, ctx, n) for n in names]
        return [f.result() for f in futures]
    finally:
        ex.shutdown(wait=not STOP.is_set(), cancel_futures=True)


def pool_audit(admin: Api, pool: GoodPool, work: Work) -> list[dict[str, Any]]:
    """Each well-behaved job's end: state, reason and (completed) its samples."""
    rows = []
    for jid, rec in pool.jobs.items():
        j = admin.job(jid)
        row: dict[str, Any] = {"job": jid, "state": j["state"], "reason": j.get("reason", "")}
        if j["state"] == "completed":
            row["samples"] = audit_records(rec, work.samples, work.epochs)
        rows.append(row)
    return rows


def run_cluster(base: Ctx, names: list[str], width: int, tag: str) -> tuple[list[Outcome], dict[str, Any]]:
    """A single-host cluster of its own (3 agents x 2 virtual GPUs, home
    ``home-TAG``) with the pool of well-behaved jobs, running the scenarios
    ``names`` ``width`` at a time; then its ledger."""
    ctx = Ctx(base.st, base.work, base.deadline, records=base.records)
    c = LocalCluster(base.work / f"home-{tag}", nodes=3, gpus_per_node=2, policy="edf", tick_s=1.0)
    c.env.update(ctx.st.server_env())
    pool: GoodPool | None = None
    try:
        c.start()
        admin = c.api()
        ctx.url, ctx.admin_token, ctx.agents = c.url, c.admin_token, c.agents
        ctx.tokens.update({who: admin.add_user(who) for who in ("alice", "mallory")})
        ctx.monitor = Monitor(admin)
        ctx.monitor.start()
        pool = GoodPool(ctx.api("alice"), ctx.work / "records" / tag, ctx.st.pool, ctx.work_of("pool"))
        pool.start()
        outcomes = run_parallel(ctx, names, width)
        pool.stop_refill()
        end = Deadline(300)
        wait_for(lambda: all(admin.job(j)["state"] in TERMINAL for j in list(pool.jobs)), end.left(240), poll=2.0)
        led = ledger(admin, ctx.monitor)
        led["cancel_s"] = cancel_live(admin, end)
        led["pool"] = pool_audit(admin, pool, ctx.work_of("pool"))
        return outcomes, led
    finally:
        if pool is not None:
            pool.stop_refill()
        if ctx.monitor is not None:
            ctx.monitor.stop()
        for a in c.agents:
            with contextlib.suppress(ProcessLookupError):
                os.kill(a.pid, signal.SIGCONT)
        c.stop()
        kill_home_processes(c.home)


def run_single_host(ctx: Ctx, names: list[str]) -> tuple[list[Outcome], list[dict[str, Any]]]:
    """Two single-host clusters at once: one runs the job faults a few at a
    time (and ``tidal up`` beside them), the other the agents away, one at a
    time (a stopped agent must not delay another scenario's verdict)."""
    groups = [(g, [n for n in names if SCENARIOS[n][0] == g], w) for g, w in (("jobs", ctx.st.parallel), ("agents", 1))]
    groups = [x for x in groups if x[1]]
    ex = ThreadPoolExecutor(max_workers=2, thread_name_prefix="chaos-cluster")
    try:
        done = [f.result() for f in [ex.submit(run_cluster, ctx, ns, w, g) for g, ns, w in groups]]
    finally:
        ex.shutdown(wait=not STOP.is_set(), cancel_futures=True)
    return [o for outs, _ in done for o in outs], [led for _, led in done]


def skipped(o: Outcome) -> bool:
    """Whether the scenario did not run (its state says why)."""
    return o.state.startswith("skipped")


def summarize(outcomes: list[Outcome], ledgers: list[dict[str, Any]], st: Settings, wall_s: float) -> dict[str, Any]:
    """The one JSON line: totals over every cluster, the acceptance values and each scenario."""
    audits = [o.extra["samples"] for o in outcomes if "samples" in o.extra]
    audits += [r["samples"] for led in ledgers for r in led.get("pool", []) if "samples" in r]
    timed = [o.seconds for o in outcomes if o.seconds is not None and not skipped(o)]
    good_unfinished = [r for led in ledgers for r in led.get("pool", []) if r["state"] != "completed"]
    stuck = [s for led in ledgers for s in led["stuck"]]
    res: dict[str, Any] = {
        "benchmark": "chaos", "date": time.strftime("%Y-%m-%d %H:%M"), "quick": st.quick,
        "jobs": sum(led["jobs"] for led in ledgers), "completed": sum(led["completed"] for led in ledgers),
        "failed": sum(led["failed"] for led in ledgers), "stuck": len(stuck),
        "max_s_to_terminal": max(timed) if timed else None,
        "lost_samples": sum(a["lost"] for a in audits), "duplicated_samples": sum(a["duplicated"] for a in audits),
        "audited_jobs": len(audits),
        "good_jobs": sum(len(led.get("pool", [])) for led in ledgers), "good_jobs_not_completed": good_unfinished,
        "gpu_held_by_ended_jobs": sum(led["gpu_held_by_ended_jobs"] for led in ledgers),
        "gpu_given_twice": sum(led["gpu_given_twice"] for led in ledgers),
        "cancel_s": max((led.get("cancel_s") or 0 for led in ledgers), default=0),
        "settings": {**st.server_env(), "TIDAL_CRASH_LIMIT": "3 (default)", "TIDAL_CRASH_BACKOFF_S": "5 (default)",
                     "TIDAL_RESTART_LIMIT": "3 (default)", "node time-out": "server default"},
        "scenarios": [{"name": o.name, "expected": o.expected, "state": o.state, "reason": o.reason[:300],
                       "seconds": o.seconds, "ok": o.ok, **({"note": o.note} if o.note else {}), **o.extra}
                      for o in outcomes],
        "stuck_jobs": stuck, "wall_s": round(wall_s, 1), "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    res["violations"] = violations(res, outcomes)
    return res


def violations(res: dict[str, Any], outcomes: list[Outcome]) -> list[str]:
    """Each acceptance value or scenario that misses the contract, in one line."""
    out = [f"{o.name}: expected {o.expected}; observed {o.state or '?'}"
           + (f" ({o.reason[:160]})" if o.reason else "") + (f" after {o.seconds} s" if o.seconds is not None else "")
           + (f" [{o.note}]" if o.note else "") for o in outcomes if not o.ok and not skipped(o)]
    for key, bad in (("stuck", res["stuck"]), ("lost_samples", res["lost_samples"]),
                     ("duplicated_samples", res["duplicated_samples"]),
                     ("gpu_held_by_ended_jobs", res["gpu_held_by_ended_jobs"]),
                     ("gpu_given_twice", res["gpu_given_twice"])):
        if bad:
            out.append(f"{key} = {bad} (must be 0)")
    if res["max_s_to_terminal"] is not None and res["max_s_to_terminal"] > BOUND_S:
        out.append(f"max_s_to_terminal = {res['max_s_to_terminal']} > {BOUND_S:g}")
    if res["good_jobs_not_completed"]:
        out.append(f"well-behaved jobs not completed: {res['good_jobs_not_completed']}")
    if res["cancel_s"] > CANCEL_BOUND_S:
        out.append(f"cancelling the jobs left took {res['cancel_s']} s > {CANCEL_BOUND_S:g}")
    return out


def acceptance_misses(result: dict[str, Any]) -> list[str]:
    """The acceptance values a run's JSON misses ([] when every one holds),
    each with the run's violations as the reason (the slow tests assert it)."""
    why = "; ".join(result.get("violations") or ())
    m = result.get("max_s_to_terminal")
    checks = {"stuck": result.get("stuck") == 0,
              "max_s_to_terminal": m is not None and m <= BOUND_S,
              "lost_samples": result.get("lost_samples") == 0,
              "duplicated_samples": result.get("duplicated_samples") == 0,
              "gpu_held_by_ended_jobs": result.get("gpu_held_by_ended_jobs") == 0,
              "gpu_given_twice": result.get("gpu_given_twice") == 0}
    return [f"{k}={result.get(k)!r} ({why})" for k, ok in checks.items() if not ok]


def run(names: list[str], st: Settings, work: Path) -> dict[str, Any]:
    """Run the scenarios ``names`` (single-host ones first) and summarize them."""
    t0 = time.time()
    ctx = Ctx(st, work, Deadline(st.global_s - 60))  # the last minute is for the clusters' ends
    outcomes: list[Outcome] = []
    ledgers: list[dict[str, Any]] = []
    single = [n for n in names if n in SINGLE_HOST]
    if single:
        got, leds = run_single_host(ctx, single)
        outcomes += got
        ledgers += leds
    for n in (n for n in names if n in NAMESPACES):
        outcomes.append(run_one(ctx, n))
    ledgers += [o.extra.pop("ledger") for o in outcomes if "ledger" in o.extra]
    return summarize(sorted(outcomes, key=lambda o: list(SCENARIOS).index(o.name)), ledgers, st, time.time() - t0)


def settings_from(a: argparse.Namespace) -> Settings:
    """The run's settings from the command line (``--quick``: one well-behaved job, 3 faults at once)."""
    st = Settings(quick=a.quick, start_timeout_s=a.start_timeout, global_s=a.deadline, parallel=a.parallel)
    if a.quick:
        st.pool, st.parallel = 1, max(a.parallel, 3)
    return st


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module's docstring); the work directory is always cleaned up."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated, of: {', '.join(SCENARIOS)}")
    ap.add_argument("--quick", action="store_true", help="small jobs, one well-behaved job, 3 faults at once")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (homes, logs, records)")
    ap.add_argument("--json", action="store_true", help="print the one JSON line only")
    ap.add_argument("--deadline", type=float, default=900.0, help="the whole run's deadline in seconds")
    ap.add_argument("--start-timeout", type=float, default=60.0,
                    help="TIDAL_START_TIMEOUT_S of the servers (30 fails well-behaved jobs on a loaded machine)")
    ap.add_argument("--parallel", type=int, default=2, help="job-fault scenarios at once")
    a = ap.parse_args(argv)
    names = [n.strip() for n in a.scenarios.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        ap.error(f"unknown scenario(s) {', '.join(unknown)}; known: {', '.join(SCENARIOS)}")
    logging.basicConfig(level=logging.WARNING if a.json else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `kill` cleans up like Ctrl-C
    work = Path(tempfile.mkdtemp(prefix="tidal-chaos-"))
    try:
        res = run(names, settings_from(a), work)
    except KeyboardInterrupt:
        STOP.set()
        print("chaos: interrupted; cleaning up", file=sys.stderr)
        return 130
    finally:
        STOP.set()
        killed = kill_home_processes(work)
        if killed:
            log.info("killed %d processes left under %s", killed, work)
        if a.keep:
            print(f"chaos: kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(res) if a.json else json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
