"""Topology, job model, throughput profiles and placement."""

from __future__ import annotations

import pytest

from tidal.core.errors import InputError
from tidal.core.job import JobSpec, JobState, check_transition
from tidal.core.profile import load_profiles
from tidal.core.topology import parse_cluster
from tidal.scheduler.api import JobView, Snapshot
from tidal.scheduler.placement import place_consolidated


def test_cluster_spec_and_file_agree(shared):
    data = shared
    for name in ("n32g8", "n256g8", "n16g4"):
        a = parse_cluster(name)
        b = parse_cluster(data / "clusters" / f"{name}.csv")
        assert (a.num_switches, a.nodes_per_switch, a.gpus_per_node) == (
            b.num_switches, b.nodes_per_switch, b.gpus_per_node)
    c = parse_cluster("n256g8")
    assert c.num_gpus == 2048 and c.num_switches == 8
    assert c.node_of(17) == 2 and c.switch_of(8 * 32) == 1


def test_cluster_bad_input_names_field(tmp_path):
    with pytest.raises(InputError, match="no such file"):
        parse_cluster("bogus")
    f = tmp_path / "c.csv"
    f.write_text("num_switch,num_node_p_switch,num_gpu_p_node\n1,x,8\n")
    with pytest.raises(InputError) as e:
        parse_cluster(f)
    assert "c.csv" in str(e.value) and "line 2" in str(e.value) and "num_node_p_switch" in str(e.value)


def test_job_states_and_counts():
    check_transition(JobState.PENDING, JobState.RUNNING)
    with pytest.raises(ValueError):
        check_transition(JobState.COMPLETED, JobState.RUNNING)
    rigid = JobSpec("r", 0, "bert", 64, 10, requested_gpus=4)
    assert rigid.counts(64) == [4] and rigid.can_run_at(4) and not rigid.can_run_at(2)
    el = JobSpec("e", 0, "bert", 64, 10, requested_gpus=4, elastic=True, min_gpus=2, max_gpus=6)
    assert el.counts(5) == [2, 3, 4, 5]
    opt = JobSpec("o", 0, "bert", 64, 10, elastic=True, allowed_gpus=(4, 1, 2))
    assert opt.counts(8) == [1, 2, 4] and not opt.can_run_at(3)
    with pytest.raises(InputError, match="iterations"):
        JobSpec("x", 0, "bert", 64, 0)
    with pytest.raises(InputError, match="deadline"):
        JobSpec("x", 10, "bert", 64, 5, deadline=5)


def test_profile_rules():
    p = load_profiles()
    # measured cell
    assert p.throughput("resnet50", 64, 4) == pytest.approx(18.298925886403232)
    # interpolation between 4 and 8
    v4, v8 = p.throughput("resnet50", 64, 4), p.throughput("resnet50", 64, 8)
    assert p.throughput("resnet50", 64, 6) == pytest.approx((v4 + v8) / 2)
    # never extrapolate upward: flat past 64
    assert p.throughput("resnet50", 64, 128) == p.throughput("resnet50", 64, 64)
    # empty cell (deepspeech2 bs32 at 64) -> flat from 32
    assert p.throughput("deepspeech2", 32, 64) == p.throughput("deepspeech2", 32, 32)
    # zero = does not run
    assert p.throughput("resnet50_cifar10", 64, 16) == 0
    assert p.max_useful("resnet50_cifar10", 64, 64) <= 8
    # curves that fall after a peak: bert bs64 peaks at 8 GPUs
    assert p.max_useful("bert", 64, 64) == 8
    # unmeasured batch: nearest measured one, scaled per iteration
    assert p.throughput("gpt2", 512, 4) == pytest.approx(p.throughput("gpt2", 256, 4) / 2)
    # cross-node penalty
    assert p.throughput("vgg16", 64, 8, spread=True) == pytest.approx(0.9 * p.throughput("vgg16", 64, 8))
    with pytest.raises(InputError, match="unknown model"):
        p.throughput("nope", 64, 1)


def test_profile_bad_file(tmp_path):
    (tmp_path / "m.csv").write_text("global_batch_size,1,2\n64,1.0,abc\n")
    with pytest.raises(InputError) as e:
        load_profiles(tmp_path)
    msg = str(e.value)
    assert "m.csv" in msg and "line 2" in msg and "'2'" in msg


def _snap(cluster, jobs):
    return Snapshot(now=0, cluster=cluster, jobs=tuple(jobs), profiles=load_profiles())


def _view(jid, gpus=(), n=1):
    spec = JobSpec(jid, 0, "resnet50", 64, 100, requested_gpus=n, elastic=True)
    return JobView(spec, JobState.RUNNING if gpus else JobState.PENDING, gpus=tuple(gpus), admitted=True)


def test_placement_best_fit_and_consolidation():
    c = parse_cluster("n4g8s2")
    # node 0 has 2 free GPUs (6 used), node 1 has 8 free: a 2-GPU job goes to node 0
    busy = _view("busy", gpus=range(6), n=6)
    new = _view("new", n=2)
    pl = place_consolidated(_snap(c, [busy, new]), {"busy": 6, "new": 2})
    assert pl["busy"] == tuple(range(6))
    assert pl["new"] == (6, 7)
    # a 16-GPU job takes two whole nodes under one switch
    pl = place_consolidated(_snap(c, [busy, _view("big", n=16)]), {"busy": 6, "big": 16})
    nodes = {g // 8 for g in pl["big"]}
    assert len(nodes) == 2 and len({n // 2 for n in nodes}) == 1


def test_placement_grow_prefers_own_node_and_shrink_keeps_consolidated():
    c = parse_cluster("n2g8")
    a = _view("a", gpus=(0, 1), n=2)
    b = _view("b", gpus=(8, 9, 10, 11, 2), n=5)
    pl = place_consolidated(_snap(c, [a, b]), {"a": 4, "b": 4})
    assert set(pl["a"]) >= {0, 1} and {g // 8 for g in pl["a"]} == {0}
    assert pl["b"] == (8, 9, 10, 11)  # gives back its lone GPU on node 0
    assert not set(pl["a"]) & set(pl["b"])
