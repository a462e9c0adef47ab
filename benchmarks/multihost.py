"""Several hosts, measured on Linux network namespaces standing in for hosts
(``tests/multihost/netns.py``: a bridge, veth pairs, ``tc tbf`` on every
host's link; loopback inside a host is not limited). Needs root
(CAP_NET_ADMIN); fails loudly without it.

The job is ``benchmarks/runtime_rescale.py --role elastic`` (MLP, 1.3 M
float32 parameters, SGD with momentum: about 10.6 MB of state; global batch
256) under ``tidal run`` on host A (``--bind 0.0.0.0``), with workers of host
B added by ``tidal run --join``.

1. **State transfer, topology-aware vs single source.** A runs 2 workers, B
   joins 2, then B joins 2 more (4 -> 6). With ``--replication topology`` the
   newcomers on B get the state from B's workers (no link crossed, Elan §IV);
   with ``single`` from rank 0 on A, over the limited link. Reported: the
   stall of A's rank-0 worker at 4 -> 6: from the end of its last step
   before the switch to the end of its first step after it, less a normal
   step at 6 (the sender's transfer falls in the switch, a receiver's
   lateness in that first all-reduce).
2. **Migration in one switch vs scale-out then scale-in.** A runs 2
   workers, B joins 2; B's two move to host C, either with ``tidal run
   --join --replace-host B`` on C (one switch; C's workers warm up while the
   job trains) or by C joining 2 (4 -> 6) and then ``tidal scale
   --remove-host B`` (6 -> 4). Reported: A's rank-0 stall(s), summed.
3. **Packed vs spread.** The step time of a 2-worker job with both workers on
   A, against one on A and one on B (the gradient all-reduce crosses the
   link): the placement policy's premise, measured.

Prints a table, or ONE JSON line with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "multihost"))
from netns import Hosts, netns_available  # noqa: E402

RR = ROOT / "benchmarks" / "runtime_rescale.py"
PORT = 29631


def _env(home: Path, host: str) -> dict[str, str]:
    e = dict(os.environ)
    for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TIDAL_BIND_ADDR", "TIDAL_ADVERTISE_ADDR"):
        e.pop(k, None)
    e.update(OMP_NUM_THREADS="1", TIDAL_HOME=str(home), PYTHONUNBUFFERED="1", TIDAL_HOST=host)
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), e.get("PYTHONPATH", "")])
    return e


def _run(h: Any, out: Path, name: str, launcher: list[str], host: str | None = None) -> subprocess.Popen[bytes]:
    """``tidal run`` in host ``h``; its workers register as host ``host``
    (default ``name``)."""
    cmd = [sys.executable, "-m", "tidal.runtime.launch", "run", *launcher, str(RR), "--role", "elastic",
           "--out", str(out), "--steps", "1500"]
    log = open(out / f"launcher-{name}.log", "ab")
    return h.popen(cmd, env=_env(out / f"home-{name}", host or name), stdout=log, stderr=subprocess.STDOUT)


def _log(out: Path, wid: str) -> list[dict[str, Any]]:
    p = out / f"elastic-{wid}.jsonl"
    if not p.exists():
        return []
    return [json.loads(x) for x in p.read_text().splitlines() if x.endswith("}")]


def _wait(what: str, cond: Callable[[], bool], out: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {f.name}\n{f.read_text()[-2000:]}" for f in sorted(out.glob("launcher-*.log")))
            raise RuntimeError(f"timed out waiting for {what}\n{logs}")
        time.sleep(0.2)


def _at(out: Path, world: int, n: int) -> bool:
    return sum(r["world"] == world for r in _log(out, "w0")) >= n


def _stop(hs: Hosts) -> None:
    for i in range(len(hs)):
        hs.kill_host(i)


def replication_pause(hs: Hosts, base: Path, mode: str) -> float:
    """A's rank-0 pause at 4 -> 6 workers, the last two joining on B."""
    out = base / f"repl-{mode}"
    out.mkdir()
    join = ["--join", f"{hs[0].addr}:{PORT}", "--workers", "2"]
    _run(hs[0], out, "A", ["--workers", "2", "--job", "mh", "--bind", "0.0.0.0", "--port", str(PORT),
                           "--replication", mode])
    _wait("2 workers on A", lambda: _at(out, 2, 10), out)
    _run(hs[1], out, "B1", join, host="B")
    _wait("4 workers", lambda: _at(out, 4, 10), out)
    _run(hs[1], out, "B2", join, host="B")
    _wait("6 workers", lambda: _steps_after(out, 2) >= 12, out)
    recs = _log(out, "w0")
    _stop(hs)
    return _stall(recs, 4, 6)


def _stall(recs: list[dict[str, Any]], before: int, after: int) -> float:
    """Training time lost at the switch ``before`` -> ``after`` on one
    worker: from the end of its last step before the switch to the end of
    its first step after it, less a normal step at the new size (a state
    transfer may fall in the switch or in that first step's all-reduce)."""
    for i, (a, b) in enumerate(zip(recs, recs[1:])):
        if a["world"] == before and b["world"] == after and a["gen"] != b["gen"]:
            nxt = recs[i + 2 : i + 12]
            step = statistics.median(y["t_end"] - x["t_end"] for x, y in zip(nxt, nxt[1:]))
            return float(b["t_end"] - a["t_end"] - step)
    raise RuntimeError(f"no {before} -> {after} switch in the log")


def _gen_pauses(recs: list[dict[str, Any]]) -> list[float]:
    """Pauses at every generation change in one worker's step log."""
    return [float(b["t_start"] - a["t_end"]) for a, b in zip(recs, recs[1:]) if a["gen"] != b["gen"]]


def _steps_after(out: Path, changes: int) -> int:
    """Steps w0 logged after its ``changes``-th generation change (-1: not yet)."""
    recs = _log(out, "w0")
    idx = [i for i, (a, b) in enumerate(zip(recs, recs[1:]), start=1) if a["gen"] != b["gen"]]
    return len(recs) - idx[changes - 1] if len(idx) >= changes else -1


def migration_pause(hs: Hosts, base: Path, one_switch: bool) -> float:
    """A's rank-0 pause(s) while B's two workers move to C."""
    out = base / ("migrate" if one_switch else "out-in")
    out.mkdir()
    join = ["--join", f"{hs[0].addr}:{PORT}", "--workers", "2"]
    _run(hs[0], out, "A", ["--workers", "2", "--job", "mh", "--bind", "0.0.0.0", "--port", str(PORT)])
    _wait("2 workers on A", lambda: _at(out, 2, 10), out)
    _run(hs[1], out, "B", join)
    _wait("4 workers", lambda: _at(out, 4, 10), out)
    before = len(_gen_pauses(_log(out, "w0")))
    if one_switch:
        _run(hs[2], out, "C", [*join, "--replace-host", "B"])
        _wait("the migration", lambda: _steps_after(out, before + 1) >= 12, out)
    else:
        _run(hs[2], out, "C", join)
        _wait("6 workers", lambda: _steps_after(out, before + 1) >= 12, out)
        cmd = [sys.executable, "-m", "tidal.runtime.launch", "scale", f"http://{hs[0].addr}:{PORT}",
               "--remove-host", "B"]
        r = hs[2].run(cmd, timeout=120, env=_env(out / "home-S", "C"), capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"tidal scale --remove-host failed: {r.stdout}{r.stderr}")
        _wait("back to 4", lambda: _steps_after(out, before + 2) >= 12, out)
    recs = _log(out, "w0")
    _stop(hs)
    if one_switch:
        return _stall(recs, 4, 4)
    return _stall(recs, 4, 6) + _stall(recs, 6, 4)


def step_time(hs: Hosts, base: Path, spread: bool, steps: int) -> float:
    """Median step time of a 2-worker job, packed on A or spread over A and B."""
    out = base / ("spread" if spread else "packed")
    out.mkdir()
    _run(hs[0], out, "A", ["--workers", "1" if spread else "2", "--job", "mh", "--bind", "0.0.0.0",
                           "--port", str(PORT)])
    if spread:
        _wait("1 worker on A", lambda: _at(out, 1, 3), out)
        _run(hs[1], out, "B", ["--join", f"{hs[0].addr}:{PORT}", "--workers", "1"])
    _wait(f"{steps} steps at 2 workers", lambda: _at(out, 2, steps + 5), out, timeout=300)
    ends = [r["t_end"] for r in _log(out, "w0") if r["world"] == 2][5 : steps + 5]
    _stop(hs)
    return statistics.median(b - a for a, b in zip(ends, ends[1:]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mbit", type=float, default=200.0, help="bandwidth of every host's link (tbf)")
    ap.add_argument("--steps", type=int, default=40, help="steps timed for packed vs spread")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    ok, why = netns_available()
    if not ok:
        print(f"multihost: FAILED: network namespaces are not available here: {why}", file=sys.stderr)
        sys.exit(2)
    base = Path(tempfile.mkdtemp(prefix="tidal-multihost-"))
    res: dict[str, Any] = {}
    t0 = time.time()
    with Hosts(3) as hs:
        for i in range(3):
            hs.limit(i, a.mbit)
        for mode in ("topology", "single"):
            res[f"scaleout_4_6_stall_{mode}_s"] = replication_pause(hs, base, mode)
        res["migration_one_switch_stall_s"] = migration_pause(hs, base, True)
        res["migration_out_then_in_stall_s"] = migration_pause(hs, base, False)
        res["step_time_packed_s"] = step_time(hs, base, False, a.steps)
        res["step_time_spread_s"] = step_time(hs, base, True, a.steps)
    res["single_over_topology"] = res["scaleout_4_6_stall_single_s"] / res["scaleout_4_6_stall_topology_s"]
    res["spread_over_packed"] = res["step_time_spread_s"] / res["step_time_packed_s"]
    res["out_then_in_over_one_switch"] = (res["migration_out_then_in_stall_s"]
                                          / res["migration_one_switch_stall_s"])
    res["config"] = {"link_mbit": a.mbit, "state_mb": 10.6, "model": "MLP 256-1024-1024-10 fp32", "hosts": 3,
                     "wall_s": round(time.time() - t0, 1), "load_avg_1m": round(os.getloadavg()[0], 2)}
    if a.json:
        print(json.dumps(res))
    else:
        for k, v in res.items():
            print(f"{k:34s} {v}")


if __name__ == "__main__":
    main()
