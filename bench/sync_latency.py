"""sync_latency: publish() -> every agent serving the new version, against three ways without weightsync.

    .venv/bin/python -m bench.sync_latency --quick        # 0.1 GiB, 6 cells, a few minutes
    .venv/bin/python -m bench.sync_latency                # 0.1/0.5/1 GiB, 1-8 agents, local + S3
    .venv/bin/python -m bench.sync_latency --sizes 1 --agents 1,8 --stores local --network netns

Checkpoints are real: `bench.checkpoints.make_lm_series` trains `weightsync.models.CausalLM` (fp32
masters, AdamW, warm moments) and keeps base + 3 successive bf16 checkpoints per lr (1e-6, 3e-6,
1e-5). Each version is handed over in memory, as a trainer's weights are (not as the file's mapped
pages, which would fault in inside the timed copy), to us and to the baselines alike, by a driver
whose heap is frozen once set up, as weightsync's trainer does (`trainer_heap_frozen`). Our path: a
`Publisher` (+ `Pusher` to one leader per region) publishes the base and the three deltas to agent
processes (`weightsync agent`, reference engine) that relay along a pipeline inside each region;
per version we read publish() -> served from the agents' ledgers (`served_unix_ms`). The third
delta is the steady state (agents already serve the previous version and build the next one in
their spare buffer); the base is reported too. Baselines (`bench/sync_baselines.py`) run on the
same checkpoint, store, receiver count and network: full safetensors through the store,
shardcast, `zstd --patch-from`.

Matrix, as themes (cells shared by themes run once): "agents" (every size, lr 1e-6, first store,
every agent count), "change" (largest size, every lr, fewest agents), "store" (largest size, lr
1e-6, fewest and most agents, every store). 1 agent = 1 region; more = 2 regions, split evenly.
Cells that would not fit in memory (agents double-buffer: ~2 models each) are skipped, with the
reason. Network: `bench/netns.py` (namespaces, 1 Gbit/s and 40 ms RTT per region link) or loopback.
CPUs: shared by every process, or with `--cpus-per-agent N` split as machines would be (`CpuPlan`):
N CPUs of its own per agent and per baseline receiver, the rest for the publisher's site. One host
that runs 8 agents on shared CPUs measures its CPUs, not the sync: each agent decodes its own copy.

Writes bench/results/sync-latency[-<label>]-<cores>cpu-<arch>-<date>.{json,md} and -<plot>.png
(rewritten after every cell, so a cut run keeps what it measured; `--label`, quick: "quick") and
prints the JSON record; `python -m bench.sync_report FILE.json` re-renders one. `--repeat N` runs
each cell N times (the headline then uses medians). Agents run as users get them (defaults), except
what a flag changes: `--push-buffer-mib` sets the publisher Pusher's per-target buffer;
`--no-baselines` measures weightsync alone. Not a test.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from pathlib import Path

from bench import sync_baselines as bl
from bench.netns import Network
from harness.moto import MotoServer

log = logging.getLogger("bench.sync_latency")
ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
CACHE = ROOT / "bench" / ".cache"
MODEL = "bench-sync"
GiB = 1024**3
_AGENT_OVERHEAD_GIB = 0.45  # an agent process's RSS besides its two buffers (torch, grpc, threads)


@dataclasses.dataclass
class Cell:
    size: float
    lr: float
    agents: int
    store: str
    themes: set[str]


def plan_cells(sizes: list[float], lrs: list[float], agents: list[int], stores: list[str]) -> list[Cell]:
    """The themed cells (module docstring), largest size first so the headline cells come early."""
    cells: dict[tuple, Cell] = {}

    def add(size: float, lr: float, n: int, store: str, theme: str) -> None:
        cells.setdefault((size, lr, n, store), Cell(size, lr, n, store, set())).themes.add(theme)

    big, few, many = max(sizes), min(agents), max(agents)
    for size in sorted(sizes, reverse=True):
        for n in agents:
            add(size, lrs[0], n, stores[0], "agents")
        if size == big:
            for lr in lrs:
                add(big, lr, few, stores[0], "change")
            for store in stores:
                for n in sorted({few, many}):
                    add(big, lrs[0], n, store, "store")
    return sorted(cells.values(), key=lambda c: (-c.size, c.store != stores[0], c.lr, c.agents))


def regions_for(agents: int, max_regions: int) -> list[int]:
    """The region of each agent: one region for one agent, else `max_regions` of equal halves."""
    count = 1 if agents == 1 else min(max_regions, agents)
    return [i * count // agents for i in range(agents)]


def memory_need_gib(model_gib: float, agents: int) -> float:
    """What a cell needs at its peak: agents (double-buffered) + the publisher's two snapshots and
    one loaded checkpoint + 1 GiB of slack."""
    return agents * (2.2 * model_gib + _AGENT_OVERHEAD_GIB) + 3 * model_gib + 1.0


def mem_available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024**2
    return float("nan")


@dataclasses.dataclass(frozen=True)
class CpuPlan:
    """Which CPUs each simulated machine runs on (`--cpus-per-agent`): each receiver (agent, or a
    baseline's receiver) gets CPUs of its own, as it would have its own machine; the trainer's site
    (the driver, i.e. the publisher, its store server, a baseline's sender, shardcast's origin and
    middle nodes) gets the rest. The same split serves every cell, so 1 agent and 8 agents are
    compared with equal CPUs per agent and for the publisher. None (the default): every process
    may run on every CPU."""

    trainer: frozenset[int]
    receivers: tuple[frozenset[int], ...]

    @classmethod
    def split(cls, cpus: set[int], receivers: int, per_receiver: int) -> CpuPlan:
        ordered = sorted(cpus)
        left = len(ordered) - receivers * per_receiver
        if left < 1:
            raise ValueError(
                f"{receivers} receivers x {per_receiver} CPUs each leave no CPU for the trainer's site "
                f"({len(ordered)} CPUs usable)"
            )
        own = tuple(
            frozenset(ordered[left + i * per_receiver : left + (i + 1) * per_receiver]) for i in range(receivers)
        )
        return cls(frozenset(ordered[:left]), own)

    def describe(self) -> dict:
        return {"trainer_site": sorted(self.trainer), "per_receiver": [sorted(c) for c in self.receivers]}


def pin_this_process(cpus: frozenset[int]) -> None:
    """Every thread of this process onto `cpus` (threads started later inherit it)."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that just ended
            os.sched_setaffinity(int(tid), cpus)


# ------------------------------------------------------------------------------ S3 (moto)


class Moto:
    """A moto S3 server on 127.0.0.1 in its own process (as tests/conftest.py), stopped by PID."""

    def __init__(self, log_path: Path) -> None:
        self.server = MotoServer(log_path).start()
        self.port = self.server.port
        self.address = f"127.0.0.1:{self.port}"
        self.bucket = f"wsb-{uuid.uuid4().hex[:10]}"
        bl._s3(f"http://{self.address}").create_bucket(Bucket=self.bucket)

    def close(self) -> None:
        self.server.stop()


def _fake_aws_env() -> None:
    """Nothing here may reach a real account: scrub AWS settings, use moto's test credentials."""
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        del os.environ[name]
    os.environ.update(
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_CONFIG_FILE=os.devnull,
        AWS_SHARED_CREDENTIALS_FILE=os.devnull,
    )


# ------------------------------------------------------------------------------ our path


def _start_agents(
    net: Network,
    regions: list[int],
    root: Path,
    arch: dict,
    store_uri: str,
    env_for: dict[int, dict],
    apply_early: bool = True,
    cpus: CpuPlan | None = None,
) -> list[dict]:
    """Agent processes, a pipeline per region (last first, so each knows its downstream peer);
    with `cpus`, agent i runs on receiver i's CPUs (and sizes its decode threads to them)."""
    root.mkdir(parents=True, exist_ok=True)
    agents: list[dict] = [{} for _ in regions]
    listen_host = "0.0.0.0" if net.mode == "netns" else "127.0.0.1"
    model = "\n".join(f"{k} = {json.dumps(v)}" for k, v in arch.items() if v is not None)
    downstream: dict[int, str] = {}
    try:
        for i in reversed(range(len(regions))):
            region = regions[i]
            peers = [downstream[region]] if region in downstream else []
            config = root / f"agent-{i}.toml"
            config.write_text(
                f'[agent]\nmodel = "{MODEL}"\nname = "agent-{i}"\nregion = "r{region}"\n'
                f'cache_dir = "{root / f"agent-{i}"}"\nstore = "{store_uri}"\nlisten = "{listen_host}:0"\n'
                f"peers = {json.dumps(peers)}\npoll_interval_s = 30.0\npush_wait_s = 5.0\n"
                f"apply_early = {str(apply_early).lower()}\n"
                f'[agent.engine]\ntype = "reference"\nport = 0\n[agent.engine.model]\n{model}\n'
            )
            argv = [sys.executable, "-m", "weightsync.app.cli", "agent", "--config", str(config), "-v"]
            with open(root / f"agent-{i}.log", "w") as errors:
                proc = subprocess.Popen(
                    net.command(region, argv),
                    stdout=subprocess.PIPE,
                    stderr=errors,
                    text=True,
                    env={**os.environ, **env_for.get(region, {})},
                    cwd=ROOT,
                    preexec_fn=bl.run_on(cpus.receivers[i] if cpus else None),
                )
            agents[i] = {"proc": proc, "region": region}
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"agent-{i} did not start: see {root / f'agent-{i}.log'}")
            port = json.loads(line)["address"].rsplit(":", 1)[1]
            host = net.bind_host(region)
            agents[i].update(status=f"{host}:{port}", push=net.into(region, f"{host}:{port}"))
            downstream[region] = f"127.0.0.1:{port}"
    except BaseException:
        _stop([a["proc"] for a in agents if a])
        raise
    return agents


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def trainer_heap_frozen():
    """The driver plays a trainer whose setup is done: its heap so far is frozen, as weightsync's
    trainer freezes its own (trainer/train.py), so a full collection that walks it (0.10-0.15 s
    in this process on 2 cores, in about a third of the 1 GiB cell's versions) does not land in a
    timed version. What each version allocates is still collected; the heap is thawed after."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def run_ours(
    net: Network,
    series,
    cell: Cell,
    regions: list[int],
    root: Path,
    moto: Moto | None,
    timeout_s: float,
    push_buffer_mib: int = 0,
    apply_early: bool = True,
    cpus: CpuPlan | None = None,
) -> dict:
    """Base + 3 deltas through Publisher -> Pusher -> relaying agents; timings per version."""
    from weightsync.publisher import Publisher, PublisherConfig
    from weightsync.stores import LocalStore
    from weightsync.stores.s3 import S3Store
    from weightsync.transport.push import PushConfig, Pusher
    from weightsync.transport.rpc import AgentClient

    arch = dataclasses.asdict(series.config.model)
    if moto is None:
        store, env_for = LocalStore(root / "store"), {}
    else:
        store = S3Store(moto.bucket, "ours", endpoint_url=f"http://{moto.address}")
        env_for = {r: {"AWS_ENDPOINT_URL": "http://" + net.out_of(r, moto.address)} for r in set(regions)}
    agents = _start_agents(net, regions, root, arch, store.uri, env_for, apply_early, cpus)
    leaders = [next(a["push"] for a in agents if a["region"] == r) for r in sorted(set(regions))]
    push_config = PushConfig(targets=tuple(leaders), model=MODEL)
    if push_buffer_mib:
        push_config = dataclasses.replace(push_config, max_buffered_bytes=push_buffer_mib * 1024**2)
    pusher = Pusher(push_config)
    clients = [AgentClient(a["status"]) for a in agents]
    versions = []
    try:
        with Publisher(
            store, model=MODEL, config=PublisherConfig(chunk_bytes=4 * 1024**2), listeners=[pusher]
        ) as publisher:
            for j in range(series.config.steps_per_lr + 1):
                state = series.load(cell.lr, j, resident=True)
                sent = sum(s["sent_bytes"] for s in pusher.stats().values())
                t0_ms = time.time() * 1000
                future = publisher.publish(state)
                result = future.result()
                deadline = time.monotonic() + timeout_s
                while any(c.status().current_version < result.version for c in clients):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"v{result.version} not served by every agent in {timeout_s} s")
                    time.sleep(0.05)
                # Freed once served, outside the timed window: a trainer's weights live on (freeing
                # 1 GiB costs ~0.07 CPU-s here).
                del state
                entries = [next(e for e in c.status().ledger if e.version == result.version) for c in clients]
                served = [(e.served_unix_ms - t0_ms) / 1000 for e in entries]
                versions.append(
                    {
                        "version": result.version,
                        "kind": result.manifest.kind,
                        "changed_fraction": result.changed_elements / max(1, result.total_elements),
                        "raw_bytes": result.raw_bytes,
                        "stored_bytes": result.stored_bytes + result.manifest_bytes,
                        "store_objects": len(result.manifest.objects()),  # PUTs besides the manifest
                        "ratio": result.ratio,
                        "commit_s": result.total_s,
                        "snapshot_s": result.snapshot_s,
                        "encode_upload_s": result.encode_s,
                        "manifest_s": result.commit_s,
                        "pushed_bytes": sum(s["sent_bytes"] for s in pusher.stats().values()) - sent,
                        "fetched_bytes": sum(e.bytes_fetched for e in entries),
                        "relayed_bytes": sum(e.bytes_pushed for e in entries),
                        "first_agent_s": min(served),
                        "all_agents_s": max(served),
                        "object_chunks": sum(1 for t in result.manifest.tensors for c in t.chunks if c.object),
                        "per_agent": [
                            {
                                "served_s": round(s, 3),
                                "path": e.path,
                                "route": e.route,
                                "route_reason": e.route_reason,
                                "applied_early": e.applied_early,
                                **{k: round(v, 3) for k, v in e.timings_s.items()},
                            }
                            for s, e in zip(served, entries, strict=True)
                        ],
                    }
                )
    finally:
        pusher.close(timeout_s=5)
        for c in clients:
            c.close()
        _stop([a["proc"] for a in agents])
    return {"first": versions[0], "steady": versions[-1], "versions": versions, "leaders": len(leaders)}


# ------------------------------------------------------------------------------ one cell


def run_cell(net: Network, series, cell: Cell, args, scratch: Path) -> dict:
    regions = regions_for(cell.agents, args.max_regions)
    raw = series.file(cell.lr, 0).stat().st_size
    out = {
        "size_gib": cell.size,
        "lr": cell.lr,
        "agents": cell.agents,
        "regions": len(set(regions)),
        "store": cell.store,
        "themes": sorted(cell.themes),
        "checkpoint_file_bytes": raw,
        "load_avg_start": os.getloadavg(),
        "mem_available_gib": round(mem_available_gib(), 1),
    }
    need = memory_need_gib(raw / GiB, cell.agents)
    if need > out["mem_available_gib"]:
        out["skipped"] = (
            f"needs ~{need:.1f} GiB ({cell.agents} agents x 2 buffers of {raw / GiB:.2f} GiB + "
            f"publisher), {out['mem_available_gib']} GiB available"
        )
        return out
    root = Path(tempfile.mkdtemp(prefix="cell-", dir=scratch))
    moto = None
    try:
        moto = Moto(scratch / f"moto-{root.name}.log") if cell.store == "s3" else None
        log.info(
            "cell %s GiB lr %g, %d agents in %d regions, %s store",
            cell.size,
            cell.lr,
            cell.agents,
            len(set(regions)),
            cell.store,
        )
        with trainer_heap_frozen():  # for ours and the baselines alike
            out["ours"] = run_ours(
                net,
                series,
                cell,
                regions,
                root / "ours",
                moto,
                args.timeout_s,
                args.push_buffer_mib,
                not args.no_apply_early,
                args.cpu_plan,
            )
            log.info(
                "  ours: steady %.2f s, first %.2f s",
                out["ours"]["steady"]["all_agents_s"],
                out["ours"]["first"]["all_agents_s"],
            )
            out["baselines"] = (
                {} if args.no_baselines else run_baselines(net, series, cell, regions, root / "baselines", moto, args)
            )
        steady = out["ours"]["steady"]["all_agents_s"]
        out["speedup"] = {name: b["all_s"] / steady for name, b in out["baselines"].items() if "all_s" in b}
    except Exception as e:  # noqa: BLE001 -- one broken cell must not lose an hour of others: record it
        log.error("cell failed: %s", traceback.format_exc())
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        if moto is not None:
            moto.close()
        if args.keep_logs:  # the agents' logs, to see what a slow cell did
            dest = Path(args.keep_logs) / f"{cell.size:g}gib-{cell.lr:g}-{cell.agents}a-{cell.store}"
            for log_file in (root / "ours").glob("*.log"):
                dest.mkdir(parents=True, exist_ok=True)
                shutil.copy(log_file, dest / log_file.name)
        shutil.rmtree(root, ignore_errors=True)
        out["load_avg_end"] = os.getloadavg()
    return out


def run_baselines(net: Network, series, cell: Cell, regions: list[int], root: Path, moto: Moto | None, args) -> dict:
    root.mkdir(parents=True)
    steps = series.config.steps_per_lr
    new_sd = series.load(cell.lr, steps, resident=True)
    old_file = series.file(cell.lr, steps - 1)
    # Worker 0 sits at the trainer's site (it serves the local store's directory over HTTP to the
    # regions: a directory there is no closer to a remote region than S3 is); 1.. are the receivers.
    plan = args.cpu_plan
    workers = bl.Workers(
        net, [None, *regions], root, cpus=[plan.trainer, *plan.receivers[: len(regions)]] if plan else None
    )
    receivers = list(range(1, len(regions) + 1))
    results: dict[str, dict] = {}
    try:
        if moto is None:
            store = {"kind": "local", "dir": str(root / "store")}
            store_for = {i: store for i in receivers}
            if net.mode == "netns":
                port = workers.call(0, "serve_dir", directory=store["dir"])["port"]
                store_for = {
                    i: {"kind": "http", "url": "http://" + net.out_of(regions[i - 1], f"127.0.0.1:{port}")}
                    for i in receivers
                }
        else:
            store = {"kind": "s3", "endpoint": f"http://{moto.address}", "bucket": moto.bucket}
            store_for = {
                i: {**store, "endpoint": "http://" + net.out_of(regions[i - 1], moto.address)} for i in receivers
            }
        for name, run in (
            (
                "full_store",
                lambda: bl.run_full_store(workers, receivers, new_sd, root, store, store_for, "full/new.safetensors"),
            ),
            (
                "zstd_patch",
                lambda: bl.run_zstd_patch(
                    workers,
                    receivers,
                    new_sd,
                    old_file,
                    root,
                    store,
                    store_for,
                    "patch/new.patch.zst",
                    args.zstd_level,
                    args.zstd_threads,
                ),
            ),
        ):
            try:
                results[name] = run()
            except Exception as e:  # noqa: BLE001 -- recorded per baseline; the others still run
                log.error("%s failed: %s", name, traceback.format_exc())
                results[name] = {"error": f"{type(e).__name__}: {e}"}
    finally:
        workers.close()
    reason = bl.shardcast_unavailable_reason()
    if reason:
        results["shardcast"] = {"skipped": reason}
    else:
        try:
            results["shardcast"] = bl.run_shardcast(
                net, root, new_sd, list(regions), args.timeout_s, (plan.trainer, list(plan.receivers)) if plan else None
            )
        except Exception as e:  # noqa: BLE001 -- recorded; the cell's other results stand
            log.error("shardcast failed: %s", traceback.format_exc())
            results["shardcast"] = {"error": f"{type(e).__name__}: {e}"}
    for name, r in results.items():
        log.info("  %s: %s", name, f"{r['all_s']:.2f} s" if "all_s" in r else r)
    return results


# ------------------------------------------------------------------------------ driver


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="0.1 GiB, agents 1,4: a few minutes")
    parser.add_argument("--sizes", help="model sizes in GiB of bf16, from 0.1,0.5,1 (default all; quick 0.1)")
    parser.add_argument(
        "--lrs", default="1e-6,3e-6,1e-5", help="lrs of the checkpoint pairs; the first is the headline"
    )
    parser.add_argument("--agents", help="agent counts (default 1,2,4,8; quick 1,4)")
    parser.add_argument(
        "--stores", default="local,s3", help="local and/or s3 (a moto server); the first is the main one"
    )
    parser.add_argument(
        "--network",
        choices=["netns", "loopback"],
        default="netns",
        help="netns: regions as namespaces with shaped links (falls back to loopback if impossible)",
    )
    parser.add_argument("--rate", default="1gbit", help="inter-region link rate (tc tbf syntax)")
    parser.add_argument("--rtt-ms", type=float, default=40.0, help="inter-region round-trip delay added")
    parser.add_argument("--max-regions", type=int, default=2)
    parser.add_argument("--zstd-level", type=int, default=3, help="zstd --patch-from level (19 takes minutes per GiB)")
    parser.add_argument("--zstd-threads", type=int, default=0, help="zstd -T (0: one per core)")
    parser.add_argument("--label", default="", help="names the result files sync-latency-LABEL-... (quick: 'quick')")
    parser.add_argument(
        "--push-buffer-mib",
        type=int,
        default=0,
        help="publisher Pusher max_buffered_bytes in MiB (0: PushConfig's default, 512)",
    )
    parser.add_argument(
        "--no-apply-early",
        action="store_true",
        help="agents apply every chunk after the offer (apply_early = false), to measure what "
        "applying pushed chunks as they arrive saves",
    )
    parser.add_argument(
        "--repeat", type=int, default=1, help="run each cell this many times (the headline uses medians)"
    )
    parser.add_argument("--keep-logs", help="copy each cell's agent logs into this directory")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per version / per baseline transfer")
    parser.add_argument(
        "--cpus-per-agent",
        type=int,
        default=0,
        help="give each agent (and each baseline receiver) this many CPUs of its own, as on its own "
        "machine; the publisher's site gets the rest (0: all processes share all CPUs)",
    )
    parser.add_argument(
        "--no-baselines",
        action="store_true",
        help="measure weightsync only (e.g. the agents-scaling cells); no full-file or patch runs",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    sizes = [float(s) for s in (args.sizes or ("0.1" if args.quick else "0.1,0.5,1")).split(",")]
    agents = [int(n) for n in (args.agents or ("1,4" if args.quick else "1,2,4,8")).split(",")]
    lrs = [float(x) for x in args.lrs.split(",")]
    stores = args.stores.split(",")
    if not set(stores) <= {"local", "s3"}:
        parser.error("--stores takes local and/or s3")
    _fake_aws_env()
    args.cpu_plan = None
    if args.cpus_per_agent:
        try:
            args.cpu_plan = CpuPlan.split(os.sched_getaffinity(0), max(agents), args.cpus_per_agent)
        except ValueError as e:
            parser.error(str(e))
        pin_this_process(args.cpu_plan.trainer)  # before any thread, server or child starts

    from bench.checkpoints import lm_series_config, make_lm_series, pair_stats
    from bench.sync_report import write_report
    from harness.machine import describe_machine

    series, changed = {}, {}
    for size in sizes:
        t0 = time.perf_counter()
        series[size] = make_lm_series(lm_series_config(size), cache_dir=CACHE)
        steps = series[size].config.steps_per_lr
        changed[size] = {
            f"{lr:g}": pair_stats(series[size].load(lr, steps - 1), series[size].load(lr, steps)).changed_fraction
            for lr in lrs
        }
        log.info(
            "%s GiB series ready in %.0f s; measured pair changed %s",
            size,
            time.perf_counter() - t0,
            {k: f"{v:.2%}" for k, v in changed[size].items()},
        )
    cells = [cell for cell in plan_cells(sizes, lrs, agents, stores) for _ in range(args.repeat)]
    record = {
        "bench": "sync_latency",
        "date": datetime.date.today().isoformat(),
        "quick": args.quick,
        "label": args.label,
        "config": {
            "sizes_gib": sizes,
            "lrs": lrs,
            "agents": agents,
            "stores": stores,
            "max_regions": args.max_regions,
            "zstd_patch": bl.zstd_patch_args(args.zstd_level, args.zstd_threads),
            "chunk_bytes": 4 * 1024**2,
            "engine": "reference (bf16, zero-copy, double-buffered)",
            "publisher_push_buffer_mib": args.push_buffer_mib or "default",
            "topology": "pipeline per region",
            "apply_early": not args.no_apply_early,
            "cpus": args.cpu_plan.describe() if args.cpu_plan else "shared (no pinning)",
            "baselines": not args.no_baselines,
            "checkpoints": {
                f"{s:g}": {
                    "arch": dataclasses.asdict(series[s].config.model),
                    "cache": series[s].path.name,
                    "changed_fraction": changed[s],
                }
                for s in sizes
            },
            "cells_planned": len(cells),
        },
        "hardware": describe_machine(),
        "versions": bl.tool_versions(),
        "cells": [],
    }
    scratch = Path(tempfile.mkdtemp(prefix="ws-bench-sync-"))
    try:
        with Network(args.network, args.max_regions, rate=args.rate, rtt_ms=args.rtt_ms) as net:
            record["network"] = net.describe()
            log.info("network: %s", record["network"])
            for cell in cells:
                result = run_cell(net, series[cell.size], cell, args, scratch)
                result["changed_fraction"] = changed[cell.size][f"{cell.lr:g}"]
                record["cells"].append(result)
                write_report(record, RESULTS)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(json.dumps(record))
    write_report(record, RESULTS)
    return record


if __name__ == "__main__":
    main()
