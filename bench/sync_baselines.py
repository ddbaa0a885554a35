"""sync_baselines: how a new checkpoint reaches N inference hosts without weightsync, timed end to end.

Three baselines of `bench/sync_latency.py`, each on the same checkpoint files, store, receiver
count and network as weightsync's own path; each time runs from "the trainer has the new bf16
weights" to "the last receiver holds them as torch tensors":

- `full_store`: the trainer writes the new checkpoint as one safetensors file and uploads it to the
  store (a copy into the store directory, or boto3 `upload_file` to S3); then every receiver
  downloads it (a file copy, or boto3 `download_file` through its region's link) and loads it with
  `safetensors.torch.load_file`. Loading into tensors, no engine swap: the swap is microseconds
  next to the transfer, and weightsync's agents pay theirs inside the time they are measured by.
- `zstd_patch`: the trainer writes the new file and diffs it against the previous one with the
  zstd CLI (`--patch-from=OLD`, level and threads as configured, `--long=31`), uploads the patch;
  every receiver downloads it, applies it to its copy of the previous file and loads the result.
- `shardcast`: the `shardcast` package (PyPI): an origin server at the trainer's site shards the
  file (50 MB shards, blake3 checksum) and serves it over HTTP; in a region with one receiver that
  receiver downloads from the origin, in a region with more a shardcast middle node relays the
  version into the region and the receivers download from it (shardcast's own fan-out). Two
  deviations, both in shardcast's favour or neutral, and said in the output: receivers start
  downloading once their server has every shard (shardcast clients otherwise start at once, get
  404s for shards a middle node has not fetched yet and sleep 2-15 s per retry), and the client's
  distribution-file download uses a per-process temp path (shardcast uses one fixed path inside
  site-packages, which concurrent clients on one machine overwrite and delete under each other).

Receivers are `python -m bench.sync_baselines worker` processes that read one JSON command per
line on stdin and answer one JSON line on stdout, so they start (and import torch) before the
clock runs and can live in a region's network namespace. Not here: weightsync's path, the network
plumbing (`bench/netns.py`), the matrix and report (`bench/sync_latency.py`).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
_ZSTD = "zstd"


def _now_ms() -> int:
    return int(time.time() * 1000)


# ------------------------------------------------------------------------------ store access


def upload(store: dict, path: Path, key: str) -> None:
    """Puts a file into the store: {"kind": "local", "dir": ...} or {"kind": "s3", "endpoint", "bucket"}.
    Receivers read it back the same way, or as {"kind": "http", "url": ...}: the local store's
    directory served over HTTP from the trainer's site, when they sit in another region."""
    if store["kind"] == "local":
        dest = Path(store["dir"]) / key
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, dest)
    else:
        _s3(store["endpoint"]).upload_file(str(path), store["bucket"], key)


def _download(store: dict, key: str, dest: Path) -> None:
    if store["kind"] == "local":
        shutil.copyfile(Path(store["dir"]) / key, dest)
    elif store["kind"] == "http":
        with urllib.request.urlopen(f"{store['url']}/{key}", timeout=60) as response, open(dest, "wb") as f:
            shutil.copyfileobj(response, f, 1024 * 1024)
    else:
        _s3(store["endpoint"]).download_file(store["bucket"], key, str(dest))


def _s3(endpoint: str):
    import boto3

    return boto3.client("s3", endpoint_url=endpoint)


def _load(path: Path) -> int:
    from safetensors.torch import load_file

    return sum(t.numel() * t.element_size() for t in load_file(path).values())


def zstd_patch_args(level: int, threads: int) -> list[str]:
    # --long=31: a window that spans the whole old file, else matches beyond 128 MiB are lost.
    return [f"-{level}", f"-T{threads}", "--long=31"]


def make_patch(old: Path, new: Path, patch: Path, level: int, threads: int) -> None:
    subprocess.run(
        [_ZSTD, "-q", "-f", *zstd_patch_args(level, threads), f"--patch-from={old}", str(new), "-o", str(patch)],
        check=True,
    )


# ------------------------------------------------------------------------------ worker process


class _Worker:
    """The receiver side: one command in, one JSON answer out (see the module docstring)."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self._client = None  # a shardcast ClientNode, once shardcast_client ran
        self._server = ""
        self.keep = []  # shardcast servers living in this process

    def fetch_load(self, store: dict, key: str) -> dict:
        t0 = time.perf_counter()
        dest = self.dir / "new.safetensors"
        _download(store, key, dest)
        t1 = time.perf_counter()
        size = _load(dest)
        done = _now_ms()
        dest.unlink()
        return {"done_unix_ms": done, "fetch_s": t1 - t0, "load_s": time.perf_counter() - t1, "bytes": size}

    def patch_load(self, store: dict, key: str, old: str) -> dict:
        t0 = time.perf_counter()
        patch, dest = self.dir / "new.patch.zst", self.dir / "new.safetensors"
        _download(store, key, patch)
        t1 = time.perf_counter()
        subprocess.run(
            [_ZSTD, "-q", "-f", "-d", "--long=31", f"--patch-from={old}", str(patch), "-o", str(dest)], check=True
        )
        t2 = time.perf_counter()
        size = _load(dest)
        done = _now_ms()
        patch.unlink()
        dest.unlink()
        return {
            "done_unix_ms": done,
            "fetch_s": t1 - t0,
            "patch_s": t2 - t1,
            "load_s": time.perf_counter() - t2,
            "bytes": size,
        }

    def serve_dir(self, directory: str) -> dict:
        """Serves `directory` over HTTP (a threaded server): the local store as remote regions reach it."""
        import functools
        from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

        class Quiet(SimpleHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

        Path(directory).mkdir(parents=True, exist_ok=True)
        server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=directory))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        self.keep.append(server)
        return {"port": server.server_address[1]}

    # -- shardcast

    def shardcast_origin(self) -> dict:
        import shardcast

        data = self.dir / "origin"
        data.mkdir(exist_ok=True)
        (data / "data1.bin").write_bytes(b"\0" * 65536)  # every downloader fetches it once at start (bandwidth probe)
        shardcast.initialize(data_dir=str(data), port=0)
        return {"port": shardcast._origin_server.http_server.server_address[1]}

    def shardcast_broadcast(self, file: str) -> dict:
        import shardcast

        t0 = time.perf_counter()
        version = shardcast.broadcast(file)
        return {"version": version, "broadcast_s": time.perf_counter() - t0, "done_unix_ms": _now_ms()}

    def shardcast_middle(self, upstream: str) -> dict:
        from shardcast import MiddleNode

        data = self.dir / "middle"
        data.mkdir(exist_ok=True)
        (data / "data1.bin").write_bytes(b"\0" * 65536)
        node = MiddleNode(upstream_servers=[upstream], data_dir=str(data), port=0, check_interval=1)
        self.keep.append(node)
        return {"port": node.http_server.server_address[1]}

    def shardcast_client(self, server: str) -> dict:
        from shardcast import ClientNode

        _patch_shardcast_temp_path(self.dir)
        self._client = ClientNode([server], str(self.dir / "downloads"))
        self._server = server
        return {}

    def shardcast_fetch_load(self, version: str, timeout_s: float) -> dict:
        client = self._client
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout_s
        while True:  # poll like a shardcast client, then wait for the server to hold every shard
            info = client.list_available_versions().get(version)
            if info is not None and _all_shards_served(self._server, version, int(info.partition("|")[2])):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"shardcast {version} not served by {self._server} in {timeout_s} s")
            time.sleep(0.1)
        t1 = time.perf_counter()
        out = client.download_version(version, str(self.dir / "new.safetensors"))
        if out is None:
            raise RuntimeError(f"shardcast download of {version} failed (see its log on stderr)")
        t2 = time.perf_counter()
        size = _load(Path(out))
        done = _now_ms()
        Path(out).unlink()
        return {
            "done_unix_ms": done,
            "wait_s": t1 - t0,
            "fetch_s": t2 - t1,
            "load_s": time.perf_counter() - t2,
            "bytes": size,
        }


def _all_shards_served(server: str, version: str, shards: int) -> bool:
    for i in range(shards, 0, -1):
        request = urllib.request.Request(f"{server}/{version}/shard_{i:05d}.bin", method="HEAD")
        try:
            urllib.request.urlopen(request, timeout=10).close()
        except OSError:
            return False
    return True


def _patch_shardcast_temp_path(directory: Path) -> None:
    """shardcast's client downloads distribution.txt to one fixed path in site-packages; give this
    process its own (see the module docstring). Same download call, same parsing."""
    from shardcast import client as sc_client

    temp = str(directory / "temp_distribution.txt")

    def download_distribution_file(self):
        if self.download_file(
            sc_client.SHARDCAST_DISTRIBUTION_FILE, temp, update_metrics=False, log_error_on_failure=False
        ):
            with open(temp) as f:
                content = f.read()
            os.unlink(temp)
            return content
        return None

    sc_client.ShardDownloader.download_distribution_file = download_distribution_file


def worker_main(directory: str) -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    # Imported before "ready": the clock must not time a receiver's start-up.
    import boto3  # noqa: F401
    import safetensors.torch  # noqa: F401

    worker = _Worker(Path(directory))
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        op = command.pop("op")
        try:
            reply = getattr(worker, op)(**command)
        except Exception as e:  # noqa: BLE001 -- reported to the driver, which records it for this baseline
            reply = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(reply), flush=True)


# ------------------------------------------------------------------------------ driver side


def run_on(cpus: frozenset[int] | None):
    """A Popen preexec_fn that puts the child on `cpus` before it runs anything (None: no pinning)."""
    return None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))


class Workers:
    """Worker processes, each in a region (None: the trainer's site); stopped by PID on close."""

    def __init__(
        self,
        net,
        regions: list[int | None],
        root: Path,
        env: dict[str, str] | None = None,
        cpus: list[frozenset[int]] | None = None,
    ) -> None:
        """`cpus`: worker i runs on cpus[i] only (its own machine's CPUs); None: anywhere."""
        self.procs: list[subprocess.Popen] = []
        self.regions = regions
        try:
            for i, region in enumerate(regions):
                argv = [sys.executable, "-m", "bench.sync_baselines", "worker", str(root / f"worker-{i}")]
                proc = subprocess.Popen(
                    net.command(region, argv),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    cwd=ROOT,
                    env={**os.environ, **(env or {})},
                    preexec_fn=run_on(cpus[i] if cpus else None),
                )
                self.procs.append(proc)
            for proc in self.procs:
                if not json.loads(proc.stdout.readline() or "{}").get("ready"):
                    raise RuntimeError("a baseline worker did not start")
        except BaseException:
            self.close()
            raise

    def call(self, i: int, op: str, **args) -> dict:
        proc = self.procs[i]
        proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"baseline worker {i} exited (rc {proc.poll()})")
        return json.loads(line)

    def call_all(self, commands: dict[int, tuple[str, dict]]) -> dict[int, dict]:
        """Commands to several workers at once; each answer as it comes."""
        with cf.ThreadPoolExecutor(len(commands)) as pool:
            futures = {i: pool.submit(self.call, i, op, **args) for i, (op, args) in commands.items()}
            return {i: f.result() for i, f in futures.items()}

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs = []


def _finish(t0_ms: int, replies: dict[int, dict], extra: dict) -> dict:
    errors = [r["error"] for r in replies.values() if "error" in r]
    if errors:
        return {**extra, "error": errors[0]}
    done = [r["done_unix_ms"] for r in replies.values()]
    return {
        **extra,
        "all_s": (max(done) - t0_ms) / 1000,
        "first_s": (min(done) - t0_ms) / 1000,
        "per_receiver": [
            {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()} for r in replies.values()
        ],
    }


def run_full_store(
    workers: Workers,
    receivers: list[int],
    new_sd: dict,
    scratch: Path,
    store: dict,
    store_for: dict[int, dict],
    key: str,
) -> dict:
    """Baseline 1 (see the module docstring); `store_for[i]`: the store as receiver i reaches it."""
    from safetensors.torch import save_file

    t0_ms, t0 = _now_ms(), time.perf_counter()
    path = scratch / "full-new.safetensors"
    save_file(new_sd, path)
    t1 = time.perf_counter()
    upload(store, path, key)
    t2 = time.perf_counter()
    replies = workers.call_all({i: ("fetch_load", {"store": store_for[i], "key": key}) for i in receivers})
    file_bytes = path.stat().st_size
    path.unlink()
    return _finish(t0_ms, replies, {"serialize_s": t1 - t0, "upload_s": t2 - t1, "file_bytes": file_bytes})


def run_zstd_patch(
    workers: Workers,
    receivers: list[int],
    new_sd: dict,
    old_file: Path,
    scratch: Path,
    store: dict,
    store_for: dict[int, dict],
    key: str,
    level: int,
    threads: int,
) -> dict:
    """Baseline 3: write, diff against the previous file, upload the patch; receivers patch + load."""
    from safetensors.torch import save_file

    t0_ms, t0 = _now_ms(), time.perf_counter()
    new, patch = scratch / "patch-new.safetensors", scratch / "new.patch.zst"
    save_file(new_sd, new)
    t1 = time.perf_counter()
    make_patch(old_file, new, patch, level, threads)
    t2 = time.perf_counter()
    upload(store, patch, key)
    t3 = time.perf_counter()
    patch_bytes = patch.stat().st_size
    replies = workers.call_all(
        {i: ("patch_load", {"store": store_for[i], "key": key, "old": str(old_file)}) for i in receivers}
    )
    new.unlink()
    patch.unlink()
    return _finish(
        t0_ms,
        replies,
        {
            "serialize_s": t1 - t0,
            "diff_s": t2 - t1,
            "upload_s": t3 - t2,
            "patch_bytes": patch_bytes,
            "zstd_args": zstd_patch_args(level, threads),
        },
    )


def run_shardcast(
    net,
    scratch: Path,
    new_sd: dict,
    receiver_regions: list[int],
    timeout_s: float,
    cpus: tuple[frozenset[int], list[frozenset[int]]] | None = None,
) -> dict:
    """Baseline 2 with its own processes: origin at the trainer's site, middle nodes, clients.
    `cpus`: (the trainer site's, each receiver's) CPUs; the origin and the middle nodes run on the
    trainer site's, client i on receiver i's."""
    from safetensors.torch import save_file

    by_region: dict[int, int] = {}
    for r in receiver_regions:
        by_region[r] = by_region.get(r, 0) + 1
    middles = [r for r, n in by_region.items() if n > 1]
    # worker 0: origin; then one middle node per crowded region; then the receivers
    layout: list[int | None] = [None, *middles, *receiver_regions]
    workers = Workers(
        net,
        layout,
        scratch / "shardcast",
        cpus=[cpus[0]] * (1 + len(middles)) + list(cpus[1][: len(receiver_regions)]) if cpus else None,
    )
    try:
        origin_port = workers.call(0, "shardcast_origin")["port"]
        server_for: dict[int, str] = {}
        for j, region in enumerate(middles, start=1):
            upstream = "http://" + net.out_of(region, f"127.0.0.1:{origin_port}")
            port = _checked(workers.call(j, "shardcast_middle", upstream=upstream))["port"]
            server_for[region] = f"http://127.0.0.1:{port}"  # the region's receivers reach it on its loopback
        first_client = 1 + len(middles)
        clients = list(range(first_client, len(layout)))
        for i in clients:  # one at a time: shardcast's start-up probe writes one fixed /tmp path
            region = layout[i]
            server = server_for.get(region) or "http://" + net.out_of(region, f"127.0.0.1:{origin_port}")
            _checked(workers.call(i, "shardcast_client", server=server))
        t0_ms, t0 = _now_ms(), time.perf_counter()
        path = scratch / "shardcast-new.safetensors"
        save_file(new_sd, path)
        t1 = time.perf_counter()
        pool = cf.ThreadPoolExecutor(1)
        # The version name is known before broadcast returns: the origin's first is always v1.
        broadcast = pool.submit(workers.call, 0, "shardcast_broadcast", file=str(path))
        replies = workers.call_all(
            {i: ("shardcast_fetch_load", {"version": "v1", "timeout_s": timeout_s}) for i in clients}
        )
        b = _checked(broadcast.result())
        pool.shutdown()
        path.unlink()
        return _finish(
            t0_ms,
            replies,
            {
                "serialize_s": t1 - t0,
                "broadcast_s": b["broadcast_s"],
                "middle_nodes": len(middles),
                "topology": "origin -> middle node per region with >1 receiver -> clients",
            },
        )
    finally:
        workers.close()


def _checked(reply: dict) -> dict:
    if "error" in reply:
        raise RuntimeError(reply["error"])
    return reply


def tool_versions() -> dict:
    versions = {}
    try:
        out = subprocess.run([_ZSTD, "--version"], check=False, capture_output=True, text=True).stdout
        versions["zstd"] = out.strip().split(" v")[-1].split(",")[0] if out else "missing"
    except OSError:
        versions["zstd"] = "missing"
    import importlib.metadata as md

    for dist in ("shardcast", "boto3", "moto", "safetensors", "torch", "grpcio", "zstandard"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            versions[dist] = "missing"
    return versions


def shardcast_unavailable_reason() -> str | None:
    """None when shardcast can run here, else why not (its client shells out to wget)."""
    try:
        import shardcast  # noqa: F401
    except ImportError as e:
        return f"shardcast not installed ({e}); pip install 'shardcast>=0.3' (the bench extra)"
    if shutil.which("wget") is None:
        return "shardcast's client needs wget (it runs `wget` per shard); apt-get install wget"
    return None


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "worker":
        threading.current_thread().name = "worker"
        worker_main(sys.argv[2])
    else:
        sys.exit("usage: python -m bench.sync_baselines worker DIR (started by bench/sync_latency.py)")
