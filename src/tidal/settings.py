"""Every ``TIDAL_*`` environment variable, in one place.

Nothing else in :mod:`tidal` reads the environment for a Tidal setting: code
asks this module (``settings.HOME.get()``, ``settings.home()``), and code that
starts a process names a variable through its :class:`Setting` (``{settings.
WORKER_ID.name: "w3"}``). ``docs/settings.md`` is generated from this table
(``python -m tidal.settings``) and a test keeps the two equal.

A setting is read when asked for, not at import time, so a test or a launcher
that changes ``os.environ`` is seen at once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Generic, TypeVar

T = TypeVar("T")

_ALL: list["Setting"] = []


def _bool(raw: str) -> bool:
    v = raw.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected 1/0, true/false, yes/no or on/off, not {raw!r}")


@dataclass(frozen=True)
class Setting(Generic[T]):
    """One environment variable: its name, parser, default and one line of doc."""

    name: str
    parse: Callable[[str], T]
    default: T
    doc: str
    who: str  # which processes read it: "worker", "master", "server", "agent", "cli"

    def __post_init__(self) -> None:
        _ALL.append(self)

    def raw(self) -> str | None:
        """The variable's text, or None when unset or empty."""
        v = os.environ.get(self.name)
        return v if v else None

    def get(self, default: T | None = None) -> T:
        """The parsed value; ``default`` (or the setting's own) when unset. A
        bad value raises ``ValueError`` naming the variable."""
        raw = self.raw()
        if raw is None:
            return self.default if default is None else default
        try:
            return self.parse(raw)
        except ValueError as e:
            raise ValueError(f"${self.name}={raw!r}: {e}") from None

    def is_set(self) -> bool:
        return self.raw() is not None


def _str(x: str) -> str:
    return x


def _opt_str(x: str) -> str | None:
    return x or None


# -- where things live -------------------------------------------------------------
HOME: Setting[str] = Setting("TIDAL_HOME", _str, "", "state directory (database, tokens, logs, checkpoints); "
                             "default ~/.tidal", "all")
LOG_LEVEL: Setting[str | None] = Setting("TIDAL_LOG_LEVEL", _opt_str, None,
                                         "log level of worker processes (DEBUG, INFO, ...); unset: Python's default",
                                         "worker")

# -- addresses (several hosts: see tidal.net) -----------------------------------------
BIND_ADDR: Setting[str] = Setting("TIDAL_BIND_ADDR", _str, "127.0.0.1",
                                  "address the job master, its store and the server listen on "
                                  "(0.0.0.0: every interface)", "master")
ADVERTISE_ADDR: Setting[str | None] = Setting("TIDAL_ADVERTISE_ADDR", _opt_str, None,
                                              "address peers are told to reach this process at; default: the "
                                              "bind address, or with 0.0.0.0 the interface routing to the "
                                              "peer", "master")

# -- a worker process (set by whoever starts it) ------------------------------------
MASTER_URL: Setting[str | None] = Setting("TIDAL_MASTER_URL", _opt_str, None,
                                          "the job master's HTTP address; unset: the script runs alone", "worker")
MASTER_FILE: Setting[str | None] = Setting("TIDAL_MASTER_FILE", _opt_str, None,
                                           "a file holding the job master's current URL (the agent rewrites it when "
                                           "the master restarts on another host); read when the master is "
                                           "unreachable", "worker")
WORKER_ID: Setting[str | None] = Setting("TIDAL_WORKER_ID", _opt_str, None,
                                         "this worker's id within its job (w0, w1, ...)", "worker")
NODE: Setting[str | None] = Setting("TIDAL_NODE", _opt_str, None,
                                    "the agent's node name, set by the agent for every process it starts", "worker")
HOST: Setting[str | None] = Setting("TIDAL_HOST", _opt_str, None,
                                    "this worker's host for topology-aware state replication; default "
                                    "$TIDAL_NODE, then the host name", "worker")
SWITCH: Setting[str] = Setting("TIDAL_SWITCH", _str, "", "the switch (rack) of this worker's host, if known",
                               "worker")
STATE_MAX_MBPS: Setting[float] = Setting("TIDAL_STATE_MAX_MBPS", float, 0.0,
                                         "cap on one source's state-transfer egress in MB/s (0: none)", "worker")
HEARTBEAT_S: Setting[float] = Setting("TIDAL_HEARTBEAT_S", float, 0.25,
                                      "rank 0's progress heartbeat interval in seconds", "worker")
DEVICE: Setting[str | None] = Setting("TIDAL_DEVICE", _opt_str, None,
                                      "this worker's device (cpu, cuda:1); default: its GPU if it has one "
                                      "(CUDA_VISIBLE_DEVICES, then LOCAL_RANK), else the CPU", "worker")
COLLECTIVE_TIMEOUT_S: Setting[float] = Setting("TIDAL_COLLECTIVE_TIMEOUT_S", float, 1800.0,
                                               "how long a collective may wait for a live peer (a dead peer "
                                               "fails it at once); see docs/runtime.md, Timeouts", "worker")
SILENT_TIMEOUT_S: Setting[float] = Setting("TIDAL_SILENT_TIMEOUT_S", float, 10.0,
                                           "a member whose liveness beats stopped this many seconds while a peer "
                                           "still beats is cut off (a silent host): the job master aborts its "
                                           "generation and the others leave their collective and re-form without "
                                           "it (0: wait for the hang timeout or the collective timeout); see "
                                           "docs/runtime.md, Failures", "master")
OVERLAP: Setting[bool] = Setting("TIDAL_OVERLAP", _bool, True,
                                 "bucketed gradient all-reduce overlapped with backward (0: after backward)",
                                 "worker")
CHECK_EVERY: Setting[int] = Setting("TIDAL_CHECK_EVERY", int, 100,
                                    "the replicas compare a checksum of parameters, optimizer state and extras in "
                                    "the first step of every generation and every this many steps (0: only after a "
                                    "switch; -1: never); a difference fails the job naming what differs", "worker")
CHECKPOINT_DIR: Setting[str | None] = Setting("TIDAL_CHECKPOINT_DIR", _opt_str, None,
                                              "periodic checkpoints and suspend/resume go here; unset: none",
                                              "worker")
RESUME_STEP: Setting[int | None] = Setting("TIDAL_RESUME_STEP", lambda v: int(v) if v not in (None, "") else None,
                                           None, "a job resumed after a suspension: the step it was suspended at "
                                           "(set by the control plane); resuming from an older checkpoint is an "
                                           "error", "worker")
CHECKPOINT_EVERY: Setting[int] = Setting("TIDAL_CHECKPOINT_EVERY", int, 0,
                                         "checkpoint every N steps (0 with a directory: every 100)", "worker")
CHECKPOINT_SHARED: Setting[bool] = Setting("TIDAL_CHECKPOINT_SHARED", _bool, False,
                                           "declare the checkpoint directory shared by every host although its "
                                           "file system looks node-local (a job spanning hosts needs shared "
                                           "storage)", "worker")
FAULTS: Setting[str | None] = Setting("TIDAL_FAULTS", _opt_str, None,
                                      "injected faults for tests, e.g. kill:w1@7;slow:w0@3=20 "
                                      "(see tidal.runtime.faults)", "worker")
FAULT_LOG: Setting[str | None] = Setting("TIDAL_FAULT_LOG", _opt_str, None,
                                         "append a JSON line per injected fault to this file", "worker")
MAX_STEPS: Setting[int] = Setting("TIDAL_MAX_STEPS", int, 0,
                                  "the job's termination condition: training ends at this global step whatever "
                                  "the script's own loop says (a job spec's iterations; tidal run --max-steps); "
                                  "0: the script's loop decides", "worker")
MASTER_WAIT_S: Setting[float] = Setting("TIDAL_MASTER_WAIT_S", float, 30.0,
                                        "seconds a starting worker keeps trying to reach its job master before "
                                        "it gives up (one line, exit 1)", "worker")
WARM_SPARES: Setting[int] = Setting("TIDAL_WARM_SPARES", int, 2,
                                    "tidal run keeps this many warm worker processes (interpreter and imports "
                                    "done, idle until granted) so that a scale-out's newcomers skip the start-up; "
                                    "never more than --max-workers allows; 0: none", "master")
JOIN_TIMEOUT_S: Setting[float] = Setting("TIDAL_JOIN_TIMEOUT_S", float, 90.0,
                                         "seconds a started worker has to register with its job master (tidal "
                                         "run warns at half of it, then fails; a scale-out's newcomers are given "
                                         "up after it)", "master")

# -- control plane --------------------------------------------------------------------
JOB_TOKEN: Setting[str] = Setting("TIDAL_JOB_TOKEN", _str, "",
                                  "the job's credential, set by the agent for the job's master and workers: the "
                                  "master's HTTP API requires it, and it acts on this job only", "worker")
JOB_TOKEN_FILE: Setting[str | None] = Setting("TIDAL_JOB_TOKEN_FILE", _opt_str, None,
                                              "a file (0600, the job's own) holding the job's credential: what "
                                              "an agent sets instead of $TIDAL_JOB_TOKEN, so the credential is in "
                                              "no process's environment", "worker")
JOB_DIR: Setting[str | None] = Setting("TIDAL_JOB_DIR", _opt_str, None,
                                       "the job's private directory on this host (0700, owned by the job's user), "
                                       "set by the agent: its credential file, its master's saved state, $HOME",
                                       "worker")
ADMIN_TOKEN: Setting[str | None] = Setting("TIDAL_ADMIN_TOKEN", _opt_str, None,
                                           "the admin token tidal server uses (default: $TIDAL_HOME/admin.token, "
                                           "created 0600); keeps it off the command line", "server")
ENV_ALLOW: Setting[str | None] = Setting("TIDAL_ENV_ALLOW", _opt_str, None,
                                         "comma-separated extra variables (or PREFIX*) a job spec's env may set, "
                                         "beyond the allow-list of docs/security.md", "server")
TENANT_ROOT: Setting[str | None] = Setting("TIDAL_TENANT_ROOT", _opt_str, None,
                                           "when set, a tenant's job workdir and script must be inside "
                                           "ROOT/<user> (the admin's are not checked)", "server")
SECRET_FILE: Setting[str | None] = Setting("TIDAL_SECRET_FILE", _opt_str, None,
                                           "the server's secret (agents', nodes' and jobs' credentials derive from "
                                           "it); default $TIDAL_HOME/server.secret; server replicas share one",
                                           "server")
PUBLIC_URL: Setting[str | None] = Setting("TIDAL_PUBLIC_URL", _opt_str, None,
                                          "the URL(s) job masters reach the server at, comma-separated for "
                                          "replicas (default: this server's own address)", "server")
LEADER_LEASE_S: Setting[float] = Setting("TIDAL_LEADER_LEASE_S", float, 20.0,
                                         "server replicas over PostgreSQL: a leader whose host goes silent loses "
                                         "its lease within this many seconds (TCP keepalives and timeouts on "
                                         "every store connection, both ends) and stops scheduling sooner; at "
                                         "least 5", "server")
READY_DB_TIMEOUT_S: Setting[float] = Setting("TIDAL_READY_DB_TIMEOUT_S", float, 2.0,
                                             "GET /readyz fails when the store does not answer a trivial query "
                                             "within this many seconds", "server")
READY_LOOP_S: Setting[float] = Setting("TIDAL_READY_LOOP_S", float, 60.0,
                                       "a leading replica whose scheduling loop completed no round for this long "
                                       "(at least 5 ticks) is stuck: GET /readyz fails and it hands the lead on",
                                       "server")
RUN_AS: Setting[str | None] = Setting("TIDAL_RUN_AS", _opt_str, None,
                                      "an agent running as root starts job processes unprivileged: a range of "
                                      "uids LO-HI gives each job a uid of its own (recommended), a user name "
                                      "runs every job as that user", "agent")
CA_FILE: Setting[str | None] = Setting("TIDAL_CA_FILE", _opt_str, None,
                                       "CA bundle (PEM) that https:// servers are verified against (agents, job "
                                       "masters, CLI); unset: the system's CAs", "cli")
SERVER: Setting[str | None] = Setting("TIDAL_SERVER", _opt_str, None,
                                      "the server's URL for the CLI; default $TIDAL_HOME/server.json, "
                                      "then http://127.0.0.1:8470", "cli")
TOKEN: Setting[str | None] = Setting("TIDAL_TOKEN", _opt_str, None,
                                     "the CLI's API token; default $TIDAL_HOME/token, then admin.token", "cli")

ENGINE: Setting[str] = Setting("TIDAL_ENGINE", _str, "agents",
                               "where jobs run: `agents` (Tidal's agents register) or `ray` (Ray's nodes, as agents "
                               "inside the server)", "server")
RAY_ADDRESS: Setting[str | None] = Setting("TIDAL_RAY_ADDRESS", _opt_str, None,
                                           "the Ray cluster of `--engine ray` (host:port of its GCS); default "
                                           "$RAY_ADDRESS, else the local one", "server")


# -- liveness: every job makes progress or frees its GPUs (docs/control.md, "Liveness") ----------
CRASH_LIMIT: Setting[int] = Setting("TIDAL_CRASH_LIMIT", int, 3,
                                    "a job whose workers exit with the same error this many times fails with it "
                                    "(each exit is replaced after a growing back-off)", "server")
CRASH_BACKOFF_S: Setting[float] = Setting("TIDAL_CRASH_BACKOFF_S", float, 5.0,
                                          "the first back-off before a worker that exited with an error is "
                                          "replaced; doubled at each repeat, at most 300 s", "server")
RESTART_LIMIT: Setting[int] = Setting("TIDAL_RESTART_LIMIT", int, 3,
                                      "restarts from the checkpoint of a job left without a live worker or "
                                      "stalled, before it fails", "server")
STALL_TIMEOUT_S: Setting[float] = Setting("TIDAL_STALL_TIMEOUT_S", float, 900.0,
                                          "a formed job that commits no step for this long is stalled: restarted "
                                          "from its checkpoint (0: never judged)", "server")
START_TIMEOUT_S: Setting[float] = Setting("TIDAL_START_TIMEOUT_S", float, 90.0,
                                          "a started job whose workers do not form a first generation within "
                                          "this long fails (the script never calls tidal.runtime.init())",
                                          "server")
CHANGE_TIMEOUT_S: Setting[float] = Setting("TIDAL_CHANGE_TIMEOUT_S", float, 120.0,
                                           "a change in flight (a scale-out's newcomers joining, a shrink, a "
                                           "suspension, a restart) is judged late after this long", "server")
NODE_GRACE_S: Setting[float] = Setting("TIDAL_NODE_GRACE_S", float, 60.0,
                                       "an agent silent this long is down: its processes are lost (before "
                                       "that, its node only takes no new work)", "server")


LIMITS: Setting[str] = Setting("TIDAL_LIMITS", _str, "auto",
                               "how an agent enforces a job's per-worker `resources`: `auto` (cgroup v2, else v1, "
                               "else the RSS watchdog), `cgroup2`, `cgroup1`, `watchdog` or `off`", "agent")


def job_token() -> str:
    """The job's credential: ``$TIDAL_JOB_TOKEN``, else the contents of
    ``$TIDAL_JOB_TOKEN_FILE``, else "" (a job outside the control plane).
    A named file that cannot be read raises ``ValueError`` naming it."""
    if (tok := JOB_TOKEN.raw()) is not None:
        return tok
    path = JOB_TOKEN_FILE.get()
    if path is None:
        return ""
    try:
        return Path(path).read_text().strip()
    except OSError as e:
        raise ValueError(f"${JOB_TOKEN_FILE.name}={path!r}: {e.strerror or e}") from None


def home() -> Path:
    """``$TIDAL_HOME`` or ``~/.tidal`` (not created here)."""
    return Path(HOME.get() or Path.home() / ".tidal")


def all_settings() -> list[Setting]:
    return list(_ALL)


def markdown() -> str:
    """The table of ``docs/settings.md``."""
    rows = ["| variable | default | read by | meaning |", "|---|---|---|---|"]
    for s in _ALL:
        d = "" if s.default in (None, "") else str(s.default)
        rows.append(f"| `{s.name}` | {('`' + d + '`') if d else '—'} | {s.who} | {s.doc} |")
    head = ("# Settings\n\nEvery `TIDAL_*` environment variable, from `tidal/settings.py` "
            "(regenerate with `python -m tidal.settings > docs/settings.md`). Command-line options override them "
            "where both exist.\n\n")
    return head + "\n".join(rows) + "\n"


if __name__ == "__main__":  # pragma: no cover - docs generator
    print(markdown(), end="")
