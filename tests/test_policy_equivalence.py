"""Optimisations must not change decisions: every registered policy returns
the same plans (and a small simulation the same per-job results) as the
unoptimised code did, on seeded random snapshots.

The digests below were computed with the code before the speed-ups of issue
15 (``python tests/test_policy_equivalence.py`` prints them).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import sys

import pytest

from tidal.core.job import JobSpec, JobState
from tidal.core.profile import load_profiles
from tidal.core.topology import parse_cluster
from tidal.scheduler.api import JobView, Plan, Snapshot
from tidal.scheduler.buddy import BuddyAllocator
from tidal.scheduler.registry import get_policy, policy_names
from tidal.sim.engine import Simulator
from tidal.sim.metrics import job_rows, summarize

PROFILES = load_profiles()
MODELS = [m for m in PROFILES.models if m != "resnet50_cifar10"]
NOW = 50_000.0
CASES = [("n4g8", 24, 0), ("n8g8", 60, 1), ("n8g8", 60, 2), ("n16g8", 120, 3), ("n16g8", 120, 4)]

PLAN_DIGESTS: dict[str, str] = {
    "backfill": "40b2b8fe928d7913",
    "chronus": "5e70aa7e8f297c45",
    "e-backfill": "f89687d93b81c0d2",
    "e-fifo": "5d82ea126df653f8",
    "edf": "b13d42058a5f0cef",
    "elastic-tiresias": "9ed2afcffa8cb378",
    "elasticflow": "5da23ce4ab01979f",
    "fifo": "69571f09442fce41",
    "gandiva": "0ed718756da981ff",
    "gavel": "bded9a0b6ebd8be9",
    "k8s-default": "b21fc8a43ccd09d0",
    "reshaping": "d636bfeb8405f085",
    "termination": "3751834b767c344f",
    "themis": "ff74bcc05959e8df",
    "tidal": "1e2c256f2c89648d",
    "tidal-hetero": "2c6c052e15919381",
    "tidal-hetero-agnostic": "2c6c052e15919381",
    "tidal-goodput": "1e2c256f2c89648d",  # tidal's decisions on a plain profile
    "pollux": "eefcc9eb22bbc594",
    "optimus": "cd8ccd775122f643",
    "tiresias": "e8acd79f29487b03"
}
SIM_DIGESTS: dict[str, str] = {
    "backfill": "c1650eac5c61bd2c",
    "chronus": "1922dfda669b3f3d",
    "e-backfill": "a94b943e68a810d5",
    "e-fifo": "a95c48694f07ad24",
    "edf": "8444b9a1d5d47ab5",
    "elastic-tiresias": "4543028f8a1a74b2",
    "elasticflow": "d82db98646a62037",
    "fifo": "79f7069d2d15e738",
    "gandiva": "65feb6baf9e35c19",
    "gavel": "48cc79cac1daf0cc",
    "k8s-default": "af630d617d12fe8e",
    "reshaping": "065471fd27d9b88f",
    "termination": "1c953cebfef42199",
    "themis": "cb46998bbec78c15",
    "tidal": "e73186e451005c82",
    "tidal-hetero": "0b50a38100ec2a5d",
    "tidal-hetero-agnostic": "e03fc7fbc3b1add5",
    "tiresias": "8fc0561ff45b6fc1",
    "pollux": "5fb1dfb4e1c08128",
    "optimus": "c735057b33d06292",
    "tidal-goodput": "c3e45407ebe34409"
}


def _spec(rng: random.Random, i: int, submitted: bool) -> JobSpec:
    model = rng.choice(MODELS)
    batch = rng.choice(PROFILES.batch_sizes(model))
    n_req = rng.choice([1, 1, 2, 4, 8, 16])
    rate = PROFILES.throughput(model, batch, n_req) or 1.0
    iters = max(1.0, round(rate * rng.uniform(600, 30_000)))
    submit = NOW if submitted else NOW - rng.uniform(60, 20_000)
    ddl = None if rng.random() < 0.3 else submit + iters / rate * rng.uniform(1.1, 4.0)
    elastic = rng.random() < 0.75
    allowed = (1, 2, 4, 8) if elastic and n_req <= 8 and rng.random() < 0.15 else None
    return JobSpec(f"j{i}", submit, model, batch, iters, requested_gpus=n_req, elastic=elastic,
                   deadline=ddl, allowed_gpus=allowed, user=f"u{i % 4}")


def random_snapshot(cluster_spec: str, jobs: int, seed: int) -> Snapshot:
    """A cluster with ``jobs`` admitted jobs (about half running on buddy
    placements, some with tags) and a few just submitted."""
    rng = random.Random(seed)
    cluster = parse_cluster(cluster_spec)
    buddy = BuddyAllocator(cluster)
    views = []
    for i in range(jobs + 4):
        submitted = i >= jobs
        spec = _spec(rng, i, submitted)
        gpus: tuple[int, ...] = ()
        state = JobState.SUBMITTED if submitted else JobState.PENDING
        if not submitted and rng.random() < 0.5:
            got = buddy.alloc(spec.requested_gpus)
            if got is not None:
                gpus, state = tuple(sorted(got)), rng.choice([JobState.RUNNING, JobState.RUNNING, JobState.RESIZING])
        done = 0.0 if submitted else rng.uniform(0.0, 0.6) * spec.iterations
        executed = 0.0 if submitted else (NOW - spec.submit_time) * rng.uniform(0.0, 1.0)
        tags = {}
        if not submitted and rng.random() < 0.4:
            tags = {"ef_class": rng.choice(["guaranteed", "best_effort"])}
        views.append(JobView(spec, state, gpus, done, attained=executed * max(1, len(gpus)),
                             executed=executed, waiting_since=spec.submit_time + rng.uniform(0, 50),
                             admitted=not submitted, tags=tags))
    return Snapshot(now=NOW, cluster=cluster, jobs=tuple(views), profiles=PROFILES)


def canonical(plan: Plan) -> str:
    d = dataclasses.asdict(plan)
    d["admit"] = sorted(d["admit"])
    if not d.get("waiting"):  # a field newer than the digests (GPU-type constraints), empty without them
        d.pop("waiting", None)
    return json.dumps(d, sort_keys=True, default=repr)


def plan_digest(name: str) -> str:
    """Two consecutive decisions per snapshot (the second sees the first's tags)."""
    h = hashlib.sha256()
    for spec, jobs, seed in CASES:
        snap = random_snapshot(spec, jobs, seed)
        policy = get_policy(name)
        first = policy.schedule(snap)
        h.update(canonical(first).encode())
        again = tuple(j._replace(tags={**j.tags, **first.tags.get(j.job_id, {})}) for j in snap.jobs)
        h.update(canonical(policy.schedule(dataclasses.replace(snap, jobs=again, now=NOW + 60))).encode())
    return h.hexdigest()[:16]


def sim_digest(name: str) -> str:
    rng = random.Random(7)
    specs = []
    for i in range(60):
        s = _spec(rng, i, False)
        specs.append(dataclasses.replace(s, submit_time=NOW + rng.uniform(0, 30_000),
                                          deadline=None if s.deadline is None else s.deadline + 40_000))
    result = Simulator(parse_cluster("n4g8"), get_policy(name), specs, slot=60.0).run()
    summary = summarize(result)
    summary.pop("wall_seconds")
    return hashlib.sha256(json.dumps([summary, job_rows(result)], sort_keys=True, default=repr).encode()).hexdigest()[:16]


@pytest.mark.parametrize("name", policy_names())
def test_same_plans_as_before(name: str) -> None:
    if name not in PLAN_DIGESTS:
        pytest.skip("no reference digest")
    assert plan_digest(name) == PLAN_DIGESTS[name]


@pytest.mark.parametrize("name", policy_names())
def test_same_simulation_as_before(name: str) -> None:
    if name not in SIM_DIGESTS:
        pytest.skip("no reference digest")
    assert sim_digest(name) == SIM_DIGESTS[name]


if __name__ == "__main__":
    names = sys.argv[1:] or policy_names()
    print("PLAN_DIGESTS =", json.dumps({n: plan_digest(n) for n in names}, indent=4))
    print("SIM_DIGESTS =", json.dumps({n: sim_digest(n) for n in names}, indent=4))
