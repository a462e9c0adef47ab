"""Parameter-server throughput at 1, 2 and 4 servers, and the repartition pause.

For each server count, a PS job with one embedding table of ``--rows`` x
``--dim`` float32 (default 10^7 x 16 = 640 MB, split over the servers, each a
process of this host) and ``--workers`` worker threads of this process; each
worker pushes ``--batch`` random rows (a gradient per row) and pulls the same
number, as fast as it can, for ``--seconds``. Then, on the 2-server job, a
scale-out to 3 and a scale-in back to 2: the pause is the time from freezing
the servers to the last commit (rows moved and each server's checkpoint
written), as the master measures it.

Prints ONE JSON line with ``--json`` (else a table).
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import threading
import time

import torch

from tidal.ps import ProcessLauncher, PSClient, PSMaster, TableSpec


def _drive(addr: str, wid: str, rows: int, dim: int, batch: int, stop: threading.Event,
           counts: dict[str, int]) -> None:
    c = PSClient(addr, wid, staleness=4)
    g = torch.Generator().manual_seed(hash(wid) & 0xFFFF)
    grad = torch.full((batch, dim), 1e-3)
    n = 0
    while not stop.is_set():
        ids = torch.randint(0, rows, (batch,), generator=g)
        c.pull({"emb": ids})
        c.push({"emb": (ids, grad)}, lr=0.1)
        n += 1
    c.flush()
    counts[wid] = n
    c.close()


def measure(n_ps: int, a: argparse.Namespace, scale: bool) -> dict[str, float]:
    """Pushes/s and samples/s with ``n_ps`` servers; with ``scale``, the pauses of 2->3->2."""
    with tempfile.TemporaryDirectory(prefix="ps-bench-") as ckpt:
        t0 = time.perf_counter()
        m = PSMaster([TableSpec("emb", a.rows, a.dim)], ckpt, ProcessLauncher(), ps=n_ps,
                     threads=a.threads, auto=False)
        addr = m.start()
        out: dict[str, float] = {"start_s": time.perf_counter() - t0}
        try:
            stop, counts = threading.Event(), {}
            ts = [threading.Thread(target=_drive, args=(addr, f"w{i}", a.rows, a.dim, a.batch, stop, counts))
                  for i in range(a.workers)]
            for t in ts:
                t.start()
            time.sleep(a.seconds)
            if scale:
                out["scale_out_2_3"] = m.scale_ps(3)
                time.sleep(a.seconds / 2)
                out["scale_in_3_2"] = m.scale_ps(2)
            stop.set()
            for t in ts:
                t.join()
            wall = a.seconds * (2 if scale else 1)
            pushes = sum(counts.values())
            out.update(pushes_per_s=pushes / wall, samples_per_s=pushes * a.batch / wall)
        finally:
            m.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=10_000_000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--threads", type=int, default=2, help="handler threads per server")
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--servers", default="1,2,4")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    result: dict[str, object] = {"rows": a.rows, "dim": a.dim, "table_mb": a.rows * a.dim * 4 / 2**20,
                                 "workers": a.workers, "batch": a.batch, "threads": a.threads}
    for n in [int(x) for x in a.servers.split(",")]:
        result[f"ps{n}"] = measure(n, a, scale=(n == 2))
    if a.json:
        print(json.dumps(result))
        return
    for k, v in result.items():
        print(f"{k:>10}: {v}")


if __name__ == "__main__":
    main()
