"""S3 servers that ignore `If-None-Match: *`: the store finds out with a probe before its first
commit, and then refuses to publish (UnsafeCommitError, saying what is unsafe and how to opt in)
unless told there is a single publisher; reading works regardless. The server that ignores the
header is a real one: s3rver 3.7.1 (Node), installed by .ci/run with
`npm install --prefix tests/.npm s3rver@3.7.1` (or by the fixture when npm is present); skipped
only where node or npm is absent. moto (which honours the header) must pass the probe.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import uuid
from pathlib import Path

import pytest

from weightsync.errors import ObjectExists, PublishError, StoreError, UnsafeCommitError, VersionConflict
from weightsync.publisher import Publisher, PublisherConfig, publish_once
from weightsync.reader import Reader
from weightsync.stores import open_store
from weightsync.stores.s3 import S3Store, S3StoreConfig
from weightsync.versions import commit_manifest, list_versions, read_manifest

pytestmark = pytest.mark.s3

NPM_PREFIX = Path(__file__).parents[1] / ".npm"
S3RVER_VERSION = "3.7.1"
S3RVER_JS = NPM_PREFIX / "node_modules" / "s3rver" / "bin" / "s3rver.js"
MODEL = "org/unconditional"


def _s3rver_script() -> Path:
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip(
            "node and npm are needed for s3rver (an S3 server that ignores If-None-Match); "
            f"install Node.js, then `npm install --prefix tests/.npm s3rver@{S3RVER_VERSION}`"
        )
    if not S3RVER_JS.exists():
        subprocess.run(
            [npm, "install", "--no-audit", "--no-fund", "--prefix", str(NPM_PREFIX), f"s3rver@{S3RVER_VERSION}"],
            check=True,
            timeout=600,
        )
    return S3RVER_JS


@pytest.fixture(scope="module")
def s3rver(tmp_path_factory):
    """s3rver on a free 127.0.0.1 port with one bucket, "weights"; stopped by PID after the module."""
    script = _s3rver_script()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    data = tmp_path_factory.mktemp("s3rver")
    proc = subprocess.Popen(
        [
            "node",
            str(script),
            "-d",
            str(data),
            "-a",
            "127.0.0.1",
            "-p",
            str(port),
            "--silent",
            "--configure-bucket",
            "weights",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    # It prints one line once it listens: wait for that line (or the process's end), not a clock.
    listening = threading.Event()
    output: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            output.append(line)
            if "listening" in line:
                listening.set()
        listening.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        if not listening.wait(120) or proc.poll() is not None:
            raise RuntimeError(f"s3rver did not start: {''.join(output)}")
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def s3rver_env(s3rver, monkeypatch):
    """s3rver's fixed credentials (it refuses other access keys); no opt-in from the environment."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "S3RVER")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "S3RVER")
    monkeypatch.delenv("WEIGHTSYNC_S3_SINGLE_PUBLISHER", raising=False)
    return s3rver


def _store(endpoint: str, **config) -> S3Store:
    return S3Store("weights", f"run-{uuid.uuid4().hex[:8]}", endpoint_url=endpoint, config=S3StoreConfig(**config))


def _publish(store, make_state_dict, seed: int = 0):
    return publish_once(
        store,
        make_state_dict(seed, width=64),
        model=MODEL,
        step=seed,
        config=PublisherConfig(chunk_bytes=4096, workers=1),
    )


def test_s3rver_ignores_the_header_and_the_probe_sees_it(s3rver_env):
    store = _store(s3rver_env)
    assert store.create_only_honoured() is False
    assert list(store.list()) == [], "the probe key is removed"


def test_publishing_is_refused_with_the_reason_and_the_way_out(s3rver_env, make_state_dict):
    store = _store(s3rver_env)
    with pytest.raises(PublishError) as info:
        _publish(store, make_state_dict)
    assert isinstance(info.value.__cause__, UnsafeCommitError)
    text = str(info.value)
    assert "ignores If-None-Match" in text and "overwrite each other's manifest" in text
    assert "single_publisher=True" in text and "WEIGHTSYNC_S3_SINGLE_PUBLISHER=1" in text
    assert list_versions(store, MODEL) == []
    with pytest.raises(UnsafeCommitError):
        store.put_new("models/x/commit", b"1")
    assert not store.exists("models/x/commit")


@pytest.mark.parametrize("how", ["config", "uri", "env"])
def test_with_the_opt_in_it_publishes_and_pulls(
    s3rver_env, how, make_state_dict, published_view, assert_bit_equal, monkeypatch
):
    prefix = f"run-{uuid.uuid4().hex[:8]}"
    if how == "config":
        store = S3Store("weights", prefix, endpoint_url=s3rver_env, config=S3StoreConfig(single_publisher=True))
    elif how == "uri":
        store = open_store(f"s3://weights/{prefix}?single_publisher=1", endpoint_url=s3rver_env)
    else:
        monkeypatch.setenv("WEIGHTSYNC_S3_SINGLE_PUBLISHER", "1")
        store = open_store(f"s3://weights/{prefix}", endpoint_url=s3rver_env)
    with Publisher(store, model=MODEL, config=PublisherConfig(chunk_bytes=4096, workers=1)) as publisher:
        for seed in range(2):
            publisher.publish(make_state_dict(seed, width=64), step=seed).result(timeout=300)
    assert list_versions(store, MODEL) == [1, 2]
    reader = open_store(f"s3://weights/{prefix}", endpoint_url=s3rver_env)  # reading needs no opt-in
    state = Reader(reader, model=MODEL).read(2)
    assert_bit_equal(state.state_dict(), published_view(make_state_dict(1, width=64)))


def test_with_the_opt_in_a_committed_version_is_still_not_overwritten(s3rver_env, make_state_dict):
    store = _store(s3rver_env, single_publisher=True)
    result = _publish(store, make_state_dict)
    with pytest.raises(VersionConflict):
        commit_manifest(store, result.manifest)
    store.put_new("models/x/once", b"1")
    with pytest.raises(ObjectExists):
        store.put_new("models/x/once", b"2")
    assert store.get("models/x/once") == b"1"


def test_reading_from_a_server_that_ignores_the_header_needs_no_opt_in(
    s3rver_env, make_state_dict, published_view, assert_bit_equal
):
    writer = _store(s3rver_env, single_publisher=True)
    _publish(writer, make_state_dict, seed=3)
    reader = S3Store("weights", writer.prefix.rstrip("/"), endpoint_url=s3rver_env)
    assert list_versions(reader, MODEL) == [1] and read_manifest(reader, MODEL, 1).step == 3
    assert_bit_equal(Reader(reader, model=MODEL).read(1).state_dict(), published_view(make_state_dict(3, width=64)))
    assert reader._create_only_honoured is None, "reading never probes"


def test_moto_honours_the_header_and_passes_the_probe(s3_store, make_state_dict):
    assert s3_store.create_only_honoured() is True
    assert list(s3_store.list()) == [], "the probe key is removed"
    _publish(s3_store, make_state_dict)
    assert list_versions(s3_store, MODEL) == [1]


def test_uri_options_are_checked():
    with pytest.raises(StoreError, match="single_publisher"):
        open_store("s3://weights/run?single_publisher=maybe")
    with pytest.raises(StoreError, match="only single_publisher"):
        open_store("s3://weights/run?singel_publisher=1")
    assert open_store("s3://weights/run?single_publisher=1").config.single_publisher
    assert not open_store("s3://weights/run?single_publisher=0").config.single_publisher
