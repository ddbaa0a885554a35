"""The S3 store end to end against a real S3-compatible server (moto, in its own process on
127.0.0.1): versions publish and read back bit for bit, the CLI works unchanged with s3:// URIs,
and a losing concurrent commit is refused, never an overwrite."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from weightsync.cli import main
from weightsync.errors import ObjectExists
from weightsync.publisher import Publisher, PublisherConfig
from weightsync.reader import Reader
from weightsync.versions import list_versions

pytestmark = pytest.mark.s3


def test_versions_publish_and_read_back_bit_exactly(s3_store, make_state_dict, perturb, published_view,
                                                     assert_bit_equal):
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


def test_a_rerun_after_a_failed_commit_uploads_no_chunk_twice(s3_store, make_state_dict, published_view,
                                                               assert_bit_equal):
    """A publisher that dies after its chunks are durable but before its manifest (simulated by a
    failing commit) leaves no version; the re-run commits it and re-uploads nothing."""
    from weightsync.errors import PublishError, StoreError
    from weightsync.s3_store import S3Store

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
