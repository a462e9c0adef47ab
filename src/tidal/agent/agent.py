"""The node agent's reconcile loop (see the package docstring)."""

from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlparse

from tidal import settings
from tidal.agent.limits import Limiter, Limits, Placement, node_memory
from tidal.agent.proctable import EXIT_UNKNOWN, Child, Handle, Proc, ProcTable
from tidal.agent.runas import JobDirs, job_name
from tidal.net import LOOPBACK, advertise_addr
from tidal.control.jobproc import EXIT_REPLACED
from tidal.httpjson import JsonHttp, Unavailable

log = logging.getLogger("tidal.agent")

#: variables of the agent's environment a job's processes do not inherit (credentials, and what
#: the agent sets per job)
_SECRETS = frozenset({settings.TOKEN.name, settings.ADMIN_TOKEN.name, settings.JOB_TOKEN.name,
                      settings.JOB_TOKEN_FILE.name, settings.JOB_DIR.name})

MASTER_RESTARTS = 3  # a job master that keeps crashing is then reported failed

#: a report's ``error`` is cut to this many characters (the server keeps no more)
MAX_ERROR = 2000
#: OS errors of a launch that may pass (the node short of processes, memory or file handles): the
#: launch is tried again at the next heartbeats, :data:`LAUNCH_TRIES` times in all; any other
#: failure (E2BIG, ENOENT, EACCES, a NUL byte, ...) would fail again and is reported at once
TRANSIENT = frozenset({errno.EAGAIN, errno.ENOMEM, errno.EMFILE, errno.ENFILE, errno.EINTR})
LAUNCH_TRIES = 3

#: starts one process row: ``launch(row, argv, env, cwd, log_path)`` -> its handle; the process
#: appends its stdout and stderr to ``log_path`` and leads its own session
Launcher = Callable[[dict[str, Any], list[str], dict[str, str], "str | None", Path], Handle]


def popen_launcher(w: dict[str, Any], argv: list[str], env: dict[str, str], cwd: str | None, log_path: Path) -> Handle:
    """The default launcher: a child process of the agent on this machine."""
    with log_path.open("ab") as fh:
        return Child(subprocess.Popen(argv, env=env, cwd=cwd, stdout=fh, stderr=subprocess.STDOUT,
                                      start_new_session=True))


popen_launcher.local = True  # type: ignore[attr-defined]  # its processes run on this machine: limits apply


def limiter_for(launcher: Launcher) -> Limiter:
    """Limits (``$TIDAL_LIMITS``) for a launcher whose processes run here
    (``launcher.local``); none for others (e.g. Ray actors)."""
    if getattr(launcher, "local", False):
        return Limiter.detect(settings.LIMITS.get())
    log.warning("per-worker resource limits are not enforced for processes of this launcher")
    return Limiter(None)


def start_limited(limiter: Limiter, launcher: Launcher, w: dict[str, Any], argv: list[str], env: dict[str, str],
                  cwd: str | None, log_path: Path) -> tuple[Handle, Placement | None]:
    """Launch a process row inside its limits (a worker row's ``resources``);
    its handle and placement. A failed launch leaves no cgroup behind."""
    limits = Limits.of(w.get("resources")) if str(w.get("kind") or "worker") == "worker" else Limits()
    pl = limiter.place(f"{os.getpid()}-{w['id']}-{w['job']}-{w['name']}", limits)
    try:
        handle = launcher(w, limiter.wrap(pl, argv), env, cwd, log_path)
    except BaseException:
        limiter.release(pl)
        raise
    limiter.started(pl, handle)
    return handle, pl


def one_line(text: str, limit: int = MAX_ERROR) -> str:
    """``text`` as one line of at most ``limit`` characters that JSON, UTF-8
    and the store all take: lone surrogates and control characters escaped
    (``\\udc80``, ``\\x00``), a long text cut in its middle."""
    if len(text) > 4 * limit:  # only its ends can show: a 128 KiB argument costs no more than they do
        text = text[:2 * limit] + text[-2 * limit:]
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    text = "".join(c if c >= " " and c != "\x7f" else ("\\x%02x" % ord(c)) for c in text)
    if len(text) > limit:
        keep = (limit - 5) // 2
        text = f"{text[:keep]} ... {text[len(text) - keep:]}"
    return text


def json_safe(value: Any) -> Any:
    """``value`` with every text in it encodable as UTF-8 (a lone surrogate,
    which no JSON parser on the server may take, becomes ``\\udcXX``)."""
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, dict):
        return {json_safe(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def launch_error(e: BaseException) -> str:
    """The one-line reason of a failed launch, e.g. ``launch failed: [Errno 7]
    Argument list too long: '/usr/bin/python3'``."""
    text = str(e) if isinstance(e, OSError) else f"{type(e).__name__}: {e}"
    return one_line(f"launch failed: {text}")


def ended_report(wid: int, state: str, error: str = "") -> dict[str, Any]:
    """The report of a process row that never ran: ``failed`` with the
    reason its launch failed (in ``error`` and as its one log line), or
    ``exited`` when it was told to stop before it started. Its exit code
    is None: it never ran, so it has none."""
    return {"id": wid, "state": state, "pid": 0, "exit_code": None, "log": f"tidal agent: {error}\n" if error else "",
            **({"error": error} if error else {})}


def detect_gpus() -> int:
    """Number of NVIDIA GPUs through NVML, 0 when there is none (or no NVML)."""
    try:
        import pynvml  # from nvidia-ml-py

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no driver, no library: no GPUs
        return 0


_VENDOR_WORDS = {"nvidia", "tesla", "geforce", "quadro"}


def gpu_type_name(nvml_name: str) -> str:
    """The GPU type a scheduler compares, from NVML's device name: vendor
    and product-line words dropped, the model's words joined, memory and form
    factor left out ("NVIDIA A100-SXM4-40GB" -> "A100", "Tesla T4" -> "T4",
    "NVIDIA GeForce RTX 2080 Ti" -> "RTX2080Ti", "NVIDIA H100 80GB HBM3" -> "H100")."""
    words = [w for w in nvml_name.replace("_", " ").split() if w.lower() not in _VENDOR_WORDS]
    out = []
    for w in words:
        head = w.split("-")[0]
        if not head or head.upper().endswith("GB") or head.upper() in ("PCIE", "SXM", "SXM2", "SXM4", "SXM5", "HBM3",
                                                                      "HBM2", "HBM2E", "NVL"):
            break
        out.append(head)
        if head != w:  # "A100-SXM4-40GB": the model is the part before the dash
            break
    return "".join(out)


def detect_gpu_type() -> str:
    """GPU 0's type through NVML (:func:`gpu_type_name`), "" when there is no NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
            return gpu_type_name(name.decode() if isinstance(name, bytes) else str(name))
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no driver, no library: untyped
        return ""


def gpu_utils(virtual: bool, num_gpus: int, procs: dict[int, Proc]) -> dict[int, float]:
    """Each GPU's utilisation (0-1) through NVML; with virtual GPUs, 1 for
    those a process runs on."""
    if virtual:
        busy = {int(p.gpu) for p in procs.values() if p.gpu.lstrip("-").isdigit()}
        return {i: (1.0 if i in busy else 0.0) for i in range(num_gpus)}
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return {i: float(pynvml.nvmlDeviceGetUtilizationRates(pynvml.nvmlDeviceGetHandleByIndex(i)).gpu) / 100
                    for i in range(num_gpus)}
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001
        return {}


def write_url(path: Path, url: str) -> bool:
    """Write ``url`` to ``path`` atomically, readable by every job user (a
    URL is no secret); False (logged) if it cannot be."""
    try:
        shared_dir(path.parent)
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        with os.fdopen(fd, "w") as fh:
            os.fchmod(fd, 0o644)
            fh.write(url)
        os.replace(tmp, path)
    except (OSError, ValueError) as e:  # tried again at the next heartbeat
        log.error("cannot write %s: %s", path, e)
        return False
    return True


def shared_dir(path: Path) -> None:
    """``path``, the agent's, which job users may pass and read (0755): the
    master URL files, the gates."""
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o755)


def private_log(path: Path) -> None:
    """``path``'s directories (``logs/`` and ``logs/JOB/``) 0700 and the
    file itself 0600, the agent's: a job writes its log through the file
    the agent opened for it and reads no other job's."""
    for d in (path.parent.parent, path.parent):
        d.mkdir(mode=0o700, exist_ok=True)
        os.chmod(d, 0o700)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


def private_logs(root: Path) -> None:
    """Logs written before (by an older agent, 0755 and 0644) made private:
    directories 0700, files 0600; symbolic links are left alone."""
    if not root.is_dir() or root.is_symlink():
        return
    for top, dirs, files in os.walk(root):  # never walks into a linked directory
        os.chmod(top, 0o700)
        for f in files:
            if not os.path.islink(os.path.join(top, f)):
                os.chmod(os.path.join(top, f), 0o600)


def process_env(w: dict[str, Any], node: str, master_file: Path, address: str) -> dict[str, str]:
    """The environment a process row runs with: the agent's own without its
    credentials (a job's processes get their job's from the server), the
    row's, and where this node and the job's master are."""
    env = {k: v for k, v in os.environ.items() if k not in _SECRETS}
    env.update({k: str(v) for k, v in (w.get("env") or {}).items()})
    env[settings.NODE.name] = node
    env[settings.MASTER_FILE.name] = str(master_file)
    # a job master started here listens on this node's address (loopback on one host)
    env[settings.BIND_ADDR.name] = env[settings.ADVERTISE_ADDR.name] = address
    return env


def stop_step(p: Proc, now: float) -> None:
    """One step of stopping a process: SIGTERM, then SIGKILL once 10 s passed."""
    if not p.stop_sent:
        p.handle.send_signal(signal.SIGTERM)
        p.stop_sent = now
    elif now - p.stop_sent > 10:
        p.handle.kill()


class Starter:
    """Starts the process rows of one node: ``launcher`` inside ``limiter``'s
    limits, the output appended to ``workdir/logs/JOB/NAME.log`` (0600 in
    0700 directories), with the job's private directory and credential file
    (:class:`~tidal.agent.runas.JobDirs`, ``workdir/jobs/JOB``), a gated
    row behind its gate file (:mod:`tidal.agent.prewarm`). ``live``: the
    agent's processes (which job holds which uid)."""

    def __init__(self, node: str, address: str, workdir: Path, launcher: Launcher, limiter: Limiter,
                 live: Callable[[], list[Proc]] = list) -> None:
        self.node, self.address, self.workdir = node, address, workdir
        self.launcher, self.limiter, self.live = launcher, limiter, live
        self.jobs = JobDirs(workdir / "jobs", launcher)
        private_logs(workdir / "logs")

    def live_pids(self) -> list[tuple[str, int]]:
        return [(p.job, p.handle.pid) for p in self.live() if p.handle.poll() is None]

    def master_file(self, job: str) -> Path:
        """Where this node's workers of ``job`` read its master's URL."""
        return self.workdir / "masters" / f"{job}.url"

    def start(self, w: dict[str, Any], offset: int | None, restarts: int) -> Proc:
        """Start row ``w``; raises what kept it from starting. Its log is
        shipped from ``offset`` (None: from the log's end)."""
        log_path = self.workdir / "logs" / job_name(str(w["job"])) / f"{w['name']}.log"
        start = offset if offset is not None else (log_path.stat().st_size if log_path.exists() else 0)
        private_log(log_path)
        env = process_env(w, self.node, self.master_file(w["job"]), self.address)
        # the job's directory, its credential in it; its uid from the job's number (the server's slot)
        self.jobs.prepare(str(w["job"]), env, self.live_pids, w.get("slot"))
        argv, gate = list(w["argv"]), None
        if w.get("gated"):
            gates = self.workdir / "gates"
            shared_dir(gates)
            gate = str(gates / f"{w['id']}")
            argv = [argv[0], "-u", "-m", "tidal.agent.prewarm", gate, "--", *argv]
        handle, pl = start_limited(self.limiter, self.launcher, w, argv, env, w.get("cwd") or None, log_path)
        return Proc(int(w["id"]), w["job"], w["name"], str(w.get("kind") or "worker"), handle, log_path,
                    offset=start, gpu=env.get("CUDA_VISIBLE_DEVICES", "-1"), gate=gate, restarts=restarts, spec=w,
                    limits=pl)


class Refused(RuntimeError):
    """The server answered a request with an error status."""

    def __init__(self, status: int, detail: Any) -> None:
        super().__init__(f"HTTP {status}: {detail}")
        self.status = status


class Agent:
    def __init__(
        self,
        server: str,
        token: str,
        name: str,
        num_gpus: int,
        *,
        virtual: bool = False,
        interval_s: float = 0.5,
        workdir: Path | None = None,
        address: str | None = None,
        labels: dict[str, str] | None = None,
        launcher: Launcher = popen_launcher,
        limiter: Limiter | None = None,
    ) -> None:
        self.server = server.rstrip("/")
        self.name = name
        # what the server and the job masters here are reached at: the interface routing to the server
        self.address = address or advertise_addr("0.0.0.0", peer=urlparse(self.server.split(",")[0]).hostname or LOOPBACK)
        self.num_gpus = num_gpus
        self.labels = dict(labels or {})  # e.g. {"switch": "rack1"}: the node's place in the topology
        self.virtual = virtual
        self.launcher = launcher  # how a process row is started (a subprocess here, or e.g. a Ray actor)
        self.interval_s = interval_s
        self.workdir = Path(workdir or settings.home() / "agents" / name)
        self.workdir.mkdir(parents=True, exist_ok=True)
        # the processes a previous run of this agent launched are adopted, never launched twice
        self.table = ProcTable(self.workdir / "procs.json")
        self.procs: dict[int, Proc]
        self.finished: dict[int, dict[str, Any]]  # exit reports not yet acknowledged by the server
        self.procs, self.finished = self.table.load()
        self.limiter = limiter or limiter_for(launcher)  # per-worker memory and CPU limits
        for p in self.procs.values():
            self.limiter.watch(p.limits, p.handle)
        self.acked: set[int] = set()  # exited processes the server knows about (never relaunched)
        self.tries: dict[int, int] = {}  # launches of a row that failed with a transient OS error
        self._stop = threading.Event()
        self.registered = False
        self._urls: dict[str, str] = {}  # the master URL last written per job
        # an unreachable server is retried for one interval, then on the next tick
        self.join_token = token
        self.http = JsonHttp(self.server, token=token, timeout_s=10.0, patience_s=interval_s)
        self.starter = Starter(name, self.address, self.workdir, launcher, self.limiter,
                               live=lambda: list(self.procs.values()))

    # -- transport ----------------------------------------------------------------
    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        status, ans = self.http.call("POST", path, body)
        if status >= 400:
            raise Refused(status, ans)
        return ans if isinstance(ans, dict) else {}

    # -- loop ------------------------------------------------------------------------
    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        log.info("agent %s at %s: %d %s GPU(s), server %s", self.name, self.address, self.num_gpus,
                 "virtual" if self.virtual else "NVIDIA", self.server)
        while not self._stop.is_set():
            try:
                if not self.registered:
                    ans = self._post("/internal/agents/register", {"name": self.name, "num_gpus": self.num_gpus,
                                                                   "virtual": self.virtual, "address": self.address,
                                                                   "labels": self.labels, "memory": node_memory()})
                    # from now on the node's own credential (its heartbeats only), not the join token
                    self.http.token = str(ans.get("token") or self.join_token)
                    self.registered = True
                self.tick()
            except Refused as e:
                if e.status in (401, 403, 404):  # a new store or secret: register again with the join token
                    self.registered = False
                    self.http.token = self.join_token
                log.warning("server answered %s; retrying", e.status)
            except (Unavailable, OSError) as e:
                log.warning("server unreachable (%s); processes keep running", e)
            except Exception:  # noqa: BLE001 - a bug, or an answer it cannot read: the agent stays up
                log.exception("heartbeat failed; processes keep running")
            self._stop.wait(self.interval_s)
        self.shutdown()

    def tick(self) -> None:
        reports = self._collect()
        self._save()  # an exit seen is reported also by the next run of this agent
        ans = self._post(f"/internal/agents/{self.name}/heartbeat",
                         json_safe({"procs": reports, "utils": gpu_utils(self.virtual, self.num_gpus, self.procs)}))
        # acknowledged: exit reports are delivered, log chunks too
        for r in reports:
            r["log"] = ""
            if r["state"] in ("exited", "failed"):
                self.finished.pop(r["id"], None)
                self.acked.add(r["id"])
        wanted = ans.get("workers", [])
        self._reconcile(wanted)
        self._write_master_urls(ans.get("masters") or {})
        self._save()
        # a job with no process here that the server wants here no more: its directory goes
        self.starter.jobs.sweep({p.job for p in self.procs.values()}
                                | {str(w.get("job")) for w in wanted if isinstance(w, dict)})

    def _save(self) -> None:
        try:
            self.table.save(self.procs, self.finished)
        except OSError as e:
            log.error("cannot write the process table %s: %s", self.table.path, e)

    def _collect(self) -> list[dict[str, Any]]:
        """Reports for every live process, plus unacknowledged exits (kept until
        a heartbeat gets through, so an exit is never lost). An adopted
        process that ended is ``failed`` with exit code None (unknown)."""
        out = []
        for p in list(self.procs.values()):
            try:
                rep = self._report(p)
            except Exception:  # noqa: BLE001 - one process never keeps the others' reports from the server
                log.exception("cannot report %s/%s (pid %d)", p.job, p.name, p.handle.pid)
                continue
            if rep is not None:
                out.append(rep)
        out.extend(self.finished.values())
        return out

    def _report(self, p: Proc) -> dict[str, Any] | None:
        """The report of a live process; None when it ended (its report is
        then kept in :attr:`finished` until delivered) or was restarted."""
        code = p.handle.poll()
        if code not in (None, 0) and self._restart_master(p, code):
            return None  # the same process row runs again; its new pid is reported next tick
        data = p.handle.read_log(p.log_path, p.offset, 256 * 1024)
        p.offset += len(data)
        text = data.decode(errors="replace")
        state = "running" if code is None else ("exited" if code == 0 else "failed")
        rep = {"id": p.id, "state": state, "pid": p.handle.pid,
               "exit_code": None if code == EXIT_UNKNOWN else code, "log": text}
        if code is None:
            return rep
        if p.error:
            rep["error"] = p.error
        # out of memory: the server raises the job's limit (docs/resources.md)
        rep["oom"] = self.limiter.finished(p.limits, None if code == EXIT_UNKNOWN else code)
        del self.procs[p.id]
        self.finished[p.id] = rep
        return None

    def _restart_master(self, p: Proc, code: int) -> bool:
        """A job master that crashed (killed, or an exception) and was not told
        to stop restarts here, from its state file and on its ports
        (``--resume``, Elan §V-D), up to :data:`MASTER_RESTARTS` times; its
        workers reconnect and the job loses no step. Not an adopted master:
        its exit code is unknown (0 after its job finished, or
        :data:`EXIT_REPLACED`); the server judges it (a lost master)."""
        w, done = p.spec, p.restarts
        if (p.kind != "master" or not w or p.stop_sent or done >= MASTER_RESTARTS
                or code in (EXIT_REPLACED, EXIT_UNKNOWN)):
            return False
        log.warning("job master %s/%s exited with %s; restarting it (%d/%d)", p.job, p.name, code, done + 1,
                    MASTER_RESTARTS)
        argv = list(w["argv"]) + ([] if "--resume" in w["argv"] else ["--resume"])
        failure = self._launch({**w, "argv": argv}, offset=p.offset, restarts=done + 1)
        if failure is not None:  # reported as it ended, with why it was not restarted
            p.error = one_line(f"exited with {code}; restart {launch_error(failure)}")
            return False
        return True

    def _reconcile(self, wanted: list[dict[str, Any]]) -> None:
        """Launch, stop or ungate each row the server wants here; a row that fails
        (its launch, or any error) is logged and reported failed unless it runs."""
        now = time.time()
        for w in wanted:
            try:
                self._reconcile_row(w, now)
            except Exception as e:  # noqa: BLE001 - one row never stops the others
                wid = w.get("id") if isinstance(w, dict) else None
                log.exception("process row %s: cannot handle it", wid)
                if isinstance(wid, int) and not self._known(wid):
                    self._end(wid, "failed", one_line(f"agent error: {type(e).__name__}: {e}"))

    def _known(self, wid: int) -> bool:  # it runs here or ended here: it is never launched again
        return wid in self.procs or wid in self.acked or wid in self.finished

    def _reconcile_row(self, w: dict[str, Any], now: float) -> None:
        wid = int(w["id"])
        p = self.procs.get(wid)
        if p is None and self._known(wid):
            return  # it ended here: its report is on its way
        if w["desired"] == "stop":
            if p is not None:
                stop_step(p, now)
            elif w.get("state", "pending") == "pending":
                self._end(wid, "exited")  # never started: nothing to stop (a cancel completes)
            return
        if p is None:
            self._launch_row(w)
        elif p is not None and p.gate and not w.get("gated"):
            Path(p.gate).touch()  # the GPU is this job's now: train

    def _launch_row(self, w: dict[str, Any]) -> None:
        """Launch a row once: a failed launch is reported failed with its reason,
        never tried again (but for a transient OS error, :data:`TRANSIENT`)."""
        wid = int(w["id"])
        failure, tries = self._launch(w), self.tries.pop(wid, 0) + 1
        if failure is not None and wid not in self.procs:
            if isinstance(failure, OSError) and failure.errno in TRANSIENT and tries < LAUNCH_TRIES:
                self.tries[wid] = tries  # tried again at the next heartbeat
            else:
                self._end(wid, "failed", launch_error(failure))

    def _end(self, wid: int, state: str, error: str = "") -> None:
        """Row ``wid``, which never ran, ended: reported at the next heartbeat."""
        self.tries.pop(wid, None)
        self.finished[wid] = ended_report(wid, state, error)
        self._save()
        log.log(logging.ERROR if error else logging.INFO, "row %d ended, never ran: %s", wid, error or "stopped")

    def _write_master_urls(self, masters: dict[str, str]) -> None:
        """Where each job's master is now, for this node's workers
        (``$TIDAL_MASTER_FILE``): a master restarted on another host after
        its own died is found there. Written atomically, only on change."""
        for job, url in masters.items():
            if self._urls.get(job) != url and write_url(self.starter.master_file(job), url):
                self._urls[job] = url

    def _launch(self, w: dict[str, Any], offset: int | None = None, restarts: int = 0) -> Exception | None:
        """Start row ``w`` (never raises): None once it runs, else what kept it from
        starting (``OSError`` from exec: E2BIG, ENOENT, EACCES; ``ValueError``: a NUL)."""
        try:
            p = self.starter.start(w, offset, restarts)
        except Exception as e:  # noqa: BLE001 - whatever the row holds, the agent carries on
            log.error("cannot launch %s/%s: %s", w.get("job"), w.get("name"), one_line(f"{type(e).__name__}: {e}"))
            return e
        self.procs[p.id] = p
        self._save()
        log.info("launched %s/%s pid %d (CUDA_VISIBLE_DEVICES=%s)", p.job, p.name, p.handle.pid, p.gpu)
        return None

    def shutdown(self) -> None:
        """Stop every process (SIGTERM, SIGKILL after 10 s); their exits are
        kept in the table for the next run to report."""
        self.http.close()
        for p in self.procs.values():
            p.stop_sent = p.stop_sent or time.time()
            p.handle.terminate()
        for p in self.procs.values():
            try:
                p.handle.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.handle.kill()
                try:
                    p.handle.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    log.error("%s/%s (pid %d) survived SIGKILL", p.job, p.name, p.handle.pid)
        self._collect()
        self._save()
        self.limiter.close()
