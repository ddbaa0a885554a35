"""Killing the publisher (SIGKILL) at a random point leaves the store readable: every listed
version pulls and verifies (deltas are written in several small packs, so kills also land
between pack writes).

A real publisher runs in a child process (tests/crash_publisher.py) and is killed at seeded
random delays, including before it has published anything and while it is restoring its delta
parent from the store; it is restarted after each kill and continues from the store. After
every kill each newly listed version must parse, read back through `Reader` with every hash
checked, and hold exactly the bf16 weights the child published for that version number; after the
last, every listed version, read again from the first.
"""

from __future__ import annotations

import importlib.util
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from weightsync.format.hashing import xxh3_hex
from weightsync.format.manifest import KIND_DELTA
from weightsync.format.tensors import raw_bytes
from weightsync.reader import Reader
from weightsync.stores import LocalStore
from weightsync.versions import list_versions, read_manifest

SCRIPT = Path(__file__).with_name("crash_publisher.py")
KILLS = 8


def _load_child_module():
    spec = importlib.util.spec_from_file_location("crash_publisher", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Expected:
    """Per-version xxh3 of each published (bf16-cast) tensor, computed once per version."""

    def __init__(self, child) -> None:
        self.child = child
        self.hashes: dict[int, dict[str, tuple[str, str]]] = {}

    def __call__(self, version: int) -> dict[str, tuple[str, str]]:
        if version not in self.hashes:
            sd = self.child.state_for(version)
            published = {n: t.to(torch.bfloat16) if t.is_floating_point() else t for n, t in sd.items()}
            self.hashes[version] = {
                n: (str(t.dtype).removeprefix("torch."), xxh3_hex(raw_bytes(t.contiguous())))
                for n, t in published.items()
            }
        return self.hashes[version]


class _StoreCheck:
    """Checks a store after each kill: every listed version parses, reads back verified and holds
    what was published. After a kill only the versions listed since the last check are read (the
    reader's state advances through them), and the newest also from scratch; `full_sweep` reads
    every version from the first, as the last check after all kills. Committed objects are
    immutable, so the last sweep sees any damage a kill did to an older version; reading the whole
    store after every kill made the check quadratic (~60 s of the S3 run, each GET through moto)."""

    def __init__(self, store: LocalStore, model: str, expected: _Expected) -> None:
        self.store, self.model, self.expected = store, model, expected
        self.reader = Reader(store, model=model, workers=2)
        self.state = None  # the reader's state at the last version checked

    def after_kill(self, seen: set[int]) -> list[int]:
        versions = self._listed(seen)
        self._sweep([v for v in versions if self.state is None or v > self.state.manifest.version])
        return versions

    def full_sweep(self, seen: set[int]) -> list[int]:
        versions = self._listed(seen)
        self.state = None
        self._sweep(versions)
        return versions

    def _listed(self, seen: set[int]) -> list[int]:
        versions = list_versions(self.store, self.model)
        assert seen <= set(versions), f"committed versions disappeared: {sorted(seen - set(versions))}"
        keys = [info.key for info in self.store.list()]
        assert not [k for k in keys if any(part.startswith(".tmp-") for part in k.split("/"))]
        return versions

    def _sweep(self, versions: list[int]) -> None:
        for version in versions:  # each version is a full read or an advance by deltas
            manifest = read_manifest(self.store, self.model, version)
            self.state = self.reader.read(version) if self.state is None else self.reader.advance(self.state, version)
            assert self.state.manifest == manifest
            got = {t.name: (t.dtype, xxh3_hex(self.state.buffers[t.name])) for t in manifest.tensors}
            assert got == self.expected(version), f"version {version} does not hold what was published"
        if self.state is not None:
            fresh = self.reader.read(self.state.manifest.version)  # and from scratch, not by advancing
            assert fresh.manifest.digest == self.state.manifest.digest


def _start(root: str, log: Path, *extra: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), root, *extra],
        stdout=subprocess.PIPE,
        stderr=open(log, "ab"),
        text=True,
        env=env,
    )


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("kind", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_sigkill_at_random_points_leaves_every_listed_version_readable(tmp_path, request, kind):
    child = _load_child_module()
    log = tmp_path / "child-stderr.log"
    if kind == "local":
        store, env = LocalStore(tmp_path / "store"), None
    else:  # the child finds the moto server the standard way, through AWS_ENDPOINT_URL
        store = request.getfixturevalue("s3_store")
        env = {**os.environ, "AWS_ENDPOINT_URL": request.getfixturevalue("s3_endpoint")}
    root = str(tmp_path / "store") if kind == "local" else store.uri
    pace = 1.0 if kind == "local" else 3.0  # every request crosses HTTP to moto: stretch the kill times
    check = _StoreCheck(store, child.MODEL, _Expected(child))
    rng = random.Random(20240607)
    # (what to wait for, then seconds): the first kill lands before anything is published, some
    # right after "ready" (while the child restores its parent from the store), the others a
    # random time after "ready" or after the child's first commit — the latter guarantee progress
    # whatever the machine's load, so the kills cannot all land before anything commits.
    plan = [("start", 0.3)] + [
        ("ready", 0.0) if i % 3 == 1 else ("commit" if i % 3 == 2 else "ready", rng.uniform(0.05, 1.5))
        for i in range(KILLS - 1)
    ]
    waits_for_a_commit = sum(1 for wait, _ in plan if wait == "commit")

    seen: set[int] = set()
    continued_by_delta = restarts_at_a_rebase = 0
    for wait, delay in plan:
        proc = _start(root, log, env=env)
        first = None
        try:
            if wait in ("ready", "commit"):
                line = proc.stdout.readline()
                assert line.startswith("ready "), f"child said {line!r}; stderr: {log.read_text()[-2000:]}"
                first = int(line.split()[1])
            if wait == "commit":
                line = proc.stdout.readline()
                assert line.startswith("committed "), f"child said {line!r}; stderr: {log.read_text()[-2000:]}"
            time.sleep(delay * pace)
        finally:
            proc.send_signal(signal.SIGKILL)
            out, _ = proc.communicate(timeout=60)
        assert proc.returncode == -signal.SIGKILL, f"child exited by itself; stderr: {log.read_text()[-2000:]}"
        assert "Traceback" not in log.read_text(), log.read_text()[-2000:]

        versions = check.after_kill(seen)
        seen.update(versions)
        if first is not None and first > 1 and first in seen:
            manifest = read_manifest(store, child.MODEL, first)
            if manifest.kind == KIND_DELTA:
                assert manifest.parent == first - 1, f"v{first} continued from v{manifest.parent}"
                continued_by_delta += 1
            else:  # full only where the chain before it reached REBASE_EVERY deltas
                chain = [read_manifest(store, child.MODEL, v) for v in range(first - child.REBASE_EVERY, first)]
                assert all(m.kind == KIND_DELTA and m.parent == m.version - 1 for m in chain), (
                    f"v{first} is a full version off a rebase point"
                )
                restarts_at_a_rebase += 1

    # After all the kills the publisher still works: a clean run commits three more versions. It
    # never rebases, so its first version is a delta on the one committed before it: the parent
    # restored from the store after the kills (a restart above may land on a rebase point instead).
    proc = _start(root, log, "3", str(10**6), env=env)
    out, _ = proc.communicate(timeout=900)  # a fresh interpreter and 3 commits: minutes on a loaded machine
    assert proc.returncode == 0, log.read_text()[-2000:]
    first = int(out.split()[1])
    assert out.split()[2:] == ["committed", str(first), "committed", str(first + 1), "committed", str(first + 2)]
    versions = check.full_sweep(seen)
    assert versions[-3:] == [first, first + 1, first + 2]
    assert len(versions) >= waits_for_a_commit + 3, f"only {len(versions)} versions were committed"
    manifest = read_manifest(store, child.MODEL, first)
    assert manifest.kind == KIND_DELTA and manifest.parent == first - 1, "the clean run did not continue with a delta"
    assert continued_by_delta + restarts_at_a_rebase >= 1, "no restart committed its first version"
    packed = [v for v in versions if read_manifest(store, child.MODEL, v).has_packs]
    assert packed, "no delta was written in packs: the kills never hit a packed publish"
