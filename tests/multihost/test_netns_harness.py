"""The namespace test bed itself: reachability, isolation, gloo across hosts,
rate limits, link cuts, host kills and leak-free teardown."""

from __future__ import annotations

import json
import os
import selectors
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from netns import Hosts, list_links, list_namespaces, netns_available

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"
TCPTOOL = str(HERE / "tcptool.py")
PORT = 7070

HostsFactory = Callable[..., Hosts]


def start_server(hs: Hosts, i: int, port: int = PORT) -> subprocess.Popen[str]:
    """Start tcptool's server on host ``i`` and wait for its ``ready`` line."""
    proc = hs[i].popen([sys.executable, TCPTOOL, "serve", hs[i].addr, str(port)],
                       stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout=10):
            raise TimeoutError(f"server on {hs[i].name} not ready")
    assert proc.stdout.readline().strip() == "ready"
    return proc


def transfer(hs: Hosts, src: int, dst: int, nbytes: int, mode: str = "D", timeout: float = 10.0) -> dict[str, Any]:
    """From host ``src``, send ``nbytes`` to the server on host ``dst``; tcptool's JSON result."""
    cmd = [sys.executable, TCPTOOL, "send", hs[dst].addr, str(PORT), str(nbytes), mode, str(timeout)]
    res = hs[src].run(cmd, timeout=timeout + 10, capture_output=True, text=True)
    out = json.loads(res.stdout)
    assert (res.returncode == 0) == out["ok"], res.stderr
    return out


def test_tcp_between_hosts_and_not_from_root(hosts: HostsFactory) -> None:
    hs = hosts(2)
    assert [h.ifname for h in hs] == ["eth0", "eth0"]
    assert hs[0].addr != hs[1].addr and hs[0].addr.rsplit(".", 1)[0] == hs[1].addr.rsplit(".", 1)[0]
    start_server(hs, 0)
    echo = transfer(hs, 1, 0, 1000, mode="E")
    assert echo["ok"], echo
    # The root namespace got no interface, no address and no route through us.
    assert not [n for n in list_links() if n.startswith(hs.prefix)]
    root_addrs = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, check=True).stdout
    assert hs[0].addr.rsplit(".", 1)[0] + "." not in root_addrs
    route = subprocess.run(["ip", "route", "get", hs[0].addr], capture_output=True, text=True).stdout
    assert hs.prefix not in route
    # A connect from the root namespace fails. It is pinned to ``lo``: the root
    # namespace may have a default route, and nothing may be sent through it.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, b"lo")
        s.settimeout(1.0)
        t0 = time.monotonic()
        with pytest.raises(OSError):
            s.connect((hs[0].addr, PORT))
        assert time.monotonic() - t0 < 3.0


@pytest.mark.slow  # two torch processes; tidal run across hosts (slow step) does the same and more
def test_gloo_all_reduce_across_hosts(hosts: HostsFactory) -> None:
    hs = hosts(2)
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH", "")) if p)}
    script = str(HERE / "gloo_allreduce.py")
    procs = [hs[r].popen([sys.executable, script, str(r), "2", hs[0].addr, "29555"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    for r, proc in enumerate(procs):
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err[-2000:]
        res = json.loads(out.strip().splitlines()[-1])
        assert res == {"rank": r, "sum": [3.0, 30.0]}


def test_limit_slows_a_transfer(hosts: HostsFactory) -> None:
    hs = hosts(2)
    start_server(hs, 0)
    nbytes = 2 * 1024 * 1024
    free = transfer(hs, 1, 0, nbytes)
    hs.limit(0, 20)  # 2 MiB at 20 Mbit/s: ~0.84 s
    slow = transfer(hs, 1, 0, nbytes)
    hs.limit(0, None)
    again = transfer(hs, 1, 0, nbytes)
    assert free["ok"] and slow["ok"] and again["ok"]
    assert free["seconds"] < 0.4, free
    assert slow["seconds"] >= 0.6, slow
    assert again["seconds"] < 0.4, again


def test_cut_and_heal(hosts: HostsFactory) -> None:
    hs = hosts(2)
    start_server(hs, 0)
    assert transfer(hs, 1, 0, 10_000)["ok"]
    hs.cut(0)
    cut = transfer(hs, 1, 0, 10_000, timeout=1.0)
    assert not cut["ok"] and cut["seconds"] < 3.0, cut
    hs.heal(0)
    healed = transfer(hs, 1, 0, 10_000, timeout=5.0)
    assert healed["ok"], healed


def test_kill_host(hosts: HostsFactory) -> None:
    hs = hosts(2)
    victim = hs[1].popen(["sh", "-c", "sleep 600 & exec sleep 600"])
    bystander = hs[0].popen(["sleep", "600"])
    deadline = time.monotonic() + 5
    while len(hs[1].pids()) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(hs[1].pids()) == 2  # the shell (exec-ed into sleep) and its background child
    hs.kill_host(1)
    assert victim.wait(timeout=5) == -9
    assert hs[1].pids() == []  # the untracked background child died too
    assert bystander.poll() is None and hs[0].pids() == [bystander.pid]


def _gone(hs: Hosts, procs: list[subprocess.Popen[Any]]) -> None:
    assert hs.leftovers() == []
    assert not [n for n in list_namespaces() if n.startswith(hs.prefix)]
    assert not [n for n in list_links() if n.startswith(hs.prefix)]
    for p in procs:
        assert p.poll() is not None
        with pytest.raises(ProcessLookupError):
            os.kill(p.pid, 0)


def test_teardown_leaves_nothing() -> None:
    ok, reason = netns_available()
    if not ok:
        pytest.skip(reason)
    procs: list[subprocess.Popen[Any]] = []
    with Hosts(2) as hs:
        procs += [h.popen(["sleep", "600"]) for h in hs]
        assert len([n for n in list_namespaces() if n.startswith(hs.prefix)]) == 3
    _gone(hs, procs)
    # ... also when the body raises,
    with pytest.raises(RuntimeError, match="boom"):
        with Hosts(3) as hs:
            procs = [h.popen(["sleep", "600"]) for h in hs]
            raise RuntimeError("boom")
    _gone(hs, procs)


def test_teardown_after_partial_build(monkeypatch: pytest.MonkeyPatch) -> None:
    ok, reason = netns_available()
    if not ok:
        pytest.skip(reason)
    real = Hosts._add_host

    def flaky(self: Hosts, i: int) -> None:
        if i == 2:
            raise RuntimeError("build failed")
        real(self, i)

    monkeypatch.setattr(Hosts, "_add_host", flaky)
    hs = Hosts(3)
    with pytest.raises(RuntimeError, match="build failed"):
        hs.__enter__()
    assert hs.prefix and hs.leftovers() == []


def test_sweep_removes_the_sets_of_a_killed_run() -> None:
    """A run killed with SIGKILL cannot tear down; the next run's sweep removes
    its namespaces and processes, and leaves a live owner's set alone."""
    ok, reason = netns_available()
    if not ok:
        pytest.skip(reason)
    from netns import sweep_stale

    code = (
        "import sys, time; sys.path.insert(0, sys.argv[1]); from netns import Hosts\n"
        "hs = Hosts(2).__enter__(); hs[0].popen(['sleep', '600'])\n"
        "print(hs.prefix, flush=True); time.sleep(600)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code, str(HERE)], stdout=subprocess.PIPE, text=True)
    try:
        prefix = child.stdout.readline().strip()  # type: ignore[union-attr]
        assert prefix, "the child did not build its set"
        assert prefix not in sweep_stale()  # its owner is alive: not touched
        assert len([n for n in list_namespaces() if n.startswith(f"{prefix}-")]) == 3
        child.kill()
        child.wait(10)
        with Hosts(1) as mine:
            assert prefix in sweep_stale()
            assert [n for n in list_namespaces() if n.startswith(f"{prefix}-")] == []
            assert mine.prefix not in sweep_stale() and len(mine.leftovers()) == 2
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
        child.stdout.close()  # type: ignore[union-attr]
        sweep_stale()
