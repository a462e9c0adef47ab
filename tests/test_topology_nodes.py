"""A cluster is a list of nodes of any size and GPU type: the short syntax,
the per-node CSV, the artifact's files, and the tree's lookups."""

from __future__ import annotations

import pytest

from tidal.core.errors import InputError
from tidal.core.job import JobSpec
from tidal.core.topology import Cluster, Node, parse_cluster
from tidal.scheduler.registry import get_policy
from tidal.sim.engine import simulate

SIA = "6xT4:4,2xA100:8,3xRTX2080Ti:8"


def test_the_sia_cluster_from_its_short_syntax() -> None:
    c = parse_cluster(SIA)
    assert (c.num_nodes, c.num_gpus, c.num_switches) == (11, 64, 3)
    assert c.gpu_types == ("T4", "A100", "RTX2080Ti") and c.name == SIA and not c.is_uniform
    assert [len(c.gpus_of_node(n)) for n in range(11)] == [4] * 6 + [8] * 5
    assert c.node_of(23) == 5 and c.node_of(24) == 6 and c.gpu_type_of(24) == "A100"
    assert c.switch_of(63) == 2 and c.max_gpus_per_node == 8 and c.min_nodes(12) == 2
    with pytest.raises(ValueError, match="nodes of \\[4, 8\\] GPUs"):
        c.gpus_per_node  # noqa: B018 - no single count to give


def test_homogeneous_names_keep_their_tree() -> None:
    c = parse_cluster("n256g8s8")
    assert c.is_uniform and (c.num_switches, c.nodes_per_switch, c.gpus_per_node) == (8, 32, 8)
    assert c == Cluster.uniform(8, 32, 8, name="n256g8s8")
    assert all(c.node_of(g) == g // 8 and c.switch_of(g) == g // 256 for g in range(0, 2048, 7))
    assert parse_cluster("4x8").name == "n4g8" and parse_cluster("4x8").is_uniform


def test_a_csv_of_node_rows(tmp_path) -> None:
    f = tmp_path / "mixed.csv"
    f.write_text("count,gpus,gpu_type,switch,labels\n2,4,T4,0,zone=a\n1,8,A100,1,zone=b;rack=r1\n1,2,,1,\n")
    c = parse_cluster(f)
    assert [n.gpus for n in c.nodes] == [4, 4, 8, 2] and c.num_gpus == 18 and c.name == "mixed"
    assert c.nodes[2].labels == (("zone", "b"), ("rack", "r1")) and c.nodes[3].gpu_type == ""


@pytest.mark.parametrize(("text", "phrase"), [
    ("count,gpus\n2,0\n", "field 'gpus': must be >= 1"),
    ("gpus,color\n4,red\n", "unknown column 'color'"),
    ("gpus,switch\n4,1\n4,0\n", "list nodes switch by switch"),
    ("gpus,labels\n4,zone\n", "a label is key=value"),
    ("gpus,gpu_type\n4,8x\n", "not a GPU type name"),
    ("gpus\n", "no data row"),
])
def test_bad_node_rows_say_which_line_and_field(tmp_path, text: str, phrase: str) -> None:
    f = tmp_path / "bad.csv"
    f.write_text(text)
    with pytest.raises(InputError, match=phrase):
        parse_cluster(f)


@pytest.mark.parametrize(("spec", "phrase"), [
    ("6xT4:0", "needs at least one node and one GPU"),
    ("6xT4:4,banana", "not a node group like '6xT4:4'"),
    ("", "empty"),
])
def test_bad_short_specs_are_refused(spec: str, phrase: str) -> None:
    with pytest.raises(InputError, match=phrase):
        parse_cluster(spec)


def test_nodes_must_come_switch_by_switch() -> None:
    with pytest.raises(InputError, match="switch by switch"):
        Cluster((Node(4, switch=1), Node(4, switch=0)))


@pytest.mark.parametrize("policy", ["fifo", "tiresias", "elasticflow", "e-fifo", "tidal", "gandiva", "elastic-tiresias",
                                    "reshaping", "edf", "themis"])
def test_the_simulator_uses_every_gpu_of_nodes_of_4_and_2(policy: str) -> None:
    """A rigid 4-GPU job and a rigid 2-GPU job arrive together on nodes of 4
    and 2 GPUs: both run at once (all 6 GPUs), none waits."""
    cluster = Cluster((Node(4), Node(2)))
    model = "resnet50"
    jobs = [JobSpec("four", 0.0, model, 64, 2000, requested_gpus=4),
            JobSpec("two", 0.0, model, 64, 2000, requested_gpus=2)]
    res = simulate(jobs, cluster, get_policy(policy), slot=60.0)
    assert max(used for _, used in res.timeline) == 6
    assert all(j.start_time == 0.0 for j in res.jobs), [(j.spec.job_id, j.start_time) for j in res.jobs]


@pytest.mark.parametrize(("nvml", "want"), [
    ("NVIDIA A100-SXM4-40GB", "A100"), ("NVIDIA A100 80GB PCIe", "A100"), ("Tesla T4", "T4"),
    ("NVIDIA GeForce RTX 2080 Ti", "RTX2080Ti"), ("NVIDIA H100 80GB HBM3", "H100"),
    ("Tesla V100-SXM2-16GB", "V100"), ("Quadro RTX 6000", "RTX6000"),
])
def test_an_agent_names_its_gpu_type_from_nvml(nvml: str, want: str) -> None:
    from tidal.agent.agent import gpu_type_name

    assert gpu_type_name(nvml) == want


def test_a_job_runs_at_its_gpu_types_profile_and_at_the_slowest_type_when_mixed(tmp_path) -> None:
    """Profiles per GPU type (``<dir>/<type>/<model>.csv``): a job on T4 nodes
    runs at the T4 profile, one over A100 and T4 GPUs at the T4's pace,
    one on untyped nodes at the default profile."""
    from tidal.core.overhead import OverheadModel
    from tidal.core.profile import load_profiles

    (tmp_path / "lin.csv").write_text("global_batch_size,1,2,4,8\n32,1,2,4,8\n")
    (tmp_path / "T4").mkdir()
    (tmp_path / "T4" / "lin.csv").write_text("global_batch_size,1,2,4,8\n32,0.25,0.5,1,2\n")
    prof = load_profiles(tmp_path)
    assert set(prof.by_type) == {"T4"} and prof.typed("T4", "lin").throughput("lin", 32, 2) == 0.5
    assert prof.typed("A100", "lin") is prof and prof.typed("T4", "other") is prof

    def end(cluster: Cluster, gpus: int) -> float:
        job = JobSpec("j", 0.0, "lin", 32, 100, requested_gpus=gpus)
        res = simulate([job], cluster, get_policy("fifo"), profiles=prof, overheads=OverheadModel(mode="stop-free",
                       warmup_s=0.0, launch_s=0.0), slot=0.0)
        return res.jobs[0].end_time

    assert end(Cluster((Node(2),)), 2) == pytest.approx(50.0, rel=0.05)  # default: 2 it/s
    assert end(Cluster((Node(2, "T4"),)), 2) == pytest.approx(200.0, rel=0.05)  # T4: 0.5 it/s
    # on two 1-GPU nodes (no fewer nodes could hold it: no spread penalty), at the T4 pace
    assert end(Cluster((Node(1, "A100"), Node(1, "T4"))), 2) == pytest.approx(200.0, rel=0.05)


def test_fewest_nodes_are_counted_among_the_placements_own_types():
    """8 GPUs on 4-GPU T4 nodes need 2 nodes even where an A100 node holds 8:
    a T4 placement on 2 nodes is not "spread" (no cross-node penalty)."""
    c = parse_cluster("6xT4:4,2xA100:8,3xRTX2080Ti:8")
    assert c.min_nodes(8) == 1
    assert c.min_nodes(8, {"T4"}) == 2 and c.min_nodes(12, {"T4"}) == 3 and c.min_nodes(40, {"T4"}) == 6
    assert c.min_nodes(8, {"A100"}) == 1 and c.min_nodes(12, {"T4", "A100"}) == 2
    assert c.min_nodes(8, {"V100"}) == 1  # a type the cluster lacks: every node counts


def test_a_trace_column_gives_gpu_type_constraints(tmp_path):
    """Any trace format may add ``gpu_types`` / ``exclude_gpu_types`` (';'-separated);
    a simulated constrained job then runs only on its types; a bad name is refused by line."""
    from tidal.sim.traces import load_trace, shipped_traces

    rows = shipped_traces()["195job"].read_text().splitlines()[:7]
    extra = ["gpu_types,exclude_gpu_types", "A100,", ",A100", "T4;A100,", ",", "A100,T4", ","]
    path = tmp_path / "typed.csv"
    path.write_text("\n".join(f"{r},{e}" for r, e in zip(rows, extra)) + "\n")
    jobs = load_trace(path).jobs
    assert [(j.gpu_types, j.exclude_gpu_types) for j in jobs] == [
        (("A100",), ()), (None, ("A100",)), (("A100", "T4"), ()), (None, ()), (("A100",), ("T4",)), (None, ())]
    # the simulator refuses (raises) any placement on a type a job does not allow
    result = simulate(jobs, parse_cluster("2xT4:4,1xA100:8"), get_policy("fifo"), slot=60.0)
    assert all(j.state.value == "completed" for j in result.jobs)
    path.write_text(rows[0] + ",gpu_types\n" + rows[1] + ",A 100\n")
    with pytest.raises(InputError, match="line 2.*gpu_types.*not a list of GPU type names"):
        load_trace(path)
