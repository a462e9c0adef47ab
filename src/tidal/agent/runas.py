"""Job processes as unprivileged OS users (``tidal agent --run-as``), and
each job's private directory on this host.

An agent that runs as root starts every job master and worker unprivileged:
no supplementary groups, umask 077. ``--run-as LO-HI`` (a range of uids,
recommended) gives each job a uid of its own, with the same number as its
private group and no ``/etc/passwd`` entry (as Kubernetes' ``runAsUser``
does): one job cannot read another's environment, credential, files or
checkpoints, nor signal or trace its processes. A job's uid is the same on
every host (``LO + n mod size``, ``n`` the job's number among all jobs,
from the server; a hash of its id without one), unless another job of this
host holds that slot: then the next free one. ``--run-as USER`` runs every job as
``USER`` (its uid and primary group): tenants are kept from the agent and
the server, not from one another.

Every job (run-as or not) has a private directory on the host,
``WORKDIR/jobs/JOB/`` (0700, owned by the job's uid; ``$TIDAL_JOB_DIR``, and
``$HOME`` with run-as): the agent writes the job's credential there
(``token``, 0600) instead of passing it in the environment
(``$TIDAL_JOB_TOKEN_FILE``), and the job master keeps its state there. It is
removed once the job has no process on the host and the server wants none.
Which uid a job holds is read again from the host (the owners of these
directories and of the agent's live processes), so a restarted agent never
hands one job's uid to another; docs/security.md.
"""

from __future__ import annotations

import errno
import grp
import hashlib
import logging
import os
import pwd
import re
import shutil
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from tidal import settings
from tidal.agent.proctable import Child, Handle

log = logging.getLogger("tidal.agent")

#: the lowest uid a range may start at (below: the system's accounts)
UID_MIN = 1000
#: the highest uid (``(uid_t)-1`` means "unchanged" to chown)
UID_MAX = 2 ** 32 - 2
#: a job id that may name a directory (the server's ids are ``[A-Za-z0-9_.-]+``)
_SAFE_NAME = re.compile(r"(?!\.\.?$)[A-Za-z0-9_.-]+")


@dataclass(frozen=True)
class Identity:
    """Who a job's processes run as; ``user`` names it in ``$USER`` ("":
    the agent's own user, the environment left as it is)."""

    uid: int
    gid: int
    user: str = ""


def job_name(job: str) -> str:
    """``job``, refused (``ValueError``) unless it may name a directory."""
    if not _SAFE_NAME.fullmatch(job):
        raise ValueError(f"job id {job!r} cannot name a directory")
    return job


def own_identity() -> Identity:
    return Identity(os.geteuid(), os.getegid())


def parse_range(spec: str) -> tuple[int, int]:
    """``"LO-HI"`` as two uids, refused (``ValueError``, one line) unless
    LO <= HI, LO >= :data:`UID_MIN` and no user or group of this host has a
    uid or gid in it (a job would get its files)."""
    lo_s, sep, hi_s = spec.partition("-")
    if not sep or not lo_s.strip().isdigit() or not hi_s.strip().isdigit():
        raise ValueError(f"--run-as {spec!r}: expected a user name or a uid range LO-HI, e.g. 200000-299999")
    lo, hi = int(lo_s), int(hi_s)
    if lo > hi:
        raise ValueError(f"--run-as {spec!r}: the range is empty ({lo} > {hi})")
    if lo < UID_MIN or hi > UID_MAX:
        raise ValueError(f"--run-as {spec!r}: uids must lie in {UID_MIN}-{UID_MAX} (below {UID_MIN}: root and "
                         "the system's accounts)")
    for pw in pwd.getpwall():
        if lo <= pw.pw_uid <= hi:
            raise ValueError(f"--run-as {spec!r}: includes uid {pw.pw_uid} of user {pw.pw_name!r}; "
                             "choose a range no user of this host has")
    for gr in grp.getgrall():
        if lo <= gr.gr_gid <= hi:
            raise ValueError(f"--run-as {spec!r}: includes gid {gr.gr_gid} of group {gr.gr_name!r}; "
                             "choose a range no group of this host has")
    return lo, hi


def proc_uids(pid: int | str) -> set[int]:
    """The uids (real, effective, saved, file system) of process ``pid``
    (none if it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("Uid:"):
                    return {int(u) for u in line.split()[1:]}
    except (OSError, ValueError):
        pass
    return set()


def uids_in_use() -> set[int]:
    """Every uid a process of this host runs as (a job's leftover daemon,
    another agent's jobs, a container's users)."""
    out: set[int] = set()
    for name in os.listdir("/proc"):
        if name.isdigit():
            out |= proc_uids(name)
    return out


class RunAs:
    """A launcher (see :data:`tidal.agent.agent.Launcher`) starting each
    process unprivileged: as ``spec``, a user name, or with a uid of its
    job's own from ``spec``, a range ``LO-HI``; refused (``ValueError``)
    unless the agent runs as root."""

    local = True  # its processes run on this machine: the agent's limits apply to them

    def __init__(self, spec: str) -> None:
        spec = spec.strip()
        self.ranged = spec[:1].isdigit()
        if self.ranged:
            self.lo, self.hi = parse_range(spec)
            self.user, self.uid, self.gid = "", -1, -1
        else:
            try:
                pw = pwd.getpwnam(spec)
            except KeyError:
                raise ValueError(f"--run-as {spec!r}: no such user on this host (a uid range is LO-HI, "
                                 "e.g. 200000-299999)") from None
            if pw.pw_uid == 0:
                raise ValueError("--run-as root would give tenants' scripts root: name an unprivileged user")
            self.user, self.uid, self.gid = spec, pw.pw_uid, pw.pw_gid
        if os.geteuid() != 0:
            raise ValueError(f"--run-as {spec!r} needs the agent to run as root (it runs as uid {os.geteuid()})")
        self.assigned: dict[str, Identity] = {}  # job -> its identity, from its last launch here

    def slot(self, job: str, number: int | None = None) -> int:
        """The uid ``job`` gets on every host where its slot is free: from
        its number among all jobs (``number``, the server's ``slot``: no two
        of any ``HI - LO + 1`` jobs in a row share one), else from a hash of
        its id."""
        if number is None:
            number = int.from_bytes(hashlib.sha256(job.encode()).digest()[:8], "big")
        return self.lo + int(number) % (self.hi - self.lo + 1)

    def identity(self, job: str, held: dict[int, str], busy: Callable[[], set[int]] = uids_in_use,
                 number: int | None = None) -> Identity:
        """Who ``job`` runs as. With a range: the uid it holds here already
        (``held``: uid -> the job holding it on this host), else the first
        from its :meth:`slot` that no other job holds and no process of this
        host (``busy()``) runs as; EAGAIN (a launch tried again) when every
        uid is taken."""
        if not self.ranged:
            ident = Identity(self.uid, self.gid, self.user)
        else:
            uid = next((u for u, j in held.items() if j == job and self.lo <= u <= self.hi), None)
            if uid is None:
                taken, size, start = set(held) | busy(), self.hi - self.lo + 1, self.slot(job, number) - self.lo
                uid = next((self.lo + (start + i) % size for i in range(size)
                            if self.lo + (start + i) % size not in taken), None)
                if uid is None:
                    raise OSError(errno.EAGAIN, f"every uid of --run-as {self.lo}-{self.hi} is taken on this host")
            ident = Identity(uid, uid, f"tidal-{uid}")
        self.assigned[job] = ident
        return ident

    def forget(self, job: str) -> None:
        self.assigned.pop(job, None)

    def private_dir(self, path: Path, ident: Identity | None = None) -> None:
        """``path`` (and missing parents) for the job's user only: 0700,
        owned by it. A job's env may name its checkpoint directory, so the
        agent (root) hands over only a directory it just made or one the user
        owns already; any other (``/etc``, another user's, a symbolic link)
        is left as it is, and the job finds out whether it may write there."""
        ident = ident or Identity(self.uid, self.gid, self.user)
        made_above = [d for d in (path.parent, *path.parent.parents) if not os.path.lexists(d)]
        path.parent.mkdir(parents=True, exist_ok=True)
        try:  # the user passes the directories above it that are the agent's (made now, or in the home)
            open_path(path.parent, own=(settings.home(), *made_above))
        except Unreachable as e:
            log.warning("checkpoint directory %s: %s", path, e)
        try:
            path.mkdir()
            made = True
        except FileExistsError:
            made = False
        if stat.S_ISLNK(os.lstat(path).st_mode):
            log.warning("checkpoint directory %s is a symbolic link: left as it is", path)
            return
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            if (made and st.st_uid == os.geteuid()) or st.st_uid == ident.uid:
                os.fchown(fd, ident.uid, ident.gid)
                os.fchmod(fd, 0o700)
            else:
                log.warning("checkpoint directory %s belongs to uid %d, not to uid %d: left as it is", path,
                            st.st_uid, ident.uid)
        finally:
            os.close(fd)

    def __call__(self, w: dict[str, Any], argv: list[str], env: dict[str, str], cwd: str | None,
                 log_path: Path) -> Handle:
        ident = self.assigned.get(str(w["job"])) or self.identity(str(w["job"]), {})
        ckpt = env.get(settings.CHECKPOINT_DIR.name)
        if ckpt:
            self.private_dir(Path(ckpt), ident)
        env = {**env, "USER": ident.user, "LOGNAME": ident.user}
        if env.get(settings.JOB_DIR.name):
            env["HOME"] = env[settings.JOB_DIR.name]
        with log_path.open("ab") as fh:  # opened by the agent: the user need not reach the log directory
            return Child(subprocess.Popen(argv, env=env, cwd=cwd, stdout=fh, stderr=subprocess.STDOUT,
                                          start_new_session=True, user=ident.uid, group=ident.gid,
                                          extra_groups=[], umask=0o077))


def write_secret(dfd: int, name: str, text: str, ident: Identity) -> None:
    """``name`` in the directory open as ``dfd`` holds ``text``, mode 0600,
    owned by ``ident``: written to a new file (never an existing one, never
    through a symbolic link), then renamed over ``name``."""
    tmp = f".{name}.tmp"
    try:
        os.unlink(tmp, dir_fd=dfd)
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
    try:
        if (ident.uid, ident.gid) != (os.geteuid(), os.getegid()):
            os.fchown(fd, ident.uid, ident.gid)
        data = text.encode()
        while data:
            data = data[os.write(fd, data):]
    finally:
        os.close(fd)
    os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)


class Unreachable(ValueError):
    """Job users could not pass a directory above their own (``--run-as``)."""


def open_path(path: Path, own: Iterable[Path]) -> list[Path]:
    """Let job users pass every directory from ``path`` up to ``/``, so each
    reaches its own directory, credential and master file below it.

    A directory without others' search permission that this user owns and
    that lies in one of ``own`` (the agent's work directory, the Tidal home:
    made under a umask of 077, say) gets it, and only it: others may pass,
    never list (0700 becomes 0701). Any other such directory
    raises :class:`Unreachable` naming it, before a job fails on it. The
    directories opened."""
    mine = [Path(os.path.abspath(o)) for o in own]
    start = Path(os.path.abspath(path))
    opened: list[tuple[Path, int]] = []
    closed: list[tuple[Path, int]] = []
    for d in (start, *start.parents):
        try:
            st = os.stat(d)
        except FileNotFoundError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_mode & stat.S_IXOTH:
            continue
        ours = st.st_uid == os.geteuid() and any(d == o or o in d.parents for o in mine)
        (opened if ours else closed).append((d, stat.S_IMODE(st.st_mode)))
    if closed:
        closed.reverse()  # from the top
        names = ", ".join(f"{d} (mode {m:o})" for d, m in closed)
        raise Unreachable(f"--run-as: job users cannot reach {path}: {names} "
                          f"{'lets' if len(closed) == 1 else 'let'} no other user pass; allow "
                          f"{'it' if len(closed) == 1 else 'them'} (chmod o+x {' '.join(str(d) for d, _ in closed)}) "
                          f"or give the agent a work directory they can reach (${settings.HOME.name})")
    for d, mode in opened:  # only once every directory is known to be passable
        os.chmod(d, mode | stat.S_IXOTH)
    if opened:
        log.info("--run-as: job users may now pass %s (search only)", ", ".join(str(d) for d, _ in opened))
    return [d for d, _ in opened]


class JobDirs:
    """``root/JOB/``: each job's private directory on this host (see the
    module docstring). ``root`` is the agent's (0711: job users pass through
    to their own directory, never list the others)."""

    TOKEN = "token"

    def __init__(self, root: Path, launcher: Any) -> None:
        self.root = Path(root)
        self.runas: RunAs | None = launcher if isinstance(launcher, RunAs) else None
        if self.runas is not None:
            open_path(self.root.parent, own=(self.root.parent, settings.home()))

    def _root(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        if stat.S_ISLNK(os.lstat(self.root).st_mode):
            raise OSError(errno.ELOOP, "the jobs directory is a symbolic link", str(self.root))
        os.chmod(self.root, 0o711)

    def held(self, live: Iterable[tuple[str, int]]) -> dict[int, str]:
        """uid -> the job holding it here: its live processes' (``live``:
        (job, pid) pairs), then its directory's owner."""
        out: dict[int, str] = {}
        for job, pid in live:
            for uid in proc_uids(pid):
                out.setdefault(uid, job)
        for e in os.scandir(self.root):
            if e.is_dir(follow_symlinks=False):
                out.setdefault(e.stat(follow_symlinks=False).st_uid, e.name)
        return out

    def identity(self, job: str, live: Callable[[], Iterable[tuple[str, int]]], number: int | None = None) -> Identity:
        if self.runas is None:
            return own_identity()
        return self.runas.identity(job, self.held(live()) if self.runas.ranged else {}, number=number)

    def prepare(self, job: str, env: dict[str, str], live: Callable[[], Iterable[tuple[str, int]]],
                number: int | None = None) -> Identity:
        """Make ``job``'s directory (0700, its uid's) and move its credential
        from ``env`` into it; ``env`` names both. Its identity."""
        job_name(job)
        self._root()
        ident = self.identity(job, live, number)
        path = self.root / job
        try:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != ident.uid:  # another uid's (--run-as changed)
                self._remove(path)
        except FileNotFoundError:
            pass
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            st = os.fstat(dfd)
            if (st.st_uid, st.st_gid) != (ident.uid, ident.gid):
                os.fchown(dfd, ident.uid, ident.gid)
            os.fchmod(dfd, 0o700)
            token = env.pop(settings.JOB_TOKEN.name, None)
            if token:
                write_secret(dfd, self.TOKEN, token, ident)
                env[settings.JOB_TOKEN_FILE.name] = str(path / self.TOKEN)
        finally:
            os.close(dfd)
        env[settings.JOB_DIR.name] = str(path)
        return ident

    @staticmethod
    def _remove(path: Path) -> None:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)  # never follows a symbolic link in it (Linux: fd-based)
        else:
            os.unlink(path)

    def sweep(self, keep: set[str]) -> list[str]:
        """Remove the directory of every job not in ``keep`` (no process of
        it here, none wanted); the jobs removed."""
        try:
            names = [e.name for e in os.scandir(self.root)]
        except FileNotFoundError:
            return []
        gone = []
        for name in names:
            if name in keep:
                continue
            try:
                self._remove(self.root / name)
            except OSError as e:  # tried again at the next heartbeat
                log.warning("cannot remove job directory %s: %s", self.root / name, e)
                continue
            if self.runas is not None:
                self.runas.forget(name)
            gone.append(name)
        return gone
