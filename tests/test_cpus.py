"""Thread pools are sized by the CPUs the process may run on, not by the machine's count."""

import json
import os
import subprocess
import sys

import pytest

from weightsync.cpus import usable_cpus

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux CPU affinity")


def test_usable_cpus_is_the_affinity_mask():
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
        "from weightsync.store import LocalStore\n"
        "reader = Reader(LocalStore(tempfile.mkdtemp()), model='m')\n"
        "print(json.dumps([usable_cpus(), PublisherConfig().workers, AgentConfig(model='m', cache_dir=tempfile.mkdtemp()).workers,"
        " reader.workers, os.cpu_count()]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    cpus, publisher, agent, reader, machine = json.loads(out.stdout.strip().splitlines()[-1])
    assert (cpus, publisher, agent, reader) == (1, 1, 1, 1)
    assert machine == os.cpu_count()
