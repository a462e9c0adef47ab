"""Replicas that drift apart fail the job, naming what differs.

Unit: two gloo processes compare their state with ``checksum.compare``;
equal replicas pass, and one parameter, one optimizer hyper-parameter or one
extra that differs raises :class:`Diverged` on both ranks naming it.

End to end (slow): the drift of the issue that asked for this. A script
anneals a plain ``lr`` it never registers and updates its parameters by hand
with it (the PyTorch word-language-model example's way). A newcomer starts
with the initial ``lr`` (20) while the others use 5: their replicas went
apart without an error. Now the job fails within seconds of the switch,
every rank naming the parameters and what to register.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from runtime_helpers import env, grow_while_reading
from test_runtime_master_failure import free_port
from tidal.runtime import checksum
from tidal.runtime.client import MasterClient
from tidal.runtime.state import ElasticState

PAIR = """
import os, sys, datetime, torch, torch.distributed as dist
from tidal.runtime import checksum
from tidal.runtime.rank0 import Diverged
from tidal.runtime.state import ElasticState
rank, port = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=30))
for what in ("none", "param", "lr", "extra"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    extras = {"best": 1.0}
    if rank == 1 and what == "param":
        with torch.no_grad():
            model[1].bias.add_(1e-7)
    if rank == 1 and what == "lr":
        opt.param_groups[0]["lr"] = 0.4
    if rank == 1 and what == "extra":
        extras["best"] = None
    try:
        checksum.compare(ElasticState(model, opt, extras=extras), 7, 3, torch.device("cpu"))
        print(what, "equal")
    except Diverged as e:
        print(what, "DIVERGED", e)
# gloo's threads can outlive the interpreter and abort it at exit (SIGABRT, "terminate called without an
# active exception"), even after destroy_process_group; the runtime's workers end with os._exit for this
# reason (worker._quiet_exit), and so does this pair, once its lines are out.
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)
"""


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    """Each rank's line per case, from one pair of gloo processes."""
    tmp = tmp_path_factory.mktemp("pair")
    script = tmp / "pair.py"
    script.write_text(PAIR)
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(port)], env=env(tmp / "home"),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = [p.communicate(timeout=60)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    return [dict(ln.split(" ", 1) for ln in o.strip().splitlines() if ln.split(" ", 1)[0] in CASES) for o in outs]


CASES = {"none": None, "param": "parameter 1.bias", "lr": "optimizer 0: param_groups[0]['lr']",
         "extra": "extras['best']"}


def test_digests_see_every_bit_and_only_the_replicated_state() -> None:
    a = torch.randn(100)
    b = a.clone()
    b[57] = torch.nextafter(b[57], torch.tensor(float("inf")))
    assert checksum.tensor_digest(a) == checksum.tensor_digest(a.clone()) != checksum.tensor_digest(b)
    assert checksum.tensor_digest(torch.zeros(4)) != checksum.tensor_digest(torch.zeros(2, 2))
    model = torch.nn.BatchNorm1d(3)  # its running statistics are each rank's own (not compared)
    names = [n for n, _ in checksum.items(ElasticState(model, torch.optim.SGD(model.parameters(), lr=0.1)))]
    assert "parameter weight" in names and not any("running" in n for n in names), names
    assert "optimizer 0: param_groups[0]['lr']" in names


@pytest.mark.slow  # two processes (about 6 s); the unit tests above and below run by default
@pytest.mark.parametrize("what", list(CASES))
def test_every_rank_raises_naming_what_differs(pair: list[dict[str, str]], what: str) -> None:
    named = CASES[what]
    lines = [p[what] for p in pair]
    if named is None:
        assert lines == ["equal", "equal"], lines
        return
    for line in lines:
        assert line.startswith("DIVERGED the replicas differ at step 7 (generation 3): "), line
        assert named in line and "job.keep" in line, line
        assert line.count("parameter ") <= (1 if what == "param" else 0), line  # only what differs


SCRIPT = """
import time, torch
import tidal.runtime
from torch.utils.data import DataLoader, TensorDataset

job = tidal.runtime.init()
torch.manual_seed(0)
model = job.wrap(torch.nn.Linear(8, 1))
loader = job.loader(DataLoader(TensorDataset(torch.randn(512, 8), torch.randn(512, 1)), batch_size=32))
lr = 20.0  # annealed by the script, never registered: a newcomer starts at 20
for epoch in job.epochs(80):
    for x, y in loader:
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-lr * 1e-3)
        job.step()
        time.sleep(0.02)
    if epoch == 0:
        lr = 5.0
"""


KEPT = (SCRIPT.replace("lr = 20.0  #", "keep = job.keep(lr=20.0)  #").replace("alpha=-lr", "alpha=-keep.lr")
        .replace("        lr = 5.0", "        keep.lr = 5.0"))


def _run_anneal(tmp_path: Path, script_text: str) -> tuple[subprocess.Popen[str], list[tuple[float, str]], float]:
    """The anneal script under tidal run, 2 workers, a third added in its third epoch."""
    script = tmp_path / "anneal.py"
    script.write_text(script_text)

    def third_epoch(c: MasterClient) -> None:
        while c.status().epoch < 2:
            time.sleep(0.2)

    return grow_while_reading(script, "anneal", tmp_path / "home", third_epoch)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_newcomer_updating_with_another_lr_fails_the_job_within_seconds_naming_the_parameters(
        tmp_path: Path) -> None:
    proc, lines, joined = _run_anneal(tmp_path, SCRIPT)
    text = "".join(ln for _, ln in lines)
    hits = [(t, ln) for t, ln in lines if "Diverged: the replicas differ" in ln]
    assert hits, text[-4000:]
    t, line = hits[0]
    assert t - joined < 30, (t - joined, line)
    assert "parameter weight" in line and "parameter bias" in line and "job.keep" in line, line
    assert proc.returncode == 1, text[-3000:]  # the job failed
    assert "finished" not in text.split("summary:")[-1].splitlines()[0], text[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_the_same_script_keeping_its_lr_with_job_keep_finishes(tmp_path: Path) -> None:
    assert "keep.lr = 5.0" in KEPT and "alpha=-keep.lr" in KEPT
    proc, lines, _ = _run_anneal(tmp_path, KEPT)
    text = "".join(ln for _, ln in lines)
    assert proc.returncode == 0 and "differ" not in text, text[-3000:]
    assert "finished" in text.split("summary:")[-1].splitlines()[0] and "final workers 3" in text, text[-2000:]


def test_kept_values_set_before_wrap_travel_as_extras_and_read_by_name() -> None:
    import tidal.runtime

    job = tidal.runtime.init()  # no master: one local worker
    keep = job.keep(lr=20.0, best=None)
    model = job.wrap(torch.nn.Linear(2, 1))
    keep.lr /= 4
    keep["best"] = 0.5
    assert job.train.elastic is not None and job.train.elastic.extras == {"lr": 5.0, "best": 0.5}
    assert model is job.train.elastic.model and job.keep().lr == 5.0
    with pytest.raises(AttributeError, match="job.keep has no value 'epoch'"):
        _ = keep.epoch
    job.close()


def test_module_variables_kept_by_name_travel_are_restored_and_compared() -> None:
    import tidal.runtime

    job = tidal.runtime.init()  # no master: one local worker
    script: dict[str, object] = {"__file__": "lm.py"}
    script.update(job=job)
    exec("lr = 20.0\nbest_val_loss = None\njob.keep('lr', 'best_val_loss')", script)
    job.wrap(torch.nn.Linear(2, 1))
    st = job.train.elastic
    assert st is not None and st.state_dict()["globals"] == {"lr": 20.0, "best_val_loss": None}
    snap = st.step_snapshot()
    exec("lr /= 4.0\nbest_val_loss = 1.5", script)
    assert ("kept variable lr", 5.0) in checksum.items(st)
    st.restore_step_snapshot(snap)  # a dropped step: the script's own variables go back
    assert (script["lr"], script["best_val_loss"]) == (20.0, None)
    st.load_state_dict({**st.state_dict(), "globals": {"lr": 1.25, "best_val_loss": 0.5}})  # a newcomer's
    assert (script["lr"], script["best_val_loss"]) == (1.25, 0.5)
    with pytest.raises(NameError, match="job.keep: epoch is not a module-level variable of lm.py"):
        exec("job.keep('epoch')", script)
    job.close()
