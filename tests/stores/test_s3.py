"""The S3 store end to end against a real S3-compatible server (moto, in its own process on
127.0.0.1): versions publish and read back bit for bit, the CLI works unchanged with s3:// URIs,
and a losing concurrent commit is refused, never an overwrite."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from weightsync.app.cli import main
from weightsync.errors import ObjectExists
from weightsync.publisher import Publisher, PublisherConfig
from weightsync.reader import Reader
from weightsync.versions import list_versions

pytestmark = pytest.mark.s3


def test_versions_publish_and_read_back_bit_exactly(
    s3_store, make_state_dict, perturb, published_view, assert_bit_equal
):
    sd = make_state_dict(3)
    expected = {}
    with Publisher(s3_store, model="org/s3-model", config=PublisherConfig(chunk_bytes=16 * 1024)) as publisher:
        for version in range(1, 5):
            result = publisher.publish(sd, step=version).result()
            assert result.version == version
            expected[version] = published_view(sd)
            sd = perturb(sd, 0.03, version)
    assert list_versions(s3_store, "org/s3-model") == [1, 2, 3, 4]
    reader = Reader(s3_store, model="org/s3-model")
    for version, want in expected.items():
        assert_bit_equal(reader.read(version).state_dict(), want)


def test_create_only_commit_refuses_the_second_writer(s3_store):
    s3_store.put_new("models/m/versions/000000000001.json", b"first")
    with pytest.raises(ObjectExists):
        s3_store.put_new("models/m/versions/000000000001.json", b"second")
    assert s3_store.get("models/m/versions/000000000001.json") == b"first"


@pytest.mark.slow
def test_cli_with_s3_uris(s3_store, s3_endpoint, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)  # how users point boto3 at MinIO/R2/...
    g = torch.Generator().manual_seed(0)
    first = {"w": torch.randn(256, 256, generator=g), "b": torch.randn(256, generator=g)}
    second = {"w": first["w"] + (torch.rand(256, 256, generator=g) < 0.02) * 1e-2, "b": first["b"]}
    save_file(first, tmp_path / "1.safetensors")
    save_file(second, tmp_path / "2.safetensors")
    uri = s3_store.uri

    def run(*argv):
        code = main(list(argv))
        out, err = capsys.readouterr()
        assert code == 0, err
        return json.loads(out)

    assert run("publish", "--store", uri, "--model", "m", str(tmp_path / "1.safetensors"), "--json")["kind"] == "full"
    assert run("publish", "--store", uri, "--model", "m", str(tmp_path / "2.safetensors"), "--json")["kind"] == "delta"
    assert [v["version"] for v in run("ls", "--store", uri, "--model", "m", "--json")["versions"]] == [1, 2]
    assert run("ls", "--store", uri, "--json")["models"] == ["m"]
    run("pull", "--store", uri, "--model", "m", "--out", str(tmp_path / "out"), "--json")
    pulled = load_file(tmp_path / "out" / "model.safetensors")
    assert all(torch.equal(pulled[k], second[k].to(torch.bfloat16)) for k in second)
    assert run("verify", "--store", uri, "--model", "m", "--all", "--json")["ok"] is True
    plan = run("gc", "--store", uri, "--model", "m", "--keep", "1", "--grace-s", "0", "--dry-run", "--json")
    assert plan["keep_versions"] == [1, 2] and plan["delete_versions"] == []


def test_a_rerun_after_a_failed_commit_uploads_no_chunk_twice(
    s3_store, make_state_dict, published_view, assert_bit_equal
):
    """A publisher that dies after its chunks are durable but before its manifest (simulated by a
    failing commit) leaves no version; the re-run commits it and re-uploads nothing."""
    from weightsync.errors import PublishError, StoreError
    from weightsync.stores.s3 import S3Store

    class CountingS3Store(S3Store):
        """Stands in for the same bucket seen by a publisher: counts writes, can fail commits."""

        fail_commits = False
        puts = 0

        def put(self, key, data):
            type(self).puts += 1
            super().put(key, data)

        def put_new(self, key, data):
            if self.fail_commits:
                raise StoreError("injected: died before the manifest")
            super().put_new(key, data)

    counting = CountingS3Store(s3_store.bucket, s3_store.prefix, endpoint_url=s3_store._client.meta.endpoint_url)
    sd = make_state_dict(9)
    config = PublisherConfig(chunk_bytes=16 * 1024)
    counting.fail_commits = True
    with Publisher(counting, model="m", config=config) as publisher:
        with pytest.raises(PublishError):
            publisher.publish(sd).result()
    first_puts = CountingS3Store.puts
    assert first_puts > 10 and list_versions(s3_store, "m") == []

    counting.fail_commits = False
    with Publisher(counting, model="m", config=config) as publisher:
        assert publisher.publish(sd).result().version == 1
    assert CountingS3Store.puts == first_puts, "the re-run uploaded chunks that were already in the store"
    assert_bit_equal(Reader(s3_store, model="m").read(1).state_dict(), published_view(sd))


# ----------------------------------------------------------------------- transfers, listing

MiB = 1024 * 1024


def _like(s3_store, **settings):
    """Another S3Store on the same bucket and prefix, with other settings."""
    from weightsync.stores.s3 import S3Store, S3StoreConfig

    endpoint = s3_store._client.meta.endpoint_url
    return S3Store(s3_store.bucket, s3_store.prefix, config=S3StoreConfig(endpoint_url=endpoint, **settings))


def _raw_head(s3_store, key):
    return s3_store._client.head_object(Bucket=s3_store.bucket, Key=s3_store.prefix + key)


def test_large_objects_go_multipart_and_come_back_in_ranges(s3_store):
    import os

    store = _like(s3_store, part_bytes=5 * MiB, multipart_threshold_bytes=5 * MiB)
    data = os.urandom(13 * MiB + 7)
    store.put("big", data)
    assert _raw_head(store, "big")["ETag"].strip('"').endswith("-3")  # three parts
    assert store.get("big") == data  # first range, then two more in parallel
    assert s3_store.get("big") == data  # default settings: one 8 MiB range and one more
    store.touch("big")
    assert store.get("big") == data


def test_large_create_only_writes_are_one_conditional_put(s3_store):
    """put_new never goes multipart (see s3_store's docstring), whatever the threshold."""
    import os

    store = _like(s3_store, part_bytes=5 * MiB, multipart_threshold_bytes=5 * MiB)
    first, second = os.urandom(11 * MiB), os.urandom(11 * MiB)
    store.put_new("versions/1.json", first)
    assert "-" not in _raw_head(store, "versions/1.json")["ETag"]
    with pytest.raises(ObjectExists):
        store.put_new("versions/1.json", second)
    assert store.get("versions/1.json") == first
    store.put("chunk", second)  # while a plain write of the same size is multipart
    with pytest.raises(ObjectExists):
        store.put_new("chunk", b"small")
    assert store.get("chunk") == second
    listing = store._client.list_multipart_uploads(Bucket=store.bucket, Prefix=store.prefix)
    assert listing.get("Uploads", []) == [], "an upload was left behind"


@pytest.mark.slow
def test_objects_replaced_while_read_in_ranges_are_never_spliced(s3_store):
    import threading

    store = _like(s3_store, part_bytes=5 * MiB, multipart_threshold_bytes=5 * MiB)
    a, b = b"A" * (11 * MiB), b"B" * (11 * MiB + 1)
    store.put("hot", a)
    stop, seen = threading.Event(), []

    def writer():
        for i in range(6):
            store.put("hot", b if i % 2 == 0 else a)
        stop.set()

    def reader():
        while not stop.is_set():
            data = store.get("hot")
            if data not in (a, b):
                seen.append((len(data), data[:1], data[-1:]))

    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not seen, f"spliced reads: {seen}"


def test_abort_stale_uploads_cleans_up_after_a_killed_writer(s3_store):
    full = s3_store.prefix + "models/m/chunks/ab/abandoned"
    s3_store._client.create_multipart_upload(Bucket=s3_store.bucket, Key=full)
    # moto reports every upload as started in 2010, so only the "old enough" side is testable here.
    assert s3_store.abort_stale_uploads(older_than_s=3600) == 1
    assert s3_store._client.list_multipart_uploads(Bucket=s3_store.bucket).get("Uploads", []) == []


@pytest.mark.slow
def test_versions_list_numerically_across_pages(s3_store):
    """More than 1,000 manifests: S3 returns them in pages of at most 1,000 keys."""
    import concurrent.futures as cf

    from weightsync.format.layout import manifest_key

    versions = list(range(1, 1101)) + [10**11, 10**12 - 1]
    with cf.ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda v: s3_store.put(manifest_key("m", v), b"{}"), versions))
    assert list_versions(s3_store, "m") == versions
    small_pages = _like(s3_store, list_page_size=7)
    assert [i.key for i in small_pages.list("models/m/")] == [i.key for i in s3_store.list("models/m/")]


def test_small_pages_list_everything(s3_store):
    for i in range(23):
        s3_store.put(f"k/{i:03d}", b"x")
    assert [i.key for i in _like(s3_store, list_page_size=5).list("k/")] == [f"k/{i:03d}" for i in range(23)]


@pytest.mark.parametrize(
    "bad",
    [
        dict(io_concurrency=0),
        dict(part_bytes=MiB),
        dict(retry_mode="legacy"),
        dict(multipart_threshold_bytes=5 * MiB, part_bytes=8 * MiB),
        dict(list_page_size=1001),
        dict(transfer_deadline_s=0),
    ],
)
def test_config_refuses_bad_settings(bad):
    from weightsync.stores.s3 import S3StoreConfig

    with pytest.raises(ValueError):
        S3StoreConfig(**bad)


def test_client_pool_matches_io_concurrency(s3_store):
    store = _like(s3_store, io_concurrency=12)
    assert store.io_concurrency == 12
    assert store._client.meta.config.max_pool_connections == 24
    assert store._client.meta.config.retries["mode"] == "standard"


def test_cli_endpoint_url_flag(s3_store, s3_endpoint, tmp_path, capsys, monkeypatch):
    """--endpoint-url alone (no AWS_ENDPOINT_URL) points every store command at the server."""
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    save_file({"w": torch.ones(64, 64)}, tmp_path / "m.safetensors")
    uri, flag = s3_store.uri, ["--endpoint-url", s3_endpoint]
    assert main(["publish", "--store", uri, *flag, "--model", "m", str(tmp_path / "m.safetensors"), "--json"]) == 0
    capsys.readouterr()
    assert main(["ls", "--store", uri, *flag, "--model", "m", "--json"]) == 0
    assert [v["version"] for v in json.loads(capsys.readouterr().out)["versions"]] == [1]
