"""moto: moto's S3 in server mode, for the tests and the benchmarks: a real S3-compatible HTTP server.

Not here: breaking its traffic on purpose (fault_proxy.py), buckets and stores (the callers make them)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


class MotoServer:
    """moto's S3 in its own process on a free 127.0.0.1 port; stopped by PID. Usable as a
    context manager, or with start() and stop()."""

    def __init__(self, log_path: Path | None = None) -> None:
        self.log_path = log_path
        """Where the server's stderr goes (None: discarded)."""
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.endpoint = ""

    def start(self) -> MotoServer:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]
        if self.log_path is None:
            self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        else:
            with open(self.log_path, "w") as errors:
                self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=errors)
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(self.endpoint + "/moto-api/", timeout=1).close()
                return self
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    see = f" (see {self.log_path})" if self.log_path is not None else ""
                    raise RuntimeError(f"moto server did not start on {self.endpoint}{see}") from None
                time.sleep(0.2)

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def cpu_s(self) -> float:
        """CPU seconds the server process has used so far."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def __enter__(self) -> MotoServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
