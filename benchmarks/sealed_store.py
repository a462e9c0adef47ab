"""What the store's seal costs: rank 0's per-step exchange with the job's
rendezvous store (write its progress, read the plan key; two round trips to
a torch TCPStore on loopback), plain and sealed (AES-SIV,
:mod:`tidal.runtime.sealed`), interleaved in one run so the machine's load
hits both alike; plus the seal alone (encrypt and verify one progress value).

    python benchmarks/sealed_store.py

Prints one JSON line (median and p99 microseconds per exchange).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time

import torch.distributed as dist

from tidal.runtime.sealed import SealedStore, listen_fd, seal, store_key, unseal

PROGRESS = json.dumps({"step": 123456, "cursor": 7890123, "epoch": 3, "gen": 4, "step_time_s": 0.0531,
                       "last_step": [0.05, 0.051, 0.049, 0.05]})


def _exchange(store: SealedStore | dist.TCPStore, key: str) -> float:
    t = time.perf_counter()
    store.set(f"tidal/{key}/progress", PROGRESS)
    store.get(f"tidal/{key}/plan")
    return 1e6 * (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=5000)
    a = ap.parse_args()
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           master_listen_fd=listen_fd("127.0.0.1", 0))
    key = store_key("a job's credential")
    plain = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=10))
    sealed = SealedStore(dist.TCPStore("127.0.0.1", server.port, is_master=False,
                                       timeout=datetime.timedelta(seconds=10)), key)
    plain.set("tidal/p/plan", "")
    sealed.set("tidal/s/plan", "")
    times: dict[str, list[float]] = {"plain": [], "sealed": []}
    for _ in range(200):  # warm up both connections
        _exchange(plain, "p"), _exchange(sealed, "s")
    for _ in range(a.rounds):
        times["plain"].append(_exchange(plain, "p"))
        times["sealed"].append(_exchange(sealed, "s"))
    t = time.perf_counter()
    for _ in range(a.rounds):
        unseal(key, "tidal/s/progress", seal(key, "tidal/s/progress", PROGRESS))
    seal_us = 1e6 * (time.perf_counter() - t) / a.rounds

    def stats(xs: list[float]) -> dict[str, float]:
        xs = sorted(xs)
        return {"median_us": round(statistics.median(xs), 1), "p99_us": round(xs[int(0.99 * len(xs))], 1)}

    p, s = stats(times["plain"]), stats(times["sealed"])
    print(json.dumps({"benchmark": "sealed_store", "rounds": a.rounds, "plain": p, "sealed": s,
                      "ratio_median": round(s["median_us"] / p["median_us"], 3),
                      "seal_and_verify_us": round(seal_us, 1)}))


if __name__ == "__main__":
    main()
