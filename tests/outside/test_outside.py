"""A corpus of training scripts written the way people write them
(tests/outside/NAME/plain.py), each with its standard DDP port (ddp.py) and
its Tidal port made as docs/runtime.md says (tidal_port.py).

Default: porting to Tidal changes no more lines than porting to DDP, for
every script, and docs/runtime.md ("Outside scripts") shows the counts.
Slow: every Tidal port runs under ``tidal run`` while it is scaled 2->3->2,
and again while it is scaled to 3 and one worker is killed with SIGKILL in
the middle of an epoch: the run ends with exit code 0 and no traceback, the
final workers hold equal parameters, and every sample of every epoch was
used exactly once. The plain scripts and the DDP ports (torchrun, 2 gloo
processes) run too.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from outside_helpers import BY_NAME, HERE, SCRIPTS, ElasticRun, applied_steps, port_counts, stop
from runtime_helpers import REPO, check_exactly_once, env

NAMES = [s.name for s in SCRIPTS]


def _table() -> list[tuple[str, tuple[int, int], tuple[int, int]]]:
    return [(s.name, *port_counts(s.name)) for s in SCRIPTS]


def test_every_script_has_its_three_files() -> None:
    for name in NAMES:
        for f in ("plain.py", "ddp.py", "tidal_port.py"):
            text = (HERE / name / f).read_text()
            assert text.startswith('"""'), f"{name}/{f}: no module docstring"
        assert (HERE / name / "tidal_port.py").read_text().count("# audit") == 1, name


def test_tidal_ports_change_no_more_lines_than_ddp_ports() -> None:
    rows = _table()
    print("\nscript        DDP (+/-)   Tidal (+/-)")
    for name, ddp, tidal in rows:
        print(f"{name:<13} +{ddp[0]}/-{ddp[1]:<8} +{tidal[0]}/-{tidal[1]}")
    for name, ddp, tidal in rows:
        assert sum(tidal) <= sum(ddp), f"{name}: Tidal +{tidal[0]}/-{tidal[1]} vs DDP +{ddp[0]}/-{ddp[1]}"
        assert tidal[0] >= 5, name  # the count is real: the port does change lines


def test_the_docs_table_shows_the_counts() -> None:
    text = (REPO / "docs" / "runtime.md").read_text()
    section = text[text.index("### Outside scripts"):]
    for name, ddp, tidal in _table():
        row = re.search(rf"^\| `{name}` \|[^\n]*\| \+(\d+)/−(\d+) \| \+(\d+)/−(\d+) \|$", section, re.M)
        assert row, f"docs/runtime.md, Outside scripts: no row for {name}"
        assert tuple(map(int, row.groups())) == (*ddp, *tidal), f"{name}: docs {row.groups()} vs {ddp}, {tidal}"


def test_applied_steps_keeps_the_redone_attempt_and_merges_micro_batches() -> None:
    """The audit itself: a step dropped when a peer died (gen 1, w1 killed
    before it recorded its share) counts only as redone by the survivors in
    gen 2; two micro-batches of one step are one record."""
    def rec(step: int, gen: int, world: int, rank: int, idx: list[int]) -> dict:
        return {"step": step, "epoch": 0, "idx": idx, "world": world, "rank": rank, "gen": gen}

    recs = {"w0": [rec(0, 1, 3, 0, [0]), rec(0, 1, 3, 0, [1]), rec(1, 1, 3, 0, [6]), rec(1, 2, 2, 0, [6, 7]),
                   rec(1, 2, 2, 0, [8])],
            "w1": [rec(0, 1, 3, 1, [2]), rec(0, 1, 3, 1, [3])],
            "w2": [rec(0, 1, 3, 2, [4, 5]), rec(1, 1, 3, 2, [10, 11]), rec(1, 2, 2, 1, [9, 10, 11])]}
    steps = applied_steps(recs)
    assert [r["idx"] for r in steps["w0"]] == [[0, 1], [6, 7, 8]] and steps["w1"][0]["idx"] == [2, 3]
    assert check_exactly_once(steps, 12, 6, 1) == 2
    del recs["w2"][-1]  # the redo's second share is missing: not exactly once
    with pytest.raises(AssertionError):
        check_exactly_once(applied_steps(recs), 12, 6, 1)


ELASTIC = NAMES


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", ELASTIC)
def test_tidal_port_scaled_2_3_2(tmp_path: Path, name: str) -> None:
    with ElasticRun(BY_NAME[name], tmp_path, f"o-{name}") as run:
        run.started()
        run.scale(3)
        run.scale(2)
        rc, out = run.finish()
    print(f"{name}: scaled 2->3->2 in a run of {time.monotonic() - run.t0:.1f} s")
    run.check(rc, out, 2, ("scale_out 2->3", "scale_in 3->2"))


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", ELASTIC)
def test_tidal_port_survives_a_kill_9_mid_epoch(tmp_path: Path, name: str) -> None:
    """Scaled to 3, then an original worker is killed with SIGKILL in the
    middle of an epoch (rank 1; for rank0_eval rank 0, whose role and best
    loss pass to a survivor): the two survivors, one of them the newcomer,
    re-form and finish."""
    s = BY_NAME[name]
    with ElasticRun(s, tmp_path, f"k-{name}") as run:
        run.started()
        run.scale(3)
        victim = run.kill_mid_epoch(s.victim, 3)
        run.wait_for("recovery", lambda recs: any(r["world"] == 2 and r["gen"] > victim["gen"]
                                                  for rows in recs.values() for r in rows))
        rc, out = run.finish()
    print(f"{name}: killed {victim['worker']} (rank {victim['rank']}) at step {victim['step']} (batch "
          f"{victim['bi']} of epoch {victim['epoch']}) in a run of {time.monotonic() - run.t0:.1f} s")
    run.check(rc, out, 2, ("scale_out 2->3", "recover 3->2"))


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("name", NAMES)
def test_plain_script_and_ddp_port_run(tmp_path: Path, name: str) -> None:
    """The plain script alone and its DDP port under torchrun with 2 gloo
    processes, one epoch each, side by side: both train and save a model."""
    e = env(tmp_path / "home")
    d = HERE / name
    runs = {"plain": [sys.executable, str(d / "plain.py")],
            "ddp": [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                    str(d / "ddp.py")]}
    procs = {k: subprocess.Popen([*cmd, "--epochs", "1", "--out", str(tmp_path / k)], env=e, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for k, cmd in runs.items()}
    outs = {}
    try:
        for k, p in procs.items():
            outs[k] = p.communicate(timeout=75)[0]
    finally:
        for p in procs.values():
            stop(p)
    for k, p in procs.items():
        assert p.returncode == 0 and "epoch 0" in outs[k] and "Traceback" not in outs[k], f"{k}:\n{outs[k][-3000:]}"
        assert list((tmp_path / k).glob("*.pt")), f"{k} saved no model: {outs[k][-2000:]}"
