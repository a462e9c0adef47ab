"""The job's rendezvous store, sealed: every value is encrypted and
authenticated with AES-SIV (RFC 5297), its key name as associated data,
under a key only the job's processes hold (derived from the job's
credential, ``$TIDAL_JOB_TOKEN`` or its file). Any local user can connect
to a TCPStore (it has no authentication of its own); with the seal, such a
user reads nothing but key names and counters, and a value it writes (a
forged plan, a "moved" master, a pickled ``on_rank0`` result, a collective's
peer address) fails verification and is never acted on: :class:`Forged` is
raised instead. Binding the key name means a genuine value cannot be moved
to another key. AES-SIV is deterministic (the same value under the same key
name seals to the same bytes), so ``compare_set`` still matches. Counters
(``add``) and key existence (``check``, ``wait``) are not sealed: a
co-tenant can delay a job through them, not steer it (docs/security.md).

The store also listens on one address only (:func:`listen_fd`), never on
every interface: torch's TCPStore server binds the wildcard address unless
it is handed a socket already bound.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import hmac
import logging
import socket
from typing import Any, Sequence

import torch.distributed as dist
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESSIV

from tidal import settings

log = logging.getLogger(__name__)

_CONTEXT = b"tidal rendezvous store v2"
_VERSION = b"\x02"  # the first byte of every sealed plaintext (AES-SIV refuses an empty one)


class Forged(RuntimeError):
    """A store value that this job did not write (its seal does not verify)."""


def store_key(token: str | None = None) -> bytes:
    """The 64-byte sealing key (AES-SIV with AES-256) of the job whose
    credential is ``token`` (default: this process's,
    :func:`tidal.settings.job_token`). Without a credential (a ``tidal run``
    job with no ``$TIDAL_JOB_TOKEN``) the key is a constant: the seal then
    catches accidents, not a co-tenant."""
    tok = settings.job_token() if token is None else token
    return hmac.new(tok.encode(), _CONTEXT, hashlib.sha512).digest()


@functools.lru_cache(maxsize=8)
def _cipher(key: bytes) -> AESSIV:
    return AESSIV(key)


def seal(key: bytes, name: str, value: str | bytes) -> bytes:
    """``value`` encrypted and authenticated for store key ``name``
    (deterministic, so ``compare_set`` can match a sealed expected value)."""
    v = value.encode() if isinstance(value, str) else bytes(value)
    return _cipher(key).encrypt(_VERSION + v, [name.encode()])


def unseal(key: bytes, name: str, raw: bytes) -> bytes:
    """The value of a sealed ``raw``; :class:`Forged` if it does not verify."""
    try:
        v = _cipher(key).decrypt(bytes(raw), [name.encode()])
    except (InvalidTag, ValueError):
        v = b""
    if not v.startswith(_VERSION):
        raise Forged(f"store key {name!r} holds a value this job did not write; ignored")
    return v[len(_VERSION):]


class SealedStore(dist.Store):
    """A ``torch.distributed.Store`` over another (a TCPStore client or
    server) whose values are sealed; usable wherever a store is, a process
    group's rendezvous included. Keep a reference to it as long as a
    process group built on it lives (torch holds only the C++ half)."""

    def __init__(self, inner: Any, key: bytes) -> None:
        super().__init__()
        self.inner, self._key = inner, key
        self._warned: set[str] = set()

    def set(self, key: str, value: str | bytes) -> None:
        self.inner.set(key, seal(self._key, key, value))

    def get(self, key: str) -> bytes:
        return unseal(self._key, key, self.inner.get(key))

    def peek(self, key: str) -> bytes | None:
        """The value of ``key``; None when it is absent or forged (a forged
        value is logged once per key)."""
        return self.read(key) if self.inner.check([key]) else None

    def read(self, key: str) -> bytes | None:
        """The value of ``key`` (waiting for it as ``get`` does); None when
        it is forged (logged once per key)."""
        try:
            return self.get(key)
        except Forged as e:
            if key not in self._warned:
                self._warned.add(key)
                log.warning("%s", e)
            return None

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        exp = seal(self._key, key, expected) if len(expected) else b""
        return unseal(self._key, key, self.inner.compare_set(key, exp, seal(self._key, key, desired)))

    def add(self, key: str, amount: int) -> int:
        return int(self.inner.add(key, amount))

    def check(self, keys: Sequence[str]) -> bool:
        return bool(self.inner.check(list(keys)))

    def wait(self, keys: Sequence[str], timeout: datetime.timedelta | None = None) -> None:
        if timeout is None:
            self.inner.wait(list(keys))
        else:
            self.inner.wait(list(keys), timeout)

    def delete_key(self, key: str) -> bool:
        return bool(self.inner.delete_key(key))

    def num_keys(self) -> int:
        return int(self.inner.num_keys())

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.inner.set_timeout(timeout)

    def has_extended_api(self) -> bool:
        return False  # torch then uses set/get/add/check/wait only


def listen_fd(host: str, port: int) -> int:
    """A listening TCP socket bound to ``host:port`` only (``port`` 0: any
    free port), for ``TCPStore(..., master_listen_fd=...)``; the caller owns
    the returned descriptor. An address this host does not have is a
    ``ValueError`` naming it."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"the rendezvous store cannot listen on {host!r}: {e.strerror}") from None
    family, _, _, _, addr = infos[0]
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted master takes its port again
        s.bind(addr)
        s.listen(1024)
    except OSError as e:
        s.close()
        raise ValueError(f"the rendezvous store cannot listen on {host}:{port}: {e.strerror or e} "
                         f"(set ${settings.ADVERTISE_ADDR.name} to an address of this host)") from None
    return s.detach()
