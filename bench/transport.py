"""transport: gRPC data-plane throughput against raw TCP, and relay scaling from 1 to N agents.

    .venv/bin/python -m bench.transport            # 1 GiB data plane; relay: 256 MiB model, 8 agents
    .venv/bin/python -m bench.transport --quick    # 128 MiB, 4 agents

Part 1, the data plane, on loopback: the chunk objects of one full (base) version of a bf16
model are sent (a) over a raw TCP socket (sendall, the receiver recv_into's and counts), (b) over
gRPC with weightsync's ObjectFrame codec to a receiver that only counts (what the transport can
do), and (c) pushed to a real sync agent, which checks every object's content hash and writes it
to its cache (what an agent ingests). Every receiver runs in its own process, as in production.

Part 2, relay: a publisher pushes a base version and then a delta (1.4 % of elements changed by
one ULP, the lr-1e-6 statistics of FACTS.md) to the leader of a region of N agent processes that
relay along a pipeline; the time from `publish()` to "every agent serves the delta" is measured
for N = 1 and N = agents, each on a fresh region, in the same run. Agents serve the reference
engine (zero-copy, double-buffered).

Prints one JSON record (config, hardware, load, results) and writes JSON + markdown under
bench/results/transport-<cores>cpu-<arch>-<date>. Not a test: nothing here asserts.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import multiprocessing as mp
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from harness.machine import describe_machine
from weightsync.models import ModelConfig, skeleton

MiB = 1024 * 1024
RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "bench-transport"


def _arch(model_mib: int) -> ModelConfig:
    """A Qwen3-style architecture of about `model_mib` MiB of bf16 weights (~90 MB per layer)."""
    per_layer = 2 * (2 * 2048 * 2048 + 2 * 2048 * 512 + 3 * 2048 * 5632)
    layers = max(1, round(model_mib * MiB / per_layer))
    return ModelConfig(
        vocab_size=259,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=4,
    )


def _weights(arch: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    shapes = {n: t.shape for n, t in skeleton(arch).state_dict().items()}
    g = torch.Generator().manual_seed(seed)
    return {n: (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for n, s in shapes.items()}


def _step(weights: dict[str, torch.Tensor], fraction: float, seed: int) -> dict[str, torch.Tensor]:
    """Moves `fraction` of the elements by one ULP up or down (bit patterns +-1)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in weights.items():
        bits = t.view(torch.int16).clone()
        flat = bits.view(-1)
        count = int(flat.numel() * fraction)
        where = torch.randint(0, flat.numel(), (count,), generator=g)
        flat[where] += torch.randint(0, 2, (count,), generator=g, dtype=torch.int16) * 2 - 1
        out[name] = bits.view(torch.bfloat16)
    return out


# ------------------------------------------------------------------------------ receivers


def _tcp_sink(port_queue) -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port_queue.put(server.getsockname()[1])
    conn, _ = server.accept()
    buf = bytearray(8 * MiB)
    total = 0
    while True:
        n = conn.recv_into(buf)
        if not n:
            break
        total += n
    conn.sendall(str(total).encode())
    conn.close()


def _grpc_sink(port_queue) -> None:
    import concurrent.futures as cf

    import grpc

    from weightsync.transport.rpc import SERVER_OPTIONS, agent_service_handler
    from weightsync.transport.v1 import sync_pb2

    def push(frames, context):
        n = size = 0
        for frame in frames:
            n += 1
            size += len(frame.data)
        return sync_pb2.PushReply(objects=n, bytes=size)

    def unused(request, context):
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "sink")

    server = grpc.server(cf.ThreadPoolExecutor(4), options=SERVER_OPTIONS)
    server.add_generic_rpc_handlers((agent_service_handler(unused, push, unused),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    port_queue.put(port)
    server.wait_for_termination()


def _start(target) -> tuple[mp.Process, int]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=target, args=(q,), daemon=True)
    proc.start()
    return proc, q.get(timeout=60)


def _agent_process(root: Path, name: str, arch: ModelConfig, store_uri: str, peers: list[str]):
    root.mkdir(parents=True, exist_ok=True)
    config = root / f"{name}.toml"
    model = "\n".join(f"{k} = {json.dumps(v)}" for k, v in dataclasses.asdict(arch).items() if v is not None)
    config.write_text(
        f'[agent]\nmodel = "{MODEL}"\nname = "{name}"\ncache_dir = "{root / name}"\nstore = "{store_uri}"\n'
        f"peers = {json.dumps(peers)}\npoll_interval_s = 30.0\npush_wait_s = 5.0\n"
        f'[agent.engine]\ntype = "reference"\nport = 0\n[agent.engine.model]\n{model}\n'
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "weightsync.app.cli", "agent", "--config", str(config)],
        stdout=subprocess.PIPE,
        text=True,
    )
    ready = json.loads(proc.stdout.readline())
    return proc, ready["address"]


def _stop(procs) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


# ------------------------------------------------------------------------------ part 1


def bench_data_plane(objects: list[tuple[str, bytes]], root: Path, arch: ModelConfig) -> dict:
    from weightsync.transport.rpc import AgentClient, ObjectFrame

    total = sum(len(o) for _, o in objects)
    result = {"objects": len(objects), "bytes": total}

    proc, port = _start(_tcp_sink)
    sock = socket.create_connection(("127.0.0.1", port))
    t0 = time.perf_counter()
    for _, obj in objects:
        sock.sendall(obj)
    sock.shutdown(socket.SHUT_WR)
    received = int(sock.recv(64))
    result["tcp_gbps"] = total / (time.perf_counter() - t0) / 1e9
    assert received == total
    sock.close()
    proc.join(timeout=10)

    proc, port = _start(_grpc_sink)
    client = AgentClient(f"127.0.0.1:{port}")
    client.push(iter([ObjectFrame(MODEL, 1, "0" * 32, b"warm-up")]))
    t0 = time.perf_counter()
    reply = client.push(ObjectFrame(MODEL, 1, address, obj) for address, obj in objects)
    result["grpc_gbps"] = total / (time.perf_counter() - t0) / 1e9
    assert reply.bytes == total
    client.close()
    proc.terminate()

    store = root / "p1-store"
    agent, address = _agent_process(root, "p1-agent", arch, f"file://{store}", [])
    client = AgentClient(address)
    t0 = time.perf_counter()
    reply = client.push(ObjectFrame(MODEL, 1, address_, obj) for address_, obj in objects)
    result["agent_ingest_gbps"] = total / (time.perf_counter() - t0) / 1e9
    assert reply.objects == len(objects)
    client.close()
    _stop([agent])
    result["grpc_over_tcp"] = result["grpc_gbps"] / result["tcp_gbps"]
    result["agent_ingest_over_tcp"] = result["agent_ingest_gbps"] / result["tcp_gbps"]
    return result


# ------------------------------------------------------------------------------ part 2


def bench_relay(n_agents: int, root: Path, arch: ModelConfig, versions: list[tuple[str, dict]]) -> dict:
    """A region of `n_agents` relaying along a pipeline: publish() -> every agent serves, per version.
    The first delta after a base is an agent's worst case (its second buffer is built from the
    base); later deltas are the steady state (the second buffer moves forward by deltas)."""
    from weightsync.publisher import Publisher, PublisherConfig
    from weightsync.stores import LocalStore
    from weightsync.transport.push import PushConfig, Pusher
    from weightsync.transport.rpc import AgentClient

    region = root / f"relay-{n_agents}"
    store = LocalStore(region / "store")
    procs, addresses = [], []
    downstream: list[str] = []
    for i in reversed(range(n_agents)):  # last first, so each knows its downstream peer
        proc, address = _agent_process(region, f"agent-{i}", arch, store.uri, downstream)
        procs.append(proc)
        addresses.insert(0, address)
        downstream = [address]
    clients = [AgentClient(a) for a in addresses]
    pusher = Pusher(PushConfig(targets=(addresses[0],), model=MODEL))
    timings = {}
    try:
        with Publisher(
            store, model=MODEL, config=PublisherConfig(chunk_bytes=4 * MiB, cast_floats_to=None), listeners=[pusher]
        ) as publisher:
            for label, weights in versions:
                t0_unix_ms = time.time() * 1000
                result = publisher.publish(weights).result()
                deadline = time.monotonic() + 600
                while any(c.status().current_version < result.version for c in clients):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{label} never reached every agent")
                    time.sleep(0.05)
                served_ms = [
                    next(e.served_unix_ms for e in c.status().ledger if e.version == result.version) for c in clients
                ]
                timings[label] = {
                    "stored_bytes": result.stored_bytes,
                    "commit_s": result.total_s,
                    "first_agent_s": (served_ms[0] - t0_unix_ms) / 1000,
                    "all_agents_s": (max(served_ms) - t0_unix_ms) / 1000,
                    "per_agent_s": [round((ms - t0_unix_ms) / 1000, 3) for ms in served_ms],
                    "fetched_from_store": sum(
                        next(e.bytes_fetched for e in c.status().ledger if e.version == result.version) for c in clients
                    ),
                }
    finally:
        pusher.close(timeout_s=5)
        for c in clients:
            c.close()
        _stop(procs)
        shutil.rmtree(region, ignore_errors=True)
    return timings


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="128 MiB model, 4 agents")
    parser.add_argument("--model-mib", type=int, help="data plane: model size in MiB of bf16 (default 1024; quick 128)")
    parser.add_argument(
        "--relay-model-mib",
        type=int,
        help="relay: model size in MiB (default 256; quick 128): every agent holds ~2 copies",
    )
    parser.add_argument("--agents", type=int, help="agents in the relay region (default 8; quick 4)")
    parser.add_argument("--changed", type=float, default=0.014, help="fraction of elements a delta changes")
    args = parser.parse_args(argv)
    model_mib = args.model_mib or (128 if args.quick else 1024)
    relay_mib = args.relay_model_mib or (128 if args.quick else 256)
    n_agents = args.agents or (4 if args.quick else 8)
    arch, relay_arch = _arch(model_mib), _arch(relay_mib)
    load_start = os.getloadavg()
    base = _weights(arch)
    relay_base = _weights(relay_arch)
    versions = [("base", relay_base)]
    for i in range(3):
        versions.append((f"delta{i + 1}", _step(versions[-1][1], args.changed, i + 1)))
    raw_bytes = sum(t.numel() * 2 for t in base.values())

    from weightsync.format.chunk import encode_chunk, object_hash
    from weightsync.format.dtypes import dtype_by_name
    from weightsync.format.tensors import raw_bytes as raw

    objects = []
    chunk = 4 * MiB
    for t in base.values():
        data = raw(t.contiguous())
        for start in range(0, data.nbytes, chunk):
            _, _, obj, _ = encode_chunk(data[start : start + chunk], None, dtype_by_name("bfloat16"), 1)
            objects.append((object_hash(obj), obj))

    root = Path(tempfile.mkdtemp(prefix="ws-bench-transport-"))
    try:
        data_plane = bench_data_plane(objects, root, arch)
        relay_1 = bench_relay(1, root, relay_arch, versions)
        relay_n = bench_relay(n_agents, root, relay_arch, versions)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    record = {
        "bench": "transport",
        "date": datetime.date.today().isoformat(),
        "config": {
            "model_mib": model_mib,
            "relay_model_mib": relay_mib,
            "raw_bytes": raw_bytes,
            "layers": arch.num_hidden_layers,
            "agents": n_agents,
            "delta_changed_fraction": args.changed,
            "topology": "pipeline",
        },
        "hardware": describe_machine(),
        "load_avg_start": load_start,
        "load_avg_end": os.getloadavg(),
        "data_plane": data_plane,
        "relay": {
            "1": relay_1,
            str(n_agents): relay_n,
            "delta_ratio_n_over_1": relay_n["delta3"]["all_agents_s"] / relay_1["delta3"]["all_agents_s"],
            "base_ratio_n_over_1": relay_n["base"]["all_agents_s"] / relay_1["base"]["all_agents_s"],
        },
    }
    print(json.dumps(record))
    _write(record)
    return record


def _write(record: dict) -> None:
    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / f"transport-{record['hardware']['cores']}cpu-{record['hardware']['machine']}-{record['date']}"
    stem.with_suffix(".json").write_text(json.dumps(record, indent=2))
    d, r, n = record["data_plane"], record["relay"], record["config"]["agents"]
    lines = [
        f"# transport: {record['config']['model_mib']} MiB bf16 model (data plane), "
        f"{record['config']['relay_model_mib']} MiB with {n} agents (relay), {record['date']}",
        "",
        f"Machine: {record['hardware']['cores']} CPUs ({record['hardware']['machine']}), load avg at start "
        f"{record['load_avg_start'][0]:.2f}, at end {record['load_avg_end'][0]:.2f}.",
        "",
        "| data plane (full version, loopback) | GB/s | vs raw TCP |",
        "|---|---|---|",
        f"| raw TCP | {d['tcp_gbps']:.2f} | 1.00 |",
        f"| gRPC, ObjectFrame codec, counting receiver | {d['grpc_gbps']:.2f} | {d['grpc_over_tcp']:.2f} |",
        f"| gRPC push into a sync agent (hash check + cache write) | {d['agent_ingest_gbps']:.2f} | "
        f"{d['agent_ingest_over_tcp']:.2f} |",
        "",
        "delta1 is the first delta after the base (each agent builds its second buffer from the base); "
        "delta3 is the steady state.",
        "",
        "| relay (publish() -> every agent serves) | 1 agent | " + f"{n} agents | ratio |",
        "|---|---|---|---|",
    ]
    for label in ("base", "delta1", "delta3"):
        one, many = r["1"][label]["all_agents_s"], r[str(n)][label]["all_agents_s"]
        lines.append(
            f"| {label} ({r['1'][label]['stored_bytes'] / 1e6:.1f} MB stored) | {one:.2f} s | "
            f"{many:.2f} s | {many / one:.2f} |"
        )
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
