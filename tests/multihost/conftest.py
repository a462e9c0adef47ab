"""Fixtures for the network-namespace ("multi-host") tests.

Like tests/runtime (whose tests ``import runtime_helpers`` from their own
directory), the modules here import their helpers (``netns``) by plain name:
this directory is put on ``sys.path``.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from netns import Hosts, netns_available, sweep_stale  # noqa: E402


@functools.lru_cache(maxsize=1)
def _available() -> tuple[bool, str]:
    return netns_available()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Before any namespace test runs: remove the sets a killed earlier run left
    behind (their owner process is dead), so they neither collide nor count as ours."""
    if any(HERE in Path(str(item.fspath)).resolve().parents for item in session.items) and _available()[0]:
        sweep_stale()


@pytest.fixture
def hosts(request: pytest.FixtureRequest) -> Callable[..., Hosts]:
    """Factory ``hosts(n, **kw) -> Hosts``: a built set of ``n`` hosts, torn down
    at the end of the test. Skips the test when namespaces are not available."""
    ok, reason = _available()
    if not ok:
        pytest.skip(reason)

    def make(n: int, **kw: Any) -> Hosts:
        hs = Hosts(n, **kw)
        request.addfinalizer(hs.teardown)
        return hs.__enter__()

    return make


def _in_here(report: pytest.TestReport, config: pytest.Config) -> bool:
    path = (config.rootpath / report.nodeid.split("::")[0]).resolve()
    return HERE in path.parents


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """One line: how many namespace tests ran and how many were skipped, and why."""
    ran, skipped, reasons = 0, 0, []
    for key in ("passed", "failed"):
        for rep in terminalreporter.stats.get(key, []):
            if isinstance(rep, pytest.TestReport) and rep.when == "call" and _in_here(rep, config):
                ran += 1
    for rep in terminalreporter.stats.get("skipped", []):
        if isinstance(rep, pytest.TestReport) and _in_here(rep, config):
            skipped += 1
            msg = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
            msg = msg.removeprefix("Skipped: ")
            if msg not in reasons:
                reasons.append(msg)
    why = f" ({'; '.join(reasons)})" if reasons else ""
    terminalreporter.write_line(f"namespace tests: {ran} ran, {skipped} skipped{why}")
