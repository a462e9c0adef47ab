"""Job processes as an unprivileged OS user (``tidal agent --run-as USER``).

An agent that runs as root starts every job master and worker as ``USER``
(its uid, its primary group, no supplementary groups, umask 077), so a
tenant's script cannot read what only the agent may: its process table, the
server's files on a shared host, other users' files. The job's checkpoint
directory is created for that user with mode 0700 (only the job's own
processes, the agent and root can enter it). The user must be able to read
the training script and to traverse to the checkpoint directory and to the
agent's work directory (the file telling workers where their master is);
docs/security.md.
"""

from __future__ import annotations

import logging
import os
import pwd
import stat
import subprocess
from pathlib import Path
from typing import Any

from tidal import settings
from tidal.agent.proctable import Child, Handle

log = logging.getLogger("tidal.agent")


class RunAs:
    """A launcher (see :data:`tidal.agent.agent.Launcher`) that starts each
    process as ``user``; refused unless the agent runs as root."""

    local = True  # its processes run on this machine: the agent's limits apply to them

    def __init__(self, user: str) -> None:
        try:
            pw = pwd.getpwnam(user)
        except KeyError:
            raise ValueError(f"--run-as {user!r}: no such user on this host") from None
        if os.geteuid() != 0:
            raise ValueError(f"--run-as {user!r} needs the agent to run as root (it runs as uid {os.geteuid()})")
        if pw.pw_uid == 0:
            raise ValueError("--run-as root would give tenants' scripts root: name an unprivileged user")
        self.user, self.uid, self.gid = user, pw.pw_uid, pw.pw_gid

    def private_dir(self, path: Path) -> None:
        """``path`` (and missing parents) for this user only: 0700, owned by
        it. A job's env may name its checkpoint directory, so the agent (root)
        hands over only a directory it just made or one the user owns
        already; any other (``/etc``, another user's, a symbolic link) is
        left as it is, and the job finds out whether it may write there."""
        path.parent.mkdir(parents=True, exist_ok=True)
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
            if (made and st.st_uid == os.geteuid()) or st.st_uid == self.uid:
                os.fchown(fd, self.uid, self.gid)
                os.fchmod(fd, 0o700)
            else:
                log.warning("checkpoint directory %s belongs to uid %d, not to %s: left as it is", path, st.st_uid,
                            self.user)
        finally:
            os.close(fd)

    def __call__(self, w: dict[str, Any], argv: list[str], env: dict[str, str], cwd: str | None,
                 log_path: Path) -> Handle:
        ckpt = env.get(settings.CHECKPOINT_DIR.name)
        if ckpt:
            self.private_dir(Path(ckpt))
        env = {**env, "USER": self.user, "LOGNAME": self.user}
        with log_path.open("ab") as fh:  # opened by the agent: the user need not reach the log directory
            return Child(subprocess.Popen(argv, env=env, cwd=cwd, stdout=fh, stderr=subprocess.STDOUT,
                                          start_new_session=True, user=self.uid, group=self.gid,
                                          extra_groups=[], umask=0o077))
