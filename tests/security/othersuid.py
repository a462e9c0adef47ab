"""Run a command as another uid with this test run's Python (not collected).

The attacks of these tests are made by a process of another uid on the
same host, with the same Python, torch and Tidal a tenant would have. On
this machine the interpreter lives under ``/root`` (mode 0700), which no
other uid may enter, and a checkout may lie in a 0700 directory too (a
``mktemp -d``). So when something another uid needs (the interpreter, the
import path, this project) is behind such a directory, the command runs in
a private mount namespace (``unshare -m``) where each of those directories
is replaced by an empty one (0755) holding only what is needed, bound from
the original: nothing changes on the host, and the namespace ends with the
command.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
from pathlib import Path

NOBODY = 65534


def _needed() -> list[Path]:
    """What a process of another uid needs to run this Python with its
    imports: the interpreter, the installation and every import path."""
    import tidal

    paths = [Path(sys.executable).resolve(), Path(sys.prefix), Path(sys.base_prefix),
             Path(tidal.__file__).resolve().parents[1], Path(__file__).resolve().parent]
    paths += [Path(p) for p in sys.path if p and Path(p).is_dir()]
    return [p.resolve() for p in paths]


def _hidden(paths: list[Path]) -> dict[Path, set[Path]]:
    """Each directory other uids cannot enter (its mode has no o+x) above a
    needed path, with the entries below it to keep: the outermost only."""
    out: dict[Path, set[Path]] = {}
    for p in paths:
        parts = [*reversed(p.parents), p]
        for d, below in zip(parts, parts[1:]):
            if d != Path("/") and not os.stat(d).st_mode & stat.S_IXOTH:
                out.setdefault(d, set()).add(below)
                break
    return out


def can_switch_uid() -> str | None:
    """Why the attacks cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "starting processes as another uid needs root"
    if shutil.which("setpriv") is None or shutil.which("unshare") is None:
        return "setpriv and unshare (util-linux) are needed"
    return None


def namespace_prefix() -> list[str]:
    """A prefix that runs a command where other uids can run this Python
    and import this project (empty when they already can)."""
    hidden = _hidden(_needed())
    if not hidden:
        return []
    # stage every kept entry under /mnt, hide each directory behind an empty 0755 tmpfs, bind them back
    lines, args = ["set -e", "mount -t tmpfs tmpfs /mnt"], []
    pairs = [(h, k) for h in sorted(hidden) for k in sorted(hidden[h])]
    for i, (_, keep) in enumerate(pairs):
        args.append(str(keep))
        lines += [f'mkdir /mnt/k{i}', f'mount --bind "${{{i + 1}}}" /mnt/k{i}']
    for h in sorted(hidden):
        args.append(str(h))
        lines.append(f'mount -t tmpfs -o mode=0755 tmpfs "${{{len(args)}}}"')
    for i, (_, keep) in enumerate(pairs):
        kind = "mkdir -p" if keep.is_dir() else "touch"
        lines += [f'{kind} "${{{i + 1}}}"', f'mount --bind /mnt/k{i} "${{{i + 1}}}"']
    lines += ["umount -l /mnt", f"shift {len(args)}", 'exec "$@"']
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", "; ".join(lines), "sh", *args]


def as_uid(uid: int, argv: list[str], gid: int | None = None) -> list[str]:
    """``argv`` run as ``uid`` (group ``gid``, default the same number), no
    supplementary groups, where that uid can run this Python."""
    g = uid if gid is None else gid
    return [*namespace_prefix(), "setpriv", f"--reuid={uid}", f"--regid={g}", "--clear-groups", *argv]
