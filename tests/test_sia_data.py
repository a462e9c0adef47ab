"""The Pollux/Sia measured data in the simulator: the fitted step-time model,
per-GPU-type profiles, and their workloads as traces (docs/simulator.md)."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest
from typer.testing import CliRunner

from tidal.cli.main import app
from tidal.core.steptime import StepRow, StepTimeParams, accumulation_steps, fit, relative_errors, step_time
from tidal.core.topology import parse_cluster
from tidal.sim.sia import SiaData, build_profiles, read_rows
from tidal.sim.traces import detect_format, load_trace

runner = CliRunner()
SIA_CLUSTER = "6xT4:4,2xA100:8,3xRTX2080Ti:8"


@pytest.fixture
def sia(shared) -> SiaData:
    root = shared / "sia" / "traces"
    if not root.is_dir():
        pytest.skip(f"Sia data not found at {root}")
    return SiaData(root)


def _rows(data: SiaData, app: str, dtype: str) -> list[StepRow]:
    return [r for kind in ("placements", "scalability")
            for r in read_rows(data.root / app / f"{kind}-{dtype}.csv")]


def test_fit_recovers_known_parameters_from_exact_data():
    true = StepTimeParams(0.02, 0.001, 0.01, 0.002, 0.05, 0.004, 2.0, max_local_bsz=512)
    rows = []
    for nodes, replicas in [(1, 1), (1, 2), (1, 4), (1, 8), (2, 4), (2, 8), (4, 16), (8, 32)]:
        for m in (16, 64, 256, 512):
            total = step_time(true, nodes, replicas, m)
            tc = 0.02 + 0.001 * m
            ts = 0.0 if replicas == 1 else total - tc  # any split: only its sum and the sync term matter
            sync = (0.01 if nodes == 1 else 0.05) + (0.002 if nodes == 1 else 0.004) * max(replicas - 2, 0)
            rows.append(StepRow(nodes, replicas, m, total, sync if replicas > 1 else 0.0))
            assert ts >= 0
    got = fit(rows)
    assert got.median_rel_error < 1e-3
    assert got.gamma == pytest.approx(2.0, rel=0.05)
    assert got.a_node == pytest.approx(0.05, rel=0.05) and got.b_compute == pytest.approx(0.001, rel=0.05)


def test_fit_quality_on_every_measured_app_and_type(sia):
    """Median relative error of the fitted step time over the measured rows
    (placements + scalability): 33% for the noisiest pair (imagenet on the
    cloud V100s, ``azure``), 10% at most on the T4s and RTX 2080 Tis, 6% for
    the median pair when this was written."""
    errors = {}
    for app_name in sia.apps:
        for dtype in sia.data_types(app_name):
            params = sia.params(app_name, dtype)
            errs = relative_errors(params, _rows(sia, app_name, dtype))
            assert float(np.median(errs)) == pytest.approx(params.median_rel_error)
            errors[app_name, dtype] = params.median_rel_error
    assert len(errors) == 38
    worst = max(errors, key=errors.get)
    assert errors[worst] < 0.40, (worst, errors[worst])
    assert float(np.median(list(errors.values()))) < 0.10
    assert all(e < 0.15 for (a, t), e in errors.items() if t in ("aws", "rtx")), errors


def test_a100_is_faster_than_t4_for_cifar10(sia):
    a100, t4 = sia.params("cifar10", "dgx-ext"), sia.params("cifar10", "aws")
    for n in (1, 2, 4, 8):
        local = 2048 / n
        assert step_time(a100, 1, n, local) < step_time(t4, -(-n // 4), n, local) / 2
    prof = build_profiles(sia, [("cifar10", 2048)], parse_cluster(SIA_CLUSTER))
    assert set(prof.by_type) == {"T4", "A100", "RTX2080Ti"}
    for n in (1, 4, 8, 16):
        assert prof.by_type["A100"].throughput("cifar10", 2048, n) > prof.by_type["T4"].throughput("cifar10", 2048, n)
        # the default (type-unaware) profile is the slowest type's
        slowest = min(prof.by_type[t].throughput("cifar10", 2048, n) for t in prof.by_type)
        assert prof.throughput("cifar10", 2048, n) == pytest.approx(slowest)
    # a mixed placement runs at its slowest type's pace
    assert prof.throughput_on("cifar10", 2048, 12, False, {"A100", "T4"}) == pytest.approx(
        prof.by_type["T4"].throughput("cifar10", 2048, 12))


def test_gradient_accumulation_above_the_largest_measured_local_batch(sia):
    p = sia.params("bert", "aws")
    assert p.max_local_bsz == 12
    assert accumulation_steps(p, 12) == 1 and accumulation_steps(p, 13) == 2 and accumulation_steps(p, 384) == 32
    one = step_time(p, 1, 1, 12)
    compute = p.a_compute + p.b_compute * 12
    assert step_time(p, 1, 1, 24) == pytest.approx(compute + one)  # two micro-steps, one sync
    assert step_time(p, 1, 1, 384) == pytest.approx(31 * compute + one)
    # per sample, accumulating costs at least as much as the largest batch that fits
    assert step_time(p, 1, 1, 13) / 13 > one / 12


def test_iterations_come_from_the_validation_files(sia):
    for app_name, batch in (("cifar10", 2048), ("bert", 384), ("imagenet", 200)):
        with (sia.root / app_name / f"validation-{batch}.csv").open() as fh:
            last = list(csv.DictReader(fh))[-1]
        assert sia.iterations(app_name, batch) == float(last["iteration"])
    # between measured batches: between their step counts; below: the same samples
    lo, hi = sia.iterations("cifar10", 1024), sia.iterations("cifar10", 2048)
    assert hi < sia.iterations("cifar10", 1500) < lo
    assert sia.iterations("cifar10", 64) == pytest.approx(2 * sia.iterations("cifar10", 128))


def test_workload_loads_as_it_is(shared, sia):
    path = shared / "sia" / "workloads" / "saturn" / "workload-1.csv"
    assert detect_format(path) == "pollux"
    tr = load_trace(path)
    assert len(tr) == 160 and tr.fmt == "pollux"
    first = tr.jobs[0]
    assert (first.job_id, first.submit_time, first.model, first.batch_size, first.requested_gpus) == (
        "cifar10-0", 401.0, "cifar10", 4096, 12)
    assert first.iterations == sia.iterations("cifar10", 4096) and first.elastic and first.min_gpus == 1
    assert first.max_gpus is None
    rigid = load_trace(path, elastic=False).jobs[0]
    assert not rigid.elastic and rigid.min_gpus is None


def _simulate(args: list[str]) -> list[dict]:
    res = runner.invoke(app, ["simulate", *args, "--json"])
    assert res.exit_code == 0, res.output
    return [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]


def test_saturn_workload_runs_on_the_sia_cluster_deterministically(shared, tmp_path):
    """The CLI run with no flag but the cluster finishes every job; the same
    inputs loaded and simulated again give the same average JCT."""
    from tidal.cli.simulate import _load_inputs, run_policies
    from tidal.sim.metrics import summarize

    trace = shared / "sia" / "workloads" / "saturn" / "workload-1.csv"
    (o,) = _simulate(["--trace", str(trace), "--cluster", SIA_CLUSTER, "--policy", "fifo", "--out", str(tmp_path)])
    assert o["jobs"] == 160 and o["finished"] == 160 and o["dropped"] == 0 and o["avg_jct"] > 0
    topo = parse_cluster(SIA_CLUSTER)
    prof, tr = _load_inputs(trace, "auto", topo, None, seed=0, limit=None, elastic=True)
    (again,) = run_policies(list(tr.jobs), topo, ["fifo"], profiles=prof, show_progress=False)
    assert summarize(again)["avg_jct"] == o["avg_jct"]


def test_cluster_csv_of_mixed_node_sizes_and_data_type_names(shared, sia, tmp_path):
    spec = tmp_path / "mixed.csv"
    spec.write_text("count,gpus,gpu_type\n2,4,aws\n1,8,dgx-ext\n1,8,RTX2080Ti\n")
    cluster = parse_cluster(spec)
    prof = build_profiles(sia, [("cifar10", 2048)], cluster)
    assert set(prof.by_type) == {"aws", "dgx-ext", "RTX2080Ti"}
    named = build_profiles(sia, [("cifar10", 2048)], parse_cluster("2xT4:4,1xA100:8"))
    for n in (1, 6, 8):  # the data's names give the same curves as the GPU names
        assert prof.by_type["aws"].throughput("cifar10", 2048, n) == named.by_type["T4"].throughput("cifar10", 2048, n)
    trace = str(shared / "sia" / "workloads" / "saturn" / "workload-1.csv")
    (o,) = _simulate(["--trace", trace, "--cluster", str(spec), "--policy", "tiresias", "--limit", "20",
                      "--out", str(tmp_path / "o")])
    assert o["finished"] == 20


def test_pollux_data_is_one_untyped_profile(shared):
    path = shared / "pollux" / "workloads" / "workload-1.csv"
    if not path.exists():
        pytest.skip("Pollux data absent")
    tr = load_trace(path)
    data = SiaData(shared / "pollux" / "traces")
    assert data.data_types("ncf") == [""]
    prof = build_profiles(data, {(j.model, j.batch_size) for j in tr.jobs}, parse_cluster(SIA_CLUSTER))
    assert not prof.by_type and "ncf" in prof.models
    assert prof.throughput_on("ncf", 256, 1, False, {"T4"}) == prof.throughput("ncf", 256, 1) > 0


def _error_lines(res) -> list[str]:
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output
    return [line for line in res.output.splitlines() if "error" in line]


def test_unknown_app_and_malformed_rows_are_one_clear_line(sia, tmp_path):
    header = "name,time,application,num_replicas,batch_size\n"
    cases = {
        "unknown.csv": ("a,0,cifar10,4,2048\nb,5,resnet9000,4,256\n", ["line 3", "application", "'resnet9000'"]),
        "badnum.csv": ("a,0,cifar10,four,2048\n", ["line 2", "num_replicas", "'four'"]),
        "short.csv": ("a,0,cifar10,4\n", ["line 2", "batch_size"]),
    }
    for name, (body, words) in cases.items():
        path = tmp_path / name
        path.write_text(header + body)
        res = runner.invoke(app, ["simulate", "--trace", str(path), "--cluster", SIA_CLUSTER,
                                  "--profiles", str(sia.root), "--out", str(tmp_path / "o")])
        (line,) = _error_lines(res)
        assert name in line and all(w in line for w in words), line
    # no measured data anywhere above the workload, and a --profiles that is not such data
    path = tmp_path / "w.csv"
    path.write_text(header + "a,0,cifar10,4,2048\n")
    (line,) = _error_lines(runner.invoke(app, ["simulate", "--trace", str(path), "--out", str(tmp_path / "o")]))
    assert "w.csv" in line and "traces/" in line
    (line,) = _error_lines(runner.invoke(app, ["simulate", "--trace", str(path), "--profiles", str(tmp_path),
                                               "--out", str(tmp_path / "o")]))
    assert "profiles" in line and "placements" in line


def test_profile_counts_are_dense_then_sparse():
    from tidal.sim.sia import profile_counts

    assert profile_counts(24) == list(range(1, 25))
    big = profile_counts(2048)
    assert big[:64] == list(range(1, 65)) and big[-1] == 2048 and len(big) < 120
    assert all(b > a and b <= math.ceil(a * 1.1) + 1 for a, b in zip(big[64:], big[65:]))


def test_progress_auto_is_goodput_on_one_gpu_type_and_steps_on_a_mixed_cluster(shared):
    """`tidal simulate`'s default for a Pollux/Sia workload: goodput jobs
    (statistical-efficiency progress, a model fitted for one GPU type) on a
    cluster of one type; fixed-batch steps at each type's speed on a mixed one."""
    from tidal.cli.simulate import _load_inputs
    from tidal.scheduler.goodput import is_goodput_job

    workload = shared / "sia" / "workloads" / "saturn" / "workload-1.csv"
    if not workload.is_file():
        pytest.skip(f"Sia workload not found at {workload}")

    def kinds(cluster: str, progress: str) -> set[bool]:
        _, tr = _load_inputs(workload, "auto", parse_cluster(cluster), None, seed=0, limit=20, elastic=True,
                             progress=progress)
        return {is_goodput_job(j) for j in tr.jobs}

    assert kinds("n16g4", "auto") == {True}
    assert kinds(SIA_CLUSTER, "auto") == {False}
    assert kinds(SIA_CLUSTER, "efficiency") == {True} and kinds("n16g4", "steps") == {False}
