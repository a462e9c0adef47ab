"""Fault injection (issue 5): the harness itself, and ``kill -9`` of a random
worker at a random (seeded) step of a real job. The survivors drop the step,
re-form without it and redo it (EDL §4.2 forced exit as a scale-in): the job
finishes, every sample of every epoch is used exactly once, no step is lost
and the parameters equal the fixed-size run's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from runtime_helpers import check_exactly_once, finish, launch, read_steps
from test_runtime_elastic import TOL, max_rel_diff, reference_run
from tidal.runtime.faults import Fault, FaultInjector, parse_faults, random_kill

N, BATCH, EPOCHS, WORKERS = 120, 12, 2, 3
STEPS = EPOCHS * (-(-N // BATCH))


def test_parse_and_match() -> None:
    fs = parse_faults("kill:w1@7; stop:#0@5=1.5;slow:*@0=50")
    assert fs == (Fault("kill", "w1", 7), Fault("stop", "#0", 5, 1.5), Fault("slow", "*", 0, 50.0))
    assert [f.to_spec() for f in fs] == ["kill:w1@7", "stop:#0@5=1.5", "slow:*@0=50"]
    assert fs[0].matches("w1", 3) and not fs[0].matches("w2", 1)
    assert fs[1].matches("w9", 0) and not fs[1].matches("w0", 1)
    assert parse_faults("") == () and parse_faults(None) == ()
    for bad in ("kill:w1", "boom:w1@3", "kill:w1@x"):
        with pytest.raises(ValueError):
            parse_faults(bad)


def test_injector_fires_once_at_its_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "faults.jsonl"
    monkeypatch.setenv("TIDAL_FAULT_LOG", str(log))
    killed: list[int] = []
    inj = FaultInjector(parse_faults("kill:w1@3;slow:w1@2=40"), kill=lambda: killed.append(1))
    for step in range(6):
        inj.before_step("w0", 0, step)
    assert not killed and inj.slow_pct == 0
    for step in range(6):
        inj.before_step("w1", 1, step)
    assert killed == [1] and inj.slow_pct == 40.0
    late = FaultInjector(parse_faults("kill:w1@3"), kill=lambda: killed.append(2))
    late.before_step("w1", 1, 5)  # joined after step 3: a kill does not fire late
    assert killed == [1]
    assert [json.loads(l)["fault"] for l in log.read_text().splitlines()] == ["slow:w1@2=40", "kill:w1@3"]


def test_random_kill_is_seeded() -> None:
    assert random_kill(5, 3, 20) == random_kill(5, 3, 20)
    fs = {random_kill(s, 3, 20) for s in range(50)}
    assert {f.target for f in fs} == {"w0", "w1", "w2"}
    assert all(1 <= f.step < 20 for f in fs) and len({f.step for f in fs}) > 5


def run_kill(tmp_path: Path, seed: int) -> None:
    fault = random_kill(seed, WORKERS, STEPS)
    out, home = tmp_path / "out", tmp_path / "home"
    out.mkdir()
    flog = tmp_path / "faults.jsonl"
    proc = launch(f"kill{seed}", WORKERS, out, home, "--n", str(N), "--batch", str(BATCH), "--epochs", str(EPOCHS),
                  "--seed", "0", timeout=100, extra_env={"TIDAL_FAULTS": fault.to_spec(), "TIDAL_FAULT_LOG": str(flog)})
    text = finish(proc, 100)
    assert proc.returncode == 0, text
    assert f"worker {fault.target} failed with exit code -9" in text and "recover 3->2" in text, (fault, text)
    fired = [json.loads(l) for l in flog.read_text().splitlines()]
    assert [(f["worker"], f["step"]) for f in fired] == [(fault.target, fault.step)]
    steps = read_steps(out)
    # each sample once per epoch, and every global step 0..STEPS-1 was applied: 0 steps lost
    assert check_exactly_once(steps, N, BATCH, EPOCHS) == STEPS
    victim = [r["step"] for r in steps[fault.target]]
    assert victim == list(range(fault.step)), (fault, victim)  # it applied steps < k, then died
    survivors = sorted(w for w in steps if w != fault.target)
    finals = sorted(p.name for p in out.glob("final-*.pt"))
    assert finals == [f"final-{w}.pt" for w in survivors]
    ref = reference_run(n=N, batch=BATCH, epochs=EPOCHS)
    for w in survivors:
        assert max_rel_diff(torch.load(out / f"final-{w}.pt"), ref) <= TOL
        assert {r["world"] for r in steps[w] if r["step"] >= fault.step} == {2}


@pytest.mark.timeout(110)
@pytest.mark.parametrize("seed", [pytest.param(s, marks=pytest.mark.slow) for s in (0, 1, 2)])
def test_kill9_random_worker_random_step(tmp_path: Path, seed: int) -> None:
    run_kill(tmp_path, seed)


@pytest.mark.slow
@pytest.mark.timeout(110)
@pytest.mark.parametrize("seed", range(100, 120))
def test_kill9_random_worker_random_step_many(tmp_path: Path, seed: int) -> None:
    run_kill(tmp_path, seed)
