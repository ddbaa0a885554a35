"""pytest_reaper: the reaper (`reaper.py`) as pytest hooks. What a test's body leaves running is
stopped when the body ends, on every path (a failed assertion, a pytest timeout, a
`subprocess.run(timeout=)` that killed only the parent); whatever is still running when the
session ends is stopped then. Each stop in a test is reported as a warning naming the processes,
so a leak is fixed in its test rather than hidden.

Processes that fixtures start (a module's server, the session's moto) are their fixtures' to stop:
a fixture's setup runs under the session's mark, also when the body requests it lazily
(`request.getfixturevalue`), so a body's scope never takes a fixture's server with it.

tests/conftest.py imports the hooks; `python -m pytest -p harness.pytest_reaper` loads them into
any other run.

Not here: finding and stopping the processes (`reaper.py`).
"""

from __future__ import annotations

import os
import uuid
import warnings

import pytest

from harness.reaper import SCOPE_ENV, Reaper, marked, marking, stop

_REAPER = Reaper()
_SESSION_TOKEN = uuid.uuid4().hex  # what the session's processes carry (fixtures' servers included)


def _report(where: str, left: dict[int, str]) -> None:
    if left:
        lines = "\n".join(f"  pid {pid}: {cmd[:200]}" for pid, cmd in sorted(left.items()))
        warnings.warn(f"{where} left {len(left)} process(es) running; stopped:\n{lines}", stacklevel=1)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    os.environ[SCOPE_ENV] = _SESSION_TOKEN
    # Python's resource tracker is one per process, started by the first test that spawns a
    # process (torch.multiprocessing, "spawn"): started inside that test, it was reaped with it
    # and reported as its leak. It belongs to the session: started here, under its mark.
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    with marking(_SESSION_TOKEN):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    with _REAPER.scope() as left:
        yield
    _report(f"test {item.nodeid}", left)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Nothing outlives the run: the fixtures have been torn down by now."""
    left = marked(_SESSION_TOKEN)
    # Except this process's resource tracker: it exits by itself once this process is gone, after
    # unlinking the semaphores and shared memory its tests leaked; killed now, it would leave them.
    from multiprocessing import resource_tracker

    left.pop(getattr(resource_tracker._resource_tracker, "_pid", None), None)
    if left:
        stop(sorted(left))
