"""Periodic checkpoints and consistent recovery (issue 5, EDL §4.2): when every
worker dies the job is started again and resumes from the newest checkpoint
with the same data positions and the parameters of an uninterrupted run."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from runtime_helpers import check_exactly_once, finish, launch, read_steps
from test_runtime_elastic import TOL, max_rel_diff, reference_run
from tidal.runtime.checkpoint import list_checkpoints, load_latest, save_checkpoint

N, BATCH, EPOCHS, WORKERS, EVERY, KILL = 120, 12, 2, 2, 5, 12
STEPS = EPOCHS * (-(-N // BATCH))


def test_atomic_save_keep_and_fallback(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    for step in (5, 10, 15):
        save_checkpoint(d, step, {"step": step, "t": torch.arange(3)}, keep=2)
    (d / ".ckpt-junk.tmp").write_bytes(b"partial")  # a writer killed before its rename
    assert [s for s, _ in list_checkpoints(d)] == [10, 15]
    assert load_latest(d)["step"] == 15
    (d / "ckpt-000000020.pt").write_bytes(b"torn")  # damaged newest file: the previous one is used
    assert load_latest(d)["step"] == 15
    assert load_latest(tmp_path / "none") is None


def _run(tmp_path: Path, tag: str, ck: Path, faults: str | None) -> tuple[int, str, Path]:
    out, home = tmp_path / f"out-{tag}", tmp_path / f"home-{tag}"
    out.mkdir()
    env = {"TIDAL_CHECKPOINT_DIR": str(ck), "TIDAL_CHECKPOINT_EVERY": str(EVERY)}
    if faults:
        env["TIDAL_FAULTS"] = faults
    proc = launch(f"ckpt-{tag}", WORKERS, out, home, "--n", str(N), "--batch", str(BATCH), "--epochs", str(EPOCHS),
                  "--seed", "0", timeout=60, extra_env=env)
    text = finish(proc, 60)
    return proc.returncode, text, out


@pytest.mark.slow
@pytest.mark.timeout(130)
def test_all_workers_killed_then_resume_from_checkpoint(tmp_path: Path) -> None:
    ck = tmp_path / "ckpt"
    # every worker SIGKILLs itself at the start of step 12; the last checkpoint is step 10's
    rc, text, out1 = _run(tmp_path, "a", ck, ";".join(f"kill:w{i}@{KILL}" for i in range(WORKERS)))
    assert rc != 0, text
    last = (KILL // EVERY) * EVERY
    assert [s for s, _ in list_checkpoints(ck)] == [last - EVERY, last]
    steps1 = read_steps(out1)
    assert all([r["step"] for r in recs] == list(range(KILL)) for recs in steps1.values()), steps1.keys()
    assert not list(out1.glob("final-*.pt"))
    # the job is started again: it continues from step 10's checkpoint, steps 10 and 11 are redone
    rc, text, out2 = _run(tmp_path, "b", ck, None)
    assert rc == 0, text
    steps2 = read_steps(out2)
    assert {min(r["step"] for r in recs) for recs in steps2.values()} == {last}
    summ = [json.loads(p.read_text()) for p in sorted(out2.glob("summary-*.json"))]
    assert any(s["resumed_from"] == last for s in summ)
    # exactly once relative to the checkpoint: run 1 up to it + run 2 from it
    merged = {w: [r for r in steps1.get(w, []) if r["step"] < last] + steps2.get(w, []) for w in set(steps1) | set(steps2)}
    assert check_exactly_once(merged, N, BATCH, EPOCHS) == STEPS
    ref = reference_run(n=N, batch=BATCH, epochs=EPOCHS)
    finals = sorted(out2.glob("final-*.pt"))
    assert len(finals) == WORKERS
    for p in finals:
        assert max_rel_diff(torch.load(p), ref) <= TOL
    assert max(list_checkpoints(ck))[0] > last  # the resumed run kept checkpointing


def test_local_mode_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a master (plain ``python script.py``) the same options apply."""
    from tidal.runtime import init
    from elastic_train import Pairs, make_data, make_model, make_opt

    x, y = make_data(60, 0)
    ck = tmp_path / "ck"

    def train(stop_at: int | None) -> tuple[torch.nn.Module, list[list[int]]]:
        job = init(master_url=None, worker_id="solo", checkpoint_dir=ck, checkpoint_every=3)
        model = make_model(0)
        opt, sched = make_opt(model)
        job.register_state(model, opt, sched)
        seen = []
        it = job.data(Pairs(x, y), batch_size=8, epochs=2, seed=0)
        for xb, yb in it:
            if stop_at is not None and job.step_count == stop_at:
                break  # "dies" here
            seen.append(it.last_indices)
            torch.nn.functional.mse_loss(model(xb), yb).backward()
            job.step()
            sched.step()
        return model, seen

    _, first = train(stop_at=7)   # checkpoint of step 6 is the newest
    model, second = train(stop_at=None)
    assert len(second) == 16 - 6 and first[:6] + second == train_ref(x, y)
    ref = reference_run(n=60, batch=8, epochs=2)
    assert max_rel_diff(model.state_dict(), ref) <= TOL


def train_ref(x: torch.Tensor, y: torch.Tensor) -> list[list[int]]:
    from tidal.runtime.data import epoch_permutation
    out = []
    for e in range(2):
        p = epoch_permutation(60, 0, e).tolist()
        out += [p[i:i + 8] for i in range(0, 60, 8)]
    return out


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_suspend_then_resume_loses_and_repeats_nothing(tmp_path: Path) -> None:
    """A scheduler preempts the job (``suspend``): at an agreed step rank 0
    writes a checkpoint of exactly the state the next step starts from and
    every worker leaves; started again (here with 3 workers instead of 2) the
    job continues at that step. No step is redone or skipped, each sample is
    used once per epoch over both runs, and the parameters equal the
    fixed-size run's."""
    from runtime_helpers import master_url
    from tidal.runtime.client import MasterClient

    ck = tmp_path / "ckpt"
    env = {"TIDAL_CHECKPOINT_DIR": str(ck), "TIDAL_CHECKPOINT_EVERY": "1000"}  # only the suspension writes one
    out1, home = tmp_path / "out-1", tmp_path / "home"
    out1.mkdir()
    n, batch, epochs = 120, 12, 6
    proc = launch("susp", WORKERS, out1, home, "--n", str(n), "--batch", str(batch), "--epochs", str(epochs),
                  "--sleep", "0.05", timeout=100, extra_env=env)
    try:
        c = MasterClient(master_url("susp", home, proc), patience_s=10)
        c.wait_for(WORKERS, timeout_s=60)
        while c.status().step < 5:
            time.sleep(0.02)
        assert c.suspend().accepted
        text = finish(proc, 60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and "suspended at step" in text, text
    (stop, _), = list_checkpoints(ck)
    steps1 = read_steps(out1)
    assert all([r["step"] for r in recs] == list(range(stop)) for recs in steps1.values())
    assert not list(out1.glob("final-*.pt"))
    assert all(json.loads(p.read_text())["suspended"] for p in out1.glob("summary-*.json"))
    out2 = tmp_path / "out-2"
    out2.mkdir()
    proc = launch("susp", WORKERS + 1, out2, home, "--n", str(n), "--batch", str(batch), "--epochs", str(epochs),
                  timeout=100, extra_env=env)
    text = finish(proc, 100)
    assert proc.returncode == 0, text
    steps2 = read_steps(out2)
    assert {min(r["step"] for r in recs) for recs in steps2.values()} == {stop}
    merged = {w: steps1.get(w, []) + steps2.get(w, []) for w in set(steps1) | set(steps2)}
    total = epochs * (-(-n // batch))
    assert check_exactly_once(merged, n, batch, epochs) == total
    ref = reference_run(n=n, batch=batch, epochs=epochs)
    finals = sorted(out2.glob("final-*.pt"))
    assert len(finals) == WORKERS + 1
    for p in finals:
        assert max_rel_diff(torch.load(p), ref) <= TOL


MOUNTINFO = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
40 22 0:50 / /mnt/nfs rw,relatime shared:20 - nfs4 srv:/export rw,vers=4.2
41 22 0:51 / /mnt/my\\040disk rw,relatime shared:21 - xfs /dev/sdb1 rw
42 22 0:52 / /mnt/s3 rw,relatime shared:22 - fuse.s3fs s3fs rw
"""


def test_a_checkpoint_directory_on_a_node_local_file_system_is_named(monkeypatch) -> None:
    from tidal.runtime.checkpoint import mount_fstype, node_local

    monkeypatch.delenv("TIDAL_CHECKPOINT_SHARED", raising=False)
    assert mount_fstype("/mnt/nfs/ckpt/job", MOUNTINFO) == "nfs4"
    assert mount_fstype("/mnt/nfsx/ckpt", MOUNTINFO) == "ext4"  # a prefix of the name is not the mount
    assert mount_fstype("/mnt/my disk/c", MOUNTINFO) == "xfs"
    assert node_local("/mnt/nfs/ckpt", MOUNTINFO) == ""
    assert node_local("/mnt/s3/ckpt", MOUNTINFO) == ""
    assert node_local("/data/ckpt", MOUNTINFO) == "/data/ckpt (ext4)"
    assert node_local(None, MOUNTINFO) == ""
    monkeypatch.setenv("TIDAL_CHECKPOINT_SHARED", "1")
    assert node_local("/data/ckpt", MOUNTINFO) == ""


def test_a_job_spanning_hosts_refuses_node_local_checkpoints() -> None:
    from tidal.runtime.master import JobMaster

    m = JobMaster("j", 2)
    assert m.register("w0", host="a", checkpoints=True, checkpoint_local="/ckpt (ext4)").get("status") != "error"
    assert m.register("w1", host="a", checkpoints=True, checkpoint_local="/ckpt (ext4)").get("status") != "error"
    ans = m.register("w2", host="b", checkpoints=True, checkpoint_local="")
    assert ans["status"] == "error", ans
    assert "w0 on a: /ckpt (ext4)" in ans["message"] and "TIDAL_CHECKPOINT_DIR" in ans["message"]
    assert "w2" not in m.snapshot()["workers"]  # refused: not registered
    shared = JobMaster("k", 2)
    assert shared.register("w0", host="a", checkpoints=True).get("status") != "error"
    assert shared.register("w1", host="b", checkpoints=True).get("status") != "error"  # shared storage: fine
    assert shared.register("w2", host="c", checkpoint_local="/tmp/c (ext4)")["status"] == "error"


def test_a_resumed_job_refuses_an_older_checkpoint_than_its_suspension(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """$TIDAL_RESUME_STEP (set by the control plane on a resume): the newest
    checkpoint must be of that step, else the job would redo steps."""
    from tidal.runtime import init
    from tidal.runtime.checkpoint import ResumeMismatch
    from elastic_train import Pairs, make_data, make_model, make_opt

    x, y = make_data(60, 0)
    ck = tmp_path / "ck"

    def train(stop_at: int | None) -> int:
        job = init(master_url=None, worker_id="solo", checkpoint_dir=ck, checkpoint_every=3)
        model = make_model(0)
        opt, sched = make_opt(model)
        job.register_state(model, opt, sched)
        it = job.data(Pairs(x, y), batch_size=8, epochs=1, seed=0)
        for xb, yb in it:
            if job.step_count == stop_at:
                break
            torch.nn.functional.mse_loss(model(xb), yb).backward()
            job.step()
        return job.checkpointer.resumed_from

    assert train(stop_at=7) is None  # checkpoints of steps 3 and 6
    monkeypatch.setenv("TIDAL_RESUME_STEP", "9")
    with pytest.raises(ResumeMismatch, match="suspended at step 9 but the newest checkpoint is of step 6"):
        train(stop_at=None)
    monkeypatch.setenv("TIDAL_RESUME_STEP", "6")
    assert train(stop_at=None) == 6
    monkeypatch.setenv("TIDAL_RESUME_STEP", "2")
    with pytest.raises(ResumeMismatch, match="no checkpoint"):
        init(master_url=None, worker_id="solo", checkpoint_dir=tmp_path / "empty").checkpointer.resume(
            None, expect_step=2)  # type: ignore[arg-type]
