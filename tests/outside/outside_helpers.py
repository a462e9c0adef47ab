"""Helpers of tests/outside (not collected by pytest): the corpus of outside
scripts, their porting counts, and one elastic ``tidal run`` of a Tidal port
driven and audited by a test."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from outside_record import VAR
from runtime_helpers import check_exactly_once, env
from test_examples_port import changed_lines

HERE = Path(__file__).resolve().parent
AUDIT = "# audit"  # the one line of a port that records for the tests; not porting effort, not counted
Records = dict[str, list[dict[str, Any]]]


@dataclass(frozen=True)
class Script:
    """One outside script and how the elastic tests run it."""

    name: str
    n: int  # training samples
    loader_batch: int  # the DataLoader's batch_size (the global batch under Tidal)
    micro: int  # loader batches per optimizer step (gradient accumulation)
    epochs: int  # epochs of an elastic test run
    hold_s: float  # seconds every batch sleeps while the test holds the job
    victim: int = 1  # the rank the kill test kills (at 3 workers; ranks 0 and 1 are the original workers)

    @property
    def batch(self) -> int:
        """Samples per optimizer step."""
        return self.loader_batch * self.micro

    @property
    def batches_per_epoch(self) -> int:
        return -(-self.n // self.loader_batch)

    @property
    def steps(self) -> int:
        return self.epochs * -(-self.n // self.batch)


# what each script exercises: docs/runtime.md, "Outside scripts"; hold_s: about 5 s per epoch while held,
# so a held job outlasts a slow scale-out on a busy machine
SCRIPTS = (
    Script("cnn_steplr", n=1536, loader_batch=64, micro=1, epochs=10, hold_s=0.2),
    Script("gan", n=2048, loader_batch=64, micro=1, epochs=10, hold_s=0.15),
    Script("vae", n=2048, loader_batch=128, micro=1, epochs=10, hold_s=0.3),
    Script("amp_accum", n=2048, loader_batch=32, micro=4, epochs=8, hold_s=0.08),
    Script("rank0_eval", n=2048, loader_batch=64, micro=1, epochs=10, hold_s=0.15, victim=0),
    # 12 streams of 416 tokens: 21 bptt windows an epoch, each window a global batch of 12 samples
    Script("lstm_lm", n=252, loader_batch=12, micro=1, epochs=10, hold_s=0.25),
)
BY_NAME = {s.name: s for s in SCRIPTS}


def port_counts(name: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """((added, removed) of the DDP port, (added, removed) of the Tidal port),
    both against plain.py; the Tidal port's audit line is left out."""
    d = HERE / name
    with tempfile.TemporaryDirectory() as tmp:
        port = Path(tmp) / "tidal_port.py"
        port.write_text("".join(line for line in (d / "tidal_port.py").read_text().splitlines(keepends=True)
                                if AUDIT not in line))
        return changed_lines(d / "plain.py", d / "ddp.py"), changed_lines(d / "plain.py", port)


def read_records(rec: Path) -> Records:
    """Every worker's batch records; a line cut by a kill -9 is skipped."""
    out: Records = {}
    for p in sorted(rec.glob("steps-*.jsonl")):
        rows = out.setdefault(p.stem[len("steps-"):], [])
        for line in p.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                pass
    return out


def applied_steps(records: Records) -> Records:
    """The records of the steps that counted, one per worker and step, in the
    format of ``runtime_helpers.check_exactly_once``: of each step only the
    attempt in its latest generation (a step dropped because a peer died is
    redone in the survivors' generation), its micro-batches merged."""
    last_gen: dict[int, int] = {}
    for rows in records.values():
        for r in rows:
            last_gen[r["step"]] = max(last_gen.get(r["step"], -1), r["gen"])
    out: Records = {}
    for worker, rows in records.items():
        merged: dict[int, dict[str, Any]] = {}
        for r in rows:
            if r["gen"] != last_gen[r["step"]]:
                continue
            m = merged.setdefault(r["step"], dict(r, idx=[]))
            assert (m["epoch"], m["world"], m["rank"]) == (r["epoch"], r["world"], r["rank"]), (m, r)
            m["idx"] = m["idx"] + r["idx"]
        out[worker] = sorted(merged.values(), key=lambda r: r["step"])
    return out


def stop(proc: subprocess.Popen[str], grace: float = 10) -> None:
    """SIGINT (``tidal run`` and torchrun stop their workers), SIGKILL after ``grace`` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class ElasticRun:
    """``tidal run --workers 2 --max-workers 4`` of one script's Tidal port,
    held slow (every batch sleeps) until the test releases it, with its
    records in ``rec`` and its output in ``log``."""

    def __init__(self, script: Script, tmp: Path, job: str) -> None:
        self.script, self.job = script, job
        self.rec, self.log = tmp / "rec", tmp / "run.log"
        self.rec.mkdir(parents=True)
        self.env = env(tmp / "home")
        self.env[VAR] = str(self.rec)
        self.env["PYTHONPATH"] = os.pathsep.join([str(HERE), self.env["PYTHONPATH"]])
        self.hold(script.hold_s)
        cmd = [sys.executable, "-m", "tidal", "run", "--workers", "2", "--max-workers", "4", "--job", job,
               "--timeout", "150", str(HERE / script.name / "tidal_port.py"),
               "--epochs", str(script.epochs), "--out", str(tmp / "out")]
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(cmd, env=self.env, stdout=f, stderr=subprocess.STDOUT, text=True)
        self.t0 = time.monotonic()

    def __enter__(self) -> "ElasticRun":
        return self

    def __exit__(self, *exc: object) -> None:
        """Stop an overrunning job: the launcher (which stops its workers),
        then any worker of this run still alive, by its recorded pid."""
        self.release()
        stop(self.proc)
        for pid in {r["pid"] for rows in read_records(self.rec).values() for r in rows}:
            try:
                mine = f"{VAR}={self.rec}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue  # exited
            if mine:
                os.kill(pid, signal.SIGKILL)

    def hold(self, seconds: float) -> None:
        tmp = self.rec / "hold.tmp"
        tmp.write_text(str(seconds))
        tmp.replace(self.rec / "hold")

    def release(self) -> None:
        (self.rec / "hold").unlink(missing_ok=True)

    def output(self) -> str:
        return self.log.read_text()

    def wait_for(self, what: str, pred: Callable[[Records], Any], timeout: float = 60) -> Any:
        """Poll the records until ``pred`` returns something true; returns it."""
        deadline = time.monotonic() + timeout
        while True:
            got = pred(read_records(self.rec))
            if got:
                return got
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{self.script.name}: no {what} (job exit code {self.proc.poll()}):\n"
                                     + self.output()[-4000:])
            time.sleep(0.1)

    def scale(self, workers: int) -> None:
        r = subprocess.run([sys.executable, "-m", "tidal", "scale", self.job, "--workers", str(workers),
                            "--timeout", "60"], env=self.env, capture_output=True, text=True, timeout=90)
        ok = r.returncode == 0 and f"at {workers} workers" in r.stdout and "Traceback" not in r.stdout + r.stderr
        assert ok, r.stdout + r.stderr + self.output()[-3000:]

    def kill_mid_epoch(self, rank: int, world: int) -> dict[str, Any]:
        """``kill -9`` the worker of rank ``rank`` once its last batch is in
        the middle of an epoch at ``world`` workers; returns that batch's
        record (with ``worker``)."""
        bpe = self.script.batches_per_epoch

        def mid(recs: Records) -> dict[str, Any] | None:
            for worker, rows in recs.items():
                r = rows[-1] if rows else {}
                if r.get("world") == world and r["rank"] == rank and bpe // 4 <= r["bi"] < 3 * bpe // 4:
                    return dict(r, worker=worker)
            return None

        r = self.wait_for(f"batch of rank {rank} mid-epoch at {world} workers", mid)
        os.kill(r["pid"], signal.SIGKILL)
        return r

    def started(self) -> None:
        self.wait_for("training", lambda recs: any(r["step"] >= 3 for rows in recs.values() for r in rows), 90)

    def finish(self, timeout: float = 60) -> tuple[int, str]:
        """Release the hold and wait for the launcher (killed by ``__exit__`` if it overruns)."""
        self.release()
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.script.name}: the job did not end within {timeout} s of its "
                                 f"release:\n{self.output()[-4000:]}") from None
        return rc, self.output()

    def check(self, rc: int, out: str, final_world: int, events: tuple[str, ...]) -> None:
        """Exit 0, no traceback, the rescales made, equal parameters on the
        final workers and every sample of every epoch used exactly once."""
        s = self.script
        assert rc == 0, out[-4000:]
        assert "Traceback" not in out, out[-6000:]
        assert f"final workers {final_world}," in out, out[-3000:]
        for e in events:
            assert e in out, f"{e!r} not in:\n{out[-3000:]}"
        finals = [json.loads(p.read_text()) for p in sorted(self.rec.glob("final-*.json"))]
        stay = [f for f in finals if not f["left"]]
        assert len(stay) == final_world, finals
        assert all(f["finished"] and f["world"] == final_world and f["steps"] == s.steps for f in stay), stay
        differ = [i for i in range(len(stay[0]["modules"])) if len({f["modules"][i] for f in stay}) > 1]
        assert not differ, f"{s.name}: the parameters of module(s) {differ} differ across the final workers: {stay}"
        assert len({f["params"] for f in stay}) == 1, stay
        assert check_exactly_once(applied_steps(read_records(self.rec)), s.n, s.batch, s.epochs) == s.steps
