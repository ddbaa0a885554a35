"""netns: emulated regions for the transfer benchmarks — network namespaces, shaped links, a delay proxy.

A `Network` is the trainer's site (the root network namespace: publisher, store, shardcast origin)
plus `regions` remote regions. In "netns" mode each region is a network namespace joined to the
root namespace by one veth pair, the region's only way out, shaped in both directions with a
token bucket (`tc ... tbf rate 1gbit`): everything a region sends or receives shares that link,
as a region's uplink would be shared. Inside a region processes talk over the namespace's own
loopback, unshaped (a datacenter LAN is 10-100x faster than the inter-region link).

Delay. This machine's kernel has no `sch_netem` (only tbf/htb/pfifo), so the link's latency is
added in user space: every connection that crosses a region's boundary goes through one relay
process (`python -m bench.netns proxy`) that holds each piece of data for half the RTT in each
direction before passing it on, with at most `window_bytes` in flight per direction (Linux's
default receive-window ceiling, 6 MiB, is what limits one real TCP flow on a long link). Callers
ask for the address to use: `into(region, addr)` from the root namespace to a server in a region,
`out_of(region, addr)` from a region to a server in the root namespace. A relay terminates TCP, so
slow start and losses over the long link are not modelled, only its delay and its rate.

"loopback" mode (no root, no `ip`/`tc`, or `--network loopback`): every process runs in the root
namespace on 127.0.0.1, addresses are returned unchanged, nothing is shaped; `describe()` says so.

Everything created is named `wsbsl<pid>...` after the creating process, and `cleanup_leftovers()`
removes what a crashed earlier run (whose pid is gone) left. Not here: what runs in the regions.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

log = logging.getLogger(__name__)

PREFIX = "wsbsl"  # namespaces and links of this module, never anything else
_NAME = re.compile(rf"^{PREFIX}-?(\d+)")
_PIECE_BYTES = 256 * 1024


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=check, capture_output=True, text=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_leftovers() -> list[str]:
    """Deletes namespaces and links of earlier runs whose process is gone; returns their names."""
    if shutil.which("ip") is None:
        return []
    removed = []
    for line in _run("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = _NAME.match(name)
        if m and not _pid_alive(int(m.group(1))):
            _run("ip", "netns", "del", name, check=False)
            removed.append(name)
    for line in _run("ip", "-o", "link", "show", check=False).stdout.splitlines():
        parts = line.split(":")
        if len(parts) < 2:
            continue
        name = parts[1].strip().split("@")[0]
        m = _NAME.match(name)
        if m and not _pid_alive(int(m.group(1))):
            _run("ip", "link", "del", name, check=False)
            removed.append(name)
    return removed


def netns_unavailable_reason() -> str | None:
    """None when namespaces and tbf shaping can be used here, else why not."""
    if os.geteuid() != 0:
        return "not root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"no `{tool}` (iproute2)"
    return None


class Network:
    """The trainer's site plus `regions` regions; use as a context manager (see module docstring)."""

    def __init__(
        self, mode: str, regions: int, *, rate: str = "1gbit", rtt_ms: float = 40.0, window_bytes: int = 6 * 1024 * 1024
    ) -> None:
        if mode not in ("netns", "loopback"):
            raise ValueError(f"mode must be 'netns' or 'loopback', got {mode!r}")
        self.mode = mode
        self.regions = regions
        self.rate = rate
        self.rtt_ms = rtt_ms
        self.window_bytes = window_bytes
        self.fallback_reason = ""
        self._pid = os.getpid()
        self._created_ns: list[str] = []
        self._created_links: list[str] = []
        self._proxy: subprocess.Popen | None = None
        self._forwards: dict[tuple[str, str], str] = {}

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> Network:  # noqa: PYI034 (py3.10 has no typing.Self)
        if self.mode == "netns":
            reason = netns_unavailable_reason()
            if reason is None:
                try:
                    self._setup()
                except (subprocess.CalledProcessError, OSError) as e:
                    err = getattr(e, "stderr", "") or str(e)
                    reason = f"namespace setup failed: {err.strip()}"
                    self._teardown()
            if reason is not None:
                log.warning("network: falling back to loopback (%s)", reason)
                self.mode, self.fallback_reason = "loopback", reason
        return self

    def __exit__(self, *exc) -> None:
        self._teardown()

    def _ns(self, region: int) -> str:
        return f"{PREFIX}-{self._pid}-r{region}"

    def _host_ip(self, region: int) -> str:
        return f"10.213.{region + 1}.1"

    def _ns_ip(self, region: int) -> str:
        return f"10.213.{region + 1}.2"

    def _setup(self) -> None:
        cleanup_leftovers()
        for r in range(self.regions):
            ns, host_if, ns_if = self._ns(r), f"{PREFIX}{self._pid}r{r}h", f"{PREFIX}{self._pid}r{r}n"
            _run("ip", "netns", "add", ns)
            self._created_ns.append(ns)
            _run("ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if)
            self._created_links.append(host_if)
            _run("ip", "link", "set", ns_if, "netns", ns)
            _run("ip", "addr", "add", f"{self._host_ip(r)}/24", "dev", host_if)
            _run("ip", "link", "set", host_if, "up")
            inside = ("ip", "netns", "exec", ns)
            _run(*inside, "ip", "addr", "add", f"{self._ns_ip(r)}/24", "dev", ns_if)
            _run(*inside, "ip", "link", "set", ns_if, "up")
            _run(*inside, "ip", "link", "set", "lo", "up")
            _run(*inside, "ip", "route", "add", "default", "via", self._host_ip(r))
            # The burst must cover a few jiffies at the rate, or tbf cannot reach it.
            shape = ("root", "tbf", "rate", self.rate, "burst", "1mb", "latency", "100ms")
            _run("tc", "qdisc", "add", "dev", host_if, *shape)
            _run(*inside, "tc", "qdisc", "add", "dev", ns_if, *shape)
        self._proxy = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.netns",
                "proxy",
                "--delay-ms",
                str(self.rtt_ms / 2),
                "--window-bytes",
                str(self.window_bytes),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parent.parent,
        )

    def _teardown(self) -> None:
        if self._proxy is not None:
            self._proxy.terminate()
            try:
                self._proxy.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proxy.kill()
            self._proxy = None
        for ns in self._created_ns:
            _run("ip", "netns", "del", ns, check=False)
        for link in self._created_links:  # usually gone with its peer's namespace already
            _run("ip", "link", "del", link, check=False)
        self._created_ns, self._created_links = [], []

    # ------------------------------------------------------------------ addresses and processes

    def bind_host(self, region: int) -> str:
        """The address a server in `region` listens on (reachable from the root namespace)."""
        return self._ns_ip(region) if self.mode == "netns" else "127.0.0.1"

    def command(self, region: int | None, argv: list[str]) -> list[str]:
        """`argv` run inside `region` (None: the trainer's site)."""
        if self.mode == "netns" and region is not None:
            return ["ip", "netns", "exec", self._ns(region), *argv]
        return list(argv)

    def into(self, region: int, address: str) -> str:
        """host:port to use from the root namespace for a server at `address` in `region`
        (through the delay relay, then over the region's shaped link)."""
        if self.mode != "netns":
            return address
        return self._forward("127.0.0.1", address)

    def out_of(self, region: int, address: str) -> str:
        """host:port to use from inside `region` for a server at `address` in the root namespace
        (over the region's shaped link, then through the delay relay)."""
        if self.mode != "netns":
            return address
        _, port = address.rsplit(":", 1)
        return self._forward(self._host_ip(region), f"127.0.0.1:{port}")

    def _forward(self, listen_host: str, target: str) -> str:
        key = (listen_host, target)
        if key not in self._forwards:
            assert self._proxy is not None and self._proxy.stdin is not None and self._proxy.stdout is not None
            self._proxy.stdin.write(json.dumps({"listen": listen_host, "target": target}) + "\n")
            self._proxy.stdin.flush()
            reply = json.loads(self._proxy.stdout.readline())
            self._forwards[key] = reply["address"]
        return self._forwards[key]

    def describe(self) -> dict:
        if self.mode == "netns":
            return {
                "mode": "netns",
                "regions": self.regions,
                "inter_region_rate": self.rate,
                "inter_region_rtt_ms": self.rtt_ms,
                "delay": "user-space relay (kernel has no sch_netem)",
                "relay_window_bytes": self.window_bytes,
                "shaping": "tc tbf on both ends of each region's veth",
                "intra_region": "namespace loopback, unshaped",
            }
        return {
            "mode": "loopback",
            "regions": self.regions,
            "shaping": "none",
            "reason": self.fallback_reason or "asked for",
        }


# ---------------------------------------------------------------------------- delay relay


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float, window: int) -> None:
    """Copies reader -> writer, each piece held for `delay_s`, at most `window` bytes in flight."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    room = asyncio.Condition()
    in_flight = 0

    async def send() -> None:
        nonlocal in_flight
        while True:
            due, data = await queue.get()
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if data is None:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()
            async with room:
                in_flight -= len(data)
                room.notify_all()

    sender = asyncio.create_task(send())
    try:
        while True:
            data = await reader.read(_PIECE_BYTES)
            async with room:
                await room.wait_for(lambda: in_flight < window)  # noqa: B023 (read now, not later)
                in_flight += len(data)
            await queue.put((loop.time() + delay_s, data or None))
            if not data:
                break
        await sender
    except (ConnectionError, OSError):
        sender.cancel()
        writer.close()


async def _relay(delay_s: float, window: int) -> None:
    async def handle(target: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        host, port = target.rsplit(":", 1)
        try:
            up_reader, up_writer = await asyncio.open_connection(host, int(port))
        except OSError:
            writer.close()
            return
        await asyncio.gather(
            _pipe(reader, up_writer, delay_s, window), _pipe(up_reader, writer, delay_s, window), return_exceptions=True
        )
        for w in (writer, up_writer):
            w.close()

    tasks: set[asyncio.Task] = set()  # asyncio keeps only weak references to connection handlers

    async def track(target: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        tasks.add(task)
        try:
            await handle(target, reader, writer)
        finally:
            tasks.discard(task)

    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    servers = []
    while line := await stdin.readline():
        spec = json.loads(line)
        target = spec["target"]
        server = await asyncio.start_server(lambda r, w, t=target: track(t, r, w), spec["listen"], 0)
        servers.append(server)
        port = server.sockets[0].getsockname()[1]
        print(json.dumps({"address": f"{spec['listen']}:{port}"}), flush=True)
    for server in servers:
        server.close()


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="delay relay: `proxy` reads forwards as JSON lines on stdin")
    parser.add_argument("command", choices=["proxy", "cleanup"])
    parser.add_argument("--delay-ms", type=float, default=20.0, help="one-way delay added in each direction")
    parser.add_argument("--window-bytes", type=int, default=6 * 1024 * 1024)
    args = parser.parse_args(argv)
    if args.command == "cleanup":
        print(json.dumps({"removed": cleanup_leftovers()}))
        return
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_relay(args.delay_ms / 1000, args.window_bytes))


if __name__ == "__main__":
    main()
