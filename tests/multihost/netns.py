"""A multi-host test bed made of Linux network namespaces.

``Hosts(n)`` builds ``n`` namespaces ("hosts") and one "switch" namespace that
holds a Linux bridge. Each host has one veth pair: ``eth0`` inside the host,
the other end enslaved to the bridge in the switch namespace. Nothing is added
to the root namespace and the hosts have no default route, so no traffic can
leave the set. Every name starts with ``PREFIX`` + a random tag so leftovers
can be found (and removed) by name. Each set also records its owner (PID and
process start time) under ``OWNERS``; ``sweep_stale()`` removes the sets whose
owner is gone (a test run killed with SIGKILL cannot tear down its own).

Needs root (CAP_NET_ADMIN + CAP_SYS_ADMIN) and iproute2 (``ip``, ``tc``).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import time
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

log = logging.getLogger(__name__)

PREFIX = "tdl"
"""Every namespace and link made here starts with this string."""

OWNERS = "/run/tidal-test-netns"
"""One file per live set, named by its prefix: ``"<pid> <start time>"`` of its owner."""

IFNAME = "eth0"
_IP_TIMEOUT = 10.0
_LIVE: set[Hosts] = set()


def _ip(*args: str, check: bool = True, timeout: float = _IP_TIMEOUT) -> subprocess.CompletedProcess[str]:
    """Run ``ip ARGS...``; raise ``RuntimeError`` with its stderr if it fails and ``check``."""
    return _cmd(["ip", *args], check=check, timeout=timeout)


def _cmd(argv: list[str], check: bool = True, timeout: float = _IP_TIMEOUT) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` capturing text output; raise ``RuntimeError`` if it fails and ``check``."""
    res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    if check and res.returncode != 0:
        raise RuntimeError(f"{shlex.join(argv)} failed ({res.returncode}): {res.stderr.strip()}")
    return res


def list_namespaces() -> list[str]:
    """Names of all named network namespaces (``ip netns list``)."""
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def list_links(netns: str | None = None) -> list[str]:
    """Interface names in ``netns`` (the root namespace when ``None``)."""
    args = ["-n", netns] if netns else []
    out = _ip(*args, "-o", "link", check=False).stdout
    names = []
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 2:
            names.append(parts[1].rstrip(":").split("@")[0])
    return names


def netns_pids(netns: str) -> list[int]:
    """PIDs of the processes living in ``netns`` (``ip netns pids``)."""
    out = _ip("netns", "pids", netns, check=False).stdout
    return [int(tok) for tok in out.split() if tok.isdigit()]


def netns_available() -> tuple[bool, str]:
    """Probe: create and delete a throwaway namespace (with a bridge and a veth
    pair in it). Returns ``(True, "")`` or ``(False, reason)``."""
    if shutil.which("ip") is None:
        return False, "iproute2 'ip' not found"
    if shutil.which("tc") is None:
        return False, "iproute2 'tc' not found"
    probe = f"{PREFIX}probe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return False, f"cannot create a network namespace (CAP_NET_ADMIN/CAP_SYS_ADMIN missing?): {exc}"
    try:
        _ip("-n", probe, "link", "add", "br0", "type", "bridge")
        _ip("-n", probe, "link", "add", "va", "type", "veth", "peer", "name", "vb")
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        return False, f"cannot create a bridge/veth inside a namespace: {exc}"
    finally:
        _ip("netns", "del", probe, check=False)
    return True, ""


def _new_tag() -> str:
    """Four hex digits, mixed from the PID and randomness, not used by a live namespace."""
    taken = "\n".join(list_namespaces())
    for _ in range(100):
        tag = f"{(os.getpid() * 40503 ^ secrets.randbits(16)) & 0xFFFF:04x}"
        if f"{PREFIX}{tag}-" not in taken:
            return tag
    raise RuntimeError("no free namespace tag")


def _start_time(pid: int) -> str | None:
    """Field 22 of ``/proc/PID/stat`` (start time in clock ticks), or ``None`` if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _record_owner(prefix: str) -> None:
    os.makedirs(OWNERS, exist_ok=True)
    Path(OWNERS, prefix).write_text(f"{os.getpid()} {_start_time(os.getpid())}\n")


def _owner_alive(prefix: str) -> bool:
    """Whether the process that built the set ``prefix`` still runs. A set with
    no owner record was left by a run that predates the records: not alive."""
    try:
        pid, start = Path(OWNERS, prefix).read_text().split()
    except (OSError, ValueError):
        return False
    return _start_time(int(pid)) == start


def owned_here() -> list[str]:
    """Prefixes of the sets this process built and has not torn down."""
    try:
        names = os.listdir(OWNERS)
    except OSError:
        return []
    me = f"{os.getpid()} "
    return [n for n in names if Path(OWNERS, n).read_text().startswith(me)]


def sweep_stale() -> list[str]:
    """Tear down every harness set whose owner process is dead (kill its
    processes, delete its namespaces and links); returns the prefixes removed.
    Sets of live owners (a concurrent run) are never touched."""
    prefixes = {n.split("-", 1)[0] for n in list_namespaces() + list_links() if n.startswith(PREFIX) and "-" in n}
    with contextlib.suppress(OSError):
        prefixes |= {n for n in os.listdir(OWNERS) if n.startswith(PREFIX)}
    removed = []
    for prefix in sorted(prefixes):
        if _owner_alive(prefix):
            continue
        spaces = [n for n in list_namespaces() if n.startswith(f"{prefix}-")]
        for ns in spaces:
            _try(_kill_namespace, ns)
            _try(_ip, "netns", "del", ns)
        for link in list_links():
            if link.startswith(f"{prefix}-"):
                _try(_ip, "link", "del", link)
        with contextlib.suppress(OSError):
            os.unlink(Path(OWNERS, prefix))
        log.warning("removed the stale namespace set %s (%s) of a dead test run", prefix, ", ".join(spaces) or "no namespaces")
        removed.append(prefix)
    return removed


_CLONE_NEWNET = 0x40000000


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


class Host:
    """One host: a network namespace with ``eth0`` at ``addr``."""

    def __init__(self, name: str, addr: str, ifname: str = IFNAME) -> None:
        self.name = name
        self.addr = addr
        self.ifname = ifname
        self.procs: list[subprocess.Popen[Any]] = []

    def __repr__(self) -> str:
        return f"Host({self.name!r}, {self.addr!r})"

    def argv(self, cmd: Sequence[str] | str) -> list[str]:
        """``cmd`` wrapped so that it runs inside this host's namespace."""
        args = shlex.split(cmd) if isinstance(cmd, str) else [str(c) for c in cmd]
        return ["ip", "netns", "exec", self.name, *args]

    def popen(self, cmd: Sequence[str] | str, **kw: Any) -> subprocess.Popen[Any]:
        """Start ``cmd`` in this host (``ip netns exec`` execs it, so the
        returned PID is the command itself); tracked and killed at teardown."""
        proc = subprocess.Popen(self.argv(cmd), **kw)
        self.procs.append(proc)
        return proc

    def run(self, cmd: Sequence[str] | str, timeout: float = 30.0, **kw: Any) -> subprocess.CompletedProcess[Any]:
        """Run ``cmd`` in this host to completion (killed after ``timeout`` s)."""
        return subprocess.run(self.argv(cmd), timeout=timeout, check=False, **kw)

    def pids(self) -> list[int]:
        """PIDs of every process in this host's namespace, tracked or not."""
        return netns_pids(self.name)

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """Move the calling thread (only it) into this host's namespace for
        the block: sockets it opens there talk to the hosts (an API client in
        a test). The thread returns to its own namespace afterwards."""
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        target = os.open(f"/var/run/netns/{self.name}", os.O_RDONLY)
        try:
            _setns(target)
            try:
                yield
            finally:
                _setns(own)
        finally:
            os.close(target)
            os.close(own)


class Hosts:
    """``n`` hosts on one bridge; ``with Hosts(n) as hs:`` builds, exit tears down.

    Host ``i`` is ``hs[i]`` at ``10.213.X.(i+1)/24`` (X derived from the tag)."""

    def __init__(self, n: int, tag: str | None = None, subnet: str | None = None) -> None:
        """``n`` hosts (1..200); ``tag``: fixed name tag (default: random, 4 hex
        digits); ``subnet``: first three octets, e.g. ``"10.213.7"`` (default from the tag)."""
        if not 1 <= n <= 200:
            raise ValueError(f"1 <= n <= 200 hosts, got {n}")
        self.n = n
        self._tag = tag
        self._subnet = subnet
        self.hosts: list[Host] = []
        self.tag = ""
        self.prefix = ""
        self.switch = ""
        self.bridge = ""

    # ----------------------------------------------------------------- names
    def _name_all(self) -> None:
        tag = self._tag or _new_tag()
        prefix = f"{PREFIX}{tag}"
        if len(f"{prefix}-s{self.n - 1}") > 15:
            raise ValueError(f"tag {tag!r} too long for 15-character interface names")
        if any(ns.startswith(f"{prefix}-") for ns in list_namespaces()):
            raise ValueError(f"namespaces with prefix {prefix!r} already exist")  # never tear down others'
        self.tag, self.prefix = tag, prefix
        _record_owner(prefix)
        self.switch = f"{prefix}-sw"
        self.bridge = f"{prefix}-br"
        subnet = self._subnet or f"10.213.{zlib.crc32(tag.encode()) % 200 + 20}"
        self.hosts = [Host(f"{self.prefix}-h{i}", f"{subnet}.{i + 1}") for i in range(self.n)]

    def port(self, i: int) -> str:
        """Name of host ``i``'s veth end on the switch (bridge port)."""
        return f"{self.prefix}-s{i}"

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __len__(self) -> int:
        return len(self.hosts)

    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts)

    # ----------------------------------------------------------------- build
    def __enter__(self) -> Hosts:
        self._name_all()
        _LIVE.add(self)
        try:
            self._build()
        except BaseException:
            log.exception("building %s failed; tearing down", self.prefix)
            self.teardown()
            raise
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.teardown()

    def _build(self) -> None:
        t0 = time.monotonic()
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "set", "lo", "up")
        _ip("-n", self.switch, "link", "add", self.bridge, "type", "bridge")
        _ip("-n", self.switch, "link", "set", self.bridge, "up")
        for i in range(self.n):
            self._add_host(i)
        log.info("built %s: %d hosts in %.2fs", self.prefix, self.n, time.monotonic() - t0)

    def _add_host(self, i: int) -> None:
        h, port = self.hosts[i], self.port(i)
        _ip("netns", "add", h.name)
        _ip("-n", h.name, "link", "set", "lo", "up")
        # Both veth ends are created directly in their namespaces: never in the root one.
        _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", h.ifname, "netns", h.name)
        _ip("-n", self.switch, "link", "set", port, "master", self.bridge)
        _ip("-n", self.switch, "link", "set", port, "up")
        _ip("-n", h.name, "addr", "add", f"{h.addr}/24", "dev", h.ifname)
        _ip("-n", h.name, "link", "set", h.ifname, "up")

    # --------------------------------------------------------------- faults
    def cut(self, i: int) -> None:
        """Take host ``i``'s link down on the switch side (``eth0`` stays, without carrier)."""
        _ip("-n", self.switch, "link", "set", self.port(i), "down")

    def heal(self, i: int, timeout: float = 5.0) -> None:
        """Bring host ``i``'s link back up; waits until both ends report ``UP``."""
        _ip("-n", self.switch, "link", "set", self.port(i), "up")
        h = self.hosts[i]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            sw = _ip("-n", self.switch, "-o", "link", "show", self.port(i)).stdout
            ho = _ip("-n", h.name, "-o", "link", "show", h.ifname).stdout
            if "state UP" in sw and "state UP" in ho:
                return
            time.sleep(0.02)
        raise RuntimeError(f"link of {h.name} not up after {timeout}s")

    def limit(self, i: int, mbit: float | None) -> None:
        """Rate-limit host ``i``'s link to ``mbit`` Mbit/s each way (``tbf`` on the
        egress of both veth ends); ``None`` removes the limit."""
        h = self.hosts[i]
        ends = [(self.switch, self.port(i)), (h.name, h.ifname)]
        for ns, dev in ends:
            if mbit is None:
                _cmd(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
                continue
            if mbit <= 0:
                raise ValueError(f"rate must be > 0 Mbit/s, got {mbit}")
            burst = max(16_000, int(mbit * 1e6 / 8 / 100))  # ~10 ms worth of bytes
            _cmd(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf",
                  "rate", f"{mbit}mbit", "burst", str(burst), "latency", "100ms"])

    def kill_host(self, i: int, timeout: float = 5.0) -> None:
        """SIGKILL every process in host ``i``'s namespace, as if the machine died."""
        _kill_namespace(self.hosts[i].name, timeout)
        _reap(self.hosts[i].procs, timeout)

    # -------------------------------------------------------------- teardown
    def namespaces(self) -> list[str]:
        """This set's namespaces (hosts first, switch last)."""
        return [h.name for h in self.hosts] + ([self.switch] if self.switch else [])

    def leftovers(self) -> list[str]:
        """Namespaces and root-namespace links with this set's prefix that still exist."""
        if not self.prefix:
            return []
        mine = f"{self.prefix}-"
        return [n for n in list_namespaces() + list_links() if n.startswith(mine)]

    def teardown(self) -> None:
        """Kill every process of every namespace of this set, delete the
        namespaces (their veth ends go with them) and any leftover link.
        Idempotent; safe on a partial build; never raises for cleanup errors."""
        if not self.prefix:
            return
        names = self.namespaces()
        existing = set(list_namespaces())
        for ns in names:
            if ns in existing:
                _try(_kill_namespace, ns)
        for h in self.hosts:
            _try(_reap, h.procs)
        for ns in names:
            if ns in existing:
                _try(_ip, "netns", "del", ns)
        for link in list_links():
            if link.startswith(f"{self.prefix}-"):
                _try(_ip, "link", "del", link)
        left = self.leftovers()
        if left:
            log.error("teardown of %s left %s", self.prefix, left)
        else:
            log.info("tore down %s", self.prefix)
            with contextlib.suppress(OSError):
                os.unlink(Path(OWNERS, self.prefix))
        _LIVE.discard(self)


def _try(fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - teardown must go on
        log.exception("teardown step %s%r failed", getattr(fn, "__name__", fn), args)


def _kill_namespace(ns: str, timeout: float = 5.0) -> None:
    """SIGKILL the processes of ``ns`` until none is left (they may fork meanwhile)."""
    deadline = time.monotonic() + timeout
    while True:
        pids = [p for p in netns_pids(ns) if p != os.getpid()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            log.error("processes %s in %s survive SIGKILL", pids, ns)
            return
        time.sleep(0.02)


def _reap(procs: list[subprocess.Popen[Any]], timeout: float = 5.0) -> None:
    """Wait for (already killed) tracked processes and close their pipes."""
    for proc in procs:
        if proc.poll() is None:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout)
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None and not pipe.closed:
                pipe.close()


@atexit.register
def _cleanup_at_exit() -> None:
    """Last resort: tear down every set still alive when the interpreter exits."""
    for hs in list(_LIVE):
        hs.teardown()
