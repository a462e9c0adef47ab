"""``profile(min_p, max_p)`` (EDL §5.2): measure a running job's scaling
curve in one job instead of one job per size.

The job is started at ``max_p`` workers; at each size the throughput is
measured over ``steps`` steps (after ``warmup`` steps following the switch),
then one worker is removed by a normal scale-in, down to ``min_p``. Timing
uses rank 0's own step-end wall clock (``Status.last_step``: step, wall time,
world size of its latest step, carried by the progress heartbeat), so the
master's polling and heartbeat period do not blur the measurement.

The curve is written in the scheduler's profile format
(:func:`tidal.core.profile.load_profiles`): ``<model>.csv`` with the header
``global_batch_size,<p1>,<p2>,...`` and one row of iterations/s, so
``tidal simulate --profiles DIR`` and the policies can use it.
"""

from __future__ import annotations

import csv
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tidal.runtime.client import MasterClient
from tidal.runtime.messages import Status


@dataclass
class ProfileResult:
    """Iterations/s per worker count, and how long profiling took."""

    global_batch_size: int
    its: dict[int, float] = field(default_factory=dict)  # worker count -> iterations/s
    windows: dict[int, tuple[int, int, float]] = field(default_factory=dict)  # count -> (first step, last step, seconds)
    total_s: float = 0.0
    path: Path | None = None

    def to_json(self) -> dict[str, Any]:
        return {"global_batch_size": self.global_batch_size, "its": {str(k): v for k, v in sorted(self.its.items())},
                "windows": {str(k): list(v) for k, v in sorted(self.windows.items())}, "total_s": self.total_s,
                "path": str(self.path) if self.path else None}


def write_profile_csv(path: str | Path, global_batch_size: int, its: dict[int, float]) -> Path:
    """One ``<model>.csv`` in the scheduler's profile format (counts ascending)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    counts = sorted(its)
    tmp = p.with_name(p.name + ".tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["global_batch_size", *counts])
        w.writerow([int(global_batch_size), *(f"{its[c]:.6g}" for c in counts)])
    tmp.replace(p)
    return p


def _status(master: Any) -> Status:
    return master.status()


def _wait(master: Any, pred: Any, timeout_s: float, what: str, poll_s: float) -> Status:
    deadline = time.monotonic() + timeout_s
    while True:
        st = _status(master)
        if pred(st):
            return st
        if st.state == "finished":
            raise RuntimeError(f"the job finished while profiling ({what}); give it more data or epochs")
        if time.monotonic() > deadline:
            raise TimeoutError(f"profile: timed out waiting for {what}: {st}")
        time.sleep(poll_s)


def profile(
    master: Any,
    min_p: int,
    max_p: int,
    global_batch_size: int,
    *,
    steps: int = 20,
    warmup: int = 3,
    out_dir: str | Path | None = None,
    model: str = "job",
    poll_s: float = 0.01,
    timeout_s: float = 120.0,
) -> ProfileResult:
    """Measure iterations/s at ``max_p, max_p - 1, ..., min_p`` workers on a
    running job (``master``: a :class:`MasterClient`, a URL or a
    :class:`JobMaster`), scaling in one worker at a time; the job must be at
    (or be scaled to) ``max_p`` and have enough data left. With ``out_dir``
    the curve is written to ``out_dir/<model>.csv``. The job keeps running
    at ``min_p`` afterwards."""
    if not 1 <= min_p <= max_p:
        raise ValueError(f"need 1 <= min_p <= max_p, got {min_p}, {max_p}")
    if isinstance(master, str):
        master = MasterClient(master)
    t0 = time.perf_counter()
    res = ProfileResult(int(global_batch_size))
    for p in range(max_p, min_p - 1, -1):
        if p == max_p:
            st = _wait(master, lambda s: s.state == "running", timeout_s, "the job to run", poll_s)
            if st.world_size != p:
                if isinstance(master, MasterClient):
                    master.scale_to(p, timeout_s=timeout_s)
                else:
                    (master.scale_out if p > st.world_size else master.scale_in)(count=abs(p - st.world_size))
        else:
            _scale_in_one(master, timeout_s, poll_s)
        st = _wait(master, lambda s, p=p: s.world_size == p and not s.changing and len(s.last_step) == 3
                   and int(s.last_step[2]) == p, timeout_s, f"{p} workers", poll_s)
        first = int(st.last_step[0]) + warmup
        a = _wait(master, lambda s: int(s.last_step[0]) >= first, timeout_s, f"warm-up at {p}", poll_s)
        s0, w0 = int(a.last_step[0]), float(a.last_step[1])
        b = _wait(master, lambda s: int(s.last_step[0]) >= s0 + steps, timeout_s, f"{steps} steps at {p}", poll_s)
        s1, w1 = int(b.last_step[0]), float(b.last_step[1])
        if b.gen != a.gen or int(b.last_step[2]) != p:
            raise RuntimeError(f"profile: the group changed while measuring {p} workers ({a} -> {b})")
        res.windows[p] = (s0, s1, w1 - w0)
        res.its[p] = (s1 - s0) / (w1 - w0) if w1 > w0 else float("inf")
    res.total_s = time.perf_counter() - t0
    if out_dir is not None:
        res.path = write_profile_csv(Path(out_dir) / f"{model}.csv", global_batch_size, res.its)
    return res


def _scale_in_one(master: Any, timeout_s: float, poll_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        ans = master.scale_in(count=1)
        if ans.status == "accepted":
            return
        if ans.status != "retry" or time.monotonic() > deadline:
            raise RuntimeError(f"profile: scale-in refused: {ans}")
        time.sleep(max(poll_s, min(ans.retry_after_s, 0.2)))
