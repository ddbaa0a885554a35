"""Thread pools are sized by the CPUs the process may use (affinity, cgroup CPU quota), not by the
machine's count."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from weightsync.cpus import cgroup_cpu_limit, usable_cpus

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux CPU affinity")


def test_usable_cpus_is_the_affinity_mask_where_no_quota_is_lower():
    if cgroup_cpu_limit() is None:
        assert usable_cpus() == len(os.sched_getaffinity(0))


def test_a_pinned_process_sizes_its_encode_and_decode_pools_to_its_cpus():
    # As under `taskset -c N` or a container's cpuset: one CPU allowed, however many the machine has.
    one_cpu = min(os.sched_getaffinity(0))
    code = (
        "import os, json, tempfile\n"
        f"os.sched_setaffinity(0, {{{one_cpu}}})\n"
        "from weightsync.cpus import usable_cpus\n"
        "from weightsync.publisher import PublisherConfig\n"
        "from weightsync.agents.config import AgentConfig\n"
        "from weightsync.reader import Reader\n"
        "from weightsync.stores import LocalStore\n"
        "reader = Reader(LocalStore(tempfile.mkdtemp()), model='m')\n"
        "print(json.dumps([usable_cpus(), PublisherConfig().workers, AgentConfig(model='m', cache_dir=tempfile.mkdtemp()).workers,"
        " reader.workers, os.cpu_count()]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    cpus, publisher, agent, reader, machine = json.loads(out.stdout.strip().splitlines()[-1])
    assert (cpus, publisher, agent, reader) == (1, 1, 1, 1)
    assert machine == os.cpu_count()


def _fake_proc(tmp_path, cgroup: str, mountinfo: str):
    proc = tmp_path / "proc-self"
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text(cgroup)
    (proc / "mountinfo").write_text(mountinfo)
    return proc


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_a_cgroup_v2_cpu_limit_is_the_lowest_quota_along_the_cgroups_ancestors(tmp_path):
    # A Kubernetes pod with a 2.5-CPU limit; its container's own cgroup has none.
    mount = tmp_path / "cg2"
    _write(mount / "kubepods" / "pod1" / "cpu.max", "250000 100000\n")
    _write(mount / "kubepods" / "pod1" / "c1" / "cpu.max", "max 100000\n")
    _write(mount / "kubepods" / "cpu.max", "max 100000\n")
    proc = _fake_proc(
        tmp_path, "0::/kubepods/pod1/c1\n", f"30 23 0:26 / {mount} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
    )
    assert cgroup_cpu_limit(proc) == 2.5


def test_a_cgroup_v1_cfs_quota_inside_a_container_that_sees_its_own_cgroup_as_root(tmp_path):
    mount = tmp_path / "cpu,cpuacct"
    _write(mount / "cpu.cfs_quota_us", "150000\n")
    _write(mount / "cpu.cfs_period_us", "100000\n")
    proc = _fake_proc(
        tmp_path,
        "5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n",
        f"41 30 0:36 /docker/abc {mount} rw,nosuid shared:17 - cgroup cgroup rw,cpu,cpuacct\n",
    )
    assert cgroup_cpu_limit(proc) == 1.5


def test_no_cpu_limit_when_the_quota_is_unset_or_unreadable(tmp_path):
    mount = tmp_path / "cpu"
    _write(mount / "cpu.cfs_quota_us", "-1\n")  # v1's "no limit"
    _write(mount / "cpu.cfs_period_us", "100000\n")
    proc = _fake_proc(tmp_path, "1:cpu:/\n", f"40 30 0:35 / {mount} rw - cgroup cgroup rw,cpu\n")
    assert cgroup_cpu_limit(proc) is None
    assert cgroup_cpu_limit(tmp_path / "no-such-proc") is None
    garbled = _fake_proc(tmp_path / "g", "nonsense\n", "also nonsense\n")
    assert cgroup_cpu_limit(garbled) is None
    _write(tmp_path / "v2" / "cpu.max", "100000 0\n")  # a zero period
    empty_path = _fake_proc(tmp_path / "e", "0::\n", f"30 23 0:26 / {tmp_path / 'v2'} rw - cgroup2 cgroup2 rw\n")
    assert cgroup_cpu_limit(empty_path) is None
    zero_period = _fake_proc(tmp_path / "z", "0::/\n", f"30 23 0:26 / {tmp_path / 'v2'} rw - cgroup2 cgroup2 rw\n")
    assert cgroup_cpu_limit(zero_period) is None


def test_usable_cpus_is_capped_by_this_processs_own_cpu_quota():
    limit = cgroup_cpu_limit()
    if limit is not None:
        assert usable_cpus() <= max(1, math.ceil(limit))
    assert 1 <= usable_cpus() <= len(os.sched_getaffinity(0))


def _writable_cpu_cgroup_v1() -> str | None:
    """This process's cgroup v1 `cpu` directory where the test may make a child (root, rw mount)."""
    try:
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    for line in mounts:
        ours, _, theirs = line.partition(" - ")
        fields, fs = ours.split(), theirs.split()
        if len(fs) >= 3 and fs[0] == "cgroup" and "cpu" in fs[2].split(",") and fields[3] == "/":
            return fields[4] if os.access(fields[4], os.W_OK) else None
    return None


def test_a_process_moved_into_a_real_cgroup_with_half_a_cpu_sizes_its_pools_to_one(tmp_path):
    parent = _writable_cpu_cgroup_v1()
    if parent is None:
        pytest.skip("needs a writable cgroup v1 cpu hierarchy (root)")
    group = os.path.join(parent, f"weightsync-test-{os.getpid()}")
    os.mkdir(group)
    try:
        with open(os.path.join(group, "cpu.cfs_quota_us"), "w") as f:
            f.write("50000")  # half of the default 100 ms period
        code = (
            f"import os\nopen({os.path.join(group, 'cgroup.procs')!r}, 'w').write(str(os.getpid()))\n"
            "from weightsync.cpus import cgroup_cpu_limit, usable_cpus\n"
            "from weightsync.publisher import PublisherConfig\n"
            "print(cgroup_cpu_limit(), usable_cpus(), PublisherConfig().workers)\n"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
        assert out.stdout.split() == ["0.5", "1", "1"]
    finally:
        os.rmdir(group)  # empty again: the subprocess has exited
