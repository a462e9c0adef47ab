"""Control-plane speed: API submissions per second and the latency from
submission to placement decision.

    python benchmarks/control_api.py --json [--jobs 300] [--clients 8] [--policy fifo]

Starts a real server process (uvicorn, SQLite in a temp dir), registers one
virtual node with enough GPUs for every job (no agent: the decision is what is
measured, not the launch), then submits rigid 1-GPU jobs from ``--clients``
threads as fast as the server takes them (throughput), then ``--paced``
jobs at ``--rate`` per second (latency under a steady load). Decision latency
= the job's ``job.start`` event time minus its submission time (both taken by
the server). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from tidal.control.local import LocalCluster


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--jobs", type=int, default=300)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--policy", default="fifo")
    ap.add_argument("--paced", type=int, default=100)
    ap.add_argument("--rate", type=float, default=10.0, help="paced submissions per second")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        c = LocalCluster(Path(d), policy=a.policy, tick_s=1.0)
        c.start_server()
        try:
            h = {"Authorization": f"Bearer {c.admin_token}"}
            httpx.post(c.url + "/internal/agents/register", json={"name": "big", "num_gpus": a.jobs + a.paced, "virtual": True},
                       headers=h).raise_for_status()
            body = {"name": "b", "script": "train.py", "gpus": 1, "elastic": False, "iterations": 1000}
            ids: list[str] = []
            lock = threading.Lock()
            per_client = a.jobs // a.clients

            def client() -> None:
                with httpx.Client(base_url=c.url, headers=h, timeout=30) as cl:
                    for _ in range(per_client):
                        r = cl.post("/v1/jobs", json=body)
                        r.raise_for_status()
                        with lock:
                            ids.append(r.json()["id"])

            t0 = time.perf_counter()
            threads = [threading.Thread(target=client) for _ in range(a.clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            submit_s = time.perf_counter() - t0
            burst = list(ids)

            def decisions(want: list[str]) -> list[float]:
                deadline = time.time() + 300
                while True:
                    ev = httpx.get(c.url + "/v1/events", headers=h, timeout=60).json()
                    starts = {e["job"]: e["time"] for e in ev if e["kind"] == "job.start"}
                    subs = {e["job"]: e["time"] for e in ev if e["kind"] == "job.submitted"}
                    if all(j in starts for j in want) or time.time() > deadline:
                        return [starts[j] - subs[j] for j in want if j in starts and j in subs]
                    time.sleep(1)

            burst_lat = decisions(burst)
            paced: list[str] = []
            with httpx.Client(base_url=c.url, headers=h, timeout=30) as cl:
                t1 = time.perf_counter()
                for k in range(a.paced):
                    time.sleep(max(0.0, t1 + k / a.rate - time.perf_counter()))
                    paced.append(cl.post("/v1/jobs", json=body).json()["id"])
            lat = decisions(paced)
        finally:
            c.stop()
    out = {
        "benchmark": "control_api",
        "policy": a.policy,
        "jobs": len(burst),
        "clients": a.clients,
        "submissions_per_s": round(len(burst) / submit_s, 1),
        "burst_decision_ms_p95": round(1e3 * pct(burst_lat, 95), 1) if burst_lat else None,
        "paced_jobs": len(paced),
        "paced_rate_per_s": a.rate,
        "decided": len(lat),
        "decision_ms_p50": round(1e3 * statistics.median(lat), 1) if lat else None,
        "decision_ms_p95": round(1e3 * pct(lat, 95), 1) if lat else None,
    }
    print(json.dumps(out))
    if not a.json:
        print(f"{out['submissions_per_s']} submissions/s; decision p50 {out['decision_ms_p50']} ms, "
              f"p95 {out['decision_ms_p95']} ms", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
