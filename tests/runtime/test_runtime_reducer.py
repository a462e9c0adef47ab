"""The weighted, overlapped gradient all-reduce in two real gloo processes,
with DDP's contract: when backward returns, p.grad holds the full-batch
gradient, for uneven local batches, an accumulation window of uneven
micro-batches (no_sync), an empty share (weight 0 on a stand-in sample) and
a parameter unused on one rank or on both (the latter keeps grad None).
Also: the gradients are views of the buckets and stay right over further
steps (zero_grad with and without set_to_none), the copying mode
(``grad_views=False``), and the control numbers riding in a float32 bucket
stay exact for large integers."""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist

from tidal.runtime.data import split_sizes
from tidal.runtime.reducer import GradReducer
from runtime_helpers import run_ranks


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


CASES = ("uneven", "accumulate", "accumulate_again", "empty", "unused", "float32", "steps", "steps_none", "copy",
         "raised")
BIG = float(2**40 + 3)  # a step number float32 alone would round


class _Listener:
    def __init__(self, rank: int) -> None:
        self.rank, self.reduced = rank, []

    def sync_begin(self) -> list[float]:
        return [5.0, 42.0, BIG] if self.rank == 0 else [0.0, 0.0, 0.0]

    def sync_done(self, reduced: list[float]) -> None:
        self.reduced.append(reduced)

    def sync_failed(self, error: Exception) -> None:
        raise error


class _Branchy(torch.nn.Module):
    """_model() plus a head used only by rank 0 and one used by nobody."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _model()
        torch.manual_seed(3)
        self.extra = torch.nn.Linear(6, 1).double()
        self.never = torch.nn.Linear(6, 1).double()

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        return self.body(x) + (0.0 * self.extra(x) if use_extra else 0.0)  # used, without changing the loss


def _worker(rank: int, port: int, out: dict) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30))
    n = 7
    x, y = _data(n)
    mse = torch.nn.functional.mse_loss
    for case in CASES:
        m = _Branchy() if case == "unused" else _model()
        if case == "float32":
            m = m.float()
        lis = _Listener(rank)
        red = GradReducer(list(m.parameters()), listener=lis, bucket_cap_mb=0.0002,  # several async launches
                          grad_views=case != "copy")
        sizes = [n, 0] if case == "empty" else split_sizes(n, 2)
        lo = sum(sizes[:rank])
        xb, yb = x[lo : lo + sizes[rank]], y[lo : lo + sizes[rank]]
        if case == "accumulate" and rank == 1:  # micro-batches of 1 and 2 samples: each weighted by its own share
            red.arm(1 / n, True)
            with red.no_sync():
                mse(m(xb[:1]), yb[:1]).backward()
            red.arm(2 / n, True)
            mse(m(xb[1:]), yb[1:]).backward()
        elif case == "accumulate_again":  # two steps, each a window of two micro-batches on rank 1
            for window in range(2):
                if rank == 1:
                    # the second window as DDP's no_sync example runs it: the next batch is taken inside the
                    # block, so the previous step ends (closed) there
                    with red.no_sync():
                        if window == 1:
                            red.closed()
                        m.zero_grad(set_to_none=True)
                        red.arm(1 / n, True)
                        mse(m(xb[:1]), yb[:1]).backward()
                    red.arm(2 / n, True)
                    mse(m(xb[1:]), yb[1:]).backward()
                else:
                    m.zero_grad(set_to_none=True)
                    red.arm(sizes[rank] / n, True)
                    mse(m(xb), yb).backward()
                if window == 0 or rank == 0:
                    red.closed()
            lis.reduced = lis.reduced[-1:]
            grads = [p.grad.clone().double() for p in m.parameters()]
            red.closed()
            # no pre-accumulation hook is left after a window (each would cost every backward)
            assert all(not p._backward_hooks for p in m.parameters())
            out[(case, rank)] = (grads, lis.reduced, len(red.buckets))
            red.remove()
            continue
        elif case == "raised":  # a backward that raised after some hooks ran (the script caught it): the next reduces
            def fail(_p: torch.Tensor) -> None:
                raise RuntimeError("out of memory (simulated)")
            h = m[0].weight.register_post_accumulate_grad_hook(fail)  # the first layer: its gradient comes last
            red.arm(sizes[rank] / n, True)
            with pytest.raises(RuntimeError, match="simulated"):
                mse(m(xb), yb).backward()
            h.remove()
            m.zero_grad(set_to_none=True)
            red.arm(sizes[rank] / n, True)
            mse(m(xb), yb).backward()
        elif case == "empty" and rank == 1:  # a stand-in sample with weight 0
            red.arm(0.0, True)
            mse(m(x[:1]), y[:1]).backward()
        elif case == "unused":
            red.arm(sizes[rank] / n, True)
            mse(m(xb, use_extra=rank == 0), yb).backward()
        elif case == "float32":
            red.arm(sizes[rank] / n, True)
            mse(m(xb.float()), yb.float()).backward()
        elif case in ("steps", "steps_none", "copy"):
            for _ in range(3):  # the same batch three times: each step's gradient is the full-batch one again
                m.zero_grad(set_to_none=case != "steps")
                red.arm(sizes[rank] / n, True)
                mse(m(xb), yb).backward()
                red.closed()
            lis.reduced = lis.reduced[-1:]
            views = [v.data_ptr() for b in red.buckets for v in b.views]
            assert sorted(p.grad.data_ptr() for p in m.parameters()) == sorted(views) or case == "copy"
        else:
            red.arm(sizes[rank] / n, True)
            mse(m(xb), yb).backward()
        grads = [None if p.grad is None else p.grad.clone().double() for p in m.parameters()]
        out[(case, rank)] = (grads, lis.reduced, len(red.buckets))
        red.remove()
    dist.destroy_process_group()



@pytest.mark.timeout(90)
def test_weighted_allreduce_equals_full_batch_gradient() -> None:
    res = run_ranks(_worker)
    full = _full_grads(7)
    for case in CASES:
        for rank in (0, 1):
            grads, reduced, nb = res[(case, rank)]
            assert nb > 1
            assert reduced == [[5.0, 42.0, BIG]]  # one sync; the control numbers ride with the gradients
            if case == "unused":
                *body, ew, eb, nw, nbias = grads
                assert nw is None and nbias is None  # unused on every rank: grad stays None, as in DDP
                assert ew is not None and eb is not None  # used by rank 0 only: reduced on both
                grads = body
            tol = dict(rtol=1e-5, atol=1e-6) if case == "float32" else dict(rtol=1e-12, atol=1e-14)
            for g, f in zip(grads, full):
                assert torch.allclose(g, f, **tol), (case, rank, (g - f).abs().max())


def _bucket_models() -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    lin = torch.nn.Linear
    return {
        # a large weight right after the first megabyte: stopping short of it would leave all but 45 kB of the
        # model to the last bucket, reduced only after backward
        "mlp": torch.nn.Sequential(lin(256, 1024), torch.nn.ReLU(), lin(1024, 1024), torch.nn.ReLU(), lin(1024, 10)),
        "deep": torch.nn.Sequential(*[lin(700, 700) for _ in range(30)]),
        # the last weight is exactly 1 MiB: a bucket closes when it reaches its limit, not only past it
        "exact": torch.nn.Sequential(lin(64, 1024), lin(1024, 256, bias=False)),
    }


@pytest.mark.skipif(tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 4),
                    reason="DDP's bucket_cap_mb=None default and its first-bucket rule date from torch 2.4")
@pytest.mark.parametrize("cap_mb", [None, 2.0])
def test_buckets_match_ddps(cap_mb: float | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The buckets hold the same parameters as DDP's own (after its rebuild in
    gradient-ready order, which is reverse registration order for these
    models), so the same all-reduces overlap backward. DDP's defaults are a
    25 MB cap and a 1 MB first bucket; a cap it is given applies to the
    first bucket too."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for name, m in _bucket_models().items():
            params = list(m.parameters())
            index = {id(p): i for i, p in enumerate(params)}
            ours = GradReducer(params) if cap_mb is None else GradReducer(params, bucket_cap_mb=cap_mb,
                                                                           first_bucket_mb=cap_mb)
            mine = [[index[id(p)] for p in b.params] for b in ours.buckets]
            ours.remove()
            ddp = torch.nn.parallel.DistributedDataParallel(m, bucket_cap_mb=cap_mb)
            x = torch.randn(2, params[0].shape[1])
            for _ in range(3):  # rebuilt in the second forward, logged in the third
                ddp(x).sum().backward()
            theirs = [[int(i) for i in b.split()] for b in
                      ddp._get_ddp_logging_data()["rebuilt_per_bucket_param_indices"].split(",")]
            assert mine == theirs, name
            assert len(mine) > 1 or name == "exact", name
            del ddp
    finally:
        dist.destroy_process_group()
