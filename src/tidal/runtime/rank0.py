"""``job.on_rank0``: rank 0 runs a function, every rank gets its result.

Rank 0 publishes ``(call site, step, result)`` under the generation's key of
that call (``<prefix>rank0/<n>``, sealed: :mod:`tidal.runtime.sealed`); the
others wait for it with no time limit while rank 0 works on it, and check
that they made the same call at the same step. Ranks that took different
paths through the script (a newcomer whose plain Python value, such as a
best loss or an annealed learning rate, was never registered, so a branch
went the other way) are caught instead of hanging or silently drifting:

* a rank whose call does not match rank 0's (another call site or step)
  raises :class:`Diverged` naming both;
* a rank that waits while rank 0 trains on (its liveness beat says it is in
  a step's compute or all-reduce, not in this call) for
  :data:`DIVERGED_AFTER_S` raises :class:`Diverged` too.

The rank that raises ends; its peers recover without it (and the control
plane's crash-loop rule fails a job whose replacements diverge again).
"""

from __future__ import annotations

import json
import pickle
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

DIVERGED_AFTER_S = 20.0  # rank 0 trains on while a rank waits in on_rank0 this long: their paths differ
_TRAINING = ("compute", "sync")  # the beat phases of a rank inside a training step


class Diverged(RuntimeError):
    """The ranks took different paths through the script."""


@dataclass(frozen=True)
class Call:
    """One ``on_rank0`` call as a rank sees it."""

    key: str  # the store key of its result
    site: str  # file:line of the script's call
    step: int  # the job's step at the call
    worker: str


def call_site(depth: int = 2) -> str:
    """``file:line`` of the caller ``depth`` frames up (the script's call)."""
    f = sys._getframe(depth)
    return f"{f.f_code.co_filename.rsplit('/', 1)[-1]}:{f.f_lineno}"


def publish(store: Any, call: Call, result: Any) -> None:
    """Rank 0: the result of ``call``, with where and when it was made."""
    store.set(call.key, pickle.dumps({"site": call.site, "step": call.step, "result": result}))


ADVICE = ("the ranks took different paths through the script. A plain value it keeps (a best loss, an annealed "
          "learning rate, a counter) is not the same on every rank: carry it with job.keep(name=value) "
          "(or job.register_state(..., extras={...})) so that a newcomer gets it (docs/runtime.md, "
          "State the workers share)")


def await_result(store: Any, call: Call, rank0_phase: Callable[[], tuple[int, str] | None],
                 lost: Callable[[], bool], now: Callable[[], float] = time.monotonic) -> tuple[bool, Any]:
    """Wait for rank 0's result of ``call``: ``(True, result)``, or
    ``(False, None)`` when ``lost()`` says rank 0 was lost (polled once a
    second, as is ``rank0_phase()``: rank 0's (step, phase) beat). Raises
    :class:`Diverged` as the module says."""
    next_ask, training_since = now() + 1.0, None
    while (raw := store.peek(call.key)) is None:
        time.sleep(0.005)
        if now() < next_ask:
            continue
        next_ask = now() + 1.0
        if lost():
            return False, None
        beat = rank0_phase()
        if beat is None or beat[1] not in _TRAINING:
            training_since = None
        elif training_since is None:
            training_since = now()
        elif now() - training_since > DIVERGED_AFTER_S:
            raise Diverged(f"worker {call.worker}: job.on_rank0 at {call.site} (step {call.step}) waited "
                           f"{now() - training_since:.0f}s while rank 0 trained on (step {beat[0]}, {beat[1]}): "
                           + ADVICE)
    got = pickle.loads(raw)
    if got["site"] != call.site or int(got["step"]) != call.step:
        raise Diverged(f"worker {call.worker}: job.on_rank0 at {call.site} (step {call.step}) met rank 0's call "
                       f"at {got['site']} (step {got['step']}): " + ADVICE)
    return True, got["result"]


def beat_phase(raw: bytes | None) -> tuple[int, str] | None:
    """(step, phase) of a liveness beat ``[n, step, phase]``."""
    if raw is None:
        return None
    b = json.loads(raw)
    return int(b[1]), str(b[2])


def run(job: Any, site: str, fn: Callable[[], Any]) -> Any:
    """``job.on_rank0`` in a generation of more than one worker: calls are
    counted per generation (every member enters one at the same step, a
    newcomer too); rank 0 runs ``fn`` and publishes, the others wait and
    check. A rank 0 lost meanwhile: the step fails and None is returned
    (recovery follows at the next batch)."""
    g = job.membership.seat.gen
    gen, calls = job.rank0_calls
    job.rank0_calls = (g.gen, calls + 1 if gen == g.gen else 1)
    call = Call(f"{g.prefix}rank0/{job.rank0_calls[1]}", site, job.step_count, job.worker_id)
    store = job.membership.stores.get(g.store_host, g.store_port)
    hb = job.heartbeat
    if job.membership.seat.rank == 0:
        hb.phase = ("rank0", job.step_count)
        out = fn()
        publish(store, call, out)
        hb.phase = ("idle", job.step_count)
        return out
    hb.phase = ("wait", job.step_count)
    ep, first = hb.endpoint, g.members[0]

    def lost() -> bool:  # rank 0 was lost: recover at the next batch
        return job.client.get("/assignment", worker_id=job.worker_id, after_gen=g.gen)["status"] != "wait"

    ok, out = await_result(store, call, lambda: beat_phase(store.peek(ep.alive_key(first))) if ep is not None else None,
                           lost)
    if not ok:
        job.runner.window.failed = True
        job.membership.fail(job.step_count, g.gen, "rank 0 was lost during job.on_rank0")
        return None
    hb.phase = ("idle", job.step_count)
    return out
