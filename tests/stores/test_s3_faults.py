"""S3 under faults: a proxy (harness/fault_proxy.py) between boto3 and the moto server answers 500s
and 503 SlowDowns, resets connections, cuts bodies short, delays, flips bytes, and loses
success responses.

What must hold: publishing and pulling either succeed with bit-exact weights or fail with a
WeightsyncError within a bounded time; a listed version is always whole and verifies; a
corrupted chunk is never accepted; gc through faults never deletes what a retained version
needs. Each test prints what the proxy injected and asserts every kind it enabled happened.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import http.client
import os
import time
import uuid

import boto3
import pytest

from harness.fault_proxy import (
    BAD_DIGEST,
    DELAY,
    ERROR_500,
    FAULT_KINDS,
    FLIP_REQUEST,
    FLIP_RESPONSE,
    LOST_RESPONSE,
    RESET_BEFORE,
    FaultPlan,
    FaultProxy,
)
from weightsync.errors import IntegrityError, ObjectExists, StoreError, WeightsyncError
from weightsync.format.layout import model_prefix
from weightsync.publisher import Publisher, PublisherConfig
from weightsync.reader import Reader
from weightsync.stores.retention import collect_garbage
from weightsync.stores.s3 import S3Store, S3StoreConfig
from weightsync.versions import list_versions, read_manifest

pytestmark = pytest.mark.s3

MiB = 1024 * 1024
BOUND_S = 120  # liveness bound on any one operation under faults (generous: this is not a timing test)
ALL_FAULTS = {kind: 0.03 for kind in FAULT_KINDS}  # ~27 % of requests meet some fault


@pytest.fixture
def proxy(s3_endpoint):
    with FaultProxy(s3_endpoint) as proxy:
        yield proxy


@pytest.fixture
def bucket(s3_endpoint) -> str:
    name = f"ws-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=name)
    return name


def _store(endpoint: str, bucket: str, **overrides) -> S3Store:
    """A store with test-sized timeouts and parts (moto's smallest part is 5 MiB), retries as in production."""
    settings = dict(
        endpoint_url=endpoint,
        io_concurrency=8,
        connect_timeout_s=5,
        read_timeout_s=5,
        part_bytes=5 * MiB,
        multipart_threshold_bytes=6 * MiB,
        transfer_deadline_s=90,
    )
    return S3Store(bucket, "run", config=S3StoreConfig(**{**settings, **overrides}))


def _report(proxy: FaultProxy, enabled) -> dict[str, int]:
    counts = proxy.counts()
    print(f"\ninjected over {proxy.requests} requests on {proxy.connections} connections: {counts}")
    missing = [kind for kind in enabled if counts.get(kind, 0) == 0]
    assert not missing, f"the proxy never injected {missing}: the test did not exercise them"
    return counts


# ------------------------------------------------------------------------------ the proxy


def test_proxy_passes_keep_alive_and_chunked_requests_through(proxy, bucket, s3_endpoint):
    store = _store(proxy.endpoint, bucket)
    for i in range(20):
        store.put(f"k/{i}", bytes([i]) * 1000)
    assert [store.get(f"k/{i}") for i in range(20)] == [bytes([i]) * 1000 for i in range(20)]
    assert proxy.connections < proxy.requests / 4, "connections to the proxy are not kept alive"

    data = os.urandom(300_000)
    conn = http.client.HTTPConnection("127.0.0.1", int(proxy.endpoint.rsplit(":", 1)[1]), timeout=30)
    pieces = (data[i : i + 65536] for i in range(0, len(data), 65536))
    conn.request(
        "PUT", f"/{bucket}/run/chunked", body=pieces, encode_chunked=True, headers={"Transfer-Encoding": "chunked"}
    )
    response = conn.getresponse()
    response.read()
    assert response.status == 200
    conn.close()
    assert _store(s3_endpoint, bucket).get("chunked") == data
    assert proxy.counts() == {}


# ----------------------------------------------------------------------------- the store


@pytest.mark.slow
@pytest.mark.parametrize("kind", FAULT_KINDS)
def test_store_operations_survive_each_fault(proxy, bucket, s3_endpoint, kind):
    """Every store operation, small and multipart objects, with one kind of fault on 25 % of requests."""
    proxy.set_plan(FaultPlan(rates={kind: 0.25}, seed=FAULT_KINDS.index(kind), delay_s=0.2))
    store = _store(proxy.endpoint, bucket, transfer_attempts=8)
    blobs = {f"objects/{i}": os.urandom(size) for i, size in enumerate([0, 1, 5000, 300_000, 13 * MiB + 7])}
    t0 = time.monotonic()
    for key, data in blobs.items():
        store.put(key, data)
    store.put_new("versions/1.json", b'{"v": 1}' * 1000)
    with pytest.raises(ObjectExists):
        store.put_new("versions/1.json", b"another writer")
    store.put_new("versions/2.json", blobs["objects/4"])  # create-only and multipart
    for key, data in blobs.items():
        assert store.get(key) == data
        store.touch(key)
    assert [i.key for i in store.list("objects/")] == sorted(blobs)
    store.delete("objects/0")
    assert not store.exists("objects/0")
    assert time.monotonic() - t0 < BOUND_S

    direct = _store(s3_endpoint, bucket)  # what the server really holds, past the proxy
    assert direct.get("versions/1.json") == b'{"v": 1}' * 1000
    assert direct.get("versions/2.json") == blobs["objects/4"]
    for key, data in list(blobs.items())[1:]:
        assert direct.get(key) == data
    _report(proxy, [kind])


@pytest.mark.slow
@pytest.mark.parametrize("server_checks_md5", [True, False], ids=["server-checks-md5", "server-checks-nothing"])
def test_flipped_uploads_are_never_stored(proxy, bucket, s3_endpoint, server_checks_md5):
    """A byte flipped on the way up is refused by the server (Content-MD5) or caught by the
    ETag check after the PUT; either way the upload is retried and the right bytes stored."""
    proxy.set_plan(FaultPlan(rates={FLIP_REQUEST: 0.3}, seed=7, check_content_md5=server_checks_md5))
    store = _store(proxy.endpoint, bucket, transfer_attempts=10)
    blobs = {f"chunks/{i}": os.urandom(100_000 + i) for i in range(12)}
    for key, data in blobs.items():
        store.put(key, data)
    store.put_new("manifest.json", b"m" * 200_000)
    store.put_new("big.json", blobs["chunks/0"] * 70)  # multipart, create-only
    direct = _store(s3_endpoint, bucket)
    assert all(direct.get(key) == data for key, data in blobs.items())
    assert direct.get("manifest.json") == b"m" * 200_000
    assert direct.get("big.json") == blobs["chunks/0"] * 70
    counts = _report(proxy, [FLIP_REQUEST])
    assert (counts.get(BAD_DIGEST, 0) > 0) == server_checks_md5


@pytest.mark.parametrize("check", ["crc32", "md5", "xxh3"], ids=lambda c: f"caught-by-{c}")
def test_a_corrupt_chunk_is_never_accepted(proxy, bucket, s3_endpoint, make_state_dict, check):
    """Every object GET flipped: the read fails with a clear error; no weights come back. The
    store catches it by the CRC32 the server returns, else by the ETag (MD5); with both checks off
    the manifest parser or the reader's xxh3 check does."""
    sd = make_state_dict(1)
    with Publisher(_store(s3_endpoint, bucket), model="m", config=PublisherConfig(chunk_bytes=64 * 1024)) as pub:
        pub.publish(sd).result()
    proxy.set_plan(FaultPlan(rates={FLIP_RESPONSE: 1.0}, seed=3))
    store = _store(
        proxy.endpoint, bucket, crc32_checksums=check == "crc32", verify_md5=check == "md5", transfer_attempts=2
    )
    t0 = time.monotonic()
    with pytest.raises(WeightsyncError) as info:
        Reader(store, model="m").read(1)
    assert time.monotonic() - t0 < BOUND_S
    print(f"\n{type(info.value).__name__}: {info.value}")
    if check == "xxh3":
        assert isinstance(info.value, (IntegrityError, ValueError))
    else:
        assert isinstance(info.value, StoreError)
        assert f"does not match its {'CRC32' if check == 'crc32' else 'ETag (MD5)'}" in str(info.value)
    _report(proxy, [FLIP_RESPONSE])


def test_a_lost_success_response_is_not_a_conflict(proxy, bucket):
    """The server commits, the client is told 500 and retries into 412: the bytes show it was ours."""
    store = _store(proxy.endpoint, bucket)
    proxy.set_plan(FaultPlan(rates={LOST_RESPONSE: 1.0}, max_faults=1))
    store.put_new("versions/000000000001.json", b"ours")
    assert store.get("versions/000000000001.json") == b"ours"
    proxy.set_plan(FaultPlan(rates={LOST_RESPONSE: 1.0}, max_faults=1))
    with pytest.raises(ObjectExists):
        store.put_new("versions/000000000001.json", b"theirs")
    assert store.get("versions/000000000001.json") == b"ours"
    assert proxy.counts() == {LOST_RESPONSE: 2}


def test_connection_failures_botocore_gave_up_on_are_retried_by_the_store(proxy, bucket):
    """botocore stops retrying when its attempts or its client-wide retry quota are spent (a
    long-lived publisher on a flaky link drains the quota); the store's own bounded attempts then
    carry every operation through connection resets. Here botocore gets one attempt."""
    store = _store(proxy.endpoint, bucket, max_attempts=1, transfer_attempts=4)
    operations = [
        ("put", lambda: store.put("k", b"v")),
        ("get", lambda: store.get("k")),
        ("stat", lambda: store.exists("k")),
        ("touch", lambda: store.touch("k")),
        ("put_new", lambda: store.put_new("new", b"n")),
        ("delete", lambda: store.delete("new")),
    ]
    for name, operation in operations:
        before = proxy.counts().get(RESET_BEFORE, 0)
        proxy.set_plan(FaultPlan(rates={RESET_BEFORE: 1.0}, max_faults=2))
        operation()
        assert proxy.counts().get(RESET_BEFORE, 0) - before == 2, name
    assert store.get("k") == b"v" and not store.exists("new")


@pytest.mark.slow
def test_errors_left_unretried_once_botocores_retry_quota_is_spent_are_retried_by_the_store(proxy, bucket):
    """botocore's client-wide retry quota (500 units, 14 a retry, 1 back per plain success) is
    drained by a run of 500s; from then on it retries nothing, and a single 500 would fail a
    publish. The store's own attempts take over."""
    store = _store(proxy.endpoint, bucket, max_attempts=2, transfer_attempts=3)
    proxy.set_plan(FaultPlan(rates={ERROR_500: 1.0}))

    def refused(i: int) -> str:
        with pytest.raises(StoreError) as info:
            store.put(f"drain/{i}", b"x")
        return str(info.value)

    with cf.ThreadPoolExecutor(8) as pool:
        errors = list(pool.map(refused, range(60)))
    assert any("retry quota is spent" in e for e in errors), "the run of 500s did not drain the quota"
    proxy.set_plan(FaultPlan(rates={ERROR_500: 1.0}, max_faults=1))
    before = proxy.counts()[ERROR_500]
    store.put("k", b"v")  # one 500, which botocore no longer retries
    assert proxy.counts()[ERROR_500] == before + 1
    proxy.enabled = False
    assert store.get("k") == b"v"


@pytest.mark.slow
def test_a_stalled_server_fails_within_a_bound(proxy, bucket):
    """Responses slower than the read timeout on every attempt: a StoreError, in bounded time."""
    store = _store(proxy.endpoint, bucket, read_timeout_s=0.5, max_attempts=2, transfer_attempts=2)
    store.put("k", b"v")
    proxy.set_plan(FaultPlan(rates={DELAY: 1.0}, delay_s=2.0))
    t0 = time.monotonic()
    with pytest.raises(StoreError):
        store.get("k")
    with pytest.raises(StoreError):
        store.put("k2", b"v")
    assert time.monotonic() - t0 < BOUND_S
    _report(proxy, [DELAY])


# ------------------------------------------------------------------------ end to end


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_publish_and_pull_through_every_fault(
    proxy, bucket, s3_endpoint, make_state_dict, perturb, published_view, assert_bit_equal
):
    proxy.set_plan(FaultPlan(rates=ALL_FAULTS, seed=2024, delay_s=0.2))
    store = _store(proxy.endpoint, bucket)
    config = PublisherConfig(chunk_bytes=64 * 1024, rebase_every=3, workers=2)
    sd, published, failed = make_state_dict(5), {}, {}
    with Publisher(store, model="m", config=config) as publisher:
        for step in range(1, 7):
            t0 = time.monotonic()
            try:
                published[publisher.publish(sd, step=step).result().version] = published_view(sd)
            except WeightsyncError as e:  # allowed: a clear error, in bounded time
                failed[step] = e
            assert time.monotonic() - t0 < BOUND_S
            sd = perturb(sd, 0.03, step)
    print(f"\npublished {sorted(published)}, failed { ({s: str(e)[:200] for s, e in failed.items()}) }")

    # Through the faults, every listed version reads back whole or fails clearly.
    listed = list_versions(store, "m")
    assert set(published) <= set(listed)
    pulled = 0
    for version in listed:
        t0 = time.monotonic()
        try:
            state = Reader(store, model="m", workers=2).read(version)
        except WeightsyncError as e:
            print(f"v{version} not pulled: {e}")
        else:
            pulled += 1
            if version in published:
                assert_bit_equal(state.state_dict(), published[version])
        assert time.monotonic() - t0 < BOUND_S
    counts = _report(proxy, list(ALL_FAULTS))

    # Past the proxy: every listed version is whole and verifies (no partial version visible).
    proxy.enabled = False
    direct = _store(s3_endpoint, bucket)
    assert list_versions(direct, "m") == listed
    for version in listed:
        state = Reader(direct, model="m", workers=2).read(version)
        if version in published:
            assert_bit_equal(state.state_dict(), published[version])
    assert len(published) >= 4 and pulled >= len(listed) - 1, (published.keys(), pulled, counts)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_gc_through_faults_keeps_what_retained_versions_need(
    proxy, bucket, s3_endpoint, make_state_dict, perturb, published_view, assert_bit_equal
):
    direct = _store(s3_endpoint, bucket)
    sd, published = make_state_dict(8), {}
    config = PublisherConfig(chunk_bytes=64 * 1024, rebase_every=2, workers=2)
    with Publisher(direct, model="m", config=config) as publisher:
        for step in range(1, 6):  # v1 full, v2-v3 deltas, v4 full, v5 delta
            published[publisher.publish(sd, step=step).result().version] = published_view(sd)
            sd = perturb(sd, 0.03, step)

    proxy.set_plan(FaultPlan(rates=ALL_FAULTS, seed=99, delay_s=0.2))
    store = _store(proxy.endpoint, bucket)
    completed = 0
    for _ in range(3):
        try:
            plan = collect_garbage(store, "m", keep=2, grace_s=0)
            completed += 1
        except WeightsyncError as e:  # allowed; what matters is what survives
            print(f"gc failed: {e}")
    assert completed >= 1
    assert list(plan.keep_versions) == [4, 5]
    for version in (4, 5):  # readable through the faults (or a clear error), and past them
        try:
            assert_bit_equal(Reader(store, model="m", workers=2).read(version).state_dict(), published[version])
        except WeightsyncError as e:
            print(f"v{version} not read through the faults: {e}")
    _report(proxy, [k for k in ALL_FAULTS if k != FLIP_REQUEST])  # gc uploads nothing
    proxy.enabled = False
    assert list_versions(direct, "m") == [4, 5]
    for version in (4, 5):
        assert_bit_equal(Reader(direct, model="m", workers=2).read(version).state_dict(), published[version])
    kept = {info.key for kind in ("chunks/", "packs/") for info in direct.list("models/m/" + kind)}
    needed = {model_prefix("m") + key for v in (4, 5) for key in read_manifest(direct, "m", v).objects()}
    assert needed <= kept
    assert len(kept) == len(needed), "gc left unreferenced objects older than the grace period"


def test_md5_etags_are_recognized():
    from weightsync.stores.s3 import _etag_is_md5

    md5 = hashlib.md5(b"x").hexdigest()
    assert _etag_is_md5({"ETag": f'"{md5}"'})
    assert _etag_is_md5({"ETag": f'"{md5}-3"'})
    assert not _etag_is_md5({"ETag": f'"{md5}"', "ServerSideEncryption": "aws:kms"})
    assert not _etag_is_md5({"ETag": f'"{md5}"', "SSECustomerAlgorithm": "AES256"})
    assert not _etag_is_md5({"ETag": '"not-an-md5"'})
