"""store benchmark: weightsync publish and pull through S3Store against plain boto3, same bytes, same run.

It starts its own S3-compatible server (moto in server mode, on 127.0.0.1, in its own process,
AWS_* variables scrubbed), makes a model-sized bf16 state dict (Llama-like shapes, 512 MiB by
default, 64 MiB with --quick) and measures, interleaved per repeat so drift hits both alike:

- ours: `Publisher.publish` of a full version (snapshot, encode, upload, commit) and
  `Reader.read` of it (fetch, verify, decode), then a delta version (1.5 % of elements moved by
  one ULP, as in RL steps) published and applied with `Reader.advance`;
- the store alone: the safetensors bytes as 4 MiB objects through `S3Store.put`/`get` on
  `io_concurrency` threads (transfer without the codec);
- plain boto3: `upload_file` / `download_file` of the same weights as one safetensors file,
  default client and TransferConfig (multipart, 10 threads).

Throughput is model (raw bf16) bytes per second. CPU seconds of this process and of the server
process are recorded per measurement: moto is pure Python and shares the machine's cores with
the client, so it is often the bottleneck; the note in the markdown says so when it is.
Prints one JSON record and writes JSON + markdown to bench/results/store-<cpus>cpu-<arch>-<date>.
Run from the repository root: `python -m bench.store [--quick]`. Not a test: it asserts no times.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import datetime
import logging
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

from bench.output import write_results
from harness.machine import describe_machine
from harness.moto import MotoServer

log = logging.getLogger("bench.store")
ROOT = Path(__file__).resolve().parent.parent
MiB = 1024 * 1024


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchConfig:
    size_mib: int = 512
    """bf16 model size; the shapes scale with it."""
    repeats: int = 3
    """Timed repetitions of every measurement, interleaved; the median is reported."""
    io_concurrency: int | None = None
    """S3Store io_concurrency (None: the store's default)."""
    changed_fraction: float = 0.015
    """Elements moved by one ULP between the full and the delta version."""

    def __post_init__(self) -> None:
        if self.size_mib < 8 or self.repeats < 1 or not 0 < self.changed_fraction < 1:
            raise ValueError("size_mib must be >= 8, repeats >= 1, changed_fraction in (0, 1)")


# ---------------------------------------------------------------------------- the server


def _scrub_aws_environment() -> None:
    """No real account or bucket can be reached: fake credentials, no profiles, no endpoint."""
    for name in list(os.environ):
        if name.startswith("AWS_") and name != "AWS_CA_BUNDLE":
            del os.environ[name]
    os.environ.update(
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_CONFIG_FILE=os.devnull,
        AWS_SHARED_CREDENTIALS_FILE=os.devnull,
    )


# ------------------------------------------------------------------------------- weights


def make_state_dict(size_mib: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A Llama-like bf16 state dict of about `size_mib` MiB: embeddings, attention and MLP
    matrices, norms; weights ~N(0, 0.02) as after initialisation."""
    hidden = 1024 if size_mib >= 128 else 512
    vocab, mlp = 32 * hidden, 4 * hidden
    per_layer = 4 * hidden * hidden + 3 * hidden * mlp + 2 * hidden
    layers = max(1, (size_mib * MiB // 2 - 2 * vocab * hidden) // per_layer)
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    sd = {"model.embed_tokens.weight": w(vocab, hidden), "lm_head.weight": w(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            sd[p + f"self_attn.{name}.weight"] = w(hidden, hidden)
        sd[p + "mlp.gate_proj.weight"] = w(mlp, hidden)
        sd[p + "mlp.up_proj.weight"] = w(mlp, hidden)
        sd[p + "mlp.down_proj.weight"] = w(hidden, mlp)
        sd[p + "input_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    sd["model.norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    return sd


def step_state_dict(sd: dict[str, torch.Tensor], fraction: float, seed: int = 1) -> dict[str, torch.Tensor]:
    """A copy with `fraction` of each matrix's elements moved by one bf16 ULP (an RL step's delta)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in sd.items():
        bits = t.clone().view(torch.int16)
        if t.dim() == 2:
            mask = torch.rand(t.shape, generator=g) < fraction
            bits[mask] += torch.where(torch.rand(t.shape, generator=g)[mask] < 0.5, 1, -1).to(torch.int16)
        out[name] = bits.view(torch.bfloat16)
    return out


# ------------------------------------------------------------------------------ measuring


class Meter:
    """Wall time and CPU seconds (this process, the server) of one measured call."""

    def __init__(self, server: MotoServer) -> None:
        self.server = server
        self.samples: dict[str, list[dict]] = {}

    def measure(self, name: str, raw_bytes: int, fn, *args, **kwargs):
        """fn(*args, **kwargs), timed; returns its result."""
        usage = resource.getrusage(resource.RUSAGE_SELF)
        server0, t0 = self.server.cpu_s(), time.perf_counter()
        result = fn(*args, **kwargs)
        seconds = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_SELF)
        self.samples.setdefault(name, []).append(
            {
                "seconds": seconds,
                "GBps": raw_bytes / seconds / 1e9,
                "client_cpu_s": after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime,
                "server_cpu_s": self.server.cpu_s() - server0,
            }
        )
        log.info("%-24s %7.2f s  %.3f GB/s", name, seconds, raw_bytes / seconds / 1e9)
        return result

    def summary(self) -> dict:
        out = {}
        for name, samples in self.samples.items():
            median = statistics.median(s["seconds"] for s in samples)
            out[name] = {
                "median_s": median,
                "GBps": statistics.median(s["GBps"] for s in samples),
                "client_cpu_s": statistics.median(s["client_cpu_s"] for s in samples),
                "server_cpu_s": statistics.median(s["server_cpu_s"] for s in samples),
                "samples": samples,
            }
        return out


def run(config: BenchConfig) -> dict:
    import boto3
    import boto3.s3.transfer
    import botocore
    import moto
    from safetensors.torch import save_file

    from weightsync import __version__
    from weightsync.publisher import Publisher, PublisherConfig
    from weightsync.reader import Reader
    from weightsync.stores.s3 import S3Store, S3StoreConfig

    _scrub_aws_environment()
    load_before = os.getloadavg()
    sd = make_state_dict(config.size_mib)
    sd2 = step_state_dict(sd, config.changed_fraction)
    raw_bytes = sum(t.numel() * t.element_size() for t in sd.values())
    tmp = tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    checkpoint = Path(tmp.name) / "model.safetensors"
    save_file(sd, checkpoint)
    file_bytes = checkpoint.stat().st_size
    log.info("model: %d tensors, %.1f MiB bf16; safetensors file %.1f MiB", len(sd), raw_bytes / MiB, file_bytes / MiB)

    store_config = (
        S3StoreConfig() if config.io_concurrency is None else S3StoreConfig(io_concurrency=config.io_concurrency)
    )
    record: dict = {}
    with MotoServer() as server:
        plain = boto3.client("s3", endpoint_url=server.endpoint)  # boto3 defaults, as a user would have them
        one_stream = boto3.s3.transfer.TransferConfig(multipart_threshold=1 << 50)
        meter = Meter(server)
        for repeat in range(config.repeats):
            bucket = f"bench-{uuid.uuid4().hex[:12]}"
            plain.create_bucket(Bucket=bucket)
            store = S3Store(bucket, f"run{repeat}", endpoint_url=server.endpoint, config=store_config)

            key, downloaded = "plain/model.safetensors", str(Path(tmp.name) / "downloaded.safetensors")
            meter.measure("boto3_upload_file", raw_bytes, plain.upload_file, str(checkpoint), bucket, key)
            with Publisher(store, model="bench", config=PublisherConfig(parent_from_store=False)) as publisher:
                full = meter.measure("ours_publish_full", raw_bytes, _publish, publisher, sd)
                delta = meter.measure("ours_publish_delta", raw_bytes, _publish, publisher, sd2)
            meter.measure("boto3_download_file", raw_bytes, plain.download_file, bucket, key, downloaded)
            os.unlink(downloaded)
            # moto answers each ranged GET by copying the whole object, so download_file's 8 MiB
            # ranges cost it O(size) each; one stream is boto3's best case against this server.
            meter.measure(
                "boto3_download_file_one_stream",
                raw_bytes,
                plain.download_file,
                bucket,
                key,
                downloaded,
                Config=one_stream,
            )
            os.unlink(downloaded)
            reader = Reader(store, model="bench")
            state = meter.measure("ours_pull_full", raw_bytes, reader.read, full.version)
            meter.measure("ours_pull_delta", raw_bytes, reader.advance, state, delta.version)
            if repeat == 0:  # bit-exact, or the numbers mean nothing
                got = state.state_dict()
                assert all(torch.equal(got[k].view(torch.int16), sd2[k].view(torch.int16)) for k in sd2)
                record["stored"] = {
                    "full_bytes": full.stored_bytes + full.manifest_bytes,
                    "delta_bytes": delta.stored_bytes + delta.manifest_bytes,
                    "full_ratio": full.ratio,
                    "delta_ratio": delta.ratio,
                    "objects_full": len(full.manifest.objects()),
                }
            del state
            _measure_store_alone(meter, store, checkpoint.read_bytes(), raw_bytes)
            _empty_bucket(plain, bucket)

    results = meter.summary()
    t = {name: r["median_s"] for name, r in results.items()}
    upload = t["boto3_upload_file"]
    download = min(t["boto3_download_file"], t["boto3_download_file_one_stream"])  # boto3 at its best here
    record.update(
        {
            "bench": "store",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "config": dataclasses.asdict(config)
            | {
                "io_concurrency": store_config.io_concurrency,
                "part_bytes": store_config.part_bytes,
                "multipart_threshold_bytes": store_config.multipart_threshold_bytes,
                "chunk_bytes": PublisherConfig().chunk_bytes,
                "publisher_workers": PublisherConfig().workers,
                "retry_mode": store_config.retry_mode,
                "verify_md5": store_config.verify_md5,
                "boto3_transfer_config": "default (multipart 8 MiB, 10 threads)",
            },
            "versions": {
                "weightsync": __version__,
                "python": platform.python_version(),
                "boto3": boto3.__version__,
                "botocore": botocore.__version__,
                "moto": moto.__version__,
                "torch": torch.__version__,
            },
            "hardware": describe_machine(),
            "load_avg_before": load_before,
            "load_avg_after": os.getloadavg(),
            "model": {"tensors": len(sd), "raw_bytes": raw_bytes, "safetensors_bytes": file_bytes},
            "results": results,
            # Ours over plain boto3 in throughput (> 1: ours is faster); downloads against boto3's
            # faster variant on this server.
            "ratios": {
                "publish_vs_upload_file": upload / t["ours_publish_full"],
                "pull_vs_download_file": download / t["ours_pull_full"],
                "pull_vs_download_file_default": t["boto3_download_file"] / t["ours_pull_full"],
                "publish_pull_vs_upload_download": (upload + download) / (t["ours_publish_full"] + t["ours_pull_full"]),
                "store_put_get_vs_upload_download": (upload + download) / (t["store_put_raw"] + t["store_get_raw"]),
                "delta_step_vs_full_upload_download": (upload + download)
                / (t["ours_publish_delta"] + t["ours_pull_delta"]),
            },
        }
    )
    tmp.cleanup()
    return record


def _publish(publisher, state_dict: dict):
    return publisher.publish(state_dict).result()


def _measure_store_alone(meter: Meter, store, data: bytes, raw_bytes: int) -> None:
    """The checkpoint's bytes as 4 MiB objects through put/get on io_concurrency threads."""
    pieces = {f"raw/{n:06d}": data[start : start + 4 * MiB] for n, start in enumerate(range(0, len(data), 4 * MiB))}
    with cf.ThreadPoolExecutor(store.io_concurrency) as pool:
        meter.measure("store_put_raw", raw_bytes, lambda: list(pool.map(store.put, pieces, pieces.values())))
        got = meter.measure("store_get_raw", raw_bytes, lambda: list(pool.map(store.get, pieces)))
    assert b"".join(got) == data


def _empty_bucket(client, bucket: str) -> None:
    """Frees the server's memory between repeats (moto keeps objects in memory)."""
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys})


def markdown(record: dict) -> str:
    r, hw, cfg = record["results"], record["hardware"], record["config"]
    rows = [
        ("weightsync publish (full version)", "ours_publish_full"),
        ("plain boto3 `upload_file`", "boto3_upload_file"),
        ("weightsync pull (full version)", "ours_pull_full"),
        ("plain boto3 `download_file` (default: 8 MiB ranges, 10 threads)", "boto3_download_file"),
        ("plain boto3 `download_file`, one stream", "boto3_download_file_one_stream"),
        ("S3Store put, 4 MiB objects (no codec)", "store_put_raw"),
        ("S3Store get, 4 MiB objects (no codec)", "store_get_raw"),
        ("weightsync publish (delta, 1 step)", "ours_publish_delta"),
        ("weightsync pull (delta, `advance`)", "ours_pull_delta"),
    ]
    ratios = record["ratios"]
    lines = [
        f"# store benchmark — {record['date']}",
        "",
        f"{hw['cores']} cores ({hw['cpu']}), load avg before {record['load_avg_before'][0]:.2f}, after "
        f"{record['load_avg_after'][0]:.2f}; model {record['model']['raw_bytes'] / MiB:.0f} MiB bf16 in "
        f"{record['model']['tensors']} tensors; moto {record['versions']['moto']} server on 127.0.0.1; "
        f"S3Store io_concurrency {cfg['io_concurrency']}, chunks {cfg['chunk_bytes'] >> 20} MiB; boto3 "
        f"{record['versions']['boto3']} {cfg['boto3_transfer_config']}; median of {cfg['repeats']}.",
        "",
        "| what | seconds | model GB/s | client CPU s | server CPU s |",
        "|---|---|---|---|---|",
    ]
    for label, key in rows:
        e = r[key]
        lines.append(
            f"| {label} | {e['median_s']:.2f} | {e['GBps']:.3f} | {e['client_cpu_s']:.1f} | {e['server_cpu_s']:.1f} |"
        )
    stored = record["stored"]
    cpu_bound = max(
        r["boto3_upload_file"]["server_cpu_s"] / r["boto3_upload_file"]["median_s"],
        r["ours_publish_full"]["server_cpu_s"] / r["ours_publish_full"]["median_s"],
    )
    lines += [
        "",
        f"Ours / plain boto3, throughput: publish {ratios['publish_vs_upload_file']:.2f}x, pull "
        f"{ratios['pull_vs_download_file']:.2f}x (against the faster download; "
        f"{ratios['pull_vs_download_file_default']:.2f}x against the default), "
        f"**publish + pull {ratios['publish_pull_vs_upload_download']:.2f}x**; "
        f"store alone {ratios['store_put_get_vs_upload_download']:.2f}x; one delta step (publish + pull) "
        f"{ratios['delta_step_vs_full_upload_download']:.1f}x a full upload + download.",
        "",
        f"A full version stores {stored['full_bytes'] / MiB:.0f} MiB ({stored['full_ratio']:.2f}x smaller than the "
        f"model) in {stored['objects_full']} objects; the delta {stored['delta_bytes'] / MiB:.1f} MiB "
        f"({stored['delta_ratio']:.0f}x).",
        "",
        f"The server (moto, pure Python) used up to {cpu_bound:.2f} CPU-seconds per second during uploads, on "
        f"{hw['cores']} cores it shares with the client; throughput here is bounded by the machine, not the "
        "network. moto answers every ranged GET by copying the whole object, which makes boto3's default "
        "`download_file` of one large file slow here; the one-stream row is boto3's best case and the pull "
        "ratio is taken against it. Reproduce: `python -m bench.store` (`--quick`: 64 MiB, one repeat).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="64 MiB model, one repeat")
    parser.add_argument("--size-mib", type=int, default=None, help="model size in MiB (default 512)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--io-concurrency", type=int, default=None, help="S3Store io_concurrency (default: 32)")
    parser.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    base = BenchConfig(size_mib=64, repeats=1) if args.quick else BenchConfig()
    config = dataclasses.replace(
        base,
        size_mib=args.size_mib or base.size_mib,
        repeats=args.repeats or base.repeats,
        io_concurrency=args.io_concurrency,
    )
    record = run(config)
    stem = f"store-{record['hardware']['cores']}cpu-{record['hardware']['machine']}-{record['date'][:10]}"
    if args.quick:
        stem += "-quick"
    write_results(Path(args.out_dir) / stem, record, markdown(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
