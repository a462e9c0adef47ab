"""``--fidelity artifact`` (issue 15, item 3): the public ElasticFlow
artifact's deadline-satisfactory ratios (its simulator, 60 s slots, A100
profiles) reproduced within ±0.01 by :func:`tidal.sim.artifact.run_artifact`.

Cells not reproduced are strict xfails that carry the measured value and
the reason (docs/fidelity.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from datafiles import data_file

from tidal.core.topology import parse_cluster
from tidal.scheduler.policies.edf import EDF
from tidal.scheduler.registry import ALIASES
from tidal.sim.artifact import ArtifactSemantics, artifact_setup, run_artifact, simulate_fidelity
from tidal.sim.artifact_ef import max_gpu
from tidal.sim.artifact_ef_plan import EFJob, plan
from tidal.sim.metrics import job_rows, summarize
from tidal.sim.traces import load_trace

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
TRACES = {
    "cluster10": ("traces/itp/cluster10.csv", "clusters/n32g8.csv"),
    "philly_103959": ("traces/philly_103959.csv", "clusters/n32g8.csv"),
    "195job": ("traces/itp/195job.csv", "clusters/n16g8.csv"),
}
TOL = 0.01

_EF = ("ef-accessctrl (the artifact's own planner and loop, tidal.sim.artifact_ef; 2 arrivals declined): "
       "0.962 is 250/260, what the port gives when one admitted job (job 87, bert) is left with a few "
       "iterations: the artifact credits a job only `interval - overhead` up to its planned end, so it stops "
       "progressing and ends late, and while its re-plan misses every arrival (7) is declined; on n32g8 that "
       "job's last planned end is 9 s before its deadline because its ranks hit the trainer cache in one round "
       "(7 s instead of 15 s of overhead); shifting the port's restart rounds (every 60th) by 32 to 46 rounds "
       "gives 0.9615 here and the artifact's philly_103959 (0.9098) and 195job (0.8769) at once, so the run "
       "behind 0.962 restarted the trainers at other rounds than the public code does on this input; "
       "measured {m}, artifact {a}")
# (trace, policy, artifact ratio, measured here or None when reproduced, xfail reason)
CELLS = [
    ("cluster10", "ef-accessctrl", 0.962, 0.9923, _EF),
    ("cluster10", "edf", 0.777, None, ""),
    ("cluster10", "dlas-gpu", 0.477, None, ""),
    ("cluster10", "themis", 0.473, None, ""),
    ("cluster10", "gandiva", 0.331, None, ""),
    ("philly_103959", "ef-accessctrl", 0.910, None, ""),
    ("philly_103959", "edf", 0.436, None, ""),
    ("philly_103959", "dlas-gpu", 0.466, None, ""),
    ("philly_103959", "themis", 0.455, None, ""),
    ("philly_103959", "gandiva", 0.413, None, ""),
    ("195job", "ef-accessctrl", 0.877, None, ""),
    ("195job", "edf", 0.097, None, ""),
    ("195job", "dlas-gpu", 0.492, None, ""),
    ("195job", "gandiva", 0.241, None, ""),
]


def _param(trace: str, policy: str, want: float, measured: float | None, why: str):
    marks = [pytest.mark.xfail(reason=why.format(m=measured, a=want), strict=True)] if measured is not None else []
    if policy == "ef-accessctrl" and trace != "cluster10":
        marks.append(pytest.mark.slow)  # 7 s each: the default suite stays within 5 min (cluster10's runs)
    return pytest.param(trace, policy, want, id=f"{trace}-{policy}", marks=marks)


_cache: dict[str, tuple] = {}


def _setup(trace: str) -> tuple:
    if trace not in _cache:
        tpath, cpath = TRACES[trace]
        _cache[trace] = (load_trace(data_file(tpath)).jobs, parse_cluster(DATA / cpath))
    return _cache[trace]


@pytest.mark.skipif(not DATA.is_dir(), reason="../shared/data (public traces) is not present")
@pytest.mark.parametrize(("trace", "policy", "want"), [_param(*c) for c in CELLS])
def test_artifact_ratio(trace: str, policy: str, want: float) -> None:
    jobs, cluster = _setup(trace)
    got = summarize(run_artifact(jobs, cluster, policy, slot=60.0))["deadline_ratio"]
    assert abs(got - want) <= TOL, f"{trace} {policy}: {got:.4f} vs artifact {want:.3f}"


def test_aliases_and_options() -> None:
    assert ALIASES["ef-accessctrl"] == "elasticflow" and ALIASES["dlas-gpu"] == "tiresias"
    policy, sem = artifact_setup("edf", slot=30.0)
    assert policy.count_rule == "largest" and sem.charge == "none" and sem.slot == 30.0
    assert EDF().count_rule == "best"  # the default stays Tidal's own EDF
    with pytest.raises(ValueError):
        EDF(count_rule="most")


def test_overhead_formula() -> None:
    sem = ArtifactSemantics()
    assert sem.overhead(8, new_set=False, restart=True) == 2.0
    assert sem.overhead(8, new_set=True, restart=False) == 2.0 + 2.0 * 4
    assert sem.overhead(1, new_set=True, restart=True) == 2.0 + 27.0 + 2.0


def test_fidelity_switch(toy_profiles) -> None:
    from tidal.core.job import JobSpec

    jobs = [JobSpec(f"j{i}", submit_time=100.0 * i, model="lin", batch_size=32, iterations=600.0,
                    requested_gpus=2, deadline=100.0 * i + 1000.0) for i in range(4)]
    cluster = parse_cluster("n1g4")
    art = simulate_fidelity(jobs, cluster, "tiresias", toy_profiles, 60.0, fidelity="artifact")
    own = simulate_fidelity(jobs, cluster, "tiresias", toy_profiles, 60.0)
    assert summarize(art)["deadline_ratio"] == summarize(own)["deadline_ratio"] == 1.0
    with pytest.raises(ValueError):
        simulate_fidelity(jobs, cluster, "tiresias", toy_profiles, fidelity="exact")


def test_gandiva_node_sets(toy_profiles) -> None:
    """Two 8-GPU jobs on one node: the second is time-sliced into the first's
    node set and only runs after it (no rotation off the minute)."""
    from tidal.core.job import JobSpec
    from tidal.sim.artifact_gandiva import GandivaNodeSetSimulator

    jobs = [JobSpec(f"j{i}", submit_time=30.0 + 10.0 * i, model="lin", batch_size=32, iterations=600.0,
                    requested_gpus=8, deadline=10_000.0, meta=(("duration", "100"),)) for i in range(2)]
    res = GandivaNodeSetSimulator(parse_cluster("n1g8"), jobs, toy_profiles).run()
    ends = sorted(j.end_time for j in res.jobs)
    assert ends[0] < ends[1] and ends[1] - ends[0] >= 100.0
    assert run_artifact(jobs, parse_cluster("n1g8"), "gandiva", toy_profiles).policy == "gandiva"


def test_ties_in_submit_time_keep_trace_order(toy_profiles) -> None:
    """The artifact sorts jobs on submit time alone (a stable sort), so its
    Gandiva takes jobs submitted together in the trace's order, not by id:
    'zeta', listed first, opens the node set; 'alpha' is time-sliced behind it
    (on 195job this is 0.2205 against 0.241)."""
    from tidal.core.job import JobSpec
    from tidal.sim.artifact_gandiva import GandivaNodeSetSimulator

    jobs = [JobSpec(jid, submit_time=30.0, model="lin", batch_size=32, iterations=600.0, requested_gpus=8,
                    deadline=10_000.0, meta=(("duration", "100"),)) for jid in ("zeta", "alpha")]
    by = {j.spec.job_id: j for j in GandivaNodeSetSimulator(parse_cluster("n1g8"), jobs, toy_profiles).run().jobs}
    assert by["zeta"].end_time < by["alpha"].end_time


def test_ef_planner_fills_late() -> None:
    """The artifact's planner fills the latest timeline periods that deliver
    the work (here 300..600, though GPUs are free now); the end is aligned to
    a slot after that period's start, the real end is not."""
    job = EFJob(idx=0, model="lin", batch=32, ddl=600, iter_left=200, max_gpu=32, counts=(1, 2, 4, 8),
                rate=float)
    res = plan(job, 0, {0: 8, 300: 4, 600: 8}, 8, 60.0)
    assert res.ok and res.alloc == {0: 0, 300: 1}
    assert (res.real_end, res.end) == (500, 540)
    assert res.timeline == {0: 8, 300: 3, 540: 4, 600: 8}


def test_ef_batch_declined_together(toy_profiles) -> None:
    """Arrivals merged into one round are declined together when any plan misses."""
    from tidal.core.job import JobSpec

    def job(i: str, t: float, its: float, ddl: float) -> JobSpec:
        return JobSpec(i, submit_time=t, model="lin", batch_size=32, iterations=its, requested_gpus=1, deadline=ddl)

    jobs = [job("ok", 0.0, 600.0, 1000.0), job("hopeless", 0.0, 1e5, 500.0), job("later", 2000.0, 600.0, 3000.0)]
    rows = {r["job_id"]: r for r in job_rows(run_artifact(jobs, parse_cluster("n1g8"), "ef-accessctrl", toy_profiles))}
    assert rows["ok"]["state"] == rows["hopeless"]["state"] == "dropped"
    assert rows["later"]["met_deadline"]
    with pytest.raises(ValueError):
        artifact_setup("ef-accessctrl")  # its own executor, not a policy


@pytest.mark.skipif(not DATA.is_dir(), reason="../shared/data (public traces) is not present")
def test_ef_stalled_job_declines_arrivals() -> None:
    """The mechanism behind the artifact's 0.962 on cluster10 (250/260), seen
    here on n64g8: job 87 is left with 16 iterations, less than a round's
    overhead lets it do, so it ends late, and its missed re-plan makes the
    next 7 arrivals be declined."""
    jobs, _ = _setup("cluster10")
    rows = job_rows(run_artifact(jobs, parse_cluster(DATA / "clusters/n64g8.csv"), "ef-accessctrl"))
    late = [r for r in rows if r["drop_reason"] == "late"]
    declined = [r for r in rows if r["state"] == "dropped"]
    assert len(late) == 1 and not late[0]["met_deadline"] and len(declined) == 9
    assert sum(bool(r["met_deadline"]) for r in rows) == 250


def test_ef_max_gpu() -> None:
    """The artifact's hand-written per-model caps (A100)."""
    assert max_gpu("bert", 64) == 8 and max_gpu("bert", 128) == 16
    assert max_gpu("gpt2", 128) == 16 and max_gpu("deepspeech2", 32) == 32
    assert max_gpu("resnet50", 256) == 64 and max_gpu("vgg16", 64) == 32
