"""Reshaping: the SideCar paper's adaptive GPU scheduler.

Wang et al., "An Efficient and Non-Intrusive GPU Scheduling Framework for
Deep Learning Training Systems", SC'20, §III-C: Algorithm 1 (incoming-job
scheduling with *reshaping down*) and Algorithm 2 (running-job scheduling
with *reshaping up*). Each job lists its optional GPU counts
(``JobSpec.allowed_gpus``; otherwise its profiled counts, see
:func:`options`). Every round:

1. **Incoming jobs** (Algorithm 1), in submission order: for each optional
   count g of the job, either g GPUs are idle, or the missing ones come from
   *one* running job whose remaining count is still one of its options. Of
   these (job, g, donor) triples the one with the smallest predicted makespan
   wins (ties: the smaller sum of predicted completion times). Waiting until
   enough GPUs are idle is scored the same way and wins when it is predicted
   better (e.g. under linear scaling); a job waits also when no triple is
   feasible. A waiting job keeps its place: later jobs are still tried, but
   only on GPUs beyond those it waits for (they are reserved for it).
2. **Running jobs** (Algorithm 2): when GPUs are idle and no job waits, the
   running job whose growth to a larger optional count lowers the predicted
   makespan most (ties: its own completion time) gets the GPUs, repeatedly,
   while a growth still shortens that job.

Completion times are predicted with the overheads the executor charges
(:class:`tidal.core.overhead.OverheadModel` segments: initialisation of a new
job; checkpoint, termination and re-initialisation of a reshaped one), see
:func:`finish_in`. **Early initialisation**: the incoming job initialises
while the donor still trains and checkpoints, so its start-up overlaps the
donor's stop instead of following it (``early_init=False`` predicts the
serial hand-over instead).

**Target accuracy.** A job may give a target accuracy instead of a known
iteration count (:func:`accuracy_job`). The policy then predicts the epochs
left from an online non-negative least-squares fit (Optimus-style,
:func:`fit_error_curve`) of the accuracy it has *observed* so far
(:func:`observed_accuracy`: one point per completed epoch, up to the job's
current progress). The ground-truth curve lives in ``JobSpec.meta`` for the
simulator and is read only through :func:`observed_accuracy`; the policy
never looks at ``spec.iterations`` of such a job.
"""

from __future__ import annotations

import bisect
import itertools
import math
import zlib
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
from scipy.optimize import minimize_scalar, nnls

from tidal.core.job import JobSpec
from tidal.core.overhead import OverheadModel
from tidal.scheduler.api import JobView, Plan, Policy, Snapshot, schedulable
from tidal.scheduler.estimate import rigid_count, useful_counts

# -- optional GPU counts -----------------------------------------------------


def options(snap: Snapshot, job: JobView | JobSpec) -> list[int]:
    """The GPU counts a job may run at, ascending: its ``allowed_gpus`` (the
    paper's "optional numbers of GPUs"); for an elastic job without them, its
    profiled counts (powers of two); for a rigid job, its requested count.
    Counts at which the model does not run are left out."""
    spec = job.spec if isinstance(job, JobView) else job
    cap = snap.cluster.num_gpus
    if not spec.elastic:
        out = [rigid_count(spec, cap)]
    elif spec.allowed_gpus is not None:
        out = spec.counts(cap)
    else:
        out = useful_counts(snap, spec, cap) or spec.counts(cap)[:1]
    return [c for c in out if snap.throughput(spec, c) > 0]


def _options_key(spec: JobSpec) -> tuple:
    """What :func:`options` reads of a spec: jobs with equal keys have the
    same options in one snapshot (a trace has a few dozen kinds of job)."""
    return (spec.model, spec.batch_size, spec.elastic, spec.allowed_gpus, spec.requested_gpus, spec.min_gpus,
            spec.max_gpus)


# -- target accuracy: ground truth (simulator side) and observations ----------

_CURVE_KEYS = ("acc_b0", "acc_b1", "acc_b2", "target_accuracy", "iters_per_epoch", "max_epochs")


def error_at(epoch: float, b0: float, b1: float, b2: float) -> float:
    """Optimus' convergence model applied to the error 1 - accuracy:
    err(e) = 1 / (b0·e + b1) + b2."""
    return 1.0 / (b0 * epoch + b1) + b2


def epochs_to_target(target: float, b0: float, b1: float, b2: float, max_epochs: float) -> float:
    """Epochs until err(e) <= 1 - target (at most ``max_epochs``)."""
    err = 1.0 - target
    if err <= b2 or b0 <= 0:
        return max_epochs
    return min(max_epochs, max(1.0, math.ceil((1.0 / (err - b2) - b1) / b0 - 1e-6)))


def accuracy_job(
    job_id: str,
    submit_time: float,
    model: str,
    batch_size: int,
    target_accuracy: float,
    curve: tuple[float, float, float],
    iters_per_epoch: float,
    max_epochs: float = 200.0,
    noise: float = 0.0,
    **kw,
) -> JobSpec:
    """A job that trains until ``target_accuracy`` (simulator side). The
    ground-truth curve ``curve`` = (b0, b1, b2) of :func:`error_at` sets the
    iterations the simulator runs; the policy sees only observed points."""
    b0, b1, b2 = curve
    epochs = epochs_to_target(target_accuracy, b0, b1, b2, max_epochs)
    meta = dict(kw.pop("meta", ()))
    meta.update({
        "acc_b0": repr(b0), "acc_b1": repr(b1), "acc_b2": repr(b2),
        "target_accuracy": repr(target_accuracy), "iters_per_epoch": repr(iters_per_epoch),
        "max_epochs": repr(max_epochs), "acc_noise": repr(noise),
    })
    return JobSpec(job_id, submit_time, model, batch_size, epochs * iters_per_epoch,
                   meta=tuple(sorted(meta.items())), **kw)


def _meta(spec: JobSpec) -> dict[str, str]:
    return dict(spec.meta)


def has_target(spec: JobSpec) -> bool:
    return "target_accuracy" in _meta(spec)


def observed_accuracy(job: JobView) -> list[tuple[int, float]]:
    """What a running job would have reported: its accuracy after each
    completed epoch, 1 .. floor(done / iters_per_epoch), with deterministic
    noise (seeded by job id and epoch). The only reader of the ground truth."""
    m = _meta(job.spec)
    ipe = float(m["iters_per_epoch"])
    b0, b1, b2 = float(m["acc_b0"]), float(m["acc_b1"]), float(m["acc_b2"])
    noise = float(m.get("acc_noise", "0"))
    out = []
    for e in range(1, int(job.done // ipe + 1e-9) + 1):
        acc = 1.0 - error_at(e, b0, b1, b2)
        if noise:
            u = zlib.crc32(f"{job.job_id}:{e}".encode()) / 0xFFFFFFFF
            acc += noise * (2 * u - 1)
        out.append((e, acc))
    return out


def fit_error_curve(points: Sequence[tuple[float, float]]) -> tuple[float, float, float] | None:
    """Fit err(e) = 1/(b0·e + b1) + b2 (b0, b1, b2 >= 0) to observed
    (epoch, accuracy) points. For a fixed asymptote b2 below the smallest
    observed error, 1/(err - b2) = b0·e + b1 is a non-negative least squares
    problem (scipy.optimize.nnls); b2 is chosen on a grid, then refined by a
    bounded scalar search, by the residual in error space. None with fewer
    than three points."""
    if len(points) < 3:
        return None
    e = np.array([p[0] for p in points], dtype=float)
    err = np.clip(1.0 - np.array([p[1] for p in points], dtype=float), 1e-6, None)
    a = np.column_stack([e, np.ones_like(e)])

    def solve(b2: float) -> tuple[float, tuple[float, float, float]]:
        coef, _ = nnls(a, 1.0 / (err - b2))
        b0, b1 = float(coef[0]), float(coef[1])
        pred = 1.0 / np.maximum(b0 * e + b1, 1e-12) + b2
        return float(np.sum((pred - err) ** 2)), (b0, b1, float(b2))

    top = float(err.min()) * 0.999
    grid = np.linspace(0.0, top, 41)
    scores = [solve(b2)[0] for b2 in grid]
    i = int(np.argmin(scores))
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    best = solve(grid[i])
    if hi > lo:
        res = minimize_scalar(lambda b2: solve(b2)[0], bounds=(lo, hi), method="bounded",
                              options={"xatol": 1e-7})
        cand = solve(float(res.x))
        if cand[0] <= best[0]:
            best = cand
    return best[1] if best[1][0] > 0 else None


def predicted_remaining(job: JobView) -> float:
    """Iterations left: the spec's count, or for a target-accuracy job the
    epochs the fitted curve still needs (before three epochs are observed:
    up to ``max_epochs``)."""
    if not has_target(job.spec):
        return job.remaining
    m = _meta(job.spec)
    ipe, max_ep = float(m["iters_per_epoch"]), float(m["max_epochs"])
    fit = fit_error_curve(observed_accuracy(job))
    epochs = max_ep if fit is None else epochs_to_target(float(m["target_accuracy"]), *fit, max_ep)
    left = epochs * ipe - job.done
    # the fit says it is done, yet it runs: it can end at its next check at the earliest
    return left if left > 0 else ipe - job.done % ipe


# -- completion time with the executor's overhead segments ---------------------


def finish_in(segments: Sequence[tuple[float, float]], now: float, work: float) -> float:
    """Seconds from ``now`` until ``work`` iterations are done along progress
    segments (start, rate)."""
    left = work
    for i, (start, rate) in enumerate(segments):
        end = segments[i + 1][0] if i + 1 < len(segments) else math.inf
        if rate > 0:
            if start + left / rate <= end:
                return start + left / rate - now
            left -= rate * (end - start)
    return math.inf


class Predictor:
    """Predicted completion times (seconds from now) under the overhead model."""

    def __init__(self, snap: Snapshot) -> None:
        self.snap = snap
        self._work: dict[str, float] = {}
        self._memo: dict[tuple, float] = {}  # start / resize: pure within a round

    def work(self, job: JobView) -> float:
        w = self._work.get(job.job_id)
        if w is None:
            w = self._work[job.job_id] = predicted_remaining(job)
        return w

    def rate(self, job: JobView, n: int) -> float:
        return self.snap.progress_rate(job, n, job.batch or None)

    def keep(self, job: JobView) -> float:
        """Running on at its current count."""
        r = self.rate(job, job.size)
        return self.work(job) / r if r > 0 else math.inf

    def start(self, job: JobView, n: int, delay: float = 0.0) -> float:
        key = ("s", job.job_id, n, delay)
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = self._start(job, n, delay)
        return hit

    def _start(self, job: JobView, n: int, delay: float) -> float:
        now, ov = self.snap.now + delay, self.snap.overheads
        rate, resumed = self.rate(job, n), job.executed > 0
        if type(ov) is not OverheadModel:
            return delay + finish_in(ov.start(now, rate, resumed=resumed), now, self.work(job))
        # finish_in over OverheadModel.start's segments, without building them: the same float
        # operations in the same order, so the same bits
        wait = ov.stop_resume_s if resumed else ov.launch_s
        begin = now + wait if wait > 0 else now
        if not rate > 0:
            return delay + math.inf
        end = begin + self.work(job) / rate
        return delay + ((end - now) if end <= math.inf else math.inf)

    def resize(self, job: JobView, n: int) -> float:
        key = ("r", job.job_id, n)
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = self._resize(job, n)
        return hit

    def _resize(self, job: JobView, n: int) -> float:
        now = self.snap.now
        segs = self.snap.overheads.resize(now, self.rate(job, job.size), self.rate(job, n), grow=n > job.size)
        return finish_in(segs, now, self.work(job))

    def downtime(self, job: JobView, n: int) -> float:
        """Seconds a reshaped job makes no progress (checkpoint, stop, restart)."""
        segs = self.snap.overheads.resize(self.snap.now, 1.0, 1.0, grow=n > job.size)
        return sum(
            (segs[i + 1][0] if i + 1 < len(segs) else s) - s for i, (s, r) in enumerate(segs) if r == 0
        )


def _top2(times: dict[str, float]) -> tuple[tuple[float, str], float]:
    first, second = (-math.inf, ""), -math.inf
    for jid, t in times.items():
        if t > first[0]:
            first, second = (t, jid), first[0]
        elif t > second:
            second = t
    return first, second


@dataclass
class _Tentative:
    """A round's allocation in the making: GPUs and predicted completion time
    per job, the free GPUs, and the jobs already started or reshaped (each
    job changes at most once per round)."""

    snap: Snapshot
    pred: Predictor
    running: dict[str, JobView]
    alloc: dict[str, int]
    done_at: dict[str, float]
    free: int
    touched: set[str] = field(default_factory=set)
    _options: dict[str, list[int]] = field(default_factory=dict)
    _by_kind: dict[tuple, list[int]] = field(default_factory=dict)  # options by _options_key
    _pairs: list[tuple[float, int, str]] = field(default_factory=list)  # (done_at, GPUs, job), sorted
    _times: list[float] = field(default_factory=list)  # the pairs' columns
    _ns: list[int] = field(default_factory=list)
    _cum: list[int] | None = None  # GPUs freed by the jobs ending up to each time
    _donors: dict[int, list[str]] | None = None  # GPUs a donor can give -> running jobs, in order
    _rows: dict[int, list[tuple[str, int, float, float]]] = field(default_factory=dict)  # donor_rows, by need
    _by_delay: dict[int, "_DonorIndex"] = field(default_factory=dict)  # best_donor's index, by need

    @classmethod
    def of(cls, snap: Snapshot, jobs: list[JobView]) -> "_Tentative":
        pred = Predictor(snap)
        running = {j.job_id: j for j in jobs if j.running}
        alloc = {jid: j.size for jid, j in running.items()}
        done_at = {jid: pred.keep(j) for jid, j in running.items()}
        st = cls(snap, pred, running, alloc, done_at, snap.cluster.num_gpus - sum(alloc.values()))
        st._pairs = sorted((t, alloc[jid], jid) for jid, t in done_at.items())
        st._times = [p[0] for p in st._pairs]
        st._ns = [p[1] for p in st._pairs]
        return st

    def opts(self, j: JobView) -> list[int]:
        """:func:`options`, computed once per job and once per kind of job
        (:func:`_options_key`: everything it reads of the spec; the snapshot
        is the same all round)."""
        hit = self._options.get(j.job_id)
        if hit is None:
            key = _options_key(j.spec)
            hit = self._by_kind.get(key)
            if hit is None:
                hit = self._by_kind[key] = options(self.snap, j)
            self._options[j.job_id] = hit
        return hit

    def ends(self) -> tuple[list[float], list[int]]:
        """Predicted completion times, ascending, and the GPUs held by the jobs
        ending up to each (cumulative); recomputed after a change."""
        if self._cum is None:
            self._cum = list(itertools.accumulate(self._ns))
        return self._times, self._cum

    def top2(self) -> tuple[tuple[float, str], float]:
        """:func:`_top2` of ``done_at``, from the sorted completion times."""
        pairs = self._pairs
        if len(pairs) >= 2 and pairs[-2][0] == pairs[-1][0]:
            return _top2(self.done_at)  # a tie: the first in job order wins
        if not pairs:
            return (-math.inf, ""), -math.inf
        return (pairs[-1][0], pairs[-1][2]), pairs[-2][0] if len(pairs) >= 2 else -math.inf

    def donors(self, need: int) -> list[str]:
        """Running jobs that can give ``need`` GPUs and keep one of their
        options, in running order (touched ones included: callers skip them)."""
        if self._donors is None:
            self._donors = {}
            for jid, d in self.running.items():
                for o in self.opts(d):
                    if 0 < o < self.alloc[jid]:
                        self._donors.setdefault(self.alloc[jid] - o, []).append(jid)
        return self._donors.get(need, [])

    def donor_rows(self, need: int) -> list[tuple[str, int, float, float]]:
        """(job, count left, completion time at it, completion time now) of
        each of :meth:`donors`; the values stay right for the untouched ones
        (the only ones callers use) for the whole round."""
        hit = self._rows.get(need)
        if hit is None:
            alloc, done_at, running, resize = self.alloc, self.done_at, self.running, self.pred.resize
            hit = self._rows[need] = [
                (jid, alloc[jid] - need, resize(running[jid], alloc[jid] - need), done_at[jid])
                for jid in self.donors(need) if jid not in self.touched
            ]
        return hit

    def best_donor(self, need: int, t_w: float, top: tuple[float, str], second: float,
                   total: float) -> tuple[float, float, str, int, float] | None:
        """:func:`_donor_loop` over :meth:`donor_rows` (the donor of ``need``
        GPUs with the least (makespan, sum of completion times), the first in
        running order on ties), looking only at the rows that can win: the
        donors that end by the makespan, in the order of the delay they take
        on (:class:`_DonorIndex`), and the job that sets the makespan."""
        rows = self.donor_rows(need)
        if len(rows) < _INDEX_FROM:
            return _donor_loop(rows, self.touched, t_w, top, second, total)
        ix = self._by_delay.get(need)
        if ix is None:
            ix = self._by_delay[need] = _DonorIndex(rows)
        cand = ix.candidates(self.touched, t_w, top, second, total)
        if cand is None:
            return _donor_loop(rows, self.touched, t_w, top, second, total)
        return _donor_loop([rows[i] for i in cand], (), t_w, top, second, total)

    def assign(self, jid: str, n: int, t: float) -> None:
        self._cum = None
        if jid in self.done_at:
            i = bisect.bisect_left(self._pairs, (self.done_at[jid], self.alloc[jid], jid))
            del self._pairs[i], self._times[i], self._ns[i]
        i = bisect.bisect_left(self._pairs, (t, n, jid))
        self._pairs.insert(i, (t, n, jid))
        self._times.insert(i, t)
        self._ns.insert(i, n)
        self.alloc[jid] = n
        self.done_at[jid] = t
        self.touched.add(jid)


_INDEX_FROM = 24  # donor rows looked up through a _DonorIndex from this many on
_ROUNDING = 1e-14  # relative slack for the float rounding of the sums (a few units in the last place)


def _donor_loop(rows: Sequence[tuple[str, int, float, float]], touched, t_w: float, top: tuple[float, str],
                second: float, total: float) -> tuple[float, float, str, int, float] | None:
    """The donor row with the least (makespan, sum of completion times) when
    the incoming job ends at ``t_w`` (the first of equal ones), as (makespan,
    sum, job, count left, its completion time); None if every row is touched."""
    top_t, top_id = top
    pa = pb = math.nan  # the best donor's key so far (compared as the tuple (makespan, sum))
    pick = None
    for jid, left, t_d, done in rows:
        if jid in touched:
            continue
        a = second if jid == top_id else top_t  # max(others, t_w, t_d)
        if a < t_w:
            a = t_w
        if a < t_d:
            a = t_d
        if a > pa:
            continue
        b = total - done + t_d + t_w
        if pick is None or a < pa or b < pb:
            pa, pb, pick = a, b, (jid, left, t_d)
    return None if pick is None else (pa, pb, pick[0], pick[1], pick[2])


class _DonorIndex:
    """One need's donor rows ordered by the delay a donor takes on
    (completion time at its smaller count minus now). Every donor other than
    the makespan's job that still ends by the makespan ``M`` scores makespan
    ``M`` and sum ``total - done + t_d + t_w``, which orders as that delay up
    to rounding; one ending later scores worse than all of them. So the least
    key is among the first untouched such rows in delay order, those within
    rounding of the first, and the makespan's job."""

    def __init__(self, rows: Sequence[tuple[str, int, float, float]]) -> None:
        delay = [t_d - done for _, _, t_d, done in rows]
        self.delay = delay
        self.order = sorted(range(len(rows)), key=delay.__getitem__)
        self.rows = rows
        self.pos = {r[0]: i for i, r in enumerate(rows)}
        self.scale = max(abs(v) for r in rows for v in r[2:])
        self.finite = all(math.isfinite(v) for r in rows for v in r[2:])
        self.start = 0  # rows before it in ``order`` are touched (touched only grows within a round)

    def candidates(self, touched, t_w: float, top: tuple[float, str], second: float,
                   total: float) -> list[int] | None:
        """Row indexes (ascending) that include the least key; None where the
        caller must look at every row (a value not finite, or no untouched
        donor ends by the makespan)."""
        top_t, top_id = top
        if not (self.finite and math.isfinite(t_w) and math.isfinite(top_t) and math.isfinite(total)
                and not math.isnan(second)):
            return None
        rows, order, delay = self.rows, self.order, self.delay
        while self.start < len(order) and rows[order[self.start]][0] in touched:
            self.start += 1
        m = t_w if top_t < t_w else top_t
        slack = _ROUNDING * (abs(total) + abs(t_w) + 2 * self.scale)
        out: list[int] = []
        first = None
        for i in order[self.start:]:
            if first is not None and delay[i] > first:
                break
            jid = rows[i][0]
            if jid in touched or jid == top_id or rows[i][2] > m:
                continue
            if first is None:
                first = delay[i] + slack
            out.append(i)
        if first is None:
            return None
        t = self.pos.get(top_id)
        if t is not None and top_id not in touched:
            out.append(t)
        out.sort()
        return out


def _reshape_down(
    st: _Tentative, w: JobView, g: int, reserved: int, top: tuple[float, str], second: float, total: float,
    early_init: bool,
) -> tuple:
    """The best candidate for waiting job ``w`` at ``g`` GPUs when not enough
    are idle: wait for idle GPUs (donor ``""``), or take the missing ones from
    one running job whose remaining count is still one of its options. The
    candidates are compared on (makespan, sum of completion times, GPUs
    taken, g); the first of equal ones wins."""
    times, cum = st.ends()
    i = bisect.bisect_left(cum, g + reserved - st.free)  # first end after which enough are idle
    t_free = times[i] if i < len(times) else math.inf
    t_start = st.pred.start(w, g)
    t_w = t_free + t_start
    top_t, top_id = top
    best = (max(top_t, t_w), total + t_w, 0, g, "", 0, t_w, 0.0)
    need = g - max(0, st.free - reserved)
    pick = None  # the best donor so far: (makespan, sum, job, count left, t_w, t_d)
    touched = st.touched
    if early_init:  # no donor delays w: t_w is the same for all
        rows = st._rows.get(need)
        found = None if rows is not None and not rows else st.best_donor(need, t_start, top, second, total)
        if found is not None:
            pick = (found[0], found[1], found[2], found[3], t_start, found[4])
    else:
        alloc, done_at, running, pred = st.alloc, st.done_at, st.running, st.pred
        for jid in st.donors(need):
            if jid in touched:
                continue
            d = running[jid]
            left = alloc[jid] - need
            t_w = pred.start(w, g, pred.downtime(d, left))
            t_d = pred.resize(d, left)
            key = (max(second if jid == top_id else top_t, t_w, t_d), total - done_at[jid] + t_d + t_w)
            if pick is None or key < pick[:2]:
                pick = (*key, jid, left, t_w, t_d)
    if pick is not None and (pick[0], pick[1], need, g) < best[:4]:
        best = (pick[0], pick[1], need, g, pick[2], pick[3], pick[4], pick[5])
    return best


def _best_start(st: _Tentative, w: JobView, reserved: int, early_init: bool) -> tuple | None:
    """Algorithm 1 for one incoming job: the best (makespan, sum of completion
    times, GPUs taken, g, donor, donor count, t_w, t_d), or None."""
    top, second = st.top2()
    total = sum(st.done_at.values())
    best = None
    for g in st.opts(w):
        if g <= st.free - reserved:
            t_w = st.pred.start(w, g)
            c = (max(top[0], t_w), total + t_w, 0, g, None, 0, t_w, 0.0)
        else:
            c = _reshape_down(st, w, g, reserved, top, second, total, early_init)
        if best is None or c[:4] < best[:4]:
            best = c
    return best


def _best_growth(st: _Tentative) -> tuple | None:
    """Algorithm 2, one step: the running job whose growth lowers the
    predicted makespan most, as (makespan, gain, job, count, completion)."""
    (top_t, top_id), second = st.top2()
    best = None
    for jid, j in st.running.items():
        if jid in st.touched:
            continue
        for c in st.opts(j):
            if c <= st.alloc[jid] or c - st.alloc[jid] > st.free:
                continue
            t = st.pred.resize(j, c)
            if t >= st.done_at[jid]:
                continue
            others = second if jid == top_id else top_t
            key = (max(others, t), t - st.done_at[jid], jid, c, t)
            if best is None or key < best:
                best = key
    return best


def reshaping_allocation(snap: Snapshot, plan: Plan, early_init: bool = True) -> None:
    """Algorithm 1 for the incoming jobs in submission order, then Algorithm 2
    while GPUs are idle and nothing waits."""
    jobs = schedulable(snap, plan)
    st = _Tentative.of(snap, jobs)
    waiting = 0
    reserved = 0  # GPUs that earlier waiting jobs will take as they free up
    for w in sorted((j for j in jobs if not j.running), key=lambda j: (j.spec.submit_time, j.job_id)):
        best = _best_start(st, w, reserved, early_init)
        if best is None or best[4] == "":
            waiting += 1  # no feasible triple, or waiting is predicted best
            reserved += best[3] if best else 0  # FIFO: later jobs do not take its GPUs
            continue
        _, _, need, g, donor, left, t_w, t_d = best
        st.assign(w.job_id, g, t_w)
        st.free -= g - need
        if donor is not None:
            st.assign(donor, left, t_d)
    while st.free > 0 and waiting == 0:
        step = _best_growth(st)
        if step is None:
            break
        _, _, jid, c, t = step
        st.free -= c - st.alloc[jid]
        st.assign(jid, c, t)
    plan.allocation.update({jid: n for jid, n in st.alloc.items() if n > 0})


class Reshaping(Policy):
    def __init__(self, early_init: bool = True) -> None:
        self.early_init = early_init

    def allocation(self, snap: Snapshot, plan: Plan) -> None:
        reshaping_allocation(snap, plan, self.early_init)
