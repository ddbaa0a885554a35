"""training_server: starts `weightsync.app.training.serve` in its own process group (one rank, or
N ranks under torchrun) on 127.0.0.1 port 0, waits for its ready line, and stops it by process
group: SIGTERM for a clean stop, SIGKILL to simulate a crash.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

API_KEY = "tml-weightsync-test"


class TrainingServer:
    def __init__(
        self,
        state_dir: str | Path,
        *,
        ranks: int = 1,
        extra_args: tuple[str, ...] = (),
        api_key: str = API_KEY,
        ready_timeout_s: float = 180.0,
    ) -> None:
        self.state_dir, self.ranks, self.extra_args = Path(state_dir), ranks, extra_args
        self.api_key, self.ready_timeout_s = api_key, ready_timeout_s
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.log_path = self.state_dir.parent / f"{self.state_dir.name}-server.log"

    def start(self) -> TrainingServer:
        args = [
            "-m",
            "weightsync.app.training.serve",
            "--state-dir",
            str(self.state_dir),
            "--port",
            "0",
            "--api-key",
            self.api_key,
            *self.extra_args,
        ]
        if self.ranks > 1:
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={self.ranks}",
                *args,
            ]
        else:
            cmd = [sys.executable, *args]
        # The caller's own process-group settings (a test or benchmark running a trainer in
        # process) must not leak into the server: it picks its own rendezvous.
        inherited = {
            k: v
            for k, v in os.environ.items()
            if k
            not in (
                "MASTER_ADDR",
                "MASTER_PORT",
                "RANK",
                "WORLD_SIZE",
                "LOCAL_RANK",
                "LOCAL_WORLD_SIZE",
                "GROUP_RANK",
                "TORCHELASTIC_RUN_ID",
            )
        }
        env = {**inherited, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self.state_dir.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, env=env, start_new_session=True)
        ready = threading.Event()
        line_box: list[bytes] = []

        def read_ready() -> None:
            for line in self.proc.stdout:
                if line.startswith(b"{") and b'"ready"' in line:
                    line_box.append(line)
                    ready.set()
                    return

        threading.Thread(target=read_ready, daemon=True).start()
        if not ready.wait(self.ready_timeout_s):
            self.stop(kill=True)
            raise RuntimeError(
                f"training server not ready after {self.ready_timeout_s} s; log: {self.log_path}\n"
                + self.log_path.read_text(errors="replace")[-3000:]
            )
        self.url = json.loads(line_box[0])["url"]
        return self

    def stop(self, *, kill: bool = False, timeout_s: float = 60.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL if kill else signal.SIGTERM)
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=timeout_s)
        except ProcessLookupError:
            pass

    def __enter__(self) -> TrainingServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
