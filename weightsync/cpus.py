"""The CPUs a process may use: how many (what sizes the encode and decode thread pools), and the
lower priority its background work runs at.

`os.cpu_count()` counts the machine's CPUs, not the ones the process may use. An agent started
under `taskset`, in a container with a cpuset, or in a Kubernetes pod with a CPU limit would start
a thread per CPU of the node and oversubscribe its share: 64 decode threads on a 64-core node for a
2-CPU pod either time-slice 2 CPUs (a cpuset) or exhaust the pod's CPU quota early in every period
and stall until the next one (a CPU limit is a CFS quota). Both bounds count: the affinity mask,
and the cgroup's quota in CPUs (rounded up), the lowest along the cgroup's ancestors.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable
from pathlib import Path


def usable_cpus() -> int:
    """CPUs this process may use: its affinity mask (the machine's count where the OS has none),
    capped by its cgroup's CPU quota."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS and Windows have no sched_getaffinity
        cpus = os.cpu_count() or 2
    limit = cgroup_cpu_limit()
    return max(1, min(cpus, math.ceil(limit)) if limit is not None else cpus)


def cgroup_cpu_limit(proc_self: Path = Path("/proc/self")) -> float | None:
    """The CPU quota of this process's cgroup, in CPUs (quota / period; cgroup v2 `cpu.max`, v1
    `cpu.cfs_quota_us`), the lowest along the cgroup's ancestors up to its mount; None when there
    is none or it cannot be read (not Linux, no cgroup filesystem mounted)."""
    try:
        memberships = (proc_self / "cgroup").read_text().splitlines()
        mounts = (proc_self / "mountinfo").read_text().splitlines()
    except OSError:
        return None
    v2_path = v1_path = None
    for line in memberships:
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0" and not controllers:
            v2_path = path
        elif "cpu" in controllers.split(","):
            v1_path = path
    limits = []
    for line in mounts:  # "id parent dev root mount-point options [optional...] - fstype source super-options"
        ours, _, theirs = line.partition(" - ")
        fields, fs = ours.split(), theirs.split()
        if len(fields) < 5 or len(fs) < 3:
            continue
        root, mount_point = fields[3], Path(fields[4])
        if fs[0] == "cgroup2" and v2_path is not None:
            limits.append(_lowest_along(mount_point, root, v2_path, _cgroup2_limit))
        elif fs[0] == "cgroup" and "cpu" in fs[2].split(",") and v1_path is not None:
            limits.append(_lowest_along(mount_point, root, v1_path, _cgroup1_limit))
    found = [limit for limit in limits if limit is not None]
    return min(found) if found else None


def _lowest_along(mount_point: Path, root: str, path: str, read: Callable[[Path], float | None]) -> float | None:
    """The lowest limit from the cgroup's directory up to the mount point (a parent's quota bounds
    its children). `root`: the part of the hierarchy the mount shows (a container's own cgroup)."""
    try:
        if os.path.commonpath([root, path]) != root:
            return None  # the process's cgroup is outside what this mount shows
    except ValueError:  # not two absolute paths: a line we do not understand
        return None
    here = mount_point / os.path.relpath(path, root)
    limits = []
    while True:
        limits.append(read(here))
        if here == mount_point or mount_point not in here.parents:
            break
        here = here.parent
    found = [limit for limit in limits if limit is not None]
    return min(found) if found else None


def _cgroup2_limit(directory: Path) -> float | None:
    try:
        quota, period = (directory / "cpu.max").read_text().split()[:2]
        return None if quota == "max" or int(quota) <= 0 or int(period) <= 0 else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _cgroup1_limit(directory: Path) -> float | None:
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None


BACKGROUND_NICE = 10
"""Niceness of work that must not slow what it runs beside (an agent's early decodes and kernel
warm-up beside a publisher or an inference server on the same host)."""


def lower_this_thread_priority(niceness: int = BACKGROUND_NICE) -> None:
    """Runs the calling thread (only it: Linux sets niceness per thread) at `niceness`."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)
    except (AttributeError, OSError):  # not Linux, or not allowed: run at the normal priority
        pass
