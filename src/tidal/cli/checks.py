"""Checks of command-line values made before a command starts anything:
numbers in range, directories a command writes into, ports it listens on,
addresses it binds, names it looks up. Each returns why a value is unusable
(one line naming the option and the value), or None; the commands print it
as their other errors and exit 2, so a mistake never surfaces later as a
traceback, a hang or a silently absurd result."""

from __future__ import annotations

import difflib
import errno
import ipaddress
import math
import os
import socket
from pathlib import Path
from typing import Callable, Iterable, Optional

import typer

from tidal.net import LOOPBACK


def number_problem(option: str, value: float | int | None, *, low: float | None = None, high: float | None = None,
                   low_open: bool = False, unit: str = "") -> Optional[str]:
    """Why ``value`` of ``option`` is out of range (NaN and infinities are), or None."""
    if value is None:
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return f"{option} {value}: give a finite number"
    unit = f" {unit}" if unit else ""
    if low is not None and (value <= low if low_open else value < low):
        return f"{option} {value:g}: must be {'more than' if low_open else 'at least'} {low:g}{unit}"
    if high is not None and value > high:
        return f"{option} {value:g}: must be at most {high:g}{unit}"
    return None


def bounded(*, low: float | None = None, high: float | None = None, low_open: bool = False,
            unit: str = "") -> Callable[[typer.Context, typer.CallbackParam, object], object]:
    """A Typer option callback for :func:`number_problem` (raises ``typer.BadParameter``)."""
    def check(ctx: typer.Context, param: typer.CallbackParam, value: object) -> object:  # noqa: ARG001
        option = param.opts[0]
        why = number_problem(option, value, low=low, high=high, low_open=low_open, unit=unit)  # type: ignore[arg-type]
        if why:
            raise typer.BadParameter(why.removeprefix(f"{option} "))
        return value
    return check


def dir_problem(path: Path, what: str) -> Optional[str]:
    """Why a command cannot keep files in directory ``path`` (``what`` names
    it: ``--out DIR``, ``$TIDAL_HOME DIR``): an existing non-directory, a
    path under a file, or the nearest existing ancestor not writable. Nothing
    is created."""
    if str(path) == "":
        return f"{what}: an empty path; give a directory"
    if path.exists() and not path.is_dir():
        return f"{what}: exists and is not a directory"
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        return f"{what}: {probe} is a file, so no directory can be made under it"
    if not os.access(probe, os.W_OK | os.X_OK) or _read_only(probe):
        return f"{what}: cannot write in {probe} (permission denied or a read-only file system)"
    return None


def _read_only(path: Path) -> bool:
    """Whether ``path`` is on a read-only mount or a pseudo file system
    (/proc, /sys), where even root cannot create files."""
    try:
        st = os.statvfs(path)
    except OSError:
        return True
    return bool(st.f_flag & os.ST_RDONLY) or str(path.resolve()).split("/")[1:2] in (["proc"], ["sys"])


def make_dir(path: Path, what: str) -> Optional[str]:
    """Create directory ``path`` (and its parents) after :func:`dir_problem`;
    why it cannot be, or None."""
    why = dir_problem(path, what)
    if why:
        return why
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"{what}: cannot create it ({e.strerror})"
    return None


def home_problem(home: Path, what: str = "") -> Optional[str]:
    """Why ``home`` (``$TIDAL_HOME`` or ``--home``) cannot hold Tidal's state
    (a file, a pseudo file system, a full disk); the directory is created
    when it can be."""
    what = what or f"state directory {home} ($TIDAL_HOME or --home)"
    return make_dir(home, what) or space_problem(home, what)


def space_problem(folder: Path, what: str) -> Optional[str]:
    """Why a few files cannot be written in ``folder`` (a full disk, quota):
    a probe file is written, synced and removed."""
    import tempfile

    try:
        fd, name = tempfile.mkstemp(dir=folder, prefix=".tidal-probe-")
    except OSError as e:
        return f"{what}: cannot create a file there ({e.strerror})"
    try:
        os.write(fd, b"\0" * 16384)
        os.fsync(fd)
    except OSError as e:
        return f"{what}: cannot write there ({e.strerror})"
    finally:
        os.close(fd)
        os.unlink(name)
    return None


def port_problem(port: int, host: str = LOOPBACK, option: str = "--port") -> Optional[str]:
    """Why nothing can listen on ``host:port`` (taken, out of range,
    privileged), or None. Port 0 (any free port) is always fine."""
    if port == 0:
        return None
    if not 1 <= port <= 65535:
        return f"{option} {port}: a port is 1-65535"
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind: TIME_WAIT is no owner
        try:
            sock.bind((host if host not in ("", "::") else "0.0.0.0", port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return f"{option} {port}: in use by another process; stop it, or choose another with {option}"
            return f"{option} {port}: cannot listen there ({e.strerror}); choose another with {option}"
    return None


def address_problem(addr: Optional[str], option: str) -> Optional[str]:
    """Why ``addr`` is not an address this host can listen on (malformed,
    unresolvable, or not one of its interfaces), or None."""
    if addr is None:
        return None
    if not addr.strip():
        return f"{option} '': give an IP address (0.0.0.0: every interface)"
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        try:
            ip = ipaddress.ip_address(socket.gethostbyname(addr))
        except (OSError, UnicodeError):
            return f"{option} {addr}: not an IP address or a known host name"
    if ip.version != 4:
        return f"{option} {addr}: give an IPv4 address"
    if ip.is_unspecified:
        return None
    with socket.socket() as sock:
        try:
            sock.bind((str(ip), 0))
        except OSError as e:
            return f"{option} {addr}: not an address of this host ({e.strerror})"
    return None


def name_problem(option: str, value: Optional[str]) -> Optional[str]:
    """Why ``value`` cannot name a job (empty, a path, a control character), or None."""
    if value is None:
        return None
    if not value.strip():
        return f"{option} {value!r}: give a name"
    if "/" in value or "\\" in value or value in (".", "..") or any(ord(c) < 32 for c in value):
        return f"{option} {value!r}: a name has no slashes or control characters"
    return None


def state_problem(url: Optional[str], option: str = "--state") -> Optional[str]:
    """Why the master state backend ``url`` (``file://PATH``, ``sqlite://PATH``
    or a bare path) cannot be written: no path, a directory, or a folder that
    does not exist (SQLite creates no folder) or cannot be written, or None.
    An unknown scheme is the backend registry's to name."""
    if url is None:
        return None
    scheme, sep, rest = url.partition("://")
    scheme, rest = (scheme, rest) if sep else ("file", url)
    if not rest.strip():
        return f"{option} {url!r}: give a file path, e.g. sqlite:///tmp/job.db"
    path = Path(rest)
    if path.is_dir():
        return f"{option} {url}: {path} is a directory; give a file path in it"
    if scheme == "sqlite" and not path.parent.is_dir():
        if path.parent.exists():
            return f"{option} {url}: {path.parent} is not a folder"
        return f"{option} {url}: the folder {path.parent} does not exist (SQLite creates no folder); create it first"
    why = dir_problem(path.parent, f"{option} {url}")
    return why


def db_problem(url: Optional[str], option: str = "--db") -> Optional[str]:
    """Why the SQLAlchemy URL ``url`` cannot be opened: not a URL, or a
    SQLite file whose folder does not exist or cannot be written, or None.
    Other databases are checked when the server connects."""
    if url is None:
        return None
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):
        return f"{option} {url!r}: not a database URL (e.g. sqlite:////srv/tidal/tidal.db, postgresql://...)"
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return None
    path = Path(parsed.database)
    if path.is_dir():
        return f"{option} {url}: {path} is a directory; give a file path in it"
    if not path.parent.is_dir():
        return f"{option} {url}: the folder {path.parent} does not exist (SQLite creates no folder); create it first"
    return dir_problem(path.parent, f"{option} {url}")


def suggest(value: str, known: Iterable[str]) -> str:
    """``; did you mean X?`` for the closest of ``known``, or ''."""
    close = difflib.get_close_matches(value, list(known), n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""
