"""The parameter-server transport: request/answer frames over TCP.

A frame is an 8-byte length, a JSON header and the raw bytes of the tensors
the header lists (``[name, dtype, shape]``), so a 50 MB embedding slice
crosses the wire as bytes, never as JSON text. One request is outstanding per
connection (:class:`Conn` holds a lock); a server reads frames on one thread
per connection and hands them to a pool of ``threads`` handler threads, which
measures each request's queue delay (the signal a hot PS shows first).

No authentication: servers bind to loopback unless told otherwise.
"""

from __future__ import annotations

import json
import logging
import queue
import socket
import struct
import threading
import time
from typing import Any, Callable

import torch

from tidal.net import advertise_addr, bind_addr

log = logging.getLogger(__name__)

Tensors = dict[str, torch.Tensor]
Handler = Callable[[str, dict[str, Any], Tensors], tuple[dict[str, Any], Tensors]]
_LEN = struct.Struct("!Q")
_DTYPES = {str(d): d for d in (torch.float32, torch.float64, torch.int64, torch.int32, torch.int16,
                                torch.int8, torch.float16, torch.bfloat16, torch.uint8, torch.bool)}
_MAX_HEADER = 64 << 20


class ConnectionLost(RuntimeError):
    """The other side closed or reset the connection, or did not answer in time."""


def _read_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionLost("connection closed")
        got += k
    return buf


def send_frame(sock: socket.socket, header: dict[str, Any], tensors: Tensors | None = None) -> None:
    """Writes one frame: the header (tensor metadata added) and the tensors' bytes."""
    tensors = tensors or {}
    flat = {k: t.detach().contiguous().cpu() for k, t in tensors.items()}
    header = dict(header, _t=[[k, str(t.dtype), list(t.shape)] for k, t in flat.items()])
    head = json.dumps(header).encode()
    sock.sendall(_LEN.pack(len(head)) + head)
    for t in flat.values():
        if t.numel():
            sock.sendall(memoryview(t.reshape(-1).view(torch.uint8).numpy()))


def recv_frame(sock: socket.socket) -> tuple[dict[str, Any], Tensors]:
    """Reads one frame written by :func:`send_frame`."""
    (n,) = _LEN.unpack(_read_exact(sock, _LEN.size))
    if n > _MAX_HEADER:
        raise ValueError(f"frame header of {n} bytes: not a PS peer")
    header = json.loads(bytes(_read_exact(sock, n)))
    tensors: Tensors = {}
    for name, dtype, shape in header.pop("_t", []):
        dt = _DTYPES[dtype]
        count = 1
        for s in shape:
            count *= s
        nbytes = count * torch.empty((), dtype=dt).element_size()
        raw = _read_exact(sock, nbytes) if nbytes else bytearray()
        t = torch.frombuffer(raw, dtype=dt) if nbytes else torch.empty(0, dtype=dt)
        tensors[name] = t.reshape(shape)
    return header, tensors


class Conn:
    """A client connection to one server; thread-safe, one request at a time."""

    def __init__(self, addr: str, timeout_s: float = 60.0) -> None:
        self.addr, self.timeout_s = addr, timeout_s
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    def call(self, op: str, header: dict[str, Any] | None = None,
             tensors: Tensors | None = None) -> tuple[dict[str, Any], Tensors]:
        """Sends ``op`` and returns the answer; :class:`ConnectionLost` on any transport error."""
        with self._lock:
            try:
                if self._sock is None:
                    host, port = self.addr.rsplit(":", 1)
                    self._sock = socket.create_connection((host, int(port)), timeout=self.timeout_s)
                    self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                send_frame(self._sock, dict(header or {}, op=op), tensors)
                return recv_frame(self._sock)
            except (OSError, ConnectionLost, ValueError) as e:
                self._close()
                raise ConnectionLost(f"{self.addr}: {op}: {e}") from None

    def _close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None

    def close(self) -> None:
        with self._lock:
            self._close()


class Server:
    """Serves ``handler(op, header, tensors)`` on ``host:port`` (0: any free port)."""

    def __init__(self, handler: Handler, threads: int = 2, host: str | None = None, port: int = 0) -> None:
        self.handler = handler
        host = bind_addr(host)  # $TIDAL_BIND_ADDR, else loopback (one host)
        self._listen = socket.create_server((host, port))
        self.addr = f"{advertise_addr(host)}:{self._listen.getsockname()[1]}"  # 0.0.0.0 is no address to dial
        self._queue: queue.Queue[tuple[float, socket.socket, threading.Lock, dict, Tensors] | None] = queue.Queue()
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._lock = threading.Lock()
        self._closed = self._aborted = False
        self.delay_sum, self.busy_s, self.served = 0.0, 0.0, 0
        self._pool = [threading.Thread(target=self._work, daemon=True, name=f"ps-handler-{i}")
                      for i in range(threads)]
        for t in self._pool:
            t.start()
        self._acceptor = threading.Thread(target=self._accept, daemon=True, name="ps-accept")
        self._acceptor.start()

    def stats(self) -> dict[str, float]:
        """Totals since start: requests served, summed queue delay and handler time (s)."""
        with self._lock:
            return {"served": self.served, "delay_sum": self.delay_sum, "busy_s": self.busy_s,
                    "queued": self._queue.qsize()}

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listen.accept()
            except OSError:
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            reader = threading.Thread(target=self._read, args=(sock,), daemon=True, name="ps-conn")
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                self._conns[sock] = reader
            reader.start()

    def _read(self, sock: socket.socket) -> None:
        send_lock = threading.Lock()
        try:
            while not self._closed:
                header, tensors = recv_frame(sock)
                self._queue.put((time.monotonic(), sock, send_lock, header, tensors))
        except (OSError, ConnectionLost, ValueError, KeyError):
            pass
        finally:
            with self._lock:
                mine = not self._closed and self._conns.pop(sock, None) is not None
            if mine:  # the client left; close() handles the sockets it finds
                sock.close()

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if self._aborted:
                continue  # a crash: what was queued is never handled
            t_in, sock, send_lock, header, tensors = item
            t0 = time.monotonic()
            op = header.pop("op", "")
            try:
                answer, out = self.handler(op, header, tensors)
            except Exception as e:  # noqa: BLE001 - the caller gets the error as an answer
                log.exception("ps handler %s failed", op)
                answer, out = {"status": "error", "error": f"{type(e).__name__}: {e}"}, {}
            with self._lock:
                self.served += 1
                self.delay_sum += t0 - t_in
                self.busy_s += time.monotonic() - t0
            try:
                with send_lock:
                    send_frame(sock, answer, out)
            except OSError:
                pass

    def close(self, abort: bool = False, timeout_s: float = 10.0) -> None:
        """Stops listening, answers what is queued (``abort``: drops it, as a crash
        would), drops every connection and joins every thread of this server."""
        with self._lock:
            if self._closed:
                return
            self._closed, self._aborted = True, abort
        try:
            self._listen.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listen.close()
        self._acceptor.join(timeout_s)
        for _ in self._pool:
            self._queue.put(None)
        end = time.monotonic() + timeout_s
        for t in self._pool:
            t.join(max(0.0, end - time.monotonic()))
        with self._lock:
            conns = dict(self._conns)
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for s, reader in conns.items():
            reader.join(max(0.0, end - time.monotonic()))
            s.close()
        alive = [t.name for t in [self._acceptor, *self._pool, *conns.values()] if t.is_alive()]
        if alive:
            log.warning("server %s: threads still running after close: %s", self.addr, alive)
