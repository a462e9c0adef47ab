"""Periodic checkpoints for "consistent recovery" (EDL §4.2).

When every worker of a job dies there is no survivor to take the state from;
the job is started again and resumes from the newest checkpoint on disk.
Rank 0 writes one every ``checkpoint_every`` steps at the batch boundary
(after the user's per-step code such as ``scheduler.step()``, the same point
where a rescale happens), so the file holds exactly the state the next step
starts from: model, optimizer, LR scheduler, RNG states, user extras, the data
cursor, the step and the batch-policy state.

Files are ``ckpt-<step>.pt`` in the checkpoint directory, written to a
temporary name in the same directory, fsynced and renamed (atomic on POSIX),
so a worker killed while writing never leaves a torn newest checkpoint. The
newest ``keep`` checkpoints are kept; a file that fails to load is skipped
in favour of the previous one.

:class:`Checkpointer` is one worker's view: where and how often (``init()``
arguments, else ``$TIDAL_CHECKPOINT_DIR`` / ``$TIDAL_CHECKPOINT_EVERY``), what
it wrote and which step it resumed from. Training thread only.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tidal import settings
from tidal.runtime.state import TrainState

log = logging.getLogger(__name__)

DEFAULT_EVERY = 100  # steps between checkpoints when only a directory is given
_NAME = re.compile(r"^ckpt-(\d+)\.pt$")


def checkpoint_path(directory: str | os.PathLike[str], step: int) -> Path:
    return Path(directory) / f"ckpt-{int(step):09d}.pt"


def list_checkpoints(directory: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """``(step, path)`` of the complete checkpoints, oldest first (temporary files are ignored)."""
    d = Path(directory)
    if not d.is_dir():
        return []
    out = []
    for p in d.iterdir():
        m = _NAME.match(p.name)
        if m:
            out.append((int(m.group(1)), p))
    return sorted(out)


def save_checkpoint(directory: str | os.PathLike[str], step: int, payload: dict[str, Any], keep: int = 2) -> Path:
    """Write ``payload`` atomically as the checkpoint of ``step`` (temp + fsync + rename)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(d, step)
    fd, tmp = tempfile.mkstemp(prefix=".ckpt-", suffix=".tmp", dir=d)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:  # make the rename itself durable
        dfd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass
    for _, old in list_checkpoints(d)[:-keep] if keep > 0 else []:
        try:
            old.unlink()
        except OSError:
            pass
    return final


def load_latest(directory: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The newest checkpoint that loads, or None."""
    for step, p in reversed(list_checkpoints(directory)):
        try:
            return torch.load(p, map_location="cpu", weights_only=False)
        except Exception as e:  # noqa: BLE001 - a damaged file: fall back to the previous one
            log.warning("checkpoint %s (step %d) unreadable (%s); trying an older one", p, step, e)
    return None


#: file systems every host of a cluster can share (network and cluster file systems)
SHARED_FS = frozenset({"nfs", "nfs4", "cifs", "smb3", "smbfs", "ceph", "lustre", "gpfs", "beegfs", "glusterfs",
                       "orangefs", "pvfs2", "panfs", "afs", "9p", "virtiofs", "juicefs", "weka", "wekafs"})


def mount_fstype(path: str | os.PathLike[str], mountinfo: str | None = None) -> str:
    """The file system type of the mount holding ``path`` (the longest
    mount point that is a prefix of it, from ``/proc/self/mountinfo``)."""
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return "unknown"
    target = os.path.realpath(os.fspath(path))
    best, fstype = "", "unknown"
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fields = left.split()
        if len(fields) < 5 or not right:
            continue
        mnt = fields[4].replace("\\040", " ")
        inside = target == mnt or target.startswith(mnt.rstrip("/") + "/")
        if inside and len(mnt) >= len(best):
            best, fstype = mnt, right.split()[0]
    return fstype


def node_local(directory: str | None, mountinfo: str | None = None) -> str:
    """Why a checkpoint directory is node-local ("/ckpt (ext4)"), or "" if
    it is shared, declared shared (``$TIDAL_CHECKPOINT_SHARED``), or unset."""
    if directory is None or settings.CHECKPOINT_SHARED.get():
        return ""
    fs = mount_fstype(directory, mountinfo)
    return "" if fs in SHARED_FS or fs.startswith("fuse.") else f"{directory} ({fs})"


@dataclass
class Checkpointer:
    """Periodic checkpoints of one worker (rank 0 writes them). ``every`` is
    0 without a directory; ``written`` lists what this worker wrote."""

    directory: str | None = None
    every: int = 0
    keep: int = 2
    resumed_from: int | None = None  # step of the checkpoint this job resumed from
    written: list[dict[str, Any]] = field(default_factory=list)
    last_step: int = -1  # step of the newest checkpoint written or resumed from

    @classmethod
    def configure(cls, directory: str | os.PathLike[str] | None = None, every: int | None = None,
                  keep: int = 2) -> "Checkpointer":
        """Arguments first, then the settings; a directory alone means every
        :data:`DEFAULT_EVERY` steps."""
        d = directory if directory is not None else settings.CHECKPOINT_DIR.get()
        if d is None:
            return cls(keep=keep)
        n = every if every is not None else settings.CHECKPOINT_EVERY.get()
        return cls(os.fspath(d), int(n) if n > 0 else DEFAULT_EVERY, keep)

    def due(self, step: int) -> bool:
        """Whether the boundary before ``step`` takes a periodic checkpoint."""
        return bool(self.every) and step % self.every == 0 and step != self.last_step and step > 0

    def write(self, train: TrainState, **meta: Any) -> Path:
        """Save what the next step starts from (and ``meta``) as the
        checkpoint of the current step, and record it."""
        assert self.directory is not None
        t0 = time.perf_counter()
        payload = dict(train.payload(), **meta, wall=time.time())
        path = save_checkpoint(self.directory, train.step, payload, keep=self.keep)
        self.last_step = train.step
        self.written.append({"step": train.step, "cursor": train.cursor, "path": str(path),
                             "write_s": time.perf_counter() - t0})
        return path

    def resume(self, train: TrainState, expect_step: int | None = None) -> bool:
        """A (re)started job: load the newest checkpoint into ``train``, if
        any. ``expect_step``: the step the job was suspended at; an older (or
        no) checkpoint raises :class:`ResumeMismatch`, since the job would
        redo steps and use their samples twice."""
        p = load_latest(self.directory) if self.directory is not None else None
        found = None if p is None else int(p.get("step", -1))
        if expect_step is not None and (found is None or found < expect_step):
            raise ResumeMismatch(expect_step, found, self.directory)
        if p is None:
            return False
        train.load_payload(p)
        self.resumed_from = self.last_step = train.step
        return True


class ResumeMismatch(RuntimeError):
    """A suspended job resumed from an older checkpoint than its suspension's."""

    def __init__(self, expected: int, found: int | None, directory: str | None) -> None:
        what = "no checkpoint" if found is None else f"the newest checkpoint is of step {found}"
        super().__init__(f"the job was suspended at step {expected} but {what} in {directory}: its checkpoint "
                         f"directory must be the one it was suspended to, on storage every host shares")
        self.expected, self.found = expected, found
