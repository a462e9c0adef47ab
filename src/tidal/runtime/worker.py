"""The worker side: :func:`init` and :class:`Job`, the handle a training
script holds. A single-process script ports in a few lines (see
``examples/`` and docs/runtime.md)::

    job = tidal.runtime.init()                       # device, backend, the job master
    model = job.wrap(model.to(job.device))           # like DDP(model)
    loader = job.loader(DataLoader(ds, batch_size=256, shuffle=True))  # global batch
    for epoch in job.epochs(10):                     # newcomers start at the current epoch
        for x, y in loader:                          # this rank's share, exactly once
            loss_fn(model(x), y).backward()          # p.grad reduced when backward returns
            clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step(); optimizer.zero_grad()  # the step boundary
        job.on_rank0(evaluate, model)                # others wait without a timeout

How a change happens without stopping (EDL §4.2, Elan §V-B):

1. The master publishes a plan (target generation, switch step ``t_cur + k``).
2. Rank 0 learns it on its asynchronous heartbeat (:mod:`tidal.runtime.
   heartbeat`) and contributes two numbers (target generation, switch step)
   to the small control tensor reduced with the gradients
   (:mod:`tidal.runtime.reducer`), so every rank agrees at the same step at
   no extra synchronisation; the effective switch step is ``max(planned,
   t + 1)``.
3. At that batch boundary (:mod:`tidal.runtime.lifecycle`) leavers exit;
   survivors ``destroy_process_group`` and ``init_process_group`` at the new
   size with the generation's store prefix (same processes); newcomers join
   the rendezvous and receive the full state (:mod:`tidal.runtime.
   membership`).

Strong scaling: each rank weights its gradient of the *mean* local loss by
``b_r / B`` before the SUM all-reduce, so the update equals the fixed-size
update for any split of the global batch.

Threads: :class:`Job` belongs to the training thread. The heartbeat threads
read the progress through :meth:`Job._progress` (single attribute reads of
values replaced whole); everything else they share goes through the locks of
:mod:`tidal.runtime.membership` and :mod:`tidal.runtime.heartbeat`.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import operator
import os
import sys
import time
from typing import Any, Callable, Iterator, NoReturn, Sequence, TypeVar

import torch
import torch.distributed as dist

from tidal import settings
from tidal.runtime import rank0
from tidal.runtime.checkpoint import Checkpointer
from tidal.runtime.client import MasterClient, MasterUnavailable, url_file
from tidal.runtime.devices import backend_for, local_device, params_device
from tidal.runtime.heartbeat import Heartbeat
from tidal.runtime.lifecycle import Lifecycle
from tidal.runtime.loader import AllEpochs, ElasticLoader
from tidal.runtime.membership import Membership, StoreCache
from tidal.runtime.messages import Generation
from tidal.runtime.scaling import BatchPolicy, make_policy
from tidal.runtime.sequence import SequenceLoader
from tidal.runtime.state import ElasticState, Kept, RescaleHook, TrainState, bind_globals
from tidal.runtime.steps import StepRunner

log = logging.getLogger(__name__)
T = TypeVar("T")


def _pctl(xs: Sequence[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def _view(path: str, doc: str = "") -> property:
    """A read-only attribute of :class:`Job` kept in one of its parts."""
    return property(operator.attrgetter(path), doc=doc)


class Job:
    """One worker's handle on the elastic job. Create with :func:`init`."""

    def __init__(
        self,
        master_url: str | None,
        worker_id: str,
        *,
        collective_timeout_s: float | None = None,
        join_timeout_s: float = 300.0,
        heartbeat_interval_s: float | None = None,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        checkpoint_every: int | None = None,
        checkpoint_keep: int = 2,
        device: torch.device | str | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.client = _master_client(master_url) if master_url else None
        self.device = torch.device(device) if device is not None else _default_device()
        self.train = TrainState()
        # periodic checkpoints (consistent recovery when every worker died): see tidal.runtime.checkpoint
        self.checkpointer = Checkpointer.configure(checkpoint_dir, checkpoint_every, checkpoint_keep)
        timeout = settings.COLLECTIVE_TIMEOUT_S.get() if collective_timeout_s is None else collective_timeout_s
        self.membership = Membership(worker_id, self.client, timeout, join_timeout_s)
        interval = settings.HEARTBEAT_S.get() if heartbeat_interval_s is None else heartbeat_interval_s
        self.heartbeat = Heartbeat(self.membership, interval, self._progress)
        self.runner = StepRunner(worker_id, self.train, self.membership, self.heartbeat)
        self.life = Lifecycle(self)
        self.finished = self.left = False
        self.suspended = False  # left because the job was suspended (it resumes from a checkpoint)
        self._loader: ElasticLoader | None = None
        self._epoch: int | None = None  # the epoch job.epochs() is in
        self.rank0_calls: tuple[int, int] = (-1, 0)  # (generation, job.on_rank0 calls made in it)
        self._kept: dict[str, Any] = {}  # job.keep's values until the state is registered
        self._bound: dict[str, dict[str, Any]] = {}  # job.keep's module-level variables (name -> module dict)
        self.carriers: list[SequenceLoader] = []  # loaders whose streams carry state (runtime.sequence)
        self.wrapped: list[torch.nn.Module] = []  # the models given to job.wrap, in order
        self.max_steps = settings.MAX_STEPS.get()  # the job's termination condition (0: the script's loop)

    # ------------------------------------------------------------------ views
    state = _view("train.elastic", "The registered :class:`ElasticState`.")
    policy = _view("train.policy", "The batch policy (strong, weak, hybrid or goodput).")
    global_batch_size = _view("train.global_batch_size")
    cursor = _view("train.cursor", "The data state: the global sample position.")
    step_count = _view("train.step", "Optimizer steps taken so far.")
    gen = _view("membership.seat.gen", "The current generation (None before joining).")
    world_size = _view("membership.seat.world_size")
    hooks = _view("membership.hooks", "Rescale hooks (see :meth:`register_hook`).")
    pauses = _view("membership.pauses", "Switches and recoveries: when and how long.")
    failures = _view("membership.failures", "Detected peer failures.")
    joined_at_step = _view("membership.joined_at_step", "The step this worker joined at (0: from the start).")
    checkpoints = _view("checkpointer.written", "What this worker (as rank 0) wrote.")
    resumed_from = _view("checkpointer.resumed_from", "Step of the checkpoint the job resumed from.")
    straggler_reports = _view("runner.stragglers.reports", "Stragglers this worker (as rank 0) reported.")
    reducer = _view("runner.reducer")
    faults = _view("runner.faults", "Injected faults (``$TIDAL_FAULTS``).")
    goodput = property(lambda self: self.train.policy.report(self.train.step), doc="The batch policy's numbers: "
                       "global batch, LR factor, noise scale, efficiency, gain (:mod:`tidal.runtime.goodput`).")

    @property
    def rank(self) -> int:
        """This worker's rank: -1 before joining and after leaving (0 in local mode)."""
        return -1 if self.left else self.membership.seat.rank

    @property
    def shares(self) -> tuple[float, ...]:
        """Relative batch shares of the ranks (empty: even split)."""
        g = self.gen
        return g.shares if g is not None else ()

    @property
    def step_time_s(self) -> float:
        return _pctl(list(self.runner.timing.step_times), 0.5)

    @property
    def epoch(self) -> int:
        if self._epoch is not None:
            return self._epoch
        n = self._loader.n if self._loader is not None else 0
        return self.cursor // n if n else 0

    # ------------------------------------------------------------------ registering
    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The counterpart of ``DistributedDataParallel(model)``: gradients
        are reduced when backward returns, and the model, its optimizers, LR
        schedulers, GradScaler and the RNG reach newcomers (found when
        training starts, :mod:`tidal.runtime.capture`). Returns ``model``
        itself (no ``.module``; state dict keys unchanged). Wrap each model of
        a job that trains several (a GAN's generator and discriminator)."""
        self.wrapped = [m for m in self.wrapped if m is not model] + [model]
        self.register_state(model if len(self.wrapped) == 1 else torch.nn.ModuleList(self.wrapped))
        return model

    def register_state(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        scheduler: Any | Sequence[Any] | None = None,
        extras: dict[str, Any] | None = None,
        scaler: Any | None = None,
    ) -> ElasticState:
        """Register what must survive a rescale (Elan's RegisterState); what
        is left out is looked for when training starts. The model's device
        picks the collective backend: NCCL for CUDA, gloo on the CPU."""
        self.membership.backend = backend_for(params_device(model.parameters()))
        self.train.elastic = ElasticState(model, optimizer, scheduler, extras, scaler)
        self.train.elastic.extras.update(self._kept)  # job.keep before job.wrap
        self.train.elastic.bound.update(self._bound)
        self._kept = self.train.elastic.extras
        if self.life.started:
            self.runner.attach()
        return self.train.elastic

    def register_hook(self, hook: RescaleHook) -> None:
        """``hook(old_world, new_world)`` after each rescale (Elan's RegisterHook)."""
        self.membership.hooks.append(hook)

    # ------------------------------------------------------------------ data and epochs
    def loader(self, data: Any, batch_size: int | None = None, *, seed: int = 0,
               scaling: str | BatchPolicy = "strong", **kw: Any) -> ElasticLoader:
        """An elastic ``DataLoader`` (:mod:`tidal.runtime.loader`): pass the
        script's ``DataLoader``, or a dataset with ``batch_size`` and
        DataLoader arguments. ``batch_size`` is the global batch under strong
        scaling (the default), the local one under weak scaling."""
        if isinstance(data, torch.utils.data.DataLoader):
            if batch_size is not None or kw:
                raise TypeError("give either a DataLoader or a dataset with batch_size and DataLoader arguments")
            ld = ElasticLoader.from_dataloader(self, data, seed=seed)
        else:
            if batch_size is None:
                raise TypeError("job.loader(dataset, batch_size=...) needs the batch size")
            ld = ElasticLoader(self, data, batch_size, seed=seed, **kw)
        t = self.train
        t.policy = scaling if isinstance(scaling, BatchPolicy) else make_policy(scaling, ld.batch_size)
        t.global_batch_size = t.policy.batch
        self._loader = ld
        return ld

    def sequence(self, data: torch.Tensor, batch_size: int, bptt: int, *, dim: int = 1,
                 **kw: Any) -> SequenceLoader:
        """bptt windows over one long tensor (``batchify`` + ``get_batch``), each rank a range of the
        ``batch_size`` streams; ``loader.carry`` moves their RNN state (:mod:`tidal.runtime.sequence`)."""
        ld = SequenceLoader(self, data, batch_size, bptt, dim=dim, **kw)
        self.train.policy = make_policy("strong", batch_size)  # a window is all the streams, at any size
        self.train.global_batch_size = batch_size
        self._loader = ld
        return ld

    def data(self, dataset: Any, batch_size: int, epochs: int = 1, seed: int = 0,
             scaling: str | BatchPolicy = "strong", collate_fn: Callable[[Any], Any] | None = None,
             **scaling_kw: Any) -> AllEpochs:
        """All epochs in one loop (``for x, y in job.data(ds, 64, epochs=3)``)."""
        kw = {"collate_fn": collate_fn} if collate_fn is not None else {}
        policy = scaling if isinstance(scaling, BatchPolicy) else make_policy(scaling, batch_size, **scaling_kw)
        return AllEpochs(self, self.loader(dataset, batch_size, seed=seed, scaling=policy, shuffle=True, **kw),
                         epochs)

    def epochs(self, count: int) -> Iterator[int]:
        """``for epoch in job.epochs(N)``: joins the job, then yields the
        epochs left (a newcomer starts at the job's current epoch), and ends
        at the job's step limit (``$TIDAL_MAX_STEPS``) if that comes first.
        The script's per-epoch code after the loader loop runs on every
        worker before any switch."""
        ld = self._loader
        if ld is None:
            raise RuntimeError("create the loader before job.epochs(): loader = job.loader(...)")
        self._start()
        e = self.cursor // ld.n
        while e < count and not self._over():
            self._epoch = e
            yield e
            if self._over():
                break
            self.runner.commit(epoch_end=(e + 1) * ld.n)  # the loop left early: skip the epoch's rest
            e += 1
        self._epoch = None
        self.life.finish()

    def _epoch_of_loader(self, ld: ElasticLoader) -> int:
        if self._epoch is not None:
            return self._epoch
        if self.client is not None:
            raise RuntimeError("iterate the loader inside `for epoch in job.epochs(N):` so that a worker "
                               "that joins later starts at the job's current epoch")
        self._start()
        return self.cursor // ld.n

    def _start(self) -> None:
        """Join the job (once). A worker that cannot reach its master within
        ``$TIDAL_MASTER_WAIT_S`` exits 1 with one line; one that finds the job
        over before it joined (a scale-out racing the end) exits 0 quietly:
        the script's code after training must not run on an untrained model."""
        if self.life.started:
            return
        if self.client is not None:
            _reach_master(self.client, self.worker_id)
        try:
            with _patience(self.client, settings.MASTER_WAIT_S.get()):
                self.life.start()
        except MasterUnavailable as e:
            _give_up(self.worker_id, f"its job master stopped answering while it joined "
                                     f"(${settings.MASTER_WAIT_S.name}): {e}", 1)
        if self.finished and self.membership.seat.gen is None:
            self.close()
            _give_up(self.worker_id, "the job finished before it joined; exiting", 0)

    def _over(self) -> bool:
        """The job is over for this worker: it finished, left, or reached the step limit."""
        return self.finished or self.left or self._at_limit()

    def _at_limit(self) -> bool:
        """The job's termination condition (``$TIDAL_MAX_STEPS``) holds at this
        batch boundary: every rank commits the same steps, so every rank stops
        at the same one."""
        return bool(self.max_steps) and self.train.step >= self.max_steps and not self.runner.window.open

    def _boundary(self, ld: ElasticLoader, epoch: int) -> bool:
        if self.max_steps and not (self.finished or self.left or self.runner.window.failed):
            self.runner.commit()  # the step just taken counts (committing again later is a no-op)
            if self._at_limit():
                log.info("worker %s: the job's step limit %d reached (%s)", self.worker_id, self.max_steps,
                         settings.MAX_STEPS.name)
                return False
        return self.life.boundary(ld, epoch)

    # ------------------------------------------------------------------ steps
    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Accumulate gradients without reducing (DDP's ``model.no_sync()``)."""
        return self.reducer.no_sync() if self.reducer is not None else contextlib.nullcontext()

    def step(self, optimizer_step: bool = True) -> bool:
        """Step the registered optimizers and zero their gradients (the
        gradients were reduced when backward returned). False: the step was
        dropped because a peer died; the survivors redo it."""
        w = self.runner.window
        if self.left:
            raise RuntimeError(f"worker {self.worker_id} left the job: job.step() has no group to step with")
        if not w.open:
            raise RuntimeError("job.step() called outside of a batch of the job's loader")
        if w.failed:
            return False
        st = self.train.elastic
        assert st is not None
        if optimizer_step and st.optimizers:
            for opt in st.optimizers:
                opt.step()
                opt.zero_grad()
        else:
            w.stepped = True
        return not w.failed

    def on_rank0(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
        """Run ``fn`` on rank 0 only (evaluation, logging, a checkpoint); the
        other ranks wait for it without any timeout and every rank returns its
        (picklable) result. Call it on every rank at the same point."""
        if self.left:  # e.g. from a finally block on the way out: there is no rank 0 for it any more
            raise RuntimeError(f"worker {self.worker_id} left the job: job.on_rank0 has no rank 0 to run on")
        seat = self.membership.seat
        if self.client is None or seat.world_size <= 1 or seat.gen is None:
            return fn(*args, **kwargs)
        return rank0.run(self, rank0.call_site(), lambda: fn(*args, **kwargs))

    def keep(self, *names: str, **values: Any) -> Kept:
        """Plain values every worker must share (a learning rate the script
        anneals, a best loss, counters). ``job.keep("lr", "best_val_loss")``
        keeps the script's module-level variables of those names where they
        are; ``keep = job.keep(lr=20.0)`` holds values read as ``keep.lr``.
        Either way they reach newcomers with the model, are restored when a
        step is dropped, and are compared across the replicas."""
        self._bound.update(bind_globals(sys._getframe(1).f_globals, names))
        st = self.train.elastic
        if st is not None:
            st.bound.update(self._bound)
        (st.extras if st is not None else self._kept).update(values)
        return Kept(lambda: self.train.elastic.extras if self.train.elastic is not None else self._kept)

    def close(self) -> None:
        """Stop the heartbeat and leave the process group (idempotent)."""
        self.heartbeat.stop()
        if self.client is not None:
            self.heartbeat.outbox.flush_switched(self.client)
        self.runner.detach()
        if dist.is_initialized():
            dist.destroy_process_group()

    def summary(self) -> dict[str, Any]:
        """This worker's numbers (and the batch policy's, when it measures the noise scale)."""
        return _summary(self)

    def _progress(self, g: Generation) -> dict[str, Any]:
        """Heartbeat thread: what rank 0 reports (reads of values the training thread replaces whole)."""
        ends = self.runner.timing.step_ends
        ls = ends[-1] if ends else None  # (step, wall time at its end, world size)
        return {"gen": g.gen, "step": self.step_count, "cursor": self.cursor, "epoch": self.epoch,
                "step_time_s": self.step_time_s, "world_size": self.world_size,
                "last_step": list(ls) if ls is not None else [], **_goodput_report(self)}


def _summary(job: Job) -> dict[str, Any]:
    rtts = list(job.heartbeat.rtts_ms)
    return {
        "worker": job.worker_id, "steps": job.step_count, "cursor": job.cursor, "left": job.left,
        "suspended": job.suspended, "step_time_s": job.step_time_s, "pauses": job.pauses,
        "coord_rtt_ms_p50": _pctl(rtts, 0.5), "coord_rtt_ms_p99": _pctl(rtts, 0.99), "heartbeats": len(rtts),
        "failures": job.failures, "stragglers": job.straggler_reports, "resumed_from": job.resumed_from,
        "checkpoints": job.checkpoints, **_goodput_report(job),
    }


def _goodput_report(job: Job) -> dict[str, Any]:
    """``{"goodput": job.goodput}`` with JSON-safe numbers (an infinite noise
    scale as None) when the policy measures the noise scale; else empty."""
    if job.train.policy.noise is None:
        return {}
    rep = job.train.policy.report(job.train.step)
    return {"goodput": {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in rep.items()}}


def _default_device() -> torch.device:
    return local_device(torch.cuda.device_count(), os.environ.get("LOCAL_RANK"),
                        os.environ.get("CUDA_VISIBLE_DEVICES"), settings.DEVICE.get())


def _master_client(url: str) -> MasterClient:
    """The worker's client of its master; on the control plane it also
    follows the master to another host (``$TIDAL_MASTER_FILE``, rewritten
    by the agent), and waits longer for it: a host is judged dead after
    seconds, then the master starts elsewhere."""
    path = settings.MASTER_FILE.get()
    if not path:
        return MasterClient(url)
    return MasterClient(url, patience_s=90.0, locate=url_file(path))


def _reach_master(client: MasterClient, worker_id: str) -> None:
    """Before registering: the master answers within ``$TIDAL_MASTER_WAIT_S``
    (not the client's longer patience, meant for a master that moves while
    the job trains) and the job is not over."""
    wait = settings.MASTER_WAIT_S.get()
    try:
        st = client.request("GET", "/status", patience_s=wait)[1]
    except MasterUnavailable as e:
        _give_up(worker_id, f"its job master at {client.url} did not answer within {wait:g} s "
                            f"(${settings.MASTER_WAIT_S.name}): {e}", 1)
    if st.get("state") == "finished":
        _give_up(worker_id, "the job finished before it joined; exiting", 0)


@contextlib.contextmanager
def _patience(client: MasterClient | None, seconds: float) -> Iterator[None]:
    """While joining, a master that does not answer is given up on after
    ``seconds``; once a member, the client's own patience applies again (a
    master that moves to another host while the job trains is waited for)."""
    http = getattr(client, "http", None)
    if http is None or not hasattr(http, "patience_s"):
        yield
        return
    old, http.patience_s = http.patience_s, min(http.patience_s, seconds)
    try:
        yield
    finally:
        http.patience_s = old


#: a store call to a silent master gives up within about two of its time-outs (connecting retries once)
QUIESCE_S = 2 * StoreCache.QUICK_TIMEOUT.total_seconds() + 2.0
_uncaught: list[bool] = []  # the script ended with an uncaught exception


def _note_uncaught(hook: Callable[..., Any]) -> Callable[..., Any]:
    def noted(*args: Any) -> Any:
        _uncaught.append(True)
        return hook(*args)
    return noted


def _quiet_exit(job: Job) -> None:
    """At interpreter exit, however the script ends (an error included): the
    heartbeat's threads stop and no helper thread is left inside a store
    call, so the process ends the way the script did. A call still pending
    after :data:`QUIESCE_S` would come back into a finalizing interpreter and
    abort the process: it ends here instead, with the script's status (1
    after an uncaught exception, else 0)."""
    job.heartbeat.stop()
    if job.membership.stores.quiesce(QUIESCE_S):
        return
    log.warning("worker %s: a store call to a silent job master is still pending at exit; ending now",
                job.worker_id)
    for f in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            f.flush()
    logging.shutdown()
    os._exit(1 if _uncaught else 0)


def _give_up(worker_id: str, why: str, code: int) -> NoReturn:
    """End this worker before it trained, with one log line and no traceback."""
    (log.warning if code == 0 else log.error)("worker %s: %s", worker_id, why)
    raise SystemExit(code)


def init(master_url: str | None = None, worker_id: str | None = None, **kw: Any) -> Job:
    """Connect this process to its job master (``$TIDAL_MASTER_URL``, set by
    ``tidal run``) and pick its device (:attr:`Job.device`; CUDA devices are
    made current). Without a master the job runs as a single local worker, so
    the same script also runs with plain ``python``."""
    lvl = settings.LOG_LEVEL.get()
    if lvl:
        logging.basicConfig(level=lvl.upper(), format="%(asctime)s %(process)d %(name)s: %(message)s")
    url = master_url or settings.MASTER_URL.get()
    wid = worker_id or settings.WORKER_ID.get() or f"local-{os.getpid()}"
    job = Job(url, wid, **kw)
    atexit.register(_quiet_exit, job)
    if getattr(sys.excepthook, "__name__", "") != "noted":  # once per process
        sys.excepthook = _note_uncaught(sys.excepthook)
    if job.device.type == "cuda":
        torch.cuda.set_device(job.device)
    return job
