"""The elastic DataLoader and the training objects found for the user, in
one local process (no master): order kept for shuffle=False and a custom
sampler, drop_last, len() per epoch, loader workers, a torch.compile'd
model, and the clear error for an optimizer created after training began."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Sampler, TensorDataset

import tidal.runtime


def _setup(n: int = 50, **dl_kw):
    job = tidal.runtime.init(worker_id="t0")
    torch.manual_seed(0)
    model = job.wrap(torch.nn.Linear(3, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ds = TensorDataset(torch.randn(n, 3), torch.randn(n, 1), torch.arange(n))
    return job, model, opt, job.loader(DataLoader(ds, **dl_kw))


def _train(job, model, opt, loader, epochs: int) -> dict[int, list[int]]:
    seen: dict[int, list[int]] = {}
    for e in job.epochs(epochs):
        for x, y, i in loader:
            seen.setdefault(e, []).extend(i.tolist())
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    return seen


class _Reverse(Sampler[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(self.n - 1, -1, -1))

    def __len__(self) -> int:
        return self.n


def test_sequential_order_and_len_per_epoch() -> None:
    job, model, opt, loader = _setup(batch_size=16, shuffle=False)
    assert len(loader) == 4  # ceil(50 / 16), per epoch
    restarts = []
    real = loader._restart
    loader._restart = lambda pos, lay: (restarts.append(pos), real(pos, lay))  # type: ignore[method-assign]
    seen = _train(job, model, opt, loader, 2)
    assert seen == {0: list(range(50)), 1: list(range(50))}
    assert job.step_count == 8
    assert restarts == [0, 50]  # loading starts once per epoch, not once per batch


def test_custom_sampler_order_and_drop_last() -> None:
    job, model, opt, loader = _setup(batch_size=16, sampler=_Reverse(50), drop_last=True)
    assert len(loader) == 3
    seen = _train(job, model, opt, loader, 2)
    assert seen[0] == list(range(49, 1, -1)) and seen[1] == seen[0]  # 48 samples: the short batch is dropped
    assert job.step_count == 6 and job.cursor == 100


def test_shuffle_with_loader_workers_is_exactly_once() -> None:
    job, model, opt, loader = _setup(batch_size=8, shuffle=True, num_workers=2)
    seen = _train(job, model, opt, loader, 2)
    for e in (0, 1):
        assert sorted(seen[e]) == list(range(50)) and seen[e] != list(range(50))
    assert seen[0] != seen[1]


def test_compiled_model_trains() -> None:
    job = tidal.runtime.init(worker_id="t1")
    torch.manual_seed(0)
    base = torch.nn.Linear(3, 1)
    model = job.wrap(torch.compile(base, backend="eager"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ds = TensorDataset(torch.randn(20, 3), torch.randn(20, 1))
    loader = job.loader(ds, batch_size=5)
    before = base.weight.detach().clone()
    for _ in job.epochs(1):
        for x, y in loader:
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    assert job.step_count == 4 and not torch.equal(before, base.weight)


def test_an_optimizer_created_after_training_began_is_refused_by_name() -> None:
    job, model, opt, loader = _setup(batch_size=25)
    with pytest.raises(RuntimeError, match="Adam over the model's parameters was created after the job started"):
        for _ in job.epochs(1):
            late = torch.optim.Adam(model.parameters())
            for x, y, _i in loader:
                torch.nn.functional.mse_loss(model(x), y).backward()
                late.step()


def _dropout_run(port: bool, shuffle: bool) -> tuple[list[torch.Tensor], float]:
    """Two epochs of a model with dropout, as a plain script or its port run alone."""
    torch.manual_seed(0)
    job = tidal.runtime.init() if port else None
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
    if job is not None:
        model = job.wrap(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dl: object = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8, shuffle=shuffle)
    if job is not None:
        dl = job.loader(dl)
    for _ in (job.epochs(2) if job is not None else range(2)):
        for x, y in dl:  # type: ignore[attr-defined]
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    if job is not None:
        job.close()
    return [p.detach().clone() for p in model.parameters()], torch.rand(1).item()


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_port_run_alone_draws_random_numbers_as_the_plain_script(shuffle: bool) -> None:
    """torch's DataLoader draws from the global RNG at each epoch's start; the
    elastic loader makes the same draws, so dropout masks are the plain
    script's: without shuffling the port alone equals the plain script bit
    for bit; with it the order is Tidal's seeded one, the random stream after
    it still the plain script's."""
    plain, after_plain = _dropout_run(False, shuffle)
    port, after_port = _dropout_run(True, shuffle)
    assert after_port == after_plain
    if not shuffle:
        assert all(torch.equal(a, b) for a, b in zip(plain, port))
