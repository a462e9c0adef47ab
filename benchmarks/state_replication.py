"""Concurrent vs single-source state replication (Elan §IV).

``S`` live workers hold the training state (``--mb`` MiB of float32 tensors,
like model + optimizer state); ``J`` newcomers need it. Three ways, with the
runtime's own transfer functions on a real gloo group (one process each):

* ``broadcast``: one ``dist.broadcast`` from rank 0 over the whole group
  (:func:`tidal.runtime.transfer.broadcast_state`; every rank takes part);
* ``single``: point to point, every newcomer from rank 0
  (:func:`~tidal.runtime.transfer.replicate_state` with one source);
* ``concurrent``: point to point, newcomer ``i`` from live worker ``i mod S``,
  all transfers at once (what :func:`tidal.runtime.replication.assign_sources`
  plans when the sources are equally near).

With ``--cap-mbps`` (default 100) the two point-to-point modes run again
with each source's egress capped (``send_state(max_bytes_per_s=...)``, what
``$TIDAL_STATE_MAX_MBPS`` sets in a job), standing in for a host's NIC, the
resource Elan spreads the load over; without a cap, loopback on this 2-core
machine is bound by CPU and memory copies shared by all processes.

Time = from a barrier until the last newcomer holds a verified copy (a
barrier after the transfer), median of ``--repeats``. Prints a table, or one
JSON object with ``--json``. All processes run on this host over loopback:
what is measured is the effect of spreading the work over sources; the
bandwidth gap between same-host and cross-host links that the topology rule
also exploits does not exist here.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MODES = ("broadcast", "single", "concurrent")


def _state(mb: float, rank: int) -> dict[str, Any]:
    n = int(mb * 2**20 / 4)
    parts = 8
    g = torch.Generator().manual_seed(1234)
    return {"model": {f"p{i}": torch.rand(n // parts, generator=g) for i in range(parts)}, "step": 17, "owner": rank}


def _worker(rank: int, world: int, sources: int, mb: float, repeats: int, store_path: str, q: Any,
            cap_mbps: float) -> None:
    from tidal.runtime.transfer import broadcast_state, replicate_state

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    held = _state(mb, rank) if rank < sources else None
    expect = _state(mb, 0)["model"]["p3"] if rank >= sources else None
    joiners = list(range(sources, world))
    plans = {"single": {j: 0 for j in joiners}, "concurrent": {j: j % sources for j in joiners}}
    runs = [(m, 0.0) for m in MODES] + ([(m, cap_mbps * 1e6) for m in ("single", "concurrent")] if cap_mbps else [])
    times: dict[str, list[float]] = {m + ("_capped" if cap else ""): [] for m, cap in runs}
    for _ in range(repeats):
        for mode, cap in runs:
            dist.barrier()
            t0 = time.perf_counter()
            if mode == "broadcast":
                got = broadcast_state(held if rank == 0 else None, src=0)
            else:
                got = replicate_state(held, plans[mode], max_bytes_per_s=cap)
            dist.barrier()
            dt = time.perf_counter() - t0
            if rank >= sources:
                assert got["step"] == 17 and torch.equal(got["model"]["p3"], expect)
            times[mode + ("_capped" if cap else "")].append(dt)
    if rank == 0:
        q.put({m: statistics.median(v) for m, v in times.items()})
    dist.destroy_process_group()


def measure(mb: float = 64.0, sources: int = 4, joiners: int = 4, repeats: int = 3,
            cap_mbps: float = 100.0) -> dict[str, Any]:
    """Run the modes on ``sources + joiners`` processes; returns seconds per mode."""
    world = sources + joiners
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        store = os.path.join(d, "store")
        procs = [ctx.Process(target=_worker, args=(r, world, sources, mb, repeats, store, q, cap_mbps)) for r in range(world)]
        for p in procs:
            p.start()
        res = q.get(timeout=600)
        for p in procs:
            p.join(timeout=60)
    return {
        "replication_state_mb": mb,
        "replication_sources": sources,
        "replication_joiners": joiners,
        "replication_broadcast_s": round(res["broadcast"], 4),
        "replication_single_s": round(res["single"], 4),
        "replication_concurrent_s": round(res["concurrent"], 4),
        "replication_speedup": round(res["single"] / res["concurrent"], 2) if res["concurrent"] else None,
        "replication_cap_mbps": cap_mbps,
        "replication_capped_single_s": round(res["single_capped"], 4) if cap_mbps else None,
        "replication_capped_concurrent_s": round(res["concurrent_capped"], 4) if cap_mbps else None,
        "replication_capped_speedup": round(res["single_capped"] / res["concurrent_capped"], 2) if cap_mbps else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=64.0, help="state size in MiB")
    ap.add_argument("--sources", type=int, default=4)
    ap.add_argument("--joiners", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cap-mbps", type=float, default=100.0,
                    help="also run with each source's egress capped at this many MB/s (a host NIC); 0: skip")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    r = measure(a.mb, a.sources, a.joiners, a.repeats, a.cap_mbps)
    if a.json:
        print(json.dumps(r))
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"state replication: {a.mb:g} MiB to {a.joiners} newcomers from {a.sources} live workers")
    t.add_column("mode")
    t.add_column("seconds", justify="right")
    for m in MODES:
        t.add_row(m, f"{r[f'replication_{m}_s']:.3f}")
    if a.cap_mbps:
        for m in ("single", "concurrent"):
            t.add_row(f"{m}, {a.cap_mbps:g} MB/s per source", f"{r[f'replication_capped_{m}_s']:.3f}")
    Console().print(t)


if __name__ == "__main__":
    sys.exit(main())
