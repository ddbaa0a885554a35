"""reaper: every process a test starts is stopped when the test ends, whatever ends it.

A test that starts servers, agents or torchrun ranks usually stops them itself, but not on every
path: a pytest timeout, a failed assertion between start and stop, or `subprocess.run(timeout=)`
killing a parent whose children live on (re-parented to init, four chaos agents once outlived
their test by 45 minutes). Such orphans are no longer our descendants, so they are found by a mark
instead: `Reaper.scope()` puts a fresh token in this process's environment
(WEIGHTSYNC_REAPER_SCOPE), every process started inside the scope inherits it (and passes it on
to its own children), and when the scope closes every process whose environment carries the token
is stopped: SIGTERM to each, then SIGKILL to what is left after a grace period. By PID, never by
name. Processes started outside the scope (a module's server) carry another token and are left to
their owner.

Not a subreaper: re-parenting orphans to the test process would keep them from seeing their parent
die (many programs watch for their parent becoming init), and would leave zombies nobody reaps.

Not here: starting processes (each harness module starts its own).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from weightsync.app.demo.processes import release_shared_memory, shared_memory_of

SCOPE_ENV = "WEIGHTSYNC_REAPER_SCOPE"


def marked(token: str) -> dict[int, str]:
    """PID -> command line of every live process (this one excepted) started with `token` in its
    environment, from /proc."""
    needle = f"{SCOPE_ENV}={token}".encode()
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0") and alive(int(entry.name)):
                found[int(entry.name)] = _command_line(int(entry.name))
        except OSError:  # gone, or not ours to read
            continue
    return found


def descendants(pid: int | None = None) -> dict[int, str]:
    """PID -> command line of every live descendant of `pid` (default: this process), from /proc."""
    root = os.getpid() if pid is None else pid
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # The command name (field 2) may hold spaces and parentheses: split after its last ")".
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
        except (OSError, ValueError):
            continue
        if fields[0] != "Z":  # a zombie is already dead; its parent reaps it
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found: dict[int, str] = {}
    stack = list(children.get(root, []))
    while stack:
        child = stack.pop()
        found[child] = _command_line(child)
        stack += children.get(child, [])
    return found


def _command_line(pid: int) -> str:
    try:
        return (Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")).strip()
    except OSError:
        return "?"


def alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped, is not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return state[state.rindex(")") + 2] != "Z"


def stop(pids: list[int], *, grace_s: float = 10.0) -> None:
    """SIGTERM to each, SIGKILL to those still alive after `grace_s`; reaps what is ours to reap,
    and releases the shared memory they held (a resource tracker killed with them would not)."""
    held = shared_memory_of(pids)
    try:
        _signal_and_wait(pids, grace_s)
    finally:
        release_shared_memory(held)


def _signal_and_wait(pids: list[int], grace_s: float) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 5.0)
        while time.monotonic() < deadline:
            for pid in pids:  # our own children: reap them, or they stay zombies
                with contextlib.suppress(ChildProcessError, OSError):
                    os.waitpid(pid, os.WNOHANG)
            if not any(alive(pid) for pid in pids):
                return
            time.sleep(0.05)


@contextlib.contextmanager
def marking(token: str | None) -> Iterator[None]:
    """Processes started inside carry `token` (none if None), whatever scope is open."""
    outer = os.environ.get(SCOPE_ENV)
    if token is None:
        os.environ.pop(SCOPE_ENV, None)
    else:
        os.environ[SCOPE_ENV] = token
    try:
        yield
    finally:
        if outer is None:
            os.environ.pop(SCOPE_ENV, None)
        else:
            os.environ[SCOPE_ENV] = outer


class Reaper:
    """Scopes in which the processes started are stopped at the end (see the module docstring)."""

    @contextlib.contextmanager
    def scope(self) -> Iterator[dict[int, str]]:
        """Yields a dict that, once the scope closes, holds what was left running (and was stopped)."""
        token = uuid.uuid4().hex
        left: dict[int, str] = {}
        try:
            with marking(token):
                yield left
        finally:
            left.update(marked(token))
            if left:
                stop(sorted(left))
