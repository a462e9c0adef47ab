"""What an installed tidal carries: the traces the README uses, cluster names
that mean what the ElasticFlow artifact's files mean, and a `--json` run that
keeps each finished policy's line."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tidal.core.topology import parse_cluster
from tidal.sim.traces import load_trace, shipped_traces

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def test_shipped_traces_load_by_name_with_their_licence():
    assert {"cluster10", "195job"} <= set(shipped_traces())
    tr = load_trace("cluster10")
    assert len(tr.jobs) == 260 and tr.fmt == "itp"
    assert len(load_trace("195job.csv").jobs) == 195
    assert "MIT License" in (shipped_traces()["cluster10"].parent / "LICENSE").read_text()


@pytest.mark.skipif(not (SHARED / "clusters").is_dir(), reason="needs ../shared/data/clusters (the artifact's files)")
def test_cluster_names_build_the_artifacts_shapes():
    differ = []
    for f in sorted((SHARED / "clusters").glob("n*g*.csv")):
        row = next(csv.DictReader(f.open()))
        want = (int(row["num_switch"]), int(row["num_node_p_switch"]), int(row["num_gpu_p_node"]))
        c = parse_cluster(f.stem)
        if (c.num_switches, c.nodes_per_switch, c.gpus_per_node) != want:
            differ.append(f.stem)
    assert differ == ["n1g2"]  # the artifact's n1g2.csv is 2 nodes x 1 GPU (docs/simulator.md)
    assert parse_cluster("n128g8").num_switches == 1 and parse_cluster("n256g8").num_switches == 8


@pytest.mark.skipif(not (SHARED / "traces" / "itp" / "cluster02.csv").exists(), reason="needs ../shared/data")
def test_a_stopped_json_run_keeps_the_finished_policies_lines(tmp_path):
    trace = SHARED / "traces" / "itp" / "cluster02.csv"
    p = subprocess.Popen([sys.executable, "-m", "tidal", "simulate", "--trace", str(trace), "--cluster", "n16g8",
                          "--policy", "fifo,e-backfill", "--json", "--out", str(tmp_path)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                         env=dict(os.environ, COLUMNS="120"))
    try:
        first = p.stdout.readline()
        still_running = p.poll() is None
        p.terminate()  # killed: SIGTERM (SIGINT may be ignored in a background shell's children)
        rest, errs = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert still_running, "e-backfill on 5,778 jobs ended before fifo's line was read"
    assert json.loads(first)["policy"] == "fifo" and json.loads(first)["finished"] == 5778
    assert "fifo: done" in errs  # plain progress lines on a pipe
