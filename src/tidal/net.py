"""Addresses on several hosts: what a listener binds, what it tells peers
(the advertised address) and which interface the collectives use.

Single-host defaults stay on loopback. With ``--bind 0.0.0.0`` (or
``$TIDAL_BIND_ADDR``) a listener accepts every interface and advertises the
address of the interface that routes to its peer (the server, the job
master), unless ``--advertise-addr`` / ``$TIDAL_ADVERTISE_ADDR`` names one.
Workers set ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` to the interface
that routes to their rendezvous store, unless the user set them.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import socket
import struct

from tidal import settings

log = logging.getLogger(__name__)

LOOPBACK = settings.BIND_ADDR.default  # "127.0.0.1": the single-host default of every listener
ANY = ("0.0.0.0", "", "::")
_SIOCGIFADDR = 0x8915


def resolve(host: str) -> str:
    """An IPv4 address for ``host`` (a name or an address)."""
    try:
        ipaddress.IPv4Address(host)
        return host
    except ValueError:
        return socket.gethostbyname(host)


def route_source(peer: str) -> str | None:
    """The local address that packets to ``peer`` leave from, or None without
    a route (a UDP ``connect`` picks the route; it sends nothing)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((resolve(peer), 9))
            return str(s.getsockname()[0])
    except OSError:
        return None


def interface_addresses() -> dict[str, str]:
    """Interface name -> its IPv4 address, for the interfaces that have one."""
    out: dict[str, str] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _idx, name in socket.if_nameindex():
            try:
                req = struct.pack("256s", name.encode()[:15])
                out[name] = socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)[20:24])
            except OSError:
                continue  # no IPv4 address (or down)
    return out


def interface_of(addr: str) -> str | None:
    """The interface holding ``addr`` (``lo`` for any 127.x address)."""
    if addr.startswith("127."):
        return "lo"
    for name, a in interface_addresses().items():
        if a == addr:
            return name
    return None


def advertise_addr(bind: str = LOOPBACK, peer: str | None = None, explicit: str | None = None) -> str:
    """The address to tell peers: ``explicit``, else a specific ``bind``
    address, else the source address of the route to ``peer``, else the
    first non-loopback interface's address, else loopback."""
    if explicit:
        return explicit
    if bind not in ANY:
        return bind
    if peer is not None and (src := route_source(peer)) is not None:
        return src
    others = [a for n, a in sorted(interface_addresses().items()) if not a.startswith("127.")]
    return others[0] if others else LOOPBACK


def bind_addr(cli: str | None = None) -> str:
    """``cli`` (a ``--bind`` option), else ``$TIDAL_BIND_ADDR``."""
    return cli or settings.BIND_ADDR.get()


def socket_env(peer: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` for collectives with
    peers reached like ``peer`` (the rendezvous store), for the variables
    ``env`` (default ``os.environ``) does not set already."""
    env = os.environ if env is None else env
    missing = [k for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if not env.get(k)]
    if not missing:
        return {}
    src = route_source(peer)
    name = interface_of(src) if src else None
    if name is None:
        log.warning("no interface routes to %s; collectives use the default interface", peer)
        return {}
    return {k: name for k in missing}
