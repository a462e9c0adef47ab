"""Addresses for several hosts (tidal.net, tidal run --join): what a
listener advertises, which interface collectives use, and how a joining
launcher names the master and its workers. The namespace tests
(tests/multihost) run these across real network namespaces."""

from __future__ import annotations

import pytest

from tidal import net
from tidal.runtime.join import master_url, worker_ids


def test_advertised_address_follows_bind_then_route_then_interfaces() -> None:
    assert net.advertise_addr("127.0.0.1") == "127.0.0.1"
    assert net.advertise_addr("10.1.2.3") == "10.1.2.3"  # a specific bind address is what peers use
    assert net.advertise_addr("0.0.0.0", explicit="10.9.9.9") == "10.9.9.9"
    assert net.advertise_addr("0.0.0.0", peer="127.0.0.1") == "127.0.0.1"  # the route to a local peer is loopback
    own = [a for a in net.interface_addresses().values() if not a.startswith("127.")]
    assert net.advertise_addr("0.0.0.0") in (own[:1] or ["127.0.0.1"])


def test_collectives_use_the_interface_that_routes_to_the_store() -> None:
    assert net.socket_env("127.0.0.1", {}) == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    assert net.socket_env("127.0.0.1", {"GLOO_SOCKET_IFNAME": "eth7"}) == {"NCCL_SOCKET_IFNAME": "lo"}
    assert net.socket_env("127.0.0.1", {"GLOO_SOCKET_IFNAME": "a", "NCCL_SOCKET_IFNAME": "b"}) == {}
    assert net.interface_of("127.0.0.5") == "lo"
    for name, addr in net.interface_addresses().items():
        assert net.interface_of(addr) == ("lo" if addr.startswith("127.") else name)


def test_join_names_the_master_and_picks_unique_worker_ids() -> None:
    assert master_url("10.0.0.1:8123") == "http://10.0.0.1:8123"
    assert master_url("http://h:1/") == "http://h:1"
    for bad in ("10.0.0.1", "host:port", ":80"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            master_url(bad)
    a, b = worker_ids(2, host="node-a.example", pid=7), worker_ids(2, host="node-a.example", pid=8)
    assert a == ["nodea-7-0", "nodea-7-1"] and not set(a) & set(b)


def test_a_client_of_several_replicas_moves_on_when_one_is_down():
    """``http://a,http://b``: a replica that refuses connections is skipped;
    the client stays with the one that answers."""
    import json as _json
    import socket
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from tidal.httpjson import JsonHttp, Unavailable

    class Ok(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            data = _json.dumps({"who": "b"}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *a):  # quiet
            pass

    with socket.socket() as s:  # a port nothing listens on: the dead replica
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Ok)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        live = f"http://127.0.0.1:{srv.server_address[1]}"
        c = JsonHttp(f"http://127.0.0.1:{dead}, {live}", patience_s=5)
        assert c.call("GET", "/x") == (200, {"who": "b"})
        assert c.url == live and c.call("GET", "/y")[1] == {"who": "b"}
        with pytest.raises(Unavailable):
            JsonHttp(f"http://127.0.0.1:{dead}", patience_s=0.2).call("GET", "/x")
    finally:
        srv.shutdown()
        srv.server_close()


def test_a_stale_keep_alive_connection_is_retried_on_the_same_replica() -> None:
    """A replica that closed an idle keep-alive connection is asked again on
    a fresh one, not given up for the next replica (a silent one there would
    stall the request for its time-out)."""
    import socket
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from tidal.httpjson import JsonHttp

    class Once(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:  # answers as keep-alive, then closes the connection while idle
            body = b'{"ok": true}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            self.close_connection = True

        def log_message(self, *a) -> None:
            pass

    live = ThreadingHTTPServer(("127.0.0.1", 0), Once)
    threading.Thread(target=live.serve_forever, daemon=True).start()
    silent = socket.socket()  # listens, never answers: a replica whose host went silent
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        urls = f"http://127.0.0.1:{live.server_address[1]},http://127.0.0.1:{silent.getsockname()[1]}"
        client = JsonHttp(urls, timeout_s=10.0, patience_s=20.0)
        assert client.call("GET", "/a") == (200, {"ok": True})
        time.sleep(0.2)  # the server has closed the idle connection by now
        t0 = time.monotonic()
        assert client.call("GET", "/b") == (200, {"ok": True})
        assert time.monotonic() - t0 < 2.0 and client.url == client.urls[0]
    finally:
        live.shutdown()
        silent.close()
