"""Parameter-server throughput at 1, 2 and 4 servers, and the repartition pause.

For each server count, a PS job with one embedding table of ``--rows`` x
``--dim`` float32 (default 10^7 x 16 = 640 MB, split over the servers, each a
process of this host) and ``--workers`` worker threads of this process; each
worker pulls ``--batch`` random rows and pushes a gradient for each, as fast
as it can (staleness 4), for ``--seconds``. Throughput is counted over that
window only. Then, on the 2-server job, with the workers still running, a
scale-out to 3 servers and a scale-in back to 2: the pause is the time from
freezing the servers to the last commit (rows moved and each server's
checkpoint written), as the master measures it. Every server process must
exit with code 0.

Prints ONE JSON line with ``--json`` (else one line per server count).
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


class _Driver:
    """One worker thread pulling and pushing random rows until stopped."""

    def __init__(self, addr: str, index: int, a: argparse.Namespace) -> None:
        self.addr, self.index, self.a = addr, index, a
        self.steps, self.error = 0, None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"bench-w{index}")
        self.thread.start()

    def _run(self) -> None:
        try:
            c = PSClient(self.addr, f"w{self.index}", staleness=4)
        except BaseException as e:  # noqa: BLE001 - reported by main
            self.error = e
            return
        try:
            g = torch.Generator().manual_seed(self.index)
            grad = torch.full((self.a.batch, self.a.dim), 1e-3)
            while not self.stop.is_set():
                ids = torch.randint(0, self.a.rows, (self.a.batch,), generator=g)
                c.pull({"emb": ids})
                c.push({"emb": (ids, grad)}, lr=0.1)
                self.steps += 1
            c.flush()
        except BaseException as e:  # noqa: BLE001 - reported by main
            self.error = e
        finally:
            c.close(leave=self.error is None)


def measure(n_ps: int, a: argparse.Namespace, scale: bool) -> dict[str, object]:
    """Pushes/s and rows/s with ``n_ps`` servers; with ``scale``, the pauses of 2->3->2."""
    with tempfile.TemporaryDirectory(prefix="ps-bench-") as ckpt:
        t0 = time.perf_counter()
        launcher = ProcessLauncher()
        m = PSMaster([TableSpec("emb", a.rows, a.dim)], ckpt, launcher, servers=n_ps, threads=a.threads, auto=False)
        addr = m.start()
        out: dict[str, object] = {"start_s": round(time.perf_counter() - t0, 2)}
        drivers: list[_Driver] = []
        procs = []
        try:
            drivers = [_Driver(addr, i, a) for i in range(a.workers)]
            time.sleep(min(2.0, a.seconds / 2))  # warm-up: every worker registered and pushing
            s0, w0 = sum(d.steps for d in drivers), time.perf_counter()
            time.sleep(a.seconds)
            steps, wall = sum(d.steps for d in drivers) - s0, time.perf_counter() - w0
            out.update(pushes_per_s=round(steps / wall, 1), rows_per_s=round(steps * a.batch / wall))
            if scale:
                out["scale_out_2_3"] = {k: round(v, 1) for k, v in m.scale_servers(3).items()}
                time.sleep(a.seconds / 2)
                out["scale_in_3_2"] = {k: round(v, 1) for k, v in m.scale_servers(2).items()}
        finally:
            for d in drivers:
                d.stop.set()
            for d in drivers:
                d.thread.join()
            procs = [h.proc for h in launcher.started]
            m.close()
        errors = [repr(d.error) for d in drivers if d.error is not None]
        if errors:
            raise RuntimeError(f"workers failed: {errors}")
        out["server_exit_codes"] = sorted({p.returncode for p in procs})
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
    result: dict[str, object] = {"rows": a.rows, "dim": a.dim, "table_mb": round(a.rows * a.dim * 4 / 1e6, 1),
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
