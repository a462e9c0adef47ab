"""The weighted, overlapped gradient all-reduce in two real gloo processes:
uneven local batches give exactly the full-batch gradient, also when one rank
runs backward twice (the late-gradient fallback must be taken by both ranks)
or has an empty local batch."""

from __future__ import annotations

import datetime
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tidal.runtime.data import split_sizes
from tidal.runtime.reducer import GradReducer


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)).double()


def _data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 6, generator=g, dtype=torch.float64), torch.randn(n, 1, generator=g, dtype=torch.float64)


def _full_grads(n: int) -> list[torch.Tensor]:
    m = _model()
    x, y = _data(n)
    torch.nn.functional.mse_loss(m(x), y).backward()
    return [p.grad.clone() for p in m.parameters()]


CASES = ("uneven", "twice", "empty")


def _worker(rank: int, port: int, out: dict) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30))
    n = 7
    x, y = _data(n)
    for case in CASES:
        m = _model()
        red = GradReducer(list(m.parameters()), bucket_cap_mb=0.0005)  # tiny buckets: several async launches
        sizes = [n, 0] if case == "empty" else split_sizes(n, 2)
        lo = sum(sizes[:rank])
        xb, yb = x[lo : lo + sizes[rank]], y[lo : lo + sizes[rank]]
        red.begin(sizes[rank] / n, True)
        if case == "twice" and rank == 1:  # two half-batch backward passes: mean = average of the halves
            h = len(xb) // 2
            for a, b in ((0, h), (h, len(xb))):
                (torch.nn.functional.mse_loss(m(xb[a:b]), yb[a:b]) * (b - a) / len(xb)).backward()
        else:
            torch.nn.functional.mse_loss(m(xb), yb).backward()
        gen, step = red.finish((5.0, 42.0) if rank == 0 else (0.0, 0.0))
        out[(case, rank)] = ([p.grad.clone() for p in m.parameters()], gen, step, len(red.buckets), red.last_redo)
        red.remove()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(90)
def test_weighted_allreduce_equals_full_batch_gradient() -> None:
    ctx = mp.get_context("spawn")
    with ctx.Manager() as mgr:
        out = mgr.dict()
        port = _free_port()
        procs = [ctx.Process(target=_worker, args=(r, port, out)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=80)
        codes = [p.exitcode for p in procs]
        for p in procs:
            if p.is_alive():
                p.kill()
        assert codes == [0, 0], codes
        res = dict(out)
    full = _full_grads(7)
    for case in CASES:
        for rank in (0, 1):
            grads, gen, step, nb, redo = res[(case, rank)]
            assert nb > 1
            assert (gen, step) == (5.0, 42.0)  # the control pair piggy-backs on the reduction
            assert redo == (case == "twice")  # the fallback is taken by both ranks or by none
            for g, f in zip(grads, full):
                assert torch.allclose(g, f, rtol=1e-12, atol=1e-14), (case, rank, (g - f).abs().max())
