"""reaper: every process a test starts is stopped when the test ends, whatever ends it.

A test that starts servers, agents or torchrun ranks usually stops them itself, but not on every
path: a pytest timeout, a failed assertion between start and stop, or `subprocess.run(timeout=)`
killing a parent whose children live on (they are re-parented to init and outlive the run, as
four chaos agents once did for 45 minutes). The reaper makes the test process a *child
subreaper* (Linux `PR_SET_CHILD_SUBREAPER`), so orphaned descendants are re-parented to it rather
than to init, and `Reaper.scope()` notes the descendants alive when a scope opens and stops every
new one still alive when it closes: SIGTERM to each, then SIGKILL to what is left after a grace
period. By PID, never by name. Processes started by a wider scope (a module's server) are left to
that scope.

Not here: starting processes (each harness module starts its own).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Makes this process the reaper of its orphaned descendants; False where the OS has no such thing."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


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


def stop(pids: list[int], *, grace_s: float = 10.0) -> None:
    """SIGTERM to each, SIGKILL to those still alive after `grace_s`; reaps what is ours to reap."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 5.0)
        while time.monotonic() < deadline:
            _reap_zombies(pids)
            if not any(alive(pid) for pid in pids):
                return
            time.sleep(0.05)


def _reap_zombies(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)


def alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped, is not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return state[state.rindex(")") + 2] != "Z"


class Reaper:
    """Scopes in which the processes started are stopped at the end (see the module docstring)."""

    def __init__(self) -> None:
        self.subreaper = become_subreaper()

    def stop_all(self) -> dict[int, str]:
        """Stops every live descendant; returns what it stopped."""
        left = descendants()
        if left:
            stop(sorted(left))
        return left

    @contextlib.contextmanager
    def scope(self) -> Iterator[dict[int, str]]:
        """Yields a dict that, once the scope closes, holds what was left running (and was stopped)."""
        before = set(descendants())
        left: dict[int, str] = {}
        try:
            yield left
        finally:
            left.update({pid: cmd for pid, cmd in descendants().items() if pid not in before})
            if left:
                stop(sorted(left))
