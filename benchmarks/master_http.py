"""Is the job master's stdlib HTTP server still needed? The same JobMaster
served two ways in one run, on loopback: the stdlib ``ThreadingHTTPServer``
(:class:`tidal.runtime.server.MasterServer`) and a FastAPI app under uvicorn
(the control plane's stack). Measured: the latency of ``GET /status`` and of a
rejected ``POST /scale_out`` through the project's one HTTP client (keep-alive),
and the import time a master process pays for each stack.

    python benchmarks/master_http.py --json

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import Any


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _fastapi_master(master: Any, port: int) -> Any:
    import uvicorn
    from fastapi import Body, FastAPI

    app = FastAPI()

    @app.get("/status")
    def status() -> dict[str, Any]:
        return master.status().to_json()

    @app.post("/scale_out")
    def scale_out(body: dict[str, Any] = Body(default_factory=dict)) -> dict[str, Any]:
        return master.scale_out(count=body.get("count")).to_json()

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.01)
    return server


def _latencies(url: str, n: int) -> dict[str, float]:
    from tidal.httpjson import JsonHttp

    c = JsonHttp(url, patience_s=5)
    out = {}
    for name, method, path, body in (("status", "GET", "/status", None), ("scale_out", "POST", "/scale_out", {"count": 0})):
        c.call(method, path, body)  # connect, warm up
        xs = []
        for _ in range(n):
            t = time.perf_counter()
            c.call(method, path, body)
            xs.append(1e3 * (time.perf_counter() - t))
        xs.sort()
        out[f"{name}_p50_ms"] = round(statistics.median(xs), 3)
        out[f"{name}_p99_ms"] = round(xs[int(0.99 * (len(xs) - 1))], 3)
    return out


def _import_s(module: str) -> float:
    code = f"import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
    runs = [float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
            for _ in range(3)]
    return round(min(runs), 3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    from tidal.runtime.master import JobMaster
    from tidal.runtime.server import MasterServer

    master = JobMaster("bench", 1)
    std = MasterServer(master).start()
    port = _free_port()
    fa = _fastapi_master(master, port)
    res: dict[str, Any] = {"requests": a.requests}
    try:
        for k, v in _latencies(std.url, a.requests).items():
            res[f"stdlib_{k}"] = v
        for k, v in _latencies(f"http://127.0.0.1:{port}", a.requests).items():
            res[f"fastapi_{k}"] = v
    finally:
        std.stop()
        fa.should_exit = True
    res["stdlib_import_s"] = _import_s("http.server")
    res["fastapi_import_s"] = _import_s("fastapi, uvicorn")
    res["status_latency_ratio_fastapi_over_stdlib"] = round(res["fastapi_status_p50_ms"] / res["stdlib_status_p50_ms"], 2)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
