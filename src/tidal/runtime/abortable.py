"""Collectives a silent peer cannot block for ever: EDL §4.2's forced
scale-in for a peer that is cut off rather than dead.

A peer that dies fails its peers' collective at once (its sockets close, the
usual recovery runs). A peer whose host goes silent — a cut link, a stopped
process, a dead host that sends no reset — fails nothing: gloo would wait
for it until the process group's timeout (``$TIDAL_COLLECTIVE_TIMEOUT_S``).
The master sees its liveness beats stop (:mod:`tidal.runtime.health`) and
aborts its generation: it sets the generation's store key ``<prefix>abort``,
which every member's beat thread reads and hands to :data:`SIGNAL`.

So the training thread never blocks in an uninterruptible wait: the reducer
launches its collectives with ``async_op=True`` and :func:`wait` waits on the
``Work`` in slices, checking the signal between them. gloo: ``Work.wait
(timeout)`` blocks in C++ (without the GIL) and returns the moment the work
completes, so a step pays nothing for the slices; NCCL: ``Work.is_completed()``
(a CUDA event query) is polled with short sleeps, because a timed-out
``WorkNCCL.wait`` tears the communicator down. On an abort :func:`wait`
raises :class:`GenerationAborted`, which the reducer reports like a failed
collective (a peer died): the step is dropped and the survivors re-form
without the silent member.

The abandoned group is never destroyed (:func:`abandon_group`): gloo cannot
cancel a pending operation, and its destructor would join a thread blocked
on the silent peer until the collective timeout. It is unregistered, so the
next generation's group can form, and kept alive for the life of the process
(its threads idle; its pending work fails at the timeout, in the
background). NCCL's communicator is aborted (``ncclCommAbort``), which makes
its pending kernels return.
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import threading
import time
from typing import Any, Callable

import torch.distributed as dist

log = logging.getLogger(__name__)

WAIT_SLICE_S = 0.1  # how often a waiting training thread checks for an abort
NCCL_POLL_S = (0.0002, 0.005)  # NCCL: first and longest sleep between completion checks


class GenerationAborted(RuntimeError):
    """The master aborted this worker's generation (a member went silent)."""


class AbortSignal:
    """Which generation the master aborted, per process (like torch's default
    group). Thread-safe: the beat thread :meth:`request` s, the training
    thread :meth:`enter` s a generation and asks :meth:`pending`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._gen = 0  # the generation whose process group is the current one
        self._reasons: dict[int, str] = {}

    def enter(self, gen: int) -> None:
        """Training thread: generation ``gen``'s group is now the default one."""
        with self._lock:
            self._gen = gen
            self._reasons = {g: r for g, r in self._reasons.items() if g >= gen}

    def request(self, gen: int, reason: str) -> None:
        """Any thread: the master aborted generation ``gen``."""
        with self._lock:
            if gen >= self._gen and gen not in self._reasons:
                self._reasons[gen] = reason
                log.warning("generation %d aborted by the master: %s", gen, reason)

    def requested(self, gen: int) -> bool:
        with self._lock:
            return gen in self._reasons

    def pending(self) -> str | None:
        """Why the current generation was aborted; None: it was not."""
        with self._lock:
            return self._reasons.get(self._gen)


SIGNAL = AbortSignal()

_KEPT: list[Any] = []


def keep_forever(*objs: Any) -> None:
    """Never free ``objs`` (an abandoned process group and its pending work),
    not even at interpreter exit, where their destructors would block until
    the collective timeout: an extra reference nobody drops."""
    for o in objs:
        if o is not None:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(o))
            _KEPT.append(o)


def wait(work: Any, aborted: Callable[[], str | None] = SIGNAL.pending, nccl: bool = False,
         slice_s: float = WAIT_SLICE_S) -> None:
    """Wait for ``work`` like ``work.wait()``, but raise
    :class:`GenerationAborted` (keeping ``work`` alive) as soon as
    ``aborted()`` names a reason. A failed collective raises its own error."""
    if nccl:
        _poll_nccl(work, aborted)
        work.wait()  # complete: the current stream waits for NCCL's (no CPU block)
        return
    step = datetime.timedelta(seconds=slice_s)
    while True:
        try:
            work.wait(step)
            return
        except RuntimeError:
            if work.is_completed():
                work.wait()  # completed meanwhile, or failed: its own outcome
                return
        _check(work, aborted)


def _poll_nccl(work: Any, aborted: Callable[[], str | None]) -> None:
    """Until ``work`` completes: a CUDA event query, then a sleep growing
    from 0.2 to 5 ms (:data:`NCCL_POLL_S`; no busy wait), checking for an
    abort every :data:`WAIT_SLICE_S`."""
    pause, longest = NCCL_POLL_S
    checked = time.monotonic()
    while not work.is_completed():
        time.sleep(pause)
        pause = min(2 * pause, longest)
        if time.monotonic() - checked >= WAIT_SLICE_S:
            checked = time.monotonic()
            _check(work, aborted)


def _check(work: Any, aborted: Callable[[], str | None]) -> None:
    why = aborted()
    if why is not None:
        keep_forever(work)
        raise GenerationAborted(f"generation aborted by the master: {why}")


def abandon_group(backend: str) -> None:
    """Leave the default process group without waiting for a silent member:
    keep it alive for ever (:func:`keep_forever`), abort NCCL's communicators
    (``ProcessGroup.abort``: ``ncclCommAbort``, so pending kernels return;
    gloo has no abort of a pending operation), then unregister it
    (``destroy_process_group`` does not block once the group is kept)."""
    if not dist.is_initialized():
        return
    pg = dist.group.WORLD
    keep_forever(pg)
    if backend == "nccl":
        try:
            pg.abort()
        except Exception as e:  # noqa: BLE001 - an older torch or NCCL: the watchdog tears it down at the timeout
            log.warning("could not abort the NCCL communicators: %s", e)
    dist.destroy_process_group()
