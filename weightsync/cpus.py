"""How many CPUs this process may run on: what sizes the encode and decode thread pools.

`os.cpu_count()` counts the machine's CPUs, not the ones the process is allowed on. An agent
started under `taskset`, a container's cpuset or a Kubernetes pod with the static CPU manager
would start a thread per machine CPU and oversubscribe its own few (a 2-CPU pod on a 64-core
node: 64 decode threads time-slicing 2 CPUs). The affinity mask is the number that counts.
"""

from __future__ import annotations

import os


def usable_cpus() -> int:
    """CPUs in this process's affinity mask (where the OS has one), else the machine's count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # macOS and Windows have no sched_getaffinity
        return os.cpu_count() or 2
