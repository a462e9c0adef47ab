"""Tests of the trace loaders (tidal.sim.traces) on the shared reference traces
and on small malformed CSVs written into tmp_path."""

from __future__ import annotations

import csv
import math
import time
from collections import Counter
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidal.core.errors import InputError
from tidal.core.profile import load_profiles
from tidal.sim.traces import Trace, detect_format, load_trace, poisson_jobs

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
TRACES = DATA / "traces"
CLUSTER10 = TRACES / "itp" / "cluster10.csv"
PHILLY_EF = TRACES / "philly_103959.csv"
PHILLY = TRACES / "philly.csv"

PROFILES = load_profiles()


def need(path: Path) -> Path:
    if not path.is_file():
        pytest.skip(f"reference trace {path} is absent (expected ../shared/data relative to the repo)")
    return path


# -- real traces --------------------------------------------------------------


def test_itp_cluster10() -> None:
    tr = load_trace(need(CLUSTER10), profiles=PROFILES)
    assert tr.fmt == "itp" and tr.source == str(CLUSTER10)
    assert len(tr.jobs) == 260
    first = tr.jobs[0]
    assert first.job_id == "5dc7d9cd-c300-9a4f-c3cd-dc2cc0935548"
    assert first.submit_time == 2266647
    assert first.iterations == 6503
    assert first.model == "bert"
    assert first.deadline == 2267101
    assert first.batch_size == 128
    assert first.requested_gpus == 16
    assert first.elastic is True
    assert dict(first.meta)["duration"] == "604"
    third = tr.jobs[2]
    assert (third.model, third.iterations, third.requested_gpus, third.deadline) == ("vgg16", 616709, 2, 2791437)
    # trace order kept, every job has a deadline after its submission
    with CLUSTER10.open() as fh:
        ids = [r["job_id"] for r in csv.DictReader(fh)]
    assert [j.job_id for j in tr.jobs] == ids
    assert all(j.deadline is not None and j.deadline >= j.submit_time for j in tr.jobs)

    s = tr.summary()
    assert s["jobs"] == 260 and s["with_deadline"] == 260
    assert s["gpu_request_hist"] == {1: 193, 2: 51, 4: 14, 16: 2}
    assert s["models"]["resnet50"] == 57 and sum(s["models"].values()) == 260
    assert s["first_submit"] == 2266647 and s["span_s"] == s["last_submit"] - s["first_submit"]
    assert s["total_iterations"] == pytest.approx(sum(j.iterations for j in tr.jobs))
    assert "260 jobs" in tr.describe() and "cluster10.csv" in tr.describe()


def test_itp_rigid_flag() -> None:
    tr = load_trace(need(CLUSTER10), "itp", profiles=PROFILES, elastic=False)
    assert not any(j.elastic for j in tr.jobs)


def test_philly_ef() -> None:
    tr = load_trace(need(PHILLY_EF), profiles=PROFILES)
    assert tr.fmt == "philly-ef"
    assert len(tr.jobs) == 876
    j0, j1 = tr.jobs[0], tr.jobs[1]
    assert (j0.job_id, j0.submit_time, j0.model, j0.batch_size, j0.requested_gpus) == ("0", 0, "vgg16", 256, 1)
    assert j0.iterations == 1282877 and j0.deadline == 771220
    assert (j1.job_id, j1.submit_time, j1.iterations, j1.deadline, j1.requested_gpus) == ("1", 219316, 26446831, 2065619, 4)
    assert tr.summary()["with_deadline"] == 876
    assert tr.jobs[-1].job_id == "875"


def test_philly_ef_uses_iteration_not_real_iteration(tmp_path: Path) -> None:
    # in philly_103959.csv both columns are equal, so check the choice on a small file
    p = tmp_path / "ef.csv"
    p.write_text(EF_HEADER + "7,10,999,bert,5000,128,2,300,250,400\n")
    (job,) = load_trace(p, profiles=PROFILES).jobs
    assert (job.job_id, job.submit_time, job.iterations, job.deadline) == ("7", 10, 400, 5000)
    assert (job.model, job.batch_size, job.requested_gpus) == ("bert", 128, 2)


def test_limit_keeps_first_by_submit_time() -> None:
    full = load_trace(need(PHILLY_EF), profiles=PROFILES)
    part = load_trace(PHILLY_EF, profiles=PROFILES, limit=10)
    assert part.jobs == full.jobs[:10]
    with pytest.raises(InputError, match="limit"):
        load_trace(PHILLY_EF, profiles=PROFILES, limit=0)


def test_limit_unsorted_trace_keeps_earliest_in_trace_order(tmp_path: Path) -> None:
    p = tmp_path / "unsorted.csv"
    p.write_text(
        ITP_HEADER
        + "a,300,10,resnet50,900,64,1,5\n"
        + "b,100,10,resnet50,900,64,1,5\n"
        + "c,200,10,resnet50,900,64,1,5\n"
    )
    tr = load_trace(p, profiles=PROFILES, limit=2)
    assert [j.job_id for j in tr.jobs] == ["b", "c"]


# -- philly.csv (the scale trace) --------------------------------------------


@pytest.fixture(scope="module")
def philly_seed0() -> tuple[Trace, float]:
    need(PHILLY)
    t0 = time.perf_counter()
    tr = load_trace(PHILLY, seed=0, profiles=PROFILES)
    return tr, time.perf_counter() - t0


def test_philly_loads_completely(philly_seed0: tuple[Trace, float]) -> None:
    # load speed is measured in benchmarks/sim_philly.py (load_s), not here
    tr, _ = philly_seed0
    assert tr.fmt == "philly"
    assert len(tr.jobs) == 82_247
    assert len({j.job_id for j in tr.jobs}) == 82_247
    assert all(j.deadline is None for j in tr.jobs)
    s = tr.summary()
    assert s["first_submit"] == 0.0 and s["zero_duration"] == 0
    assert s["gpu_request_hist"][1] == 76_627 and s["gpu_request_hist"][128] == 3


def test_philly_submit_times_and_order(philly_seed0: tuple[Trace, float]) -> None:
    tr, _ = philly_seed0
    with PHILLY.open(newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if r["timestamp"]]
    origin = datetime.strptime(min(r["timestamp"] for r in rows), "%Y-%m-%d %H:%M:%S")
    by_id = {j.job_id: j for j in tr.jobs}
    for i in (0, 1, 2, 1000, len(rows) - 1):
        expected = (datetime.strptime(rows[i]["timestamp"], "%Y-%m-%d %H:%M:%S") - origin).total_seconds()
        job = by_id[f"p{i}"]
        assert job.submit_time == expected
        assert job.requested_gpus == int(rows[i]["num_gpus"])
    # sorted by submit time, ties by row index
    keys = [(j.submit_time, int(j.job_id[1:])) for j in tr.jobs]
    assert keys == sorted(keys)


def test_philly_iterations_reproduce_duration(philly_seed0: tuple[Trace, float]) -> None:
    tr, _ = philly_seed0
    with PHILLY.open(newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if r["timestamp"]]
    by_id = {j.job_id: j for j in tr.jobs}
    checked = 0
    big = [i for i, r in enumerate(rows) if int(r["num_gpus"]) in (12, 16, 128)][:3]
    for i in [0, 1, 2, 5000, 40000, *big]:
        job = by_id[f"p{i}"]
        duration = float(rows[i]["duration"])
        tput = PROFILES.throughput(job.model, job.batch_size, job.requested_gpus)
        assert tput > 0
        assert job.iterations / tput == pytest.approx(duration, rel=1e-6)
        assert job.batch_size in PROFILES.batch_sizes(job.model)
        checked += 1
    assert checked >= 6


def test_philly_models_run_at_requested_count(philly_seed0: tuple[Trace, float]) -> None:
    tr, _ = philly_seed0
    # resnet50_cifar10's profile has 0 ("does not run") from 16 GPUs on
    for j in tr.jobs:
        if j.requested_gpus >= 16:
            assert j.model != "resnet50_cifar10"
    pairs = {(j.model, j.batch_size, j.requested_gpus) for j in tr.jobs}
    assert all(PROFILES.throughput(m, b, n) > 0 for m, b, n in pairs)
    # every profiled model is used on a trace this large
    assert set(tr.summary()["models"]) == set(PROFILES.models)


def test_philly_seeded(philly_seed0: tuple[Trace, float]) -> None:
    tr0, _ = philly_seed0
    again = load_trace(PHILLY, seed=0, profiles=PROFILES)
    assert again.jobs == tr0.jobs
    other = load_trace(PHILLY, seed=1, profiles=PROFILES)
    assert [j.job_id for j in other.jobs] == [j.job_id for j in tr0.jobs]
    differ = sum(a.model != b.model for a, b in zip(tr0.jobs, other.jobs))
    assert differ > len(tr0.jobs) // 2


def test_philly_zero_duration_is_one_iteration(tmp_path: Path) -> None:
    p = tmp_path / "ph.csv"
    p.write_text(
        PHILLY_HEADER
        + "2017-10-09 07:01:55,0.0,1,0.0,c1\n"
        + "2017-10-09 07:00:00,120.0,2,240.0,c1\n"
        + "2017-10-09 07:00:00,60.0,4,240.0,c2\n\n\n"
    )
    tr = load_trace(p, profiles=PROFILES)
    assert [j.job_id for j in tr.jobs] == ["p1", "p2", "p0"]
    assert [j.submit_time for j in tr.jobs] == [0.0, 0.0, 115.0]
    assert tr.jobs[2].iterations == 1.0
    assert tr.summary()["zero_duration"] == 1
    assert dict(tr.jobs[0].meta)["cluster"] == "c1"


# -- format detection ----------------------------------------------------------


def test_detect_format_real_files() -> None:
    assert detect_format(need(CLUSTER10)) == "itp"
    assert detect_format(need(PHILLY_EF)) == "philly-ef"
    assert detect_format(need(PHILLY)) == "philly"


def test_detect_format_unknown_header(tmp_path: Path) -> None:
    p = tmp_path / "weird.csv"
    p.write_text("foo,bar,baz\n1,2,3\n")
    with pytest.raises(InputError) as ei:
        detect_format(p)
    msg = str(ei.value)
    assert "weird.csv" in msg and "foo,bar,baz" in msg
    with pytest.raises(InputError, match="weird.csv"):
        load_trace(p, profiles=PROFILES)


def test_explicit_format_and_unknown_format(tmp_path: Path) -> None:
    p = tmp_path / "ok.csv"
    p.write_text(ITP_HEADER + GOOD_ITP_ROW)
    assert load_trace(p, "itp", profiles=PROFILES).fmt == "itp"
    with pytest.raises(InputError, match="philly"):  # wrong explicit format: missing philly columns
        load_trace(p, "philly", profiles=PROFILES)
    with pytest.raises(InputError, match="fmt"):
        load_trace(p, "csv", profiles=PROFILES)


def test_header_whitespace_and_bom(tmp_path: Path) -> None:
    p = tmp_path / "bom.csv"
    p.write_text("\ufeff" + ITP_HEADER.replace(",", ", ") + GOOD_ITP_ROW, encoding="utf-8")
    tr = load_trace(p, profiles=PROFILES)
    assert tr.jobs[0].job_id == "a" and tr.fmt == "itp"


# -- malformed input -------------------------------------------------------------

ITP_HEADER = "job_id,submission_time,num_iteration,model_name,deadline,batch_size,num_gpu,duration\n"
GOOD_ITP_ROW = "a,100,1000,resnet50,5000,64,1,600\n"
EF_HEADER = "job_id,submit_time,real_iteration,model_name,ddl,batch_size,num_gpu,real_duration,duration,iteration\n"
GOOD_EF_ROW = "0,0,500,vgg16,9000,64,1,100,100,500\n"
PHILLY_HEADER = "timestamp,duration,num_gpus,gpu_time,cluster\n"
GOOD_PHILLY_ROW = "2017-10-09 07:01:55,66.0,1,66.0,11cb48\n"

# (case id, file content, line, field, fragment of the reason)
BAD_CASES = [
    ("itp-missing-column", ITP_HEADER.replace(",num_gpu", "") + "a,100,1000,resnet50,5000,64,600\n", 1, "num_gpu", "missing column"),
    ("itp-short-row", ITP_HEADER + GOOD_ITP_ROW + "b,200,1000,resnet50,5000,64\n", 3, "num_gpu", "fields"),
    ("itp-long-row", ITP_HEADER + GOOD_ITP_ROW + "b,200,1000,resnet50,5000,64,1,600,7\n", 3, None, "9 fields"),
    ("itp-nonnumeric-submit", ITP_HEADER + GOOD_ITP_ROW + "b,soon,1000,resnet50,5000,64,1,600\n", 3, "submission_time", "not a number"),
    ("itp-nan-submit", ITP_HEADER + GOOD_ITP_ROW + "b,nan,1000,resnet50,5000,64,1,600\n", 3, "submission_time", "finite"),
    ("itp-negative-submit", ITP_HEADER + GOOD_ITP_ROW + "b,-5,1000,resnet50,5000,64,1,600\n", 3, "submission_time", "negative"),
    ("itp-empty-submit", ITP_HEADER + GOOD_ITP_ROW + "b,,1000,resnet50,5000,64,1,600\n", 3, "submission_time", "empty"),
    ("itp-nonnumeric-iterations", ITP_HEADER + GOOD_ITP_ROW + "b,200,lots,resnet50,5000,64,1,600\n", 3, "num_iteration", "not a number"),
    ("itp-zero-iterations", ITP_HEADER + GOOD_ITP_ROW + "b,200,0,resnet50,5000,64,1,600\n", 3, "num_iteration", "> 0"),
    ("itp-negative-iterations", ITP_HEADER + GOOD_ITP_ROW + "b,200,-3,resnet50,5000,64,1,600\n", 3, "num_iteration", "> 0"),
    ("itp-zero-batch", ITP_HEADER + GOOD_ITP_ROW + "b,200,1000,resnet50,5000,0,1,600\n", 3, "batch_size", "> 0"),
    ("itp-fractional-batch", ITP_HEADER + GOOD_ITP_ROW + "b,200,1000,resnet50,5000,64.5,1,600\n", 3, "batch_size", "integer"),
    ("itp-zero-gpus", ITP_HEADER + GOOD_ITP_ROW + "b,200,1000,resnet50,5000,64,0,600\n", 3, "num_gpu", ">= 1"),
    ("itp-unknown-model", ITP_HEADER + GOOD_ITP_ROW + "b,200,1000,alexnet,5000,64,1,600\n", 3, "model_name", "resnet50"),
    ("itp-deadline-before-submit", ITP_HEADER + GOOD_ITP_ROW + "b,200,1000,resnet50,150,64,1,600\n", 3, "deadline", "before submit"),
    ("itp-negative-duration", ITP_HEADER + GOOD_ITP_ROW + "b,200,1000,resnet50,5000,64,1,-1\n", 3, "duration", "negative"),
    ("itp-duplicate-id", ITP_HEADER + GOOD_ITP_ROW + "a,200,1000,resnet50,5000,64,1,600\n", 3, "job_id", "line 2"),
    ("itp-blank-line-inside", ITP_HEADER + GOOD_ITP_ROW + "\n" + "b,200,1000,resnet50,5000,64,1,600\n", 3, None, "blank line"),
    ("itp-header-only", ITP_HEADER, 2, None, "no data rows"),
    ("itp-header-only-blank-lines", ITP_HEADER + "\n\n", 2, None, "no data rows"),
    ("ef-deadline-before-submit", EF_HEADER + GOOD_EF_ROW + "1,500,10,vgg16,400,64,1,5,5,10\n", 3, "ddl", "before submit"),
    ("ef-zero-iteration", EF_HEADER + GOOD_EF_ROW + "1,500,10,vgg16,900,64,1,5,5,0\n", 3, "iteration", "> 0"),
    ("ef-missing-column", EF_HEADER.replace(",iteration", "") + "0,0,500,vgg16,9000,64,1,100,100\n", 1, "iteration", "missing column"),
    ("philly-bad-timestamp", PHILLY_HEADER + GOOD_PHILLY_ROW + "yesterday,66.0,1,66.0,11cb48\n", 3, "timestamp", "timestamp"),
    ("philly-negative-duration", PHILLY_HEADER + GOOD_PHILLY_ROW + "2017-10-09 07:01:55,-1,1,66.0,11cb48\n", 3, "duration", "negative"),
    ("philly-nonnumeric-duration", PHILLY_HEADER + GOOD_PHILLY_ROW + "2017-10-09 07:01:55,long,1,66.0,11cb48\n", 3, "duration", "not a number"),
    ("philly-zero-gpus", PHILLY_HEADER + GOOD_PHILLY_ROW + "2017-10-09 07:01:55,66,0,66.0,11cb48\n", 3, "num_gpus", ">= 1"),
    ("philly-fractional-gpus", PHILLY_HEADER + GOOD_PHILLY_ROW + "2017-10-09 07:01:55,66,1.5,66.0,11cb48\n", 3, "num_gpus", "integer"),
    ("philly-missing-column", "timestamp,num_gpus,gpu_time,cluster\n2017-10-09 07:01:55,1,66.0,11cb48\n", 1, "duration", "missing column"),
]


@pytest.mark.parametrize("content,line,field,fragment", [c[1:] for c in BAD_CASES], ids=[c[0] for c in BAD_CASES])
def test_bad_input_names_file_line_field(tmp_path: Path, content: str, line: int, field: str | None, fragment: str) -> None:
    p = tmp_path / "bad_trace.csv"
    p.write_text(content)
    with pytest.raises(InputError) as ei:
        load_trace(p, profiles=PROFILES)
    exc, msg = ei.value, str(ei.value)
    assert exc.source == str(p) and "bad_trace.csv" in msg
    assert exc.line == line and f"line {line}" in msg
    assert exc.field == field
    if field is not None:
        assert f"'{field}'" in msg
    assert fragment in msg


def test_duplicate_id_names_both_lines(tmp_path: Path) -> None:
    p = tmp_path / "dup.csv"
    p.write_text(ITP_HEADER + GOOD_ITP_ROW + "b,150,10,bert,900,64,1,5\n" + "a,200,10,bert,900,64,1,5\n")
    with pytest.raises(InputError) as ei:
        load_trace(p, profiles=PROFILES)
    assert ei.value.line == 4 and "line 2" in str(ei.value) and "'a'" in str(ei.value)


def test_trailing_blank_lines_ignored(tmp_path: Path) -> None:
    p = tmp_path / "trailing.csv"
    p.write_text(ITP_HEADER + GOOD_ITP_ROW + "b,200,10,bert,900,64,2,5\n\n  \n")
    assert len(load_trace(p, profiles=PROFILES).jobs) == 2


def test_empty_and_missing_files(tmp_path: Path) -> None:
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    with pytest.raises(InputError) as ei:
        load_trace(empty, profiles=PROFILES)
    assert "empty.csv" in str(ei.value) and ei.value.line == 1
    missing = tmp_path / "nope" / "missing.csv"
    for call in (lambda: load_trace(missing, profiles=PROFILES), lambda: detect_format(missing)):
        with pytest.raises(InputError) as ei:
            call()
        assert str(missing) in str(ei.value) and "does not exist" in str(ei.value)


# -- synthetic Poisson workload ------------------------------------------------------


def test_poisson_deterministic() -> None:
    a = poisson_jobs(300, rate_per_hour=10, seed=7)
    b = poisson_jobs(300, rate_per_hour=10, seed=7)
    c = poisson_jobs(300, rate_per_hour=10, seed=8)
    assert a.jobs == b.jobs
    assert a.jobs != c.jobs
    assert [j.model for j in a.jobs] != [j.model for j in c.jobs]
    assert [j.job_id for j in a.jobs[:3]] == ["s0", "s1", "s2"]
    assert a.fmt == "poisson" and a.source.startswith("poisson(")


def test_poisson_rate_and_mix() -> None:
    rate = 12.0
    tr = poisson_jobs(2000, rate_per_hour=rate, seed=3, profiles=PROFILES)
    submits = np.array([j.submit_time for j in tr.jobs])
    assert np.all(np.diff(submits) >= 0) and submits[0] > 0
    mean_gap = float(np.mean(np.diff(np.concatenate([[0.0], submits]))))
    assert abs(mean_gap - 3600 / rate) < 0.1 * 3600 / rate
    gpus = Counter(j.requested_gpus for j in tr.jobs)
    assert set(gpus) == {1, 2, 4, 8}
    assert gpus[1] > gpus[2] > gpus[4] > gpus[8]
    assert abs(gpus[1] / 2000 - 0.5) < 0.05
    assert set(Counter(j.model for j in tr.jobs)) == set(PROFILES.models)
    assert all(j.deadline is None for j in tr.jobs)
    for j in tr.jobs:
        duration = j.iterations / PROFILES.throughput(j.model, j.batch_size, j.requested_gpus)
        assert 600 * (1 - 1e-9) <= duration <= 8 * 3600 * (1 + 1e-9)
        assert duration == pytest.approx(float(dict(j.meta)["duration"]), rel=1e-9)
        assert j.batch_size in PROFILES.batch_sizes(j.model)


def test_poisson_options() -> None:
    tr = poisson_jobs(200, rate_per_hour=30, seed=1, deadline_factor=2.0, max_gpus=2, models=["bert", "vgg16"], elastic=False)
    assert {j.requested_gpus for j in tr.jobs} <= {1, 2}
    assert {j.model for j in tr.jobs} == {"bert", "vgg16"}
    assert not any(j.elastic for j in tr.jobs)
    for j in tr.jobs:
        duration = float(dict(j.meta)["duration"])
        assert j.deadline == pytest.approx(j.submit_time + 2.0 * duration)
    assert tr.summary()["with_deadline"] == 200
    assert "200 jobs" in tr.describe()


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(n=0, rate_per_hour=1.0), "n"),
        (dict(n=5, rate_per_hour=0.0), "rate_per_hour"),
        (dict(n=5, rate_per_hour=math.inf), "rate_per_hour"),
        (dict(n=5, rate_per_hour=1.0, max_gpus=0), "max_gpus"),
        (dict(n=5, rate_per_hour=1.0, deadline_factor=-1.0), "deadline_factor"),
        (dict(n=5, rate_per_hour=1.0, models=["alexnet"]), "models"),
        (dict(n=5, rate_per_hour=1.0, models=[]), "models"),
    ],
)
def test_poisson_bad_arguments(kwargs: dict, field: str) -> None:
    n = kwargs.pop("n")
    with pytest.raises(InputError) as ei:
        poisson_jobs(n, **kwargs)
    assert ei.value.field == field


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 60),
    rate=st.floats(0.1, 500),
    seed=st.integers(0, 2**32 - 1),
    max_gpus=st.integers(1, 16),
)
def test_poisson_properties(n: int, rate: float, seed: int, max_gpus: int) -> None:
    tr = poisson_jobs(n, rate_per_hour=rate, seed=seed, max_gpus=max_gpus, deadline_factor=1.5, profiles=PROFILES)
    assert len(tr.jobs) == n
    submits = [j.submit_time for j in tr.jobs]
    assert submits == sorted(submits)
    for j in tr.jobs:
        assert j.requested_gpus in (1, 2, 4, 8) and j.requested_gpus <= max_gpus
        assert PROFILES.throughput(j.model, j.batch_size, j.requested_gpus) > 0
        assert j.deadline is not None and j.deadline > j.submit_time
