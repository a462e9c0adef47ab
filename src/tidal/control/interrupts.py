"""Ctrl-C that never lands inside a store transaction.

Python raises KeyboardInterrupt in the main thread at whichever bytecode it
happens to run. Inside SQLAlchemy's or the SQLite driver's own bookkeeping
that can leave a connection half-released: the next transaction may then
wait for a write lock nobody will release (SQLite's busy timeout, 30 s). A
command that goes on using the store after a Ctrl-C (``tidal up`` suspends
the running jobs, then stops) installs :func:`handler` for SIGINT and
SIGTERM. An interrupt that arrives while the main thread is inside a store
session (:class:`Shielded`, which :meth:`tidal.control.db.Store.session`
enters) is held until that session ends and raised then. Anywhere else it is
raised at once, as with Python's default handler. Other threads never
receive signals, so the shield only counts the main thread's sessions.
"""

from __future__ import annotations

import threading
from types import FrameType, TracebackType
from typing import Any

_MAIN = threading.main_thread().ident


class _State:
    depth = 0  # store sessions the main thread is inside
    pending = False  # an interrupt arrived inside one


def handler(signum: int, frame: FrameType | None) -> None:  # noqa: ARG001 - signal handler signature
    """SIGINT/SIGTERM handler: KeyboardInterrupt now, or when the main
    thread's store session ends."""
    if _State.depth:
        _State.pending = True
        return
    raise KeyboardInterrupt


class Shielded:
    """A context in which :func:`handler` holds interrupts back (re-entrant)."""

    __slots__ = ("_counted",)

    def __enter__(self) -> "Shielded":
        self._counted = threading.get_ident() == _MAIN
        if self._counted:
            _State.depth += 1
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> Any:
        if self._counted:
            _State.depth -= 1
            if not _State.depth and _State.pending:
                _State.pending = False
                raise KeyboardInterrupt
        return None
