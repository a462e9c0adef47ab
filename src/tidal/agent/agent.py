"""The node agent's reconcile loop (see the package docstring)."""

from __future__ import annotations

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
from tidal.net import LOOPBACK, advertise_addr
from tidal.control.jobproc import EXIT_REPLACED
from tidal.httpjson import JsonHttp, Unavailable

log = logging.getLogger("tidal.agent")

#: variables of the agent's environment a job's processes do not inherit
_SECRETS = frozenset({settings.TOKEN.name, settings.ADMIN_TOKEN.name, settings.JOB_TOKEN.name})

MASTER_RESTARTS = 3  # a job master that keeps crashing is then reported failed

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
        self._stop = threading.Event()
        self.registered = False
        self._urls: dict[str, str] = {}  # the master URL last written per job
        # an unreachable server is retried for one interval, then on the next tick
        self.join_token = token
        self.http = JsonHttp(self.server, token=token, timeout_s=10.0, patience_s=interval_s)

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
            self._stop.wait(self.interval_s)
        self.shutdown()

    def tick(self) -> None:
        reports = self._collect()
        self._save()  # an exit seen is reported also by the next run of this agent
        ans = self._post(f"/internal/agents/{self.name}/heartbeat", {"procs": reports, "utils": self._utils()})
        # acknowledged: exit reports are delivered, log chunks too
        for r in reports:
            r["log"] = ""
            if r["state"] in ("exited", "failed"):
                self.finished.pop(r["id"], None)
                self.acked.add(r["id"])
        self._reconcile(ans.get("workers", []))
        self._write_master_urls(ans.get("masters") or {})
        self._save()

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
            code = p.handle.poll()
            if code not in (None, 0) and self._restart_master(p, code):
                continue  # the same process row runs again; its new pid is reported next tick
            text = self._read_log(p)
            state = "running" if code is None else ("exited" if code == 0 else "failed")
            rep = {"id": p.id, "state": state, "pid": p.handle.pid,
                   "exit_code": None if code == EXIT_UNKNOWN else code, "log": text}
            if code is not None:  # out of memory: the server raises the job's limit (docs/resources.md)
                rep["oom"] = self.limiter.finished(p.limits, None if code == EXIT_UNKNOWN else code)
                del self.procs[p.id]
                self.finished[p.id] = rep
            else:
                out.append(rep)
        out.extend(self.finished.values())
        return out

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
        self._launch({**w, "argv": argv}, offset=p.offset, restarts=done + 1)
        return True

    def _read_log(self, p: Proc) -> str:
        data = p.handle.read_log(p.log_path, p.offset, 256 * 1024)
        p.offset += len(data)
        return data.decode(errors="replace")

    def _utils(self) -> dict[int, float]:
        if self.virtual:
            busy = {int(p.gpu) for p in self.procs.values() if p.gpu.lstrip("-").isdigit()}
            return {i: (1.0 if i in busy else 0.0) for i in range(self.num_gpus)}
        try:
            import pynvml

            pynvml.nvmlInit()
            try:
                return {i: float(pynvml.nvmlDeviceGetUtilizationRates(pynvml.nvmlDeviceGetHandleByIndex(i)).gpu) / 100
                        for i in range(self.num_gpus)}
            finally:
                pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            return {}

    def _reconcile(self, wanted: list[dict[str, Any]]) -> None:
        now = time.time()
        for w in wanted:
            wid = int(w["id"])
            p = self.procs.get(wid)
            if w["desired"] == "stop":
                if p is not None:
                    if not p.stop_sent:
                        p.handle.send_signal(signal.SIGTERM)
                        p.stop_sent = now
                    elif now - p.stop_sent > 10:
                        p.handle.kill()
                continue
            if p is None and wid not in self.acked and wid not in self.finished:
                self._launch(w)
            elif p is not None and p.gate and not w.get("gated"):
                Path(p.gate).touch()  # the GPU is this job's now: train

    def _master_file(self, job: str) -> Path:
        return self.workdir / "masters" / f"{job}.url"

    def _write_master_urls(self, masters: dict[str, str]) -> None:
        """Where each job's master is now, for this node's workers
        (``$TIDAL_MASTER_FILE``): a master restarted on another host after
        its own died is found there. Written atomically, only on change."""
        for job, url in masters.items():
            path = self._master_file(job)
            if self._urls.get(job) == url:
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(url)
            os.replace(tmp, path)
            self._urls[job] = url

    def _launch(self, w: dict[str, Any], offset: int | None = None, restarts: int = 0) -> None:
        d = self.workdir / "logs" / w["job"]
        d.mkdir(parents=True, exist_ok=True)
        log_path = d / f"{w['name']}.log"
        start = offset if offset is not None else (log_path.stat().st_size if log_path.exists() else 0)
        # the agent's own credentials never reach a job's processes; they get their job's from the server
        env = {k: v for k, v in os.environ.items() if k not in _SECRETS}
        env.update({k: str(v) for k, v in (w.get("env") or {}).items()})
        env[settings.NODE.name] = self.name
        env[settings.MASTER_FILE.name] = str(self._master_file(w["job"]))
        # a job master started here listens on this node's address (loopback on one host)
        env[settings.BIND_ADDR.name] = env[settings.ADVERTISE_ADDR.name] = self.address
        cwd = w.get("cwd") or None
        argv, gate = list(w["argv"]), None
        if w.get("gated"):
            gates = self.workdir / "gates"
            gates.mkdir(exist_ok=True)
            gate = str(gates / f"{w['id']}")
            argv = [argv[0], "-u", "-m", "tidal.agent.prewarm", gate, "--", *argv]
        handle, pl = start_limited(self.limiter, self.launcher, w, argv, env, cwd, log_path)
        self.procs[int(w["id"])] = Proc(int(w["id"]), w["job"], w["name"], str(w.get("kind") or "worker"),
                                        handle, log_path, offset=start,
                                        gpu=env.get("CUDA_VISIBLE_DEVICES", "-1"), gate=gate, restarts=restarts,
                                        spec=w, limits=pl)
        self._save()
        log.info("launched %s/%s pid %d (CUDA_VISIBLE_DEVICES=%s)", w["job"], w["name"], handle.pid,
                 env.get("CUDA_VISIBLE_DEVICES", ""))

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
