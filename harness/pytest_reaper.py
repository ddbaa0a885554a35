"""pytest_reaper: the reaper (`reaper.py`) as pytest hooks. What a test's body leaves running is
stopped when the body ends, on every path (a failed assertion, a pytest timeout, a
`subprocess.run(timeout=)` that killed only the parent); whatever is still running when the
session ends is stopped then. Each stop is reported as a warning naming the processes, so a leak is
fixed in its test rather than hidden.

Processes that fixtures start (a module's server, the session's moto) are their fixtures' to stop:
the scope is the test body only, so a session fixture first requested inside a test is not
mistaken for a leak.

tests/conftest.py imports the hooks; `python -m pytest -p harness.pytest_reaper` loads them into
any other run.

Not here: finding and stopping the processes (`reaper.py`).
"""

from __future__ import annotations

import warnings

import pytest

from harness.reaper import Reaper

_REAPER = Reaper()


def _report(where: str, left: dict[int, str]) -> None:
    if left:
        lines = "\n".join(f"  pid {pid}: {cmd[:200]}" for pid, cmd in sorted(left.items()))
        warnings.warn(f"{where} left {len(left)} process(es) running; stopped:\n{lines}", stacklevel=1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    with _REAPER.scope() as left:
        yield
    _report(f"test {item.nodeid}", left)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Nothing outlives the run: the fixtures have been torn down by now."""
    _REAPER.stop_all()
