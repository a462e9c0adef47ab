"""Where a submitted job's script is, checked before the job is submitted.

A job's ``script`` is a path on the agents' hosts. The server cannot look at
those disks, so ``tidal submit`` does what ``sbatch`` does: a relative path is
resolved where the user typed it (against the job spec's folder, or the
current directory for ``--script``), and when the server is on this host (a
loopback URL, as with ``tidal up``) the file must exist and be readable here.
Against a remote server a missing file is only a warning: the agents' hosts
may have files this one does not, and a job whose workers cannot start fails
with the workers' own error (``tidal job ID``).
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit


@dataclass(frozen=True)
class ScriptCheck:
    """The script path to submit, and a problem with it (None: none found)."""

    script: str
    problem: str | None
    fatal: bool


def server_is_local(url: str) -> bool:
    """True when the server's (first) URL names this host's loopback."""
    host = urlsplit(url.split(",")[0].strip()).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_script(script: str, workdir: str, base: Path, server_url: str) -> ScriptCheck:
    """Resolve ``script`` (relative to ``workdir`` if given, else to ``base``)
    and check it exists here; fatal only when the server is on this host."""
    if script.startswith("-") or (workdir and not Path(workdir).is_absolute()):
        return ScriptCheck(script, None, False)  # the server refuses an option; a relative workdir is the agents'
    where = Path(workdir) if workdir else base
    path = Path(script) if Path(script).is_absolute() else (where / script).resolve()
    out = script if workdir else str(path)
    local = server_is_local(server_url)
    if path.is_file() and os.access(path, os.R_OK):
        return ScriptCheck(out, None, False)
    why = "is not a readable file" if path.exists() else "does not exist"
    if local:
        return ScriptCheck(out, f"{path} {why} (the server is on this host, so its agents are too)", True)
    return ScriptCheck(out, f"{path} {why} on this host; submitting anyway, since the agents' hosts of "
                            f"{server_url} may have it", False)
