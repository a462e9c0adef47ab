"""Tiny TCP tool for the namespace tests (runs inside a host via ``ip netns exec``).

``serve ADDR PORT``: listen, print ``ready``, then answer connections forever.
A request is an 8-byte length, a mode byte and the payload; the reply is the
payload itself (mode ``E``, echo) or its SHA-256 digest (mode ``D``).

``send ADDR PORT NBYTES MODE TIMEOUT``: send NBYTES and check the reply; print
JSON ``{"ok", "seconds", "error"}``; exit 0 on success, 1 on failure.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import struct
import sys
import threading
import time

HEADER = struct.Struct("!Qc")


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(min(1 << 20, n - len(buf)))
        if not chunk:
            raise ConnectionError(f"peer closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def _answer(conn: socket.socket) -> None:
    with conn:
        n, mode = HEADER.unpack(_recv_exact(conn, HEADER.size))
        payload = _recv_exact(conn, n)
        conn.sendall(payload if mode == b"E" else hashlib.sha256(payload).digest())


def serve(addr: str, port: int) -> None:
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((addr, port))
    srv.listen(16)
    print("ready", flush=True)
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=_answer, args=(conn,), daemon=True).start()


def send(addr: str, port: int, nbytes: int, mode: str, timeout: float) -> dict:
    payload = os.urandom(nbytes)
    want = payload if mode == "E" else hashlib.sha256(payload).digest()
    t0 = time.monotonic()
    try:
        with socket.create_connection((addr, port), timeout=timeout) as conn:
            conn.settimeout(timeout)
            conn.sendall(HEADER.pack(nbytes, mode.encode()) + payload)
            got = _recv_exact(conn, len(want))
    except OSError as exc:
        return {"ok": False, "seconds": time.monotonic() - t0, "error": repr(exc)}
    ok = got == want
    return {"ok": ok, "seconds": time.monotonic() - t0, "error": "" if ok else "reply mismatch"}


def main(argv: list[str]) -> int:
    if argv[0] == "serve":
        serve(argv[1], int(argv[2]))
        return 0
    res = send(argv[1], int(argv[2]), int(argv[3]), argv[4], float(argv[5]))
    print(json.dumps(res), flush=True)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
