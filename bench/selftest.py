"""selftest: the benchmarks' checks of their own pure helpers (sync_latency's matrix plan, region split,
CPU split, memory estimate, loopback addressing; sync_report's markdown). No timings, no processes, no namespaces.

    python -m bench.selftest    # prints one line per check; exits 1 if one fails

tests/test_bench_selftest.py runs it in CI: tests never import bench/, they run its command lines.
Not here: anything that measures (the benchmarks themselves).
"""

from __future__ import annotations

import sys
import traceback

from bench.netns import Network
from bench.sync_latency import CpuPlan, memory_need_gib, plan_cells, regions_for
from bench.sync_report import headline, markdown


def check_regions_split_agents_evenly_and_one_agent_is_one_region():
    assert regions_for(1, 2) == [0]
    assert regions_for(2, 2) == [0, 1]
    assert regions_for(8, 2) == [0, 0, 0, 0, 1, 1, 1, 1]
    assert regions_for(4, 1) == [0, 0, 0, 0]


def check_plan_runs_shared_cells_once_largest_size_first():
    cells = plan_cells([0.1, 0.5, 1.0], [1e-6, 3e-6, 1e-5], [1, 2, 4, 8], ["local", "s3"])
    keys = [(c.size, c.lr, c.agents, c.store) for c in cells]
    assert len(keys) == len(set(keys))
    assert cells[0].size == 1.0 and cells[-1].size == 0.1
    headline_cell = next(c for c in cells if (c.size, c.lr, c.agents, c.store) == (1.0, 1e-6, 1, "local"))
    assert headline_cell.themes == {"agents", "change", "store"}
    assert {c.lr for c in cells if "change" in c.themes} == {1e-6, 3e-6, 1e-5}
    assert {(c.store, c.agents) for c in cells if "store" in c.themes} == {
        ("local", 1),
        ("local", 8),
        ("s3", 1),
        ("s3", 8),
    }


def check_memory_estimate_counts_two_buffers_per_agent():
    assert memory_need_gib(1.0, 8) > 2 * memory_need_gib(1.0, 2)
    assert memory_need_gib(1.0, 8) > 21  # does not fit this 24 GiB machine beside anything else
    assert memory_need_gib(0.1, 8) < 8


def check_cpu_plan_gives_each_receiver_its_own_cpus_and_the_trainer_the_rest():
    plan = CpuPlan.split(set(range(16)), receivers=8, per_receiver=1)
    assert plan.trainer == frozenset(range(8))
    assert [sorted(c) for c in plan.receivers] == [[8 + i] for i in range(8)]
    plan = CpuPlan.split({0, 1, 2, 3, 4, 5, 6}, receivers=3, per_receiver=2)
    assert plan.trainer == {0} and [sorted(c) for c in plan.receivers] == [[1, 2], [3, 4], [5, 6]]
    try:
        CpuPlan.split({0, 1}, receivers=2, per_receiver=1)
    except ValueError as e:
        assert "no CPU for the trainer" in str(e)
    else:
        raise AssertionError("a split that leaves the trainer no CPU must be refused")


def check_loopback_network_leaves_addresses_and_commands_alone():
    with Network("loopback", 2) as net:
        assert net.into(1, "127.0.0.1:5") == "127.0.0.1:5"
        assert net.out_of(0, "127.0.0.1:6") == "127.0.0.1:6"
        assert net.command(1, ["x"]) == ["x"]
        assert net.describe()["mode"] == "loopback"


def check_report_renders_a_finished_and_a_skipped_cell():
    version = {
        "all_agents_s": 1.0,
        "commit_s": 0.5,
        "stored_bytes": 10**6,
        "pushed_bytes": 10**6,
        "fetched_bytes": 0,
        "per_agent": [{"apply": 0.2}],
    }
    done = {
        "size_gib": 1.0,
        "lr": 1e-6,
        "agents": 1,
        "regions": 1,
        "store": "local",
        "themes": ["agents"],
        "changed_fraction": 0.014,
        "load_avg_start": [1.0],
        "load_avg_end": [2.0],
        "ours": {"steady": version, "first": {**version, "all_agents_s": 5.0}},
        "baselines": {"full_store": {"all_s": 12.0}, "shardcast": {"skipped": "no wget"}},
        "speedup": {"full_store": 12.0},
    }
    skipped = {**done, "agents": 8, "skipped": "needs 23 GiB"}
    del skipped["ours"], skipped["baselines"]
    record = {
        "date": "2026-01-01",
        "hardware": {"cores": 2, "cpu": "x", "machine": "x86_64", "memory_GiB": 24, "torch": "t", "weightsync": "w"},
        "versions": {"zstd": "1.5"},
        "network": {"mode": "loopback"},
        "config": {"lrs": [1e-6], "stores": ["local"], "checkpoints": {"1": {"changed_fraction": {"1e-06": 0.014}}}},
        "cells": [done, skipped],
    }
    text = markdown(record)
    assert "12.00 (12.0x)" in text and "needs 23 GiB" in text and "shardcast: no wget" in text
    assert "full safetensors via store 12.00 s (12.0x)" in "\n".join(headline(record))
    assert "| 1 | 1e-06 | 1 | local | 1.00 |" in text  # the time breakdown
    assert "CPUs: every process may run on every CPU" in text
    record["config"]["cpus"] = CpuPlan.split(set(range(4)), 2, 1).describe()
    assert "on 1 CPU(s) of its own, as on its own machine ([2], [3])" in markdown(record)


def main() -> int:
    checks = [(name, check) for name, check in globals().items() if name.startswith("check_") and callable(check)]
    failed = 0
    for name, check in checks:
        try:
            check()
        except Exception:  # noqa: BLE001 - every check runs; each failure is printed with its traceback
            failed += 1
            print(f"FAIL {name}\n{traceback.format_exc()}", flush=True)
        else:
            print(f"ok   {name}", flush=True)
    print(f"{len(checks) - failed} of {len(checks)} checks passed")
    return 1 if failed or not checks else 0


if __name__ == "__main__":
    sys.exit(main())
