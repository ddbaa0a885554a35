"""The CPUs a process may use: how many (what sizes the encode and decode thread pools), and the
lower priority its background work runs at.

`os.cpu_count()` counts the machine's CPUs, not the ones the process is allowed on. An agent
started under `taskset`, a container's cpuset or a Kubernetes pod with the static CPU manager
would start a thread per machine CPU and oversubscribe its own few (a 2-CPU pod on a 64-core
node: 64 decode threads time-slicing 2 CPUs). The affinity mask is the number that counts.
"""

from __future__ import annotations

import os
import threading


def usable_cpus() -> int:
    """CPUs in this process's affinity mask (where the OS has one), else the machine's count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # macOS and Windows have no sched_getaffinity
        return os.cpu_count() or 2


BACKGROUND_NICE = 10
"""Niceness of work that must not slow what it runs beside (an agent's early decodes and kernel
warm-up beside a publisher or an inference server on the same host)."""


def lower_this_thread_priority(niceness: int = BACKGROUND_NICE) -> None:
    """Runs the calling thread (only it: Linux sets niceness per thread) at `niceness`."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)
    except (AttributeError, OSError):  # not Linux, or not allowed: run at the normal priority
        pass
