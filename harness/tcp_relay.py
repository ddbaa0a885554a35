"""tcp_relay: a TCP relay for one link on 127.0.0.1 that can flip bytes in flight or hold all
traffic (a partition), for chaos runs and tests of what a bad link does to gRPC.

Not here: HTTP-aware faults on S3 traffic (fault_proxy.py), delay and bandwidth shaping of a
link between network namespaces (bench/netns.py).
"""

from __future__ import annotations

import contextlib
import random
import socket
import threading
import time


class TcpRelay:
    """A TCP relay for one link: forwards bytes both ways, flips bytes at `flip_rate` per read, or
    holds everything while `partitioned` (packets dropped, connections hang: what a partition looks
    like to both ends until keepalives give up). On healing, held data flows again."""

    def __init__(self, name: str, target_port: int, rng: random.Random) -> None:
        self.name = name
        self.target = ("127.0.0.1", target_port)
        self.partitioned = False
        self.flip_rate = 0.0
        self.flips = 0
        self._rng = rng
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        self._sockets: set[socket.socket] = set()
        self._closed = False
        threading.Thread(target=self._accept, name=f"relay-{name}", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:  # the agent is down: the caller sees a reset, as from a dead host
                client.close()
                continue
            with self._lock:
                self._sockets.update((client, upstream))
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                while self.partitioned and not self._closed:
                    time.sleep(0.05)
                if self.flip_rate and self._rng.random() < self.flip_rate:
                    buf = bytearray(data)
                    i = self._rng.randrange(len(buf))
                    buf[i] ^= 1 << self._rng.randrange(8)
                    data = bytes(buf)
                    with self._lock:
                        self.flips += 1
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()
            with self._lock:
                self._sockets.discard(src)
                self._sockets.discard(dst)

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        with self._lock:
            sockets = list(self._sockets)
        for s in sockets:
            s.close()
