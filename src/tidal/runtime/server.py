"""HTTP server of the job master (stdlib only).

Protocol (HTTP/1.1 + JSON on localhost, stdlib only; every answer is a JSON
object, errors carry ``{"status": "error", "message": ...}``):

Scheduler-facing
  ``POST /scale_out {"count": int, "hosts": [str]?} | {"workers": [str]}`` -> ScaleAnswer
  (``workers``: ids started by someone else, which the master expects to register)
  ``POST /scale_in  {"count": int} | {"ranks": [int]} | {"workers": [str]}`` -> ScaleAnswer
  (``"n"`` is accepted for ``"count"``; every scaling request may carry a ``request_id``)
  ``POST /migrate   {"ranks": [int], "hosts": [str]?, "workers": [str]?}`` -> ScaleAnswer (one switch, EDL §5.2)
  ``POST /reshare   {"shares": {worker: weight}}``   -> ScaleAnswer (batch shares)
  ``POST /suspend``  -> ScaleAnswer (checkpoint at an agreed step, then every worker leaves)
  ``GET  /status``                                   -> Status
  ``POST /handover  {"url": str}``                   -> snapshot; the old
  master then answers every request with ``{"status": "moved", "url": ...}``.
Worker-facing
  ``POST /register {"worker_id", "pid", "host", "checkpoint_local"?}`` -> store address, or 409 (refused)
  ``GET  /assignment?worker_id=W``   -> wait | assigned(Generation) | finished
  ``GET  /store``  -> store address and keys; ``GET /plan?gen=G`` -> a published plan
  ``POST /heartbeat Progress``       -> {"plan": SwitchPlan|null, "finished": bool}
  (the same exchange also runs through the TCPStore keys ``tidal/<job>/progress``
  and ``tidal/<job>/plan``, which is what workers use every step)
  ``POST /failed {"worker_id", "gen", "step"}`` (a collective failed: recovery),
  ``POST /agreed {"gen", "switch_step"}``, ``POST /switched {"gen", "step",
  "pause_s"}``, ``POST /left {"worker_id"}``, ``POST /done {"step", "cursor"}``
  ``POST /shard/next|progress|complete|release`` (shard mode, EDL §4.3)

With a token (the job's credential, ``$TIDAL_JOB_TOKEN``) every request must
carry ``Authorization: Bearer <token>``; others get 401.

Per-step traffic is one asynchronous heartbeat from rank 0 (a background
thread) through the TCPStore (progress written, plan read), never on the
training thread's critical path; HTTP carries only rare events.
"""

from __future__ import annotations

import hmac
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

from tidal import settings
from tidal.net import LOOPBACK, advertise_addr
from tidal.runtime.master import JobMaster

log = logging.getLogger(__name__)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: one connection per client thread
    disable_nagle_algorithm = True  # headers and body are two writes: avoid the 40 ms delayed-ACK stall
    master: JobMaster  # set on a subclass
    token: str = ""  # set on a subclass; "" accepts every request

    def log_message(self, fmt: str, *args: Any) -> None:  # quiet
        log.debug("http: " + fmt, *args)

    def _send(self, code: int, obj: dict[str, Any]) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> dict[str, Any]:
        n = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(n) or b"{}") if n else {}

    def do_GET(self) -> None:  # noqa: N802
        self._dispatch("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch("POST")

    def _authorized(self) -> bool:
        if not self.token:
            return True
        auth = self.headers.get("Authorization") or ""
        given = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        return hmac.compare_digest(given.encode(), self.token.encode())

    def _dispatch(self, method: str) -> None:
        if not self._authorized():
            self._body() if method == "POST" else None  # drain it: the connection stays usable
            return self._send(401, {"status": "error", "message": "this job's credential is required"})
        m = self.master
        u = urlparse(self.path)
        q = {k: v[0] for k, v in parse_qs(u.query).items()}
        try:
            body = self._body() if method == "POST" else {}
            if m.moved_to and u.path != "/handover":
                return self._send(200, {"status": "moved", "url": m.moved_to})
            p = u.path
            if p == "/status":
                return self._send(200, m.status().to_json())
            if p in ("/scale_out", "/scale_in"):
                count = body.get("count", body.get("n"))
                if p == "/scale_out":
                    ans = m.scale_out(count=count, hosts=body.get("hosts"), workers=body.get("workers"),
                                      request_id=body.get("request_id"))
                else:
                    ans = m.scale_in(count=count, ranks=body.get("ranks"), workers=body.get("workers"),
                                     request_id=body.get("request_id"))
                code = {"accepted": 200, "retry": 409}.get(ans.status, 400)
                return self._send(code, ans.to_json())
            if p == "/migrate":
                ans = m.migrate([int(r) for r in body.get("ranks") or []], hosts=body.get("hosts"),
                                workers=body.get("workers"),
                                request_id=body.get("request_id"))
                return self._send({"accepted": 200, "retry": 409}.get(ans.status, 400), ans.to_json())
            if p == "/reshare":
                ans = m.reshare({str(k): float(v) for k, v in (body.get("shares") or {}).items()},
                                request_id=body.get("request_id"))
                return self._send({"accepted": 200, "retry": 409}.get(ans.status, 400), ans.to_json())
            if p == "/suspend":
                ans = m.suspend(request_id=body.get("request_id"))
                return self._send({"accepted": 200, "retry": 409}.get(ans.status, 400), ans.to_json())
            if p == "/suspended":
                return self._send(200, m.suspended_at(int(body["step"]), int(body["cursor"]), str(body.get("path", ""))))
            if p == "/handover":
                return self._send(200, m.handover(body["url"]))
            if p == "/store":
                return self._send(200, m.store_info())
            if p == "/plan":
                plan = m.published_plan(int(q.get("gen", -1)))
                return self._send(200 if plan else 404, {"status": "ok" if plan else "error", "plan": plan})
            if p == "/register":
                ans = m.register(body["worker_id"], int(body.get("pid", 0)), str(body.get("host", "")),
                                 str(body.get("switch", "")), bool(body.get("checkpoints", False)),
                                 str(body.get("checkpoint_local") or ""))
                return self._send(409 if ans.get("status") == "error" else 200, ans)
            if p == "/assignment":
                return self._send(200, m.assignment(q.get("worker_id") or body["worker_id"], int(q.get("after_gen", 0))))
            if p == "/failed":
                return self._send(200, m.failed(body["worker_id"], int(body["gen"]), int(body["step"])))
            if p == "/heartbeat":
                return self._send(200, m.heartbeat(body))
            if p == "/agreed":
                return self._send(200, m.agreed(int(body["gen"]), int(body["switch_step"])))
            if p == "/switched":
                return self._send(200, m.switched(int(body["gen"]), int(body["step"]), float(body.get("pause_s", 0.0))))
            if p == "/straggler":
                return self._send(200, m.straggler(body["worker_id"], int(body["gen"]), int(body["step"]),
                                                   float(body.get("ratio", 0.0)), body.get("detected_at")))
            if p == "/left":
                return self._send(200, m.left(body["worker_id"]))
            if p == "/done":
                ep = body.get("epoch")
                return self._send(200, m.done(int(body["step"]), int(body["cursor"]), None if ep is None else int(ep)))
            if p.startswith("/shard/"):
                return self._send(200, m.shard_call(p[len("/shard/") :], body))
            return self._send(404, {"status": "error", "message": f"no route {p}"})
        except Exception as e:  # noqa: BLE001
            log.exception("master error on %s", self.path)
            return self._send(500, {"status": "error", "message": repr(e)})


class MasterServer:
    """Serves a :class:`JobMaster` over HTTP on ``host:port`` (0 = any free);
    ``advertise``: the address in its URL (default: ``host``, see
    :func:`tidal.net.advertise_addr`); ``token``: the credential every
    request must carry (default ``$TIDAL_JOB_TOKEN``; empty: none)."""

    def __init__(self, master: JobMaster, host: str = LOOPBACK, port: int = 0, advertise: str | None = None,
                 token: str | None = None) -> None:
        token = settings.job_token() if token is None else token
        handler = type("Handler", (_Handler,), {"master": master, "token": token})
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self.master = master
        self.url = f"http://{advertise_addr(host, explicit=advertise)}:{self.httpd.server_address[1]}"
        master.url = self.url
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="tidal-master-http", daemon=True)

    def start(self) -> "MasterServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
