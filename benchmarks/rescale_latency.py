"""Latency from a scaling request to the switch, part by part.

One file, two roles:

* driver (default): launches a job with ``tidal run`` (2 workers, an MLP
  64-256-10, global batch 48, ``--step-ms`` of non-compute time per step),
  then ``--repeats`` times asks for a scale-out to 3 and, once it switched,
  a scale-in back to 2; ends the job with a suspension (so the launcher exits
  0) and prints ONE JSON line with the medians over the repeats;
* ``--role worker``: the training script; every worker logs when its process
  was spawned (from ``/proc/self/stat``), when the script had built its model
  and data, when it registered (ready) and, per step, its generation, the
  wall time the batch started and whether a switch was agreed in its
  all-reduce.

Parts of a scale-out (wall clocks of one host; medians):

* ``request_to_spawned``: the driver sends ``POST /scale_out`` -> the
  newcomer's process exists;
* ``spawned_to_ready`` (= ``newcomer_startup_s``): python + torch import,
  model and data built, and the runtime's own preparation on the first
  iteration, until the newcomer registers (``spawned_to_built`` is the
  script's part alone);
* ``ready_to_published``: it registers -> the master published the plan;
* ``published_to_agreed``: -> rank 0 put the plan in the control tensor
  reduced with the gradients (every rank agreed);
* ``agreed_to_switched``: -> the last member of the new generation started
  its first step in it (the switch is done).

``request_to_switch_s`` is the whole scale-out, ``overhead_s`` the same
minus the newcomer's own start-up (target: <= 1 s);
``scale_in_request_to_switch_s`` is ``POST /scale_in`` -> the last survivor
started its first step in the smaller generation; ``switch_to_master_s``
is that moment -> the master recorded the switch (rank 0's ``/switched``;
until then ``status()`` says ``changing`` and ``tidal scale`` waits);
``pause_s`` is the survivors' pause at the scale-out switch.
``request_to_spawned`` comes from ``/proc`` start times (10 ms resolution:
it may read slightly negative). ``ready_to_published`` and
``published_to_agreed`` are null with a runtime whose change records have no
``published_at`` (before 2026-11-23). ``--switch-lead S`` passes
``--switch-lead`` to ``tidal run`` (default: the launcher's).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("rescale_latency")

N, BATCH, DIM = 4800, 48, 64
JOB = "rescale-latency"


def _spawned_at() -> float:
    """Wall time this process was created (``/proc``; 10 ms resolution)."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start_s = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time in ticks since boot
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - start_s
        return time.time() - age
    except (OSError, ValueError, IndexError):
        return time.time()


def role_worker(a: argparse.Namespace) -> None:
    spawned = _spawned_at()
    import torch

    import tidal.runtime

    job = tidal.runtime.init(checkpoint_dir=a.ckpt, checkpoint_every=10**9)  # only for the final suspension
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(N, DIM, generator=g), torch.randint(0, 10, (N,), generator=g)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(DIM, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    job.register_state(model, opt)
    data = [(x[i], y[i]) for i in range(N)]
    loader = job.data(data, batch_size=BATCH, epochs=10**6, seed=0)
    marks = {"spawned": spawned, "built": time.time()}  # built: imports done, model and data built
    register = job.membership.register

    def registering(**kw: Any) -> Any:  # the runtime registers when it is ready (first iteration)
        marks["ready"] = time.time()
        return register(**kw)

    job.membership.register = registering  # type: ignore[method-assign]
    with open(Path(a.out) / f"log-{job.worker_id}.jsonl", "w") as f:
        for xb, yb in loader:  # the first next() registers and joins
            if marks:
                f.write(json.dumps(marks) + "\n")
                marks = {}
            t0 = time.time()
            torch.nn.functional.cross_entropy(model(xb), yb).backward()
            job.step()
            ag = job.membership.agreement.agreed  # set in this step's all-reduce if a switch was agreed at it
            f.write(json.dumps({"step": job.step_count, "gen": job.gen.gen if job.gen else 0, "t0": t0,
                                "t1": time.time(), "agreed": ag.gen if ag else 0}) + "\n")
            time.sleep(a.step_ms / 1e3)
    job.close()


def _env(home: Path, src: Path) -> dict[str, str]:
    e = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", TIDAL_HOME=str(home))
    e["PYTHONPATH"] = os.pathsep.join([str(src), e.get("PYTHONPATH", "")])
    return e


def _wait(client: Any, size: int, after_changes: int, timeout_s: float = 120.0) -> Any:
    """Poll the master until the job runs at ``size`` with no change pending
    and has recorded more than ``after_changes`` changes."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = client.status()
        if st.world_size == size and not st.changing and len(st.changes) > after_changes:
            return st
        if st.state in ("finished", "suspended") or time.monotonic() > deadline:
            raise RuntimeError(f"job did not reach {size} workers: {st}")
        time.sleep(0.01)


def _steady(client: Any, steps: int) -> None:
    """Let the job run ``steps`` steps (step-time estimate settles)."""
    s0 = client.status().step
    while client.status().step < s0 + steps:
        time.sleep(0.02)


def drive(a: argparse.Namespace, tmp: Path) -> tuple[list[dict[str, Any]], tuple[dict[str, Any], ...], float]:
    """Run the job and the requests; returns the request times, the master's
    change records and the launch time."""
    src = Path(a.src) if a.src else Path(os.path.abspath(__file__)).parent.parent / "src"
    sys.path.insert(0, str(src))
    from tidal.runtime.client import MasterClient

    out, home, ckpt = tmp / "out", tmp / "home", tmp / "ckpt"
    out.mkdir()
    lead = ["--switch-lead", str(a.switch_lead)] if a.switch_lead is not None else []
    cmd = [sys.executable, "-m", "tidal.runtime.launch", "run", "--workers", "2", "--max-workers", "3", "--job", JOB,
           "--timeout", "600", *lead, os.path.abspath(__file__), "--role", "worker", "--out", str(out),
           "--ckpt", str(ckpt), "--step-ms", str(a.step_ms)]
    t_launch = time.time()
    proc = subprocess.Popen(cmd, env=_env(home, src), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    reqs: list[dict[str, Any]] = []
    try:
        jf = home / "jobs" / f"{JOB}.json"
        while not jf.exists():
            if proc.poll() is not None:
                raise RuntimeError(f"launcher exited: {proc.stdout.read() if proc.stdout else ''}")
            time.sleep(0.05)
        client = MasterClient(json.loads(jf.read_text())["url"])
        _wait(client, 2, -1)
        for _ in range(a.repeats):
            _steady(client, 30)
            n = len(client.status().changes)
            t = time.time()
            ans = client.scale_out(1)
            reqs.append({"kind": "scale_out", "t_req": t, "t_acc": time.time(), "answer": ans.message})
            _wait(client, 3, n)
            _steady(client, 30)
            n = len(client.status().changes)
            t = time.time()
            ans = client.scale_in(1)
            reqs.append({"kind": "scale_in", "t_req": t, "t_acc": time.time(), "answer": ans.message})
            _wait(client, 2, n)
        changes = client.status().changes
        client.suspend()
        text, _ = proc.communicate(timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"launcher exited {proc.returncode}: {text[-3000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return reqs, changes, t_launch


def _logs(out: Path) -> dict[str, list[dict[str, Any]]]:
    return {p.stem[len("log-"):]: [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
            for p in out.glob("log-*.jsonl")}


def _first_step(logs: dict[str, list[dict[str, Any]]], gen: int) -> float | None:
    """When the last member started its first step in generation ``gen``."""
    firsts = [next((r["t0"] for r in recs if r.get("gen") == gen), None) for recs in logs.values()]
    firsts = [t for t in firsts if t is not None]
    return max(firsts) if firsts else None


def _agreed(logs: dict[str, list[dict[str, Any]]], gen: int) -> float | None:
    """When the first rank ended the step whose all-reduce agreed on the switch to ``gen``."""
    ts = [r["t1"] for recs in logs.values() for r in recs if r.get("agreed") == gen]
    return min(ts) if ts else None


def _get(rec: dict[str, Any], key: str) -> float | None:
    v = rec.get(key)
    return float(v) if v else None


def analyse(reqs: list[dict[str, Any]], changes: tuple[dict[str, Any], ...],
            logs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per-repeat parts and their medians."""
    recs = [c for c in changes if c["kind"] in ("scale_out", "scale_in")]
    if len(recs) != len(reqs) or any(c["kind"] != r["kind"] for c, r in zip(recs, reqs)):
        raise RuntimeError(f"changes {[c['kind'] for c in recs]} do not match the requests")
    runs: list[dict[str, Any]] = []
    for req, ch in zip(reqs, recs):
        switched = _first_step(logs, int(ch["gen"]))
        run: dict[str, Any] = {"kind": req["kind"], "gen": ch["gen"], "accepted_s": req["t_acc"] - req["t_req"],
                               "request_to_switch_s": switched - req["t_req"] if switched else None,
                               "switch_to_master_s": ch["switched_at"] - switched if switched else None,
                               "pause_s": ch.get("pause_s")}
        if req["kind"] == "scale_out":
            new = [w for w in logs if f"'{w}'" in req["answer"]]
            head = logs[new[0]][0]
            pub, agr = _get(ch, "published_at"), _agreed(logs, int(ch["gen"]))
            marks = [("request", req["t_req"]), ("spawned", head["spawned"]), ("ready", head["ready"]),
                     ("published", pub), ("agreed", agr), ("switched", switched)]
            run["parts"] = {f"{a}_to_{b}": (tb - ta if ta is not None and tb is not None else None)
                            for (a, ta), (b, tb) in zip(marks, marks[1:])}
            run["newcomer_startup_s"] = head["ready"] - head["spawned"]
            run["spawned_to_built"] = head["built"] - head["spawned"]
        runs.append(run)
    return _medians(runs)


def _med(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return round(statistics.median(vals), 4) if vals else None


def _medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    outs = [r for r in runs if r["kind"] == "scale_out"]
    ins = [r for r in runs if r["kind"] == "scale_in"]
    total = _med([r["request_to_switch_s"] for r in outs])
    startup = _med([r["newcomer_startup_s"] for r in outs])
    return {
        "request_to_switch_s": total,
        "newcomer_startup_s": startup,
        "spawned_to_built": _med([r["spawned_to_built"] for r in outs]),
        "overhead_s": _med([r["request_to_switch_s"] - r["newcomer_startup_s"] for r in outs
                            if r["request_to_switch_s"] is not None]),
        "parts": {k: _med([r["parts"][k] for r in outs]) for k in outs[0]["parts"]} if outs else {},
        "scale_in_request_to_switch_s": _med([r["request_to_switch_s"] for r in ins]),
        "switch_to_master_s": _med([r["switch_to_master_s"] for r in runs]),
        "pause_s": _med([r["pause_s"] for r in outs]),
        "accepted_s": _med([r["accepted_s"] for r in runs]),
        "repeats": len(outs),
        "runs": runs,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", choices=["driver", "worker"], default="driver")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--step-ms", type=float, default=20.0, help="non-compute time per step (ms)")
    ap.add_argument("--switch-lead", type=float, default=None, help="tidal run's --switch-lead (T_a, seconds)")
    ap.add_argument("--src", default="", help="the tidal source tree to run (default: this repository's src)")
    ap.add_argument("--out", default="", help="(worker role)")
    ap.add_argument("--ckpt", default="", help="(worker role)")
    a = ap.parse_args()
    if a.role == "worker":
        role_worker(a)
        return
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    with tempfile.TemporaryDirectory(prefix="rescale-latency-") as d:
        tmp = Path(d)
        reqs, changes, _ = drive(a, tmp)
        res = analyse(reqs, changes, _logs(tmp / "out"))
    sys.stdout.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()
