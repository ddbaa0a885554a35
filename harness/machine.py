"""machine: describe_machine(), what every benchmark result records about the machine it ran on.

One shape for every record (cores, CPU model, memory, bf16 support, GPU, kernel, versions), so
results from different benchmarks and days compare. Not here: the load average (a benchmark
samples it around its own run) or the code's revision (bench/chaos records it).
"""

from __future__ import annotations

import os
import platform
from pathlib import Path


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (platform.processor() is often empty on Linux)."""
    return next(
        (line.split(":", 1)[1].strip() for line in _cpuinfo().splitlines() if line.startswith("model name")),
        platform.processor(),
    )


def describe_machine() -> dict:
    """Cores, CPU model, architecture, memory, bf16 hardware, GPU, kernel and the versions that
    decide speed (python, torch, weightsync)."""
    import torch

    import weightsync

    flags = _cpuinfo()
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "machine": platform.machine(),
        "memory_GiB": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "bf16_hardware": any(f in flags for f in ("avx512_bf16", "amx_bf16")),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "weightsync": weightsync.__version__,
    }
