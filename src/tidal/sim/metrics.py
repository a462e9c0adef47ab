"""Metrics of a simulation: per-job records, a summary, CSV/JSON and plots.

Definitions (times in seconds):
- JCT = completion - submission, over completed jobs; pending = first start -
  submission, over jobs that started.
- makespan = last completion - first submission.
- utilisation = allocated GPU-seconds / (GPUs x span), span = first
  submission .. last event.
- cluster efficiency (ElasticFlow §6, eq. 8): the time average of
  (1/M) * sum_j T_j(x_j) / T_j(1), i.e. each job's throughput on its x_j GPUs
  normalised by its one-GPU throughput, summed and divided by the M GPUs.
  Paused GPUs (rescale overhead) count 0.
- deadline ratio: jobs with a deadline that completed by it / jobs with a
  deadline (dropped jobs count as misses).
- overhead GPU-s: GPU time lost to rescale overheads (paused or warming up).
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from statistics import median
from typing import Any, Iterable

from tidal.core.job import JobState
from tidal.sim.engine import SimResult
from tidal.sim.progress import SimJob

SUMMARY_KEYS = (
    "policy",
    "jobs",
    "finished",
    "avg_jct",
    "median_jct",
    "p95_jct",
    "p99_jct",
    "avg_pending",
    "makespan",
    "utilization",
    "cluster_efficiency",
    "deadline_ratio",
    "admitted",
    "dropped",
    "rescales",
    "wall_seconds",
)

JOB_COLUMNS = (
    "job_id",
    "user",
    "model",
    "batch_size",
    "requested_gpus",
    "max_gpus_used",
    "submit_time",
    "start_time",
    "end_time",
    "jct",
    "pending",
    "deadline",
    "met_deadline",
    "state",
    "drop_reason",
    "rescales",
    "preemptions",
    "migrations",
    "gpu_seconds",
    "overhead_gpu_s",
)


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolation percentile (numpy's default), ``q`` in [0, 100]."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def job_rows(result: SimResult) -> list[dict[str, Any]]:
    rows = []
    for j in result.jobs:
        s = j.spec
        done = j.state is JobState.COMPLETED
        met = None
        if s.deadline is not None:
            met = bool(done and j.end_time is not None and j.end_time <= s.deadline + 1e-6)
        rows.append(
            {
                "job_id": s.job_id,
                "user": s.user,
                "model": s.model,
                "batch_size": s.batch_size,
                "requested_gpus": s.requested_gpus,
                "max_gpus_used": j.max_gpus,
                "submit_time": s.submit_time,
                "start_time": j.start_time,
                "end_time": j.end_time if done or j.state is JobState.DROPPED else None,
                "jct": (j.end_time - s.submit_time) if done else None,
                "pending": (j.start_time - s.submit_time) if j.start_time is not None else None,
                "deadline": s.deadline,
                "met_deadline": met,
                "state": j.state.value,
                "drop_reason": j.drop_reason,
                "rescales": j.rescales,
                "preemptions": j.preemptions,
                "migrations": j.migrations,
                "gpu_seconds": j.gpu_seconds,
                "overhead_gpu_s": j.overhead_gpu_s,
            }
        )
    return rows


def _tally(jobs: list[SimJob]) -> dict[str, Any]:
    """One pass over the jobs: the lists and counts :func:`summarize` needs,
    in job order (as from :func:`job_rows`)."""
    jcts: list[float] = []
    ends: list[float] = []
    pend: list[float] = []
    overhead: list[float] = []
    states: dict[str, int] = {}
    ddl = met = admitted = rescales = preemptions = migrations = 0
    for j in jobs:
        spec, state, end = j.spec, j.state, j.end_time
        if state is JobState.COMPLETED and end is not None:
            ends.append(end)
            jcts.append(end - spec.submit_time)
        if j.start_time is not None:
            pend.append(j.start_time - spec.submit_time)
        if spec.deadline is not None:
            ddl += 1
            met += state is JobState.COMPLETED and end is not None and end <= spec.deadline + 1e-6
        states[state.value] = states.get(state.value, 0) + 1
        admitted += bool(j.admitted)
        rescales += j.rescales
        preemptions += j.preemptions
        migrations += j.migrations
        overhead.append(j.overhead_gpu_s)
    return {"jcts": jcts, "ends": ends, "pend": pend, "overhead": overhead, "states": states, "ddl": ddl,
            "met": met, "admitted": admitted, "rescales": rescales, "preemptions": preemptions,
            "migrations": migrations}


def summarize(result: SimResult) -> dict[str, Any]:
    """The summary of :data:`SUMMARY_KEYS` and more, from the jobs' fields
    (the same values as from :func:`job_rows`, without building the rows)."""
    jobs = result.jobs
    t = _tally(jobs)
    jcts, ends, pend, states = t["jcts"], t["ends"], t["pend"], t["states"]
    by_jct = sorted(jcts)  # median and percentiles sort again: in linear time
    span = max(result.end - result.start, 0.0)
    gpus = result.cluster.num_gpus
    out: dict[str, Any] = {
        "policy": result.policy,
        "jobs": len(jobs),
        "finished": len(jcts),
        "avg_jct": sum(jcts) / len(jcts) if jcts else None,
        "median_jct": median(by_jct) if jcts else None,
        "p95_jct": percentile(by_jct, 95),
        "p99_jct": percentile(by_jct, 99),
        "avg_pending": sum(pend) / len(pend) if pend else None,
        "makespan": (max(ends) - result.start) if ends else None,
        "utilization": result.busy_gpu_s / (gpus * span) if span > 0 else 0.0,
        "cluster_efficiency": result.useful_norm_s / (gpus * span) if span > 0 else 0.0,
        "deadline_ratio": (t["met"] / t["ddl"]) if t["ddl"] else None,
        "admitted": t["admitted"],
        "dropped": states.get("dropped", 0),
        "rescales": t["rescales"],
        "wall_seconds": result.wall_seconds,
        # beyond the contract
        "preemptions": t["preemptions"],
        "migrations": t["migrations"],
        "overhead_gpu_s": sum(t["overhead"]),
        "running_at_end": states.get("running", 0) + states.get("resizing", 0),
        "pending_at_end": states.get("pending", 0) + states.get("submitted", 0) + states.get("admitted", 0),
        "rounds": result.rounds,
        "cluster": result.cluster.name,
        "gpus": gpus,
    }
    return out


def write_job_csv(result: SimResult, path: Path) -> None:
    rows = job_rows(result)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=JOB_COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if v is None else v) for k, v in r.items()})
    tmp.replace(path)


def write_json(obj: Any, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    tmp.replace(path)


def _matplotlib():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_utilization(results: Iterable[SimResult], path: Path) -> None:
    """GPUs allocated over time (fraction of the cluster): one panel per policy,
    sharing the time axis, so overlapping curves stay readable."""
    plt = _matplotlib()
    results = [r for r in results if r.timeline]
    if not results:
        return
    fig, axes = plt.subplots(len(results), 1, figsize=(9, 1.3 + 1.2 * len(results)), sharex=True, squeeze=False)
    for ax, r in zip(axes[:, 0], results):
        ts = [(t - r.start) / 3600 for t, _ in r.timeline] + [(r.end - r.start) / 3600]
        us = [u / r.cluster.num_gpus for _, u in r.timeline]
        us.append(us[-1])
        ax.fill_between(ts, us, step="post", alpha=0.35)
        ax.step(ts, us, where="post", linewidth=0.7)
        avg = r.busy_gpu_s / (r.cluster.num_gpus * max(r.end - r.start, 1e-9))
        ax.set_ylim(0, 1.05)
        ax.set_ylabel(r.policy, rotation=0, ha="right", va="center")
        ax.text(0.995, 0.9, f"mean {100 * avg:.1f}%", transform=ax.transAxes, ha="right", va="top", fontsize="small")
    axes[-1, 0].set_xlabel("hours since first submission")
    fig.suptitle(f"GPUs allocated (fraction of {results[0].cluster.num_gpus})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_jct_cdf(results: Iterable[SimResult], path: Path) -> None:
    plt = _matplotlib()
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        jcts = sorted(row["jct"] / 3600 for row in job_rows(r) if row["jct"] is not None)
        if not jcts:
            continue
        ys = [(i + 1) / len(jcts) for i in range(len(jcts))]
        ax.step(jcts, ys, where="post", label=r.policy)
    ax.set_xscale("log")
    ax.set_xlabel("job completion time (hours, log scale)")
    ax.set_ylabel("fraction of jobs")
    ax.set_title("JCT CDF")
    ax.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


#: the files :func:`write_outputs` writes into its folder (``*`` is a policy's name)
OUTPUT_FILES = ("summary.json", "*_jobs.csv", "utilization.png", "jct_cdf.png")


def clear_outputs(out: Path, extra: Iterable[str] = ()) -> None:
    """Remove the files a run writes into ``out`` (:data:`OUTPUT_FILES`,
    ``extra`` names or patterns) and their ``.tmp`` leftovers: a folder then
    holds one run's results, never an older run's beside them. Other files stay."""
    for pattern in (*OUTPUT_FILES, *extra):
        for p in [*out.glob(pattern), *out.glob(pattern + ".tmp")]:
            if p.is_file() or p.is_symlink():
                p.unlink(missing_ok=True)


def write_outputs(results: list[SimResult], out: Path, extra: Iterable[str] = ()) -> dict[str, Path]:
    """Per-job CSV per policy, summary.json, utilization.png, jct_cdf.png,
    replacing the previous run's files (:func:`clear_outputs`; ``extra``: other
    files of the run the caller writes afterwards). If writing fails (a full
    disk), none of this run's files is left half-written: they are removed
    and the error raised."""
    out.mkdir(parents=True, exist_ok=True)
    clear_outputs(out, extra)
    paths: dict[str, Path] = {}
    try:
        for r in results:
            p = out / f"{r.policy}_jobs.csv"
            write_job_csv(r, p)
            paths[f"{r.policy}_jobs"] = p
        summary = [summarize(r) for r in results]
        write_json(summary, out / "summary.json")
        paths["summary"] = out / "summary.json"
        plot_utilization(results, out / "utilization.png")
        plot_jct_cdf(results, out / "jct_cdf.png")
    except BaseException:
        clear_outputs(out, extra)
        raise
    paths["utilization"] = out / "utilization.png"
    paths["jct_cdf"] = out / "jct_cdf.png"
    return paths
