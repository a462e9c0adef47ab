"""Run a command as another uid with this test run's Python (not collected).

The attacks of these tests are made by a process of another uid on the
same host, with the same Python and torch a tenant would have. This
machine's Python lives under ``/root`` (mode 0700), which no other uid may
enter, so when the interpreter is not reachable by others the command runs
in a private mount namespace (``unshare -m``) where ``/root`` is replaced by
an empty directory holding only the Python installation: nothing changes
on the host, and the namespace ends with the command.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
from pathlib import Path

NOBODY = 65534


def _reachable_by_others(path: Path) -> bool:
    """Every directory above ``path`` can be entered by any uid."""
    for d in path.resolve().parents:
        if not os.stat(d).st_mode & stat.S_IXOTH:
            return False
    return True


def _hidden_root() -> str | None:
    """The 0700 directory (under /) that hides the interpreter, if any."""
    exe = Path(sys.executable).resolve()
    for d in reversed(exe.parents):
        if d != Path("/") and not os.stat(d).st_mode & stat.S_IXOTH:
            return str(d)
    return None


def can_switch_uid() -> str | None:
    """Why the attacks cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "starting processes as another uid needs root"
    if shutil.which("setpriv") is None or shutil.which("unshare") is None:
        return "setpriv and unshare (util-linux) are needed"
    return None


def namespace_prefix() -> list[str]:
    """A prefix that runs a command where other uids can run this Python
    (empty when they already can)."""
    hidden = _hidden_root()
    if hidden is None or _reachable_by_others(Path(sys.executable)):
        return []
    exe = Path(sys.executable).resolve()
    keep = exe.parents[len(exe.relative_to(hidden).parts) - 2]  # the first directory below ``hidden``
    script = ('set -e; mount -t tmpfs tmpfs /mnt; mkdir /mnt/keep; mount --bind "$1" /mnt/keep; '
              'mount -t tmpfs -o mode=0755 tmpfs "$2"; mkdir -p "$1"; mount --bind /mnt/keep "$1"; '
              'umount -l /mnt; shift 2; exec "$@"')
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", str(keep), hidden]


def as_uid(uid: int, argv: list[str], gid: int | None = None) -> list[str]:
    """``argv`` run as ``uid`` (group ``gid``, default the same number), no
    supplementary groups, where that uid can run this Python."""
    g = uid if gid is None else gid
    return [*namespace_prefix(), "setpriv", f"--reuid={uid}", f"--regid={g}", "--clear-groups", *argv]
