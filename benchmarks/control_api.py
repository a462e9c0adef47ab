"""Control-plane speed and safety: API submissions per second, submission
latency under a concurrent burst, lost and duplicated jobs, and the latency
from submission to placement decision.

    python benchmarks/control_api.py --json [--jobs 300] [--clients 8] [--policy fifo]

Starts a real ``tidal server`` process (uvicorn, SQLite in a temp
``TIDAL_HOME``, loopback), registers virtual nodes with enough GPUs for
every job and heart-beats them (no agent: the decision is what is measured,
not the launch), then
submits rigid 1-GPU jobs from ``--clients`` threads as fast as the server
takes them, each under its own ``Idempotency-Key``; ``--dup-share`` of them are
sent a second time with the same key, at a random point of the burst
(sometimes while the first is in flight). Afterwards ``GET /v1/jobs`` is
compared with the answers:

* ``lost``: submissions answered 2xx whose job is not listed;
* ``duplicated``: jobs beyond one per key (a key answered with two job ids, or
  a listed job that no answer named);
* ``failed``: submissions answered with an error or not at all;
* ``burst_submit_ms_p50`` / ``_p95``: latency of each submission of the burst.

Then ``--paced`` jobs at ``--rate`` per second (latency under a steady load).
Decision latency = the job's ``job.start`` event time minus its submission
time (both taken by the server). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from tidal.control.local import LocalCluster

BURST, PACED = "burst", "paced"  # the jobs' names
MAX_NODE_GPUS = 1024  # the most GPUs an agent may register


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def burst(url: str, headers: dict[str, str], jobs: int, clients: int, dup_share: float,
          seed: int = 0) -> dict[str, Any]:
    """Submit ``jobs`` jobs (plus the duplicates) from ``clients`` threads;
    the answers by key, each submission's latency, the failures and the wall time."""
    body = {"name": BURST, "script": "train.py", "gpus": 1, "elastic": False, "iterations": 1000}
    keys = [uuid.uuid4().hex for _ in range(jobs)]
    rng = random.Random(seed)
    work = keys + rng.sample(keys, round(dup_share * jobs))
    rng.shuffle(work)
    todo: queue.SimpleQueue[str] = queue.SimpleQueue()
    for k in work:
        todo.put(k)
    acked: dict[str, set[str]] = {}
    latencies: list[float] = []
    failures: list[str] = []
    lock = threading.Lock()

    def client() -> None:
        with httpx.Client(base_url=url, headers=headers, timeout=60) as cl:
            while True:
                try:
                    key = todo.get_nowait()
                except queue.Empty:
                    return
                t0 = time.perf_counter()
                try:
                    r = cl.post("/v1/jobs", json=body, headers={"Idempotency-Key": key})
                except httpx.HTTPError as e:
                    with lock:
                        failures.append(type(e).__name__)
                    continue
                dt = time.perf_counter() - t0
                with lock:
                    latencies.append(dt)
                    if r.is_success:
                        acked.setdefault(key, set()).add(r.json()["id"])
                    else:
                        failures.append(str(r.status_code))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"acked": acked, "latencies": latencies, "failures": failures, "sent": len(work),
            "wall_s": time.perf_counter() - t0}


def decisions(url: str, headers: dict[str, str], want: list[str], timeout_s: float = 300) -> list[float]:
    """Submit -> ``job.start`` latencies of ``want`` (those decided in time)."""
    deadline = time.time() + timeout_s
    while True:
        ev = httpx.get(url + "/v1/events", headers=headers, timeout=60).json()
        starts = {e["job"]: e["time"] for e in ev if e["kind"] == "job.start"}
        subs = {e["job"]: e["time"] for e in ev if e["kind"] == "job.submitted"}
        if all(j in starts for j in want) or time.time() > deadline:
            return [starts[j] - subs[j] for j in want if j in starts and j in subs]
        time.sleep(1)


def paced(url: str, headers: dict[str, str], count: int, rate: float) -> list[str]:
    body = {"name": PACED, "script": "train.py", "gpus": 1, "elastic": False, "iterations": 1000}
    ids: list[str] = []
    with httpx.Client(base_url=url, headers=headers, timeout=30) as cl:
        t1 = time.perf_counter()
        for k in range(count):
            time.sleep(max(0.0, t1 + k / rate - time.perf_counter()))
            ids.append(cl.post("/v1/jobs", json=body, headers={"Idempotency-Key": uuid.uuid4().hex}).json()["id"])
    return ids


def keep_up(url: str, headers: dict[str, str], nodes: list[str], stop: threading.Event,
            every_s: float = 2.0) -> threading.Thread:
    """Heart-beat the virtual nodes (an agent's one duty the benchmark needs):
    a silent node would be declared down and its jobs' processes lost."""
    def run() -> None:
        with httpx.Client(base_url=url, headers=headers, timeout=60) as cl:
            while not stop.wait(every_s):
                for n in nodes:
                    cl.post(f"/internal/agents/{n}/heartbeat", json={"procs": [], "utils": {}})

    t = threading.Thread(target=run, name="heartbeats", daemon=True)
    t.start()
    return t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=300)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--dup-share", type=float, default=0.05, help="share of submissions sent twice with one key")
    ap.add_argument("--policy", default="fifo")
    ap.add_argument("--paced", type=int, default=100)
    ap.add_argument("--rate", type=float, default=10.0, help="paced submissions per second")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        c = LocalCluster(Path(d), policy=a.policy, tick_s=1.0)
        stop = threading.Event()
        c.start_server()
        try:
            h = {"Authorization": f"Bearer {c.admin_token}"}
            need = a.jobs + a.paced
            nodes = [f"big{i}" for i in range(-(-need // MAX_NODE_GPUS))]  # equal: the topology is homogeneous
            for n in nodes:
                httpx.post(c.url + "/internal/agents/register",
                           json={"name": n, "num_gpus": -(-need // len(nodes)), "virtual": True},
                           headers=h).raise_for_status()
            keep_up(c.url, h, nodes, stop)
            b = burst(c.url, h, a.jobs, a.clients, a.dup_share)
            listed = httpx.get(c.url + "/v1/jobs", headers=h, timeout=120).json()
            burst_ids = [j["id"] for j in listed if j["name"] == BURST]
            acked_ids = set().union(*b["acked"].values()) if b["acked"] else set()
            burst_lat = decisions(c.url, h, burst_ids)
            paced_ids = paced(c.url, h, a.paced, a.rate)
            lat = decisions(c.url, h, paced_ids)
        finally:
            stop.set()
            c.stop()
    sub_lat = b["latencies"]
    out = {
        "benchmark": "control_api",
        "policy": a.policy,
        "jobs": a.jobs,
        "clients": a.clients,
        "sent": b["sent"],
        "submissions_per_s": round(b["sent"] / b["wall_s"], 1),
        "burst_submit_ms_p50": round(1e3 * statistics.median(sub_lat), 1) if sub_lat else None,
        "burst_submit_ms_p95": round(1e3 * pct(sub_lat, 95), 1) if sub_lat else None,
        "failed": len(b["failures"]),
        "lost": len(acked_ids - set(burst_ids)),
        # a key answered with two ids, or a listed job no answer named (e.g. a second one for a key)
        "duplicated": sum(len(v) - 1 for v in b["acked"].values()) + len(set(burst_ids) - acked_ids),
        "burst_decision_ms_p95": round(1e3 * pct(burst_lat, 95), 1) if burst_lat else None,
        "paced_jobs": len(paced_ids),
        "paced_rate_per_s": a.rate,
        "decided": len(lat),
        "decision_ms_p50": round(1e3 * statistics.median(lat), 1) if lat else None,
        "decision_ms_p95": round(1e3 * pct(lat, 95), 1) if lat else None,
    }
    print(json.dumps(out))
    if not a.json:
        print(f"{out['submissions_per_s']} submissions/s, p95 {out['burst_submit_ms_p95']} ms; lost {out['lost']}, "
              f"duplicated {out['duplicated']}; decision p50 {out['decision_ms_p50']} ms, "
              f"p95 {out['decision_ms_p95']} ms", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
