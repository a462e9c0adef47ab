"""Auto-configuration: size a job whose user gave no GPU count (or wrote
``resources: auto``). DLRover's premise — users set resources badly — with
SideCar's method: measure the job's throughput at a few sizes and fit a
throughput model by non-negative least squares, then plan with it.

A control-plane component that reconciles, never waits: the coordinator
calls :meth:`AutoConf.tick` once per round, before it builds the snapshot;
each call reads what the job master already reports (``Job.progress``: rank
0's last step and wall time, the world size) and moves each auto job's
state (``Job.autoconf``) one step:

``new`` ─► ``sampling`` (one size after another) ─► ``planned`` ⇄ (adjust)

* **initial**: from the store's history of similar jobs (same model name,
  else same script, else nearest by declared dataset size and batch) — its
  measured samples seed the model and only the count it predicts is
  measured, to verify; with no history, :data:`DEFAULT_SIZE` worker and the
  sizes :data:`SAMPLE_SIZES` to measure.
* **sampling**: the policy is offered the job at the size to measure (or
  where it is); once the job runs at that size, :data:`WARMUP_STEPS` steps
  are skipped and the step time is measured over at least
  :data:`MIN_STEPS` steps and :data:`MIN_WINDOW_S`.
* **plan**: fit :class:`ThroughputModel`, pick the counts
  (:func:`choose`) and the per-worker memory limit
  (:func:`memory_limit`, from the workers' resident memory, which the
  agents' limits module measures the same way).
* **adjust**: while planned, every :data:`ADJUST_WINDOW_S` the observed step
  time is compared with the model's; off by more than :data:`DEVIATION`,
  the sample is replaced, the model re-fitted and the plan re-made.

The policy still decides GPUs (policies stay pure): :func:`apply_autoconf`
only narrows the job's counts in its ``JobView`` (the way a ``tidal scale``
pin does; a pin still wins). Every decision is an event with its reason:
``autoconf.initial``, ``autoconf.sampled``, ``autoconf.plan``,
``autoconf.adjust`` (docs/autoconf.md).
"""

from __future__ import annotations

import copy
import logging
import math
from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np
from scipy.optimize import nnls
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from tidal.agent.limits import session_rss
from tidal.control.db import GPU, Job, Node, Process, Store, ThroughputRow
from tidal.control.snapshot import ACTIVE, job_spec
from tidal.control.spec import MIN_MEMORY
from tidal.net import LOOPBACK
from tidal.scheduler.api import Snapshot

log = logging.getLogger(__name__)

DEFAULT_SIZE = 1  # workers of a job with no history (conservative, DLRover starts small too)
SAMPLE_SIZES = (1, 2, 4)  # sizes measured without history (those within the cluster and the batch)
WARMUP_STEPS = 3  # steps skipped after the job reached a size (the switch, caches)
MIN_STEPS = 8  # a sample spans at least this many steps ...
MIN_WINDOW_S = 8.0  # ... and this many seconds (the master reports every second)
SAMPLE_WAIT_S = 90.0  # a size the policy does not give the running job within this is skipped
ADJUST_WINDOW_S = 20.0  # while planned: how often the model is checked against the job
DEVIATION = 0.2  # observed vs modelled step time off by more than this: re-fit, re-plan
GOAL_FRACTION = 0.9  # no deadline: the smallest count with this share of the best modelled throughput
DEADLINE_SAFETY = 0.9  # a deadline is planned to be met within this share of the time left
EXTRAPOLATE = 2  # the plan never exceeds this many times the largest size measured
MEM_HEADROOM = 1.5  # memory limit = peak resident memory x this, rounded up to MEM_ROUND
MEM_ROUND = 64 * 2**20
MEM_EVERY_S = 2.0  # how often the workers' resident memory is sampled
HISTORY_FACTOR = 4.0  # nearest by dataset size / batch: only within this factor of each


def new_state() -> dict[str, Any]:
    """The state of a job just submitted for auto-configuration."""
    return {"stage": "new", "samples": [], "peak": 0}


@dataclass(frozen=True)
class ThroughputModel:
    """Step time ``t(n, b) = θ0·b/n + θ1 + θ2·(n − 1)`` seconds at ``n``
    workers and global batch ``b``: per-sample compute split across the
    workers, a fixed cost, and a cost growing with the group (all-reduce,
    contention). θ ≥ 0, fitted by NNLS on relative error (Optimus' and
    SideCar's online fit)."""

    theta: tuple[float, float, float]

    def step_time(self, n: int, batch: int) -> float:
        t0, t1, t2 = self.theta
        return t0 * batch / n + t1 + t2 * (n - 1)

    def samples_per_s(self, n: int, batch: int) -> float:
        t = self.step_time(n, batch)
        return batch / t if t > 0 else 0.0

    @classmethod
    def fit(cls, points: Sequence[Sequence[Any]]) -> "ThroughputModel | None":
        """From ``(n, batch, step seconds, ...)`` points; None without any."""
        pts = [(int(p[0]), int(p[1]), float(p[2])) for p in points if float(p[2]) > 0]
        if not pts:
            return None
        a = np.array([[b / n / t, 1.0 / t, (n - 1) / t] for n, b, t in pts])
        coef, _ = nnls(a, np.ones(len(pts)))
        if not np.any(coef > 0):
            return None
        return cls((float(coef[0]), float(coef[1]), float(coef[2])))


def choose(model: ThroughputModel, batch: int, cap: int, *, remaining_steps: float = 0.0,
           time_left: float | None = None) -> dict[str, Any]:
    """The counts to plan with: ``gpus`` (preferred), ``min``, ``max`` and the
    reason. With a deadline: the smallest count predicted to finish within
    :data:`DEADLINE_SAFETY` of the time left (min = that count). Otherwise
    the best throughput per GPU: the smallest count reaching
    :data:`GOAL_FRACTION` of the best modelled throughput — every further GPU
    would add less than the rest (min 1)."""
    counts = list(range(1, max(1, min(cap, batch)) + 1))
    rate = {n: model.samples_per_s(n, batch) for n in counts}
    best = max(counts, key=lambda n: (rate[n], -n))
    knee = min(n for n in counts if rate[n] >= GOAL_FRACTION * rate[best])
    out = {"predicted": {str(n): round(rate[n], 3) for n in counts}}
    if time_left is not None:
        need = remaining_steps * batch / max(time_left * DEADLINE_SAFETY, 1e-9)  # samples/s
        meet = [n for n in counts if rate[n] >= need]
        if meet:
            n = meet[0]
            why = (f"deadline: {remaining_steps:.0f} steps left in {time_left:.0f} s need {need:.1f} samples/s; "
                   f"{n} GPUs give {rate[n]:.1f} (min {n}, max {max(n, knee)})")
            return {**out, "gpus": n, "min": n, "max": max(n, knee), "reason": why}
        why = (f"deadline: no count gives the {need:.1f} samples/s needed; the fastest is {best} GPUs "
               f"({rate[best]:.1f} samples/s)")
        return {**out, "gpus": best, "min": best, "max": best, "reason": why}
    why = (f"throughput per GPU: {knee} GPUs give {rate[knee]:.1f} samples/s, {rate[knee] / rate[best]:.0%} of "
           f"the best modelled ({rate[best]:.1f} at {best}); each further GPU adds less")
    return {**out, "gpus": knee, "min": 1, "max": knee, "reason": why}


def memory_limit(peak: int) -> int | None:
    """A per-worker memory limit from the peak resident memory seen (None: none seen)."""
    if peak <= 0:
        return None
    return max(MIN_MEMORY, math.ceil(peak * MEM_HEADROOM / MEM_ROUND) * MEM_ROUND)


def measure(win: dict[str, Any] | None, progress: dict[str, Any], sizes: Sequence[int],
            min_s: float, now: float) -> tuple[dict[str, Any] | None, tuple[int, float, int] | None]:
    """One look at the master's report: the window (steps, and rank 0's wall
    clock when the report carries ``last_step``, else ``now``) and, once it is
    long enough, ``(size, seconds per step, steps)``. The window restarts
    whenever the group changes or leaves ``sizes``."""
    last = progress.get("last_step") or ()
    if progress.get("state") != "running" or progress.get("changing"):
        return None, None
    if len(last) == 3:
        step, wall, n = int(last[0]), float(last[1]), int(last[2])
    else:
        step, wall, n = int(progress.get("step", 0)), now, int(progress.get("world_size", 0))
    gen = progress.get("gen")
    if n not in sizes or int(progress.get("world_size", 0)) != n:
        return None, None
    if win is None or win.get("gen") != gen or win.get("n") != n:
        return {"n": n, "gen": gen, "s0": step + WARMUP_STEPS, "w0": None}, None
    if win["w0"] is None:
        if step >= win["s0"]:
            win = {**win, "s0": step, "w0": wall}
        return win, None
    steps, secs = step - int(win["s0"]), wall - float(win["w0"])
    if steps >= MIN_STEPS and secs >= min_s:
        return None, (n, secs / steps, steps)
    return win, None


def apply_autoconf(snap: Snapshot, jobs: dict[str, Any]) -> Snapshot:
    """The policy's view of auto jobs: the counts their auto-configuration
    plans with (the size to measure while sampling, the planned range after)."""
    views, changed = [], False
    for v in snap.jobs:
        st = getattr(jobs.get(v.job_id), "autoconf", None)
        if not st:
            views.append(v)
            continue
        if st["stage"] == "planned":
            plan = st["plan"]
            allowed, want = tuple(range(int(plan["min"]), int(plan["max"]) + 1)), int(plan["gpus"])
        else:
            want = int(st.get("target") or DEFAULT_SIZE)
            allowed = tuple(sorted({want, v.size} - {0}))
        views.append(v._replace(spec=replace(v.spec, elastic=True, allowed_gpus=allowed, min_gpus=None,
                                             max_gpus=None, requested_gpus=want)))
        changed = True
    return replace(snap, jobs=tuple(views)) if changed else snap


class AutoConf:
    """Moves every auto job's configuration one step per :meth:`tick`."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def tick(self, now: float) -> None:
        """One step for every live auto job (one short transaction, none without such jobs)."""
        live = (Job.autoconf.is_not(None), Job.state.in_(ACTIVE))
        with self.store.session(write=False) as s:
            if not s.scalar(select(func.count()).select_from(Job).where(*live)):
                return
        with self.store.session() as s:
            cap = int(s.scalar(select(func.count()).select_from(GPU).join(Node, GPU.node == Node.name)
                               .where(Node.state == "up")) or 0)
            for j in s.scalars(select(Job).where(*live)).all():
                st = copy.deepcopy(j.autoconf)
                try:
                    if self.step(s, j, st, cap, now):
                        j.autoconf = st
                except Exception:  # noqa: BLE001 - one job's sizing must not stop the others
                    log.exception("auto-configuration of %s failed", j.id)

    def step(self, s: Session, j: Job, st: dict[str, Any], cap: int, now: float) -> bool:
        """One step of ``j``'s configuration; whether ``st`` changed."""
        if st["stage"] == "new":
            return cap > 0 and self._initial(s, j, st, cap, now)
        changed = self._memory(s, j, st, now)
        if j.state not in ("running", "resizing"):
            if st["stage"] == "sampling" and st.get("asked") is not None:
                st["asked"] = None  # waiting for GPUs is not the policy refusing the size
                return True
            return changed
        if st["stage"] == "sampling":
            return self._sample(s, j, st, cap, now) or changed
        return self._check(s, j, st, cap, now) or changed

    # -- stages ---------------------------------------------------------------------
    def _initial(self, s: Session, j: Job, st: dict[str, Any], cap: int, now: float) -> bool:
        batch = _batch(j)
        hist = self._history(s, j)
        limit = max(1, min(cap, batch))
        if hist is not None:
            hid, points = hist
            model = ThroughputModel.fit(points)
            plan = choose(model, batch, cap, **_goal(j, now)) if model else None
            n = min(int(plan["gpus"]) if plan else DEFAULT_SIZE, limit)
            queue = [n]
            why = f"history: job {hid}'s model predicts {n} GPUs; measuring that size to check it"
            st.update(samples=[[*p[:3], f"history:{hid}"] for p in points], source=f"history:{hid}")
        else:
            n = min(DEFAULT_SIZE, limit)
            queue = sorted({n, *(c for c in SAMPLE_SIZES if c <= limit)})
            why = (f"no history of a similar job: start at {n} GPU(s), then measure "
                   f"{', '.join(map(str, queue))}")
            st["source"] = "default"
        st.update(stage="sampling", target=queue[0], queue=queue[1:], asked=None, win=None)
        self.store.log(s, "autoconf.initial", j.id, gpus=queue[0], source=st["source"], sizes=queue, reason=why)
        log.info("autoconf %s: %s", j.id, why)
        return True

    def _sample(self, s: Session, j: Job, st: dict[str, Any], cap: int, now: float) -> bool:
        target = int(st["target"])
        win, res = measure(st.get("win"), dict(j.progress or {}), (target,), MIN_WINDOW_S, now)
        changed = win != st.get("win") or st.get("asked") is None
        st["win"] = win
        st["asked"] = st.get("asked") or now  # the clock runs while the job runs
        if res is None:
            if now - float(st["asked"]) <= SAMPLE_WAIT_S:
                return changed
            self.store.log(s, "autoconf.sampled", j.id, gpus=target, skipped=True,
                           reason=f"the policy did not run the job at {target} GPUs within {SAMPLE_WAIT_S:.0f} s")
        else:
            n, t, steps = res
            batch = _batch(j)
            self._verify(s, j, st, n, batch, t, cap)
            self._record(s, j, st, n, batch, t)
            self.store.log(s, "autoconf.sampled", j.id, gpus=n, step_time_s=round(t, 5), steps=steps,
                           samples_per_s=round(batch / t, 3), reason=f"{steps} steps at {n} GPUs after "
                           f"{WARMUP_STEPS} warm-up steps")
        if st["queue"]:
            st.update(target=st["queue"][0], queue=st["queue"][1:], asked=None, win=None)
            return True
        self._plan(s, j, st, cap, now, "sampled " + ", ".join(str(p[0]) for p in st["samples"] if p[3] == "job"))
        return True

    def _verify(self, s: Session, j: Job, st: dict[str, Any], n: int, batch: int, t: float, cap: int) -> None:
        """A history-seeded job measured at its first size: history off by more
        than :data:`DEVIATION` is dropped and the default sizes measured."""
        hist = [p for p in st["samples"] if p[3] != "job"]
        model = ThroughputModel.fit(hist)
        if not hist or model is None:
            return
        pred = model.step_time(n, batch)
        if abs(t - pred) <= DEVIATION * pred:
            return
        st["samples"] = [p for p in st["samples"] if p[3] == "job"]
        limit = max(1, min(cap, batch))
        st["queue"] = [c for c in SAMPLE_SIZES if c <= limit and c != n]
        self.store.log(s, "autoconf.adjust", j.id, gpus=n, observed_step_s=round(t, 5),
                       predicted_step_s=round(pred, 5), deviation=round((t - pred) / pred, 3),
                       reason=f"history of {st.get('source')} is off by more than {DEVIATION:.0%}: dropped; "
                              f"measuring {st['queue']}")

    def _plan(self, s: Session, j: Job, st: dict[str, Any], cap: int, now: float, why: str,
              kind: str = "autoconf.plan", **detail: Any) -> None:
        batch = _batch(j)
        model = ThroughputModel.fit(st["samples"])
        measured = [int(p[0]) for p in st["samples"]] or [DEFAULT_SIZE]
        bound = max(1, min(cap, EXTRAPOLATE * max(measured)))
        if model is None:
            n = max(measured)
            plan = {"gpus": n, "min": 1, "max": n, "predicted": {}, "reason": "nothing measured: the largest size tried"}
        else:
            plan = choose(model, batch, bound, **_goal(j, now))
        mem = self._set_memory(j, memory_limit(int(st.get("peak") or 0)))
        plan["memory"] = mem
        st.update(stage="planned", plan=plan, fit=list(model.theta) if model else None, win=None)
        self.store.log(s, kind, j.id, gpus=plan["gpus"], min=plan["min"], max=plan["max"], memory=mem,
                       memory_mib=(mem >> 20) if mem else None, predicted=plan["predicted"],
                       fit=st["fit"], reason=f"{why}; {plan['reason']}", **detail)
        log.info("autoconf %s: plan %s GPUs (%s-%s), memory %s: %s", j.id, plan["gpus"], plan["min"], plan["max"],
                 mem, plan["reason"])

    def _check(self, s: Session, j: Job, st: dict[str, Any], cap: int, now: float) -> bool:
        plan = st["plan"]
        sizes = tuple(range(1, cap + 1))
        win, res = measure(st.get("win"), dict(j.progress or {}), sizes, ADJUST_WINDOW_S, now)
        changed = win != st.get("win")
        st["win"] = win
        if res is None or not st.get("fit"):
            return changed
        n, t, steps = res
        batch = _batch(j)
        pred = ThroughputModel(tuple(st["fit"])).step_time(n, batch)  # type: ignore[arg-type]
        dev = (t - pred) / pred if pred > 0 else math.inf
        if abs(dev) <= DEVIATION:
            return True
        self._record(s, j, st, n, batch, t)
        self._plan(s, j, st, cap, now, f"observed {t:.4f} s per step at {n} GPUs vs {pred:.4f} s modelled "
                   f"({dev:+.0%}, more than {DEVIATION:.0%}): re-fitted", kind="autoconf.adjust",
                   observed_step_s=round(t, 5), predicted_step_s=round(pred, 5), deviation=round(dev, 3),
                   previous=plan["gpus"])
        return True

    @staticmethod
    def _record(s: Session, j: Job, st: dict[str, Any], n: int, batch: int, t: float) -> None:
        """A measured step time: the job's sample (with the GPU type it ran
        on) and, for a named model on GPUs of one (named) type, the store's
        throughput row for (model, batch, n, type), which the policy's
        profiles read (:func:`tidal.control.snapshot.profiles_from_store`)."""
        gtype = held_gpu_type(s, j.id)
        st["samples"] = ([p for p in st["samples"] if not (p[0] == n and p[1] == batch)]
                         + [[n, batch, t, "job", gtype or ""]])
        model = job_spec(j).model
        if not gtype or model == "generic" or t <= 0:  # untyped GPUs: the shipped curve stays
            return
        row = s.get(ThroughputRow, (model, batch, n, gtype))
        if row is None:
            s.add(ThroughputRow(model=model, batch=batch, gpus=n, gpu_type=gtype, value=1.0 / t, source=f"job:{j.id}"))
        else:
            row.value, row.source = 1.0 / t, f"job:{j.id}"

    # -- memory ---------------------------------------------------------------------
    def _memory(self, s: Session, j: Job, st: dict[str, Any], now: float) -> bool:
        """The highest resident memory of one of the job's workers, sampled
        every :data:`MEM_EVERY_S` on nodes on this host (a loopback address:
        the server can read their ``/proc``)."""
        if j.state not in ("running", "resizing") or now - float(st.get("mem_at", 0.0)) < MEM_EVERY_S:
            return False
        st["mem_at"] = now
        pids = s.scalars(select(Process.pid).join(Node, Process.node == Node.name).where(
            Process.job_id == j.id, Process.kind == "worker", Process.state == "running", Process.pid > 0,
            Node.address == LOOPBACK)).all()
        if not pids:
            return True
        peak = max(session_rss(set(pids)).values(), default=0)
        if peak > int(st.get("peak") or 0):
            st["peak"] = peak
            plan = st.get("plan")
            want = memory_limit(peak)
            if plan and plan.get("memory") and want and want > plan["memory"]:
                plan["memory"] = self._set_memory(j, want)
                self.store.log(s, "autoconf.adjust", j.id, memory=plan["memory"], memory_mib=plan["memory"] >> 20,
                               peak_mib=peak >> 20, reason=f"a worker's resident memory grew to {peak >> 20} MiB: "
                                                           f"x{MEM_HEADROOM} is over the limit; new workers get more")
        return True

    @staticmethod
    def _set_memory(j: Job, limit: int | None) -> int | None:
        """The job's per-worker memory limit for new workers (the tag an
        out-of-memory kill raises, docs/resources.md); never one the user
        set, nor below a limit raised after a kill."""
        res = (j.spec.get("submission") or {}).get("resources") or {}
        tags = dict(j.tags or {})
        if limit is None or res.get("memory") or tags.get("_ooms"):
            return int(tags.get("_memory") or 0) or None
        j.tags = {**tags, "_memory": int(limit)}
        return int(limit)

    # -- history --------------------------------------------------------------------
    def _history(self, s: Session, j: Job) -> tuple[str, list[list[Any]]] | None:
        """The most similar earlier auto job with measurements of its own, and
        those: same model name (unless "generic"), else same script, else the
        nearest by declared dataset size and batch within :data:`HISTORY_FACTOR`."""
        rows = s.execute(select(Job.id, Job.spec, Job.autoconf).where(Job.autoconf.is_not(None), Job.id != j.id)
                         .order_by(Job.submit_time.desc()).limit(200)).all()
        me = j.spec.get("submission") or {}
        cands = []
        for rid, spec, st in rows:
            pts = [p for p in (st or {}).get("samples", []) if len(p) > 3 and p[3] == "job"]
            if pts:
                cands.append((rid, spec.get("submission") or {}, pts))
        if me.get("model", "generic") != "generic":
            for rid, sub, pts in cands:
                if sub.get("model") == me["model"]:
                    return rid, pts
        for rid, sub, pts in cands:
            if sub.get("script") == me.get("script") and sub.get("args") == me.get("args"):
                return rid, pts
        scored = [(_distance(me, sub), rid, pts) for rid, sub, pts in cands]
        scored = [x for x in scored if x[0] is not None]
        if not scored:
            return None
        _, rid, pts = min(scored, key=lambda x: x[0])
        return rid, pts


def held_gpu_type(s: Session, job_id: str) -> str | None:
    """The GPU type of the GPUs ``job_id`` holds (its nodes' ``gpu-type``
    label; ``""`` untyped), or None when it holds none or several types."""
    labels = s.execute(select(Node.labels).join(GPU, GPU.node == Node.name).where(GPU.job_id == job_id)).scalars()
    types = {str((lab or {}).get("gpu-type", "")) for lab in labels}
    return types.pop() if len(types) == 1 else None


def _batch(j: Job) -> int:
    return int(j.batch or job_spec(j).batch_size)


def _goal(j: Job, now: float) -> dict[str, Any]:
    spec = job_spec(j)
    if spec.deadline is None:
        return {}
    return {"remaining_steps": max(0.0, spec.iterations - float(j.done or 0)),
            "time_left": max(1.0, spec.deadline - now)}


def _distance(a: dict[str, Any], b: dict[str, Any]) -> float | None:
    """log-distance by dataset size and batch (None: a declared size is
    missing or either is more than :data:`HISTORY_FACTOR` apart)."""
    d = 0.0
    for key in ("dataset_size", "global_batch_size"):
        x, y = a.get(key), b.get(key)
        if not x or not y:
            return None
        r = abs(math.log(float(x) / float(y)))
        if r > math.log(HISTORY_FACTOR):
            return None
        d += r
    return d
