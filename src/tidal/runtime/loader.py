"""An elastic torch ``DataLoader``: this rank's share of every global batch,
exactly once per epoch, across rescaling (EDL's elastic shard generator,
AdaptDL's elastic sampler).

:meth:`tidal.runtime.Job.loader` takes a ``DataLoader`` as the script built
it (or a dataset and its keyword arguments) and keeps everything but the
order: ``batch_size`` becomes the *global* batch under strong scaling (the
single-process script's meaning; the local batch under weak scaling),
``shuffle=False`` keeps the dataset order, a custom ``sampler`` gives the
order of each epoch, and ``collate_fn``, ``num_workers``, ``pin_memory``,
``drop_last`` and the rest are passed on to the torch ``DataLoader`` that
does the loading. Epoch ``e`` visits that order; step positions are split
into contiguous slices over the current ranks (:func:`~tidal.runtime.data.
step_slice`). A rank whose share of the last short batch is empty computes
one sample of it with weight 0, so every rank runs the same code and the
sample counts once.

Batches are prefetched by the ``DataLoader``. Each one is remembered with its
slice; when the split changes (a switch, a recovery) the prefetched batches
are dropped and loading restarts from the job's cursor.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING, Any, Iterator, NamedTuple

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, Sampler, SequentialSampler

from tidal.runtime.data import StepSlice, epoch_permutation, step_slice

if TYPE_CHECKING:
    from tidal.runtime.worker import Job

log = logging.getLogger(__name__)

# DataLoader arguments passed on unchanged
_PASSED = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
           "prefetch_factor", "persistent_workers", "pin_memory_device", "in_order")


class Layout(NamedTuple):
    """What a rank's batches depend on besides the cursor (made and
    compared at every batch: a tuple)."""

    epoch: int
    rank: int
    world_size: int
    shares: tuple[float, ...]
    batch: int


class EpochOrder:
    """The order of each epoch's samples, equal on every rank: a seeded
    permutation (``shuffle=True``), the dataset order, or a custom sampler's
    order (``set_epoch(e)`` is called if it has one, and torch's RNG is
    seeded with ``(seed, e)`` around it)."""

    def __init__(self, n: int, mode: str, seed: int, sampler: Sampler[int] | None = None) -> None:
        self.n, self.mode, self.seed, self.sampler = n, mode, seed, sampler
        self._epoch, self._order = -1, torch.arange(0)

    def get(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            self._order, self._epoch = self._make(epoch), epoch
        return self._order

    def _make(self, epoch: int) -> torch.Tensor:
        if self.mode == "shuffle":
            return epoch_permutation(self.n, self.seed, epoch)
        if self.mode == "sequential":
            return torch.arange(self.n)
        assert self.sampler is not None
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(self.seed) * 1_000_003 + int(epoch))
            order = torch.tensor(list(iter(self.sampler)), dtype=torch.int64)
        if len(order) != self.n:
            raise ValueError(f"the sampler {type(self.sampler).__name__} gave {len(order)} indices for epoch "
                             f"{epoch}, not one per sample ({self.n}); Tidal splits an order of all samples")
        return order


class _StepIndices(Sampler[list[int]]):
    """The batch sampler given to the torch DataLoader: this rank's indices
    for successive steps of one epoch from ``start``, under ``layout``; each
    slice is queued in ``pending`` as its indices are handed out."""

    def __init__(self, owner: "ElasticLoader") -> None:
        self.owner = owner
        self.start = 0
        self.layout = Layout(0, 0, 1, (), 1)
        self.next_pos = 0  # the global position of the next batch this iterator hands out

    def __iter__(self) -> Iterator[list[int]]:
        o, lay = self.owner, self.layout
        n, pos = o.n, self.start
        order = o.order.get(lay.epoch)
        while pos < (lay.epoch + 1) * n:
            sl = step_slice(pos, n, lay.batch, lay.rank, lay.world_size, lay.shares)
            if o.drop_last and sl.global_size < lay.batch:
                return
            idx = order[sl.lo : sl.hi].tolist()
            o.pending.append((sl, idx))
            pos = self.next_pos = lay.epoch * n + sl.stop
            yield idx if idx else order[sl.start : sl.start + 1].tolist()  # weight 0: counts nothing

    def __len__(self) -> int:
        return self.owner.steps_per_epoch()


class ElasticLoader:
    """Iterate it once per epoch, inside ``for epoch in job.epochs(N)``."""

    def __init__(self, job: "Job", dataset: Any, batch_size: int, *, shuffle: bool = False,
                 sampler: Sampler[int] | None = None, drop_last: bool = False, seed: int = 0,
                 **loader_kw: Any) -> None:
        if isinstance(dataset, IterableDataset):
            raise TypeError("an IterableDataset has no index to split exactly once; use a map-style dataset "
                            "(__getitem__ and __len__) or shard mode (tidal.runtime.ShardReader)")
        self.job, self.dataset = job, dataset
        self.n = len(dataset)
        if self.n <= 0:
            raise ValueError("the dataset is empty")
        mode = "custom" if sampler is not None else ("shuffle" if shuffle else "sequential")
        self.order = EpochOrder(self.n, mode, seed, sampler)
        self.drop_last = bool(drop_last)
        self.batch_size = int(batch_size)
        self.pending: deque[tuple[StepSlice, list[int]]] = deque()
        self.last_indices: list[int] = []
        self.batch_index = -1  # of the batch just handed out, within its epoch (also on a newcomer)
        self.epoch = 0
        self._steps = _StepIndices(self)
        # torch's DataLoader draws from the global RNG at each epoch's start: its workers' base seed, and a
        # RandomSampler's seed; the same draws here keep the script's random stream (dropout masks) as it was
        own = loader_kw.get("generator") is not None
        self.rng_draws = (0 if own else 1) + (1 if mode == "shuffle" and not own else 0)
        loader_kw.setdefault("generator", torch.Generator().manual_seed(seed))  # leaves the script's RNG alone
        self._dl = DataLoader(dataset, batch_sampler=self._steps, **loader_kw)
        self._it: Iterator[Any] | None = None

    @classmethod
    def from_dataloader(cls, job: "Job", dl: DataLoader, seed: int = 0) -> "ElasticLoader":
        """Rebuild a script's ``DataLoader`` with the elastic order."""
        bs = dl.batch_sampler
        if dl.batch_size is None or (bs is not None and type(bs) is not BatchSampler):
            raise ValueError(f"a custom batch_sampler ({type(bs).__name__}) decides the batches itself; give "
                             "Tidal batch_size (and a sampler for the order) instead")
        s = dl.sampler
        custom = None if isinstance(s, (RandomSampler, SequentialSampler)) else s
        kw = {k: getattr(dl, k) for k in _PASSED if hasattr(dl, k)}
        if not kw.get("num_workers"):
            kw.pop("prefetch_factor", None)
            kw.pop("persistent_workers", None)
        if dl.generator is not None:
            kw["generator"] = dl.generator
        return cls(job, dl.dataset, dl.batch_size, shuffle=isinstance(s, RandomSampler), sampler=custom,
                   drop_last=dl.drop_last, seed=seed, **kw)

    # ------------------------------------------------------------------ sizes
    def steps_per_epoch(self) -> int:
        """Global steps (= this rank's batches) in a full epoch at the current global batch."""
        b = max(1, self.job.global_batch_size)
        return self.n // b if self.drop_last else -(-self.n // b)

    def __len__(self) -> int:
        return self.steps_per_epoch()

    def epoch_over(self, epoch: int, cursor: int) -> bool:
        left = (epoch + 1) * self.n - cursor
        return left <= 0 or (self.drop_last and left < self.job.global_batch_size)

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[Any]:
        job = self.job
        epoch = job._epoch_of_loader(self)
        self.epoch = epoch
        for _ in range(self.rng_draws):
            torch.empty((), dtype=torch.int64).random_()
        while True:
            if not job._boundary(self, epoch):
                break
            pos = job.runner.live_cursor
            lay = Layout(epoch, job.rank, job.world_size, tuple(job.shares), job.global_batch_size)
            ahead = lay.epoch * self.n + self.pending[0][0].start if self.pending else self._steps.next_pos
            if self._it is None or lay != self._steps.layout or ahead != pos:
                self._restart(pos, lay)  # the split changed (a switch, a recovery): drop what was prefetched
            assert self._it is not None
            try:
                batch = next(self._it)
            except StopIteration:  # cannot happen while the epoch is not over; stop safely anyway
                log.error("the loader ran out at cursor %d of epoch %d", pos, epoch)
                break
            sl, idx = self.pending.popleft()
            self.last_indices = idx
            self.batch_index = sl.start // max(1, lay.batch)
            job.runner.begin(sl, epoch * self.n + sl.stop)
            yield batch
        self._drop_iterator()

    def _restart(self, pos: int, lay: Layout) -> None:
        """(Re)start loading at ``pos`` under ``lay`` (prefetched batches dropped)."""
        self._drop_iterator()
        self._steps.start, self._steps.next_pos, self._steps.layout = pos, pos, lay
        self._it = iter(self._dl)

    def _drop_iterator(self) -> None:
        it, self._it = self._it, None
        self.pending.clear()
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None and not self._dl.persistent_workers:  # persistent ones are reset by iter()
            shutdown()


class AllEpochs:
    """``job.data(...)``: every epoch's batches in one loop."""

    def __init__(self, job: "Job", loader: ElasticLoader, epochs: int) -> None:
        self.job, self.loader, self.epochs = job, loader, int(epochs)

    @property
    def epoch(self) -> int:
        return self.loader.epoch

    @property
    def last_indices(self) -> list[int]:
        return self.loader.last_indices

    def __len__(self) -> int:
        return self.epochs * self.loader.steps_per_epoch()

    def __iter__(self) -> Iterator[Any]:
        for _ in self.job.epochs(self.epochs):
            yield from self.loader
