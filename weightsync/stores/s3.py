"""stores.s3: the `Store` contract over S3-compatible object storage (`s3://BUCKET/PREFIX`).

Endpoint, region, credentials and addressing style come from boto3's standard mechanisms
(`AWS_ENDPOINT_URL`, `AWS_REGION`, profiles, environment, instance roles); `endpoint_url`
overrides the endpoint. docs/stores.md is the user's page; this docstring is the mechanics.

Transfers. Objects above `multipart_threshold_bytes` are uploaded in parts, in parallel; an
object larger than `part_bytes` is read as parallel ranged GETs (the first GET asks for the
first range, so small objects cost one request and large ones no extra HEAD; later ranges carry
`If-Match` on the first one's ETag, so an object replaced mid-read is read again, never spliced).
Part and range transfers run on one pool of `io_concurrency` threads shared by the store; callers
run their own `io_concurrency` transfers beside it, hence a connection pool of twice that.

Integrity on the wire. Every PUT and UploadPart carries a Content-MD5, so a server refuses a
body corrupted on the way (400 BadDigest) and the upload is retried. Where the ETag is the
MD5 of the bytes (single-part objects without SSE-KMS or SSE-C) the store also compares it after
each upload: a server that stored a corrupted body without checking is caught and re-written.
Single-part PUTs also carry a CRC32 that the server keeps; GETs ask for it and botocore checks
the body against it while reading. A body that came without one is checked against an MD5 ETag
instead. Every GET checks the length it was promised. A failed check is retried.

Retries. botocore retries requests ("standard" mode: exponential backoff with jitter on 5xx,
SlowDown/throttling, resets and timeouts, bounded by a client-wide retry quota), but not the
streaming of a response body, nor a BadDigest, nor anything once the quota is spent. The store
retries those itself: a body cut short or reset, a read timeout mid-body, a checksum mismatch, a
BadDigest, a connection failure botocore gave up on, any error botocore did not retry because
its quota was spent; at most `transfer_attempts` times and
no new attempt after `transfer_deadline_s`, then a StoreError saying what failed and how often.

Create-only writes are one PutObject with `If-None-Match: *`, whatever their size (up to S3's 5
GiB; they are manifests, at most 64 MiB): of two racing writers exactly one succeeds, the other
gets ObjectExists. They are never multipart: CompleteMultipartUpload's If-None-Match is newer and
less widely implemented (a server that ignored it would overwrite), and moto 5.2 checks it
before assembling the parts, without a lock, so racing completes there can both "win" (observed:
2 of 4). A writer whose success response was lost and whose retry then hits 412 reads the object
back: its own bytes mean it had won. Not every S3-compatible server honours the header (s3rver,
older Ceph and gateways answer 200 and overwrite), and the result is silent, so before its first
create-only write a store probes: it creates a probe key create-only twice; a second success
means the header is ignored, and create-only writes (commits) are then refused with
UnsafeCommitError unless `single_publisher` says only one publisher writes there. `touch` copies an object onto itself (server side, no data transfer) to
refresh its LastModified.
Not here: manifests or versions (stores are bytes in, bytes out).
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import dataclasses
import hashlib
import logging
import os
import re
import threading
import time
import urllib.parse
import uuid
import zlib
from collections.abc import Callable, Iterator
from typing import TypeVar

from weightsync.errors import (
    ObjectExists,
    ObjectNotFound,
    ObjectTooShort,
    StoreError,
    StoreUriError,
    UnsafeCommitError,
)
from weightsync.retry import Backoff, GaveUp, retry_call
from weightsync.stores.base import ObjectInfo, check_key, check_range

log = logging.getLogger(__name__)

MiB = 1024 * 1024
_S3_MIN_PART_BYTES = 5 * MiB  # S3's smallest part but the last
_S3_MAX_PUT_BYTES = 5 * 1024 * MiB  # S3's largest single PUT
_READ_PIECE_BYTES = 8 * MiB  # a body is read in pieces so a trickling server meets the deadline
_MD5_ETAG = re.compile(r'"?([0-9a-fA-F]{32})(-\d+)?"?')
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+)")
_TRANSFER_BACKOFF = Backoff(first_s=0.1, max_s=2.0, jitter=True)  # corruption is rarely load: short waits
T = TypeVar("T")


@dataclasses.dataclass(frozen=True, kw_only=True)
class S3StoreConfig:
    endpoint_url: str | None = None
    """Endpoint of an S3-compatible server (MinIO, R2, Ceph...). None: boto3's own resolution
    (`AWS_ENDPOINT_URL_S3`, `AWS_ENDPOINT_URL`, the profile's `endpoint_url`, else AWS)."""
    io_concurrency: int = 32
    """Object transfers callers should run at once (publisher uploads, reader fetches), and the
    size of the store's own pool for parts and ranges. Transfers are latency-bound, so far more
    than the CPU count; 16-64 suits most links."""
    max_pool_connections: int | None = None
    """HTTP connections kept open; None: 2 * io_concurrency (callers plus the part pool)."""
    retry_mode: str = "standard"
    """botocore retry mode: "standard" (per-request backoff with jitter, bounded) or "adaptive"
    (adds a client-wide rate limiter after throttling; slows every thread, experimental)."""
    max_attempts: int = 8
    """Attempts per request, botocore's retries included (its `total_max_attempts`)."""
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0
    """Longest wait for any one socket read; a stalled transfer fails after this."""
    multipart_threshold_bytes: int = 16 * MiB
    """Objects larger than this are uploaded as a multipart upload."""
    part_bytes: int = 8 * MiB
    """Size of upload parts and of ranged GETs (S3 requires at least 5 MiB for parts)."""
    transfer_attempts: int = 5
    """Attempts of one transfer at what botocore does not retry (bodies cut short, checksum
    mismatches, BadDigest) or no longer retries (connection failures, and anything once its
    client-wide retry quota is spent); each attempt is itself retried by botocore per request."""
    transfer_deadline_s: float = 300.0
    """No new attempt of a transfer starts after this many seconds; bodies are read against it."""
    crc32_checksums: bool = True
    """Send a CRC32 with each single-part PUT (`x-amz-checksum-crc32`, checked and kept by the
    server) and ask for it back on GET (`x-amz-checksum-mode`), so downloads are checked at CRC32
    speed (~2.6 GB/s a core) instead of MD5. Turn off for servers that refuse these headers."""
    verify_md5: bool = True
    """Compare bodies with ETags that are MD5s: after uploads, and after downloads that carried no
    CRC32 (~0.7 GB/s a core). Turn off for servers whose ETags are not MD5s even for plain objects."""
    list_page_size: int = 1000
    """Keys per ListObjectsV2 page (S3's maximum is 1000)."""
    single_publisher: bool = False
    """Commit on a server that ignores `If-None-Match: *` (the store probes before its first
    create-only write). Safe only while one publisher at a time writes each model: two publishers
    racing for one version would overwrite each other's manifest, and agents could verify one and
    read the other's chunks. Commits then check the key is free first (a restarted publisher still
    cannot overwrite a committed version). Also `?single_publisher=1` on the URI, or
    WEIGHTSYNC_S3_SINGLE_PUBLISHER=1. Reading never needs it."""

    def __post_init__(self) -> None:
        if self.io_concurrency < 1:
            raise ValueError(f"io_concurrency must be at least 1, got {self.io_concurrency}")
        if self.max_pool_connections is not None and self.max_pool_connections < 1:
            raise ValueError("max_pool_connections must be at least 1 (or None for 2 * io_concurrency)")
        if self.retry_mode not in ("standard", "adaptive"):
            raise ValueError(f"retry_mode must be 'standard' or 'adaptive', got {self.retry_mode!r}")
        if self.max_attempts < 1 or self.transfer_attempts < 1:
            raise ValueError("max_attempts and transfer_attempts must be at least 1")
        if min(self.connect_timeout_s, self.read_timeout_s, self.transfer_deadline_s) <= 0:
            raise ValueError("timeouts and transfer_deadline_s must be positive")
        if self.part_bytes < _S3_MIN_PART_BYTES:
            raise ValueError(f"part_bytes must be at least 5 MiB (S3's minimum part), got {self.part_bytes}")
        if self.multipart_threshold_bytes < self.part_bytes:
            raise ValueError("multipart_threshold_bytes must be at least part_bytes")
        if not 1 <= self.list_page_size <= 1000:
            raise ValueError(f"list_page_size must be in [1, 1000], got {self.list_page_size}")


# The one table from S3 error codes (HTTP status when there is no code) to what they mean here.
# Codes botocore retries itself (5xx, SlowDown, throttling, RequestTimeout) are absent: when they
# reach us its attempts are spent.
_MISSING, _PRECONDITION, _CORRUPT, _CONFLICT, _NO_BUCKET, _NO_UPLOAD, _EMPTY_RANGE = (
    "missing",
    "precondition",
    "corrupt",
    "conflict",
    "no bucket",
    "no upload",
    "empty range",
)
_ERROR_MEANINGS = {
    "NoSuchKey": _MISSING,
    "NotFound": _MISSING,
    "404": _MISSING,
    "PreconditionFailed": _PRECONDITION,
    "412": _PRECONDITION,
    "ConditionalRequestConflict": _CONFLICT,  # a racing conditional write in progress: retry (AWS advice)
    "BadDigest": _CORRUPT,  # the body did not match its Content-MD5 / checksum
    "XAmzContentSHA256Mismatch": _CORRUPT,
    "NoSuchBucket": _NO_BUCKET,
    "NoSuchUpload": _NO_UPLOAD,
    "InvalidRange": _EMPTY_RANGE,  # any range of an empty object
    "416": _EMPTY_RANGE,
}


def _meaning(e: BaseException) -> str | None:
    response = getattr(e, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", ""))
    status = str(response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
    return _ERROR_MEANINGS.get(code) or _ERROR_MEANINGS.get(status)


class _Transient(StoreError):
    """A transfer failure worth another attempt (body cut short, checksum mismatch, BadDigest,
    a connection failure botocore gave up on, an error it left unretried for want of quota)."""


class _Replaced(StoreError):
    """The object changed while its ranges were being read: read it again from the start."""


class _Precondition(StoreError):
    """A create-only write found the key present (resolved to success or ObjectExists by put_new)."""


class S3Store:
    """Objects under `s3://bucket/prefix/`. Thread-safe."""

    def __init__(
        self, bucket: str, prefix: str = "", *, endpoint_url: str | None = None, config: S3StoreConfig | None = None
    ) -> None:
        try:
            import boto3
            import botocore.config
            import botocore.exceptions
            import urllib3.exceptions
        except ModuleNotFoundError as e:  # boto3 is the `s3` extra, not a core dependency
            raise StoreError(f"s3:// stores need boto3 ({e}): pip install 'weightsync[s3]'") from None

        if not bucket:
            raise StoreUriError("s3:// URI needs a bucket, e.g. s3://my-bucket/weights")
        config = config or S3StoreConfig()
        if endpoint_url is not None:
            config = dataclasses.replace(config, endpoint_url=endpoint_url)
        self.config = config
        self.bucket = bucket
        self.io_concurrency = config.io_concurrency
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        if self.prefix:
            check_key(self.prefix.rstrip("/"))
        self.uri = f"s3://{bucket}/{self.prefix}".rstrip("/")
        client_config = botocore.config.Config(
            max_pool_connections=config.max_pool_connections or 2 * config.io_concurrency,
            retries={"mode": config.retry_mode, "total_max_attempts": config.max_attempts},
            connect_timeout=config.connect_timeout_s,
            read_timeout=config.read_timeout_s,
            # We send Content-MD5 ourselves. botocore's default trailing checksums (aws-chunked
            # bodies) are refused by some S3-compatible servers.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        self._client = boto3.session.Session().client("s3", endpoint_url=config.endpoint_url, config=client_config)
        # Failures while a response body streams, which botocore leaves to the caller.
        self._stream_errors = (
            botocore.exceptions.IncompleteReadError,
            botocore.exceptions.ResponseStreamingError,
            botocore.exceptions.ReadTimeoutError,
            botocore.exceptions.ConnectionClosedError,
            urllib3.exceptions.HTTPError,
            ConnectionError,
            TimeoutError,
        )
        self._checksum_error = botocore.exceptions.FlexibleChecksumError
        # A request that still fails at the connection after botocore's retries. botocore stops
        # retrying at once when its client-wide retry quota is spent (a long-lived publisher on
        # a flaky link drains it), so the store's own bounded attempts take these too.
        self._connection_errors = (
            botocore.exceptions.ConnectionError,
            botocore.exceptions.HTTPClientError,
            urllib3.exceptions.HTTPError,
            ConnectionError,
            TimeoutError,
        )
        self._pool: cf.ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._create_only_honoured: bool | None = None  # None: not probed yet
        self._probe_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"S3Store({self.uri!r})"

    def _key(self, key: str) -> str:
        return self.prefix + check_key(key)

    # ------------------------------------------------------------------------------ reads

    def get(self, key: str) -> bytes:
        full = self._key(key)
        return self._retrying(
            f"read {self.uri}/{key}",
            lambda deadline: self._get_once(full, key, deadline),
            retry_on=(_Transient, _Replaced),
        )

    def _get_once(self, full: str, key: str, deadline: float) -> bytes:
        part = self.config.part_bytes
        checksum = {"ChecksumMode": "ENABLED"} if self.config.crc32_checksums else {}
        try:
            response = self._call(
                "read",
                key,
                self._client.get_object,
                Bucket=self.bucket,
                Key=full,
                Range=f"bytes=0-{part - 1}",
                **checksum,
            )
        except _EmptyRange:  # S3 refuses any range of an empty object
            response = self._call("read", key, self._client.get_object, Bucket=self.bucket, Key=full, **checksum)
        length = response["ContentLength"]
        match = _CONTENT_RANGE.fullmatch(response.get("ContentRange") or "")
        size = int(match.group(3)) if match else length  # 200: the server sent it all
        if match and (int(match.group(1)) != 0 or length != min(part, size)):
            raise StoreError(f"{self.uri}/{key}: server answered {response['ContentRange']} to bytes=0-{part - 1}")
        buffer = bytearray(size)
        view = memoryview(buffer)
        self._read_body(response, view[:length], key, deadline)
        if size > length:
            etag = response["ETag"]
            ranges = [(start, min(start + part, size)) for start in range(length, size, part)]
            self._parallel(
                lambda r: self._retrying(
                    f"read {self.uri}/{key} bytes {r[0]}-{r[1] - 1}",
                    lambda d: self._get_range(full, key, etag, r[0], view[r[0] : r[1]], d),
                    deadline=deadline,
                ),
                ranges,
            )
        self._check_md5(response, buffer)
        return bytes(buffer)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """Bytes [start, start + length) in one ranged GET per `part_bytes` (parallel beyond one).
        No If-Match between the pieces: ranges are read from immutable objects (packs), whose
        members are checked against their own hashes by the caller."""
        check_range(start, length)
        full = self._key(key)
        buffer = bytearray(length)
        view = memoryview(buffer)
        part = self.config.part_bytes
        pieces = [(offset, min(offset + part, length)) for offset in range(0, length, part)]

        def read(piece: tuple[int, int]) -> None:
            lo, hi = piece
            self._retrying(
                f"read {self.uri}/{key} bytes {start + lo}-{start + hi - 1}",
                lambda d: self._get_range(full, key, None, start + lo, view[lo:hi], d),
            )

        if len(pieces) == 1:
            read(pieces[0])
        else:
            self._parallel(read, pieces)
        return bytes(buffer)

    def _get_range(self, full: str, key: str, etag: str | None, start: int, out: memoryview, deadline: float) -> None:
        condition = {"IfMatch": etag} if etag is not None else {}
        try:
            response = self._call(
                "read",
                key,
                self._client.get_object,
                Bucket=self.bucket,
                Key=full,
                Range=f"bytes={start}-{start + len(out) - 1}",
                **condition,
            )
        except _Precondition:
            raise _Replaced(f"{self.uri}/{key} was replaced while being read") from None
        except _EmptyRange:  # the range starts at or past the end
            raise ObjectTooShort(
                f"{self.uri}/{key}: bytes {start}..{start + len(out)} run past the object's end"
            ) from None
        expected = f"bytes {start}-{start + len(out) - 1}/"
        match = _CONTENT_RANGE.fullmatch(response.get("ContentRange") or "")
        if match and int(match.group(1)) == start and int(match.group(3)) < start + len(out):
            response["Body"].close()
            raise ObjectTooShort(
                f"{self.uri}/{key}: bytes {start}..{start + len(out)} run past the object's end "
                f"({match.group(3)} bytes)"
            )
        if not (response.get("ContentRange") or "").startswith(expected) or response["ContentLength"] != len(out):
            raise _Transient(f"asked for {expected}, got {response.get('ContentRange')}")
        self._read_body(response, out, key, deadline)

    def _read_body(self, response: dict, out: memoryview, key: str, deadline: float) -> None:
        """Reads exactly len(out) bytes of the response body into `out`, in pieces, against the deadline."""
        body = response["Body"]
        done = 0
        try:
            while done < len(out):
                if time.monotonic() > deadline:
                    raise _Transient(f"{done} of {len(out)} bytes read when the deadline passed")
                n = body.readinto(out[done : done + _READ_PIECE_BYTES])
                if not n:
                    raise _Transient(f"body ended after {done} of {len(out)} bytes")
                done += n
            # The read past the end returns nothing, or the server sent more than it promised;
            # it is also where botocore checks the body's CRC32 (when the response carried one).
            if body.read(1):
                raise _Transient(f"body longer than the {len(out)} bytes promised")
        except self._checksum_error as e:
            raise _Transient(f"body does not match its CRC32 ({e})") from None
        except self._stream_errors as e:
            raise _Transient(f"body broken after {done} of {len(out)} bytes: {e}") from None
        finally:
            body.close()

    def exists(self, key: str) -> bool:
        try:
            self._retrying(
                f"stat {self.uri}/{key}",
                lambda _: self._call("stat", key, self._client.head_object, Bucket=self.bucket, Key=self._key(key)),
            )
            return True
        except ObjectNotFound:
            return False

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        if prefix:
            check_key(prefix.rstrip("/") or "x")
        pages = self._client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket,
            Prefix=self.prefix + prefix,
            PaginationConfig={"PageSize": self.config.list_page_size},
        )
        try:
            for page in pages:
                for item in page.get("Contents", []):
                    yield ObjectInfo(item["Key"][len(self.prefix) :], item["Size"], item["LastModified"].timestamp())
        except Exception as e:  # botocore raises many types; _map is the one table
            raise self._map(e, prefix, "list") from None

    # ----------------------------------------------------------------------------- writes

    def put(self, key: str, data: bytes | memoryview) -> None:
        self._upload(key, data, create_only=False)

    def put_new(self, key: str, data: bytes | memoryview) -> None:
        if not self.create_only_honoured():
            if not self._single_publisher():
                raise UnsafeCommitError(
                    f"{self.uri}: the server ignores If-None-Match: * (a create-only write of a probe key "
                    "succeeded twice), so a commit here is not atomic: two publishers racing for one version "
                    "would overwrite each other's manifest. Use a server that supports conditional writes "
                    "(AWS S3, MinIO, R2, recent Ceph), or, if exactly one publisher writes each model, opt in with "
                    "S3StoreConfig(single_publisher=True), ?single_publisher=1 on the store URI or "
                    "WEIGHTSYNC_S3_SINGLE_PUBLISHER=1. Reading needs none of this."
                )
            # One publisher: nobody races us, but a restarted one must still not overwrite a commit.
            if self.exists(key):
                raise ObjectExists(f"{self.uri}/{key} already exists")
        try:
            self._upload(key, data, create_only=True)
        except _Precondition:
            # Either another writer won, or we did and the success response was lost (botocore
            # then retried into our own object): only the bytes can tell.
            try:
                ours = self.get(key) == bytes(data)
            except ObjectNotFound:  # deleted since: the key was taken all the same
                ours = False
            if not ours:
                raise ObjectExists(f"{self.uri}/{key} already exists") from None
            log.info("%s/%s: create-only write had succeeded before its retry", self.uri, key)

    def create_only_honoured(self) -> bool:
        """Whether the server honours `If-None-Match: *`; probed once, on first use."""
        with self._probe_lock:
            if self._create_only_honoured is None:
                self._create_only_honoured = self._probe_create_only()
                if not self._create_only_honoured:
                    log.warning(
                        "%s: the server ignores If-None-Match: *; commits are not atomic here%s",
                        self.uri,
                        " (single_publisher: allowed)" if self._single_publisher() else "",
                    )
            return self._create_only_honoured

    def _probe_create_only(self) -> bool:
        # A fresh key each time: racing probes of two publishers cannot see each other's.
        key = f"_weightsync/probe/if-none-match-{uuid.uuid4().hex}"
        full = self._key(key)
        try:
            try:
                for body in (b"first", b"second"):
                    self._retrying(
                        f"probe {self.uri}/{key}", lambda _, body=body: self._put_once(full, key, body, True)
                    )
            except _Precondition:  # refused (or our first write's lost reply retried into itself)
                return True
            return False
        finally:
            try:
                self.delete(key)
            except StoreError as e:  # a probe key left behind is harmless (gc does not look there)
                log.warning("%s: could not delete the probe key %s: %s", self.uri, key, e)

    def _single_publisher(self) -> bool:
        return self.config.single_publisher or _truthy(os.environ.get("WEIGHTSYNC_S3_SINGLE_PUBLISHER", ""))

    def _upload(self, key: str, data: bytes | memoryview, *, create_only: bool) -> None:
        full = self._key(key)
        data = bytes(data)  # botocore re-sends the body on retries; no copy when it is bytes already
        if create_only and len(data) > _S3_MAX_PUT_BYTES:
            raise StoreError(f"{self.uri}/{key}: a create-only write is one PUT, at most 5 GiB ({len(data)} bytes)")
        if not create_only and len(data) > self.config.multipart_threshold_bytes:
            return self._upload_multipart(full, key, data)
        self._retrying(f"write {self.uri}/{key}", lambda _: self._put_once(full, key, data, create_only))

    def _put_once(self, full: str, key: str, data: bytes, create_only: bool) -> None:
        md5 = hashlib.md5(data)
        kwargs = {"IfNoneMatch": "*"} if create_only else {}
        if self.config.crc32_checksums:
            crc = zlib.crc32(data).to_bytes(4, "big")
            kwargs.update(ChecksumAlgorithm="CRC32", ChecksumCRC32=base64.b64encode(crc).decode())
        response = self._call(
            "write",
            key,
            self._client.put_object,
            Bucket=self.bucket,
            Key=full,
            Body=data,
            ContentMD5=base64.b64encode(md5.digest()).decode(),
            **kwargs,
        )
        if not self._etag_matches(response, md5.hexdigest()):
            # The server stored other bytes than we sent without checking Content-MD5. A plain
            # object is simply written again; a create-only one is ours (our create won), so
            # remove it (If-Match: only that object) and create it again.
            if create_only:
                self._call(
                    "clean up", key, self._client.delete_object, Bucket=self.bucket, Key=full, IfMatch=response["ETag"]
                )
            raise _Transient("the server stored bytes that differ from those sent (ETag is not their MD5)")

    def _upload_multipart(self, full: str, key: str, data: bytes) -> None:
        start = self._call("write", key, self._client.create_multipart_upload, Bucket=self.bucket, Key=full)
        upload_id = start["UploadId"]
        view = memoryview(data)
        part = self.config.part_bytes
        numbered = [(n + 1, view[offset : offset + part]) for n, offset in enumerate(range(0, len(data), part))]
        try:
            digests = self._parallel(
                lambda item: self._retrying(
                    f"write {self.uri}/{key} part {item[0]}", lambda _: self._upload_part(full, key, upload_id, *item)
                ),
                numbered,
            )
            parts = [{"PartNumber": n, "ETag": f'"{d.hex()}"'} for (n, _), d in zip(numbered, digests, strict=True)]
            try:
                response = self._call(
                    "write",
                    key,
                    self._client.complete_multipart_upload,
                    Bucket=self.bucket,
                    Key=full,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": parts},
                )
            except _NoUpload:  # an earlier attempt completed it and its response was lost: the ETag tells
                response = self._call("write", key, self._client.head_object, Bucket=self.bucket, Key=full)
        except BaseException:
            self._abort_upload(full, upload_id)
            raise
        expected = hashlib.md5(b"".join(digests)).hexdigest() + f"-{len(parts)}"
        if not self._etag_matches(response, expected):
            raise StoreError(
                f"{self.uri}/{key}: multipart upload completed with ETag {response.get('ETag')}, expected {expected}"
            )

    def _upload_part(self, full: str, key: str, upload_id: str, number: int, body: memoryview) -> bytes:
        data = bytes(body)
        md5 = hashlib.md5(data)
        response = self._call(
            "write",
            key,
            self._client.upload_part,
            Bucket=self.bucket,
            Key=full,
            UploadId=upload_id,
            PartNumber=number,
            Body=data,
            ContentMD5=base64.b64encode(md5.digest()).decode(),
        )
        if not self._etag_matches(response, md5.hexdigest()):
            raise _Transient(f"part {number} stored with bytes that differ from those sent (ETag is not their MD5)")
        return md5.digest()

    def _abort_upload(self, full: str, upload_id: str) -> None:
        try:
            self._client.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload_id)
        except Exception as e:  # cleanup only: abort_stale_uploads (or a lifecycle rule) gets it later
            log.warning("%s: could not abort multipart upload of %s: %s", self.uri, full, e)

    def abort_stale_uploads(self, older_than_s: float) -> int:
        """Aborts multipart uploads under the prefix started more than `older_than_s` ago (left by
        a killed writer; they hold storage but are never visible). Returns how many it aborted."""
        cutoff = time.time() - older_than_s
        aborted = 0
        try:
            pages = self._client.get_paginator("list_multipart_uploads").paginate(
                Bucket=self.bucket, Prefix=self.prefix
            )
            for page in pages:
                for upload in page.get("Uploads", []):
                    if upload["Initiated"].timestamp() < cutoff:
                        self._abort_upload(upload["Key"], upload["UploadId"])
                        aborted += 1
        except Exception as e:
            raise self._map(e, "", "list uploads under") from None
        return aborted

    def touch(self, key: str) -> None:
        full = self._key(key)
        checksum = {"ChecksumAlgorithm": "CRC32"} if self.config.crc32_checksums else {}  # the copy keeps one
        self._retrying(
            f"touch {self.uri}/{key}",
            lambda _: self._call(
                "touch",
                key,
                self._client.copy_object,
                Bucket=self.bucket,
                Key=full,
                CopySource={"Bucket": self.bucket, "Key": full},
                MetadataDirective="REPLACE",
                **checksum,
            ),
        )

    def delete(self, key: str) -> None:
        try:
            self._retrying(
                f"delete {self.uri}/{key}",
                lambda _: self._call("delete", key, self._client.delete_object, Bucket=self.bucket, Key=self._key(key)),
            )
        except ObjectNotFound:
            pass

    # ---------------------------------------------------------------------------- helpers

    def _call(self, action: str, key: str, method: Callable[..., dict], **kwargs) -> dict:
        """One botocore request (botocore retries it), its failure mapped through the table."""
        try:
            return method(**kwargs)
        except Exception as e:  # botocore raises many types; _map is the one table
            raise self._map(e, key, action) from None

    def _map(self, e: Exception, key: str, action: str) -> Exception:
        if isinstance(e, StoreError):
            return e
        meaning = _meaning(e)
        where = f"{self.uri}/{key}"
        if isinstance(e, self._connection_errors):
            return _Transient(f"cannot {action} {where}: {type(e).__name__}: {e}")
        if (getattr(e, "response", None) or {}).get("ResponseMetadata", {}).get("RetryQuotaReached"):
            # A 5xx or SlowDown botocore would have retried but for its spent retry quota.
            return _Transient(f"cannot {action} {where}: {type(e).__name__}: {e} (botocore's retry quota is spent)")
        if meaning == _MISSING:
            return ObjectNotFound(f"{where} does not exist")
        if meaning == _PRECONDITION:
            return _Precondition(f"{where}: precondition failed")
        if meaning in (_CORRUPT, _CONFLICT):
            return _Transient(f"cannot {action} {where}: {type(e).__name__}: {e}")
        if meaning == _NO_BUCKET:
            return StoreError(f"bucket {self.bucket!r} does not exist ({self.uri})")
        if meaning == _NO_UPLOAD:
            return _NoUpload(f"{where}: multipart upload not found")
        if meaning == _EMPTY_RANGE:
            return _EmptyRange(f"{where}: range not satisfiable")
        return StoreError(f"cannot {action} {where}: {type(e).__name__}: {e}")

    def _retrying(
        self,
        what: str,
        attempt: Callable[[float], T],
        *,
        deadline: float | None = None,
        retry_on: tuple[type[BaseException], ...] = (_Transient,),
    ) -> T:
        """Runs `attempt(deadline)` until it succeeds, at most transfer_attempts times and no new
        attempt after the deadline, backing off with jitter; then a StoreError."""
        deadline = time.monotonic() + self.config.transfer_deadline_s if deadline is None else deadline
        try:
            return retry_call(
                what,
                lambda: attempt(deadline),
                attempts=self.config.transfer_attempts,
                backoff=_TRANSFER_BACKOFF,
                retry_on=retry_on,
                deadline_s=deadline - time.monotonic(),
                log=log,
            )
        except GaveUp as e:
            raise StoreError(str(e)) from e.last

    def _parallel(self, fn: Callable[[T], object], items: list[T]) -> list:
        """fn over items on the store's transfer pool; the first failure cancels the rest and is
        raised once every started transfer has finished (none keeps writing into a buffer)."""
        with self._pool_lock:
            if self._pool is None:
                self._pool = cf.ThreadPoolExecutor(self.config.io_concurrency, thread_name_prefix="ws-s3-part")
        futures = [self._pool.submit(fn, item) for item in items]
        done, _ = cf.wait(futures, return_when=cf.FIRST_EXCEPTION)
        if any(f.exception() is not None for f in done):
            for f in futures:
                f.cancel()
            cf.wait(futures)
        return [f.result() for f in futures]

    def _etag_matches(self, response: dict, md5_hex: str) -> bool:
        """False only when the ETag is an MD5 of the bytes and differs from `md5_hex`."""
        if not self.config.verify_md5 or not _etag_is_md5(response):
            return True
        return response["ETag"].strip('"').lower() == md5_hex

    def _check_md5(self, response: dict, data: bytearray) -> None:
        """MD5 against the ETag, for bodies botocore did not check by their full-object CRC32."""
        crc = response.get("ChecksumCRC32")
        if crc and "-" not in crc:  # a full-object CRC32: botocore checked it while reading
            return
        if not self.config.verify_md5 or not _etag_is_md5(response) or "-" in response["ETag"]:
            return
        if hashlib.md5(data).hexdigest() != response["ETag"].strip('"').lower():
            raise _Transient("body does not match its ETag (MD5)")


def _etag_is_md5(response: dict) -> bool:
    """Whether S3 promises this response's ETag is an MD5 (of the bytes, or of part MD5s with -N)."""
    if response.get("SSECustomerAlgorithm") or str(response.get("ServerSideEncryption", "")).startswith("aws:kms"):
        return False
    return bool(_MD5_ETAG.fullmatch(response.get("ETag") or ""))


class _NoUpload(StoreError):
    """CompleteMultipartUpload found no such upload (an earlier attempt completed it)."""


class _EmptyRange(StoreError):
    """A ranged GET of an empty object (S3 answers 416)."""


def _truthy(text: str) -> bool:
    return text.strip().lower() in ("1", "true", "yes", "on")


def open_s3(uri_rest: str, endpoint_url: str | None = None, config: S3StoreConfig | None = None) -> S3Store:
    """`BUCKET/PREFIX[?single_publisher=1]` (the part after `s3://`) as a store."""
    uri_rest, _, query = uri_rest.partition("?")
    if query:
        options = urllib.parse.parse_qs(query, keep_blank_values=True)
        unknown = sorted(set(options) - {"single_publisher"})
        value = options.get("single_publisher", [""])[-1].strip().lower()
        if unknown or value not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            raise StoreUriError(f"s3:// URI options: only single_publisher=1 (or 0) is known, got ?{query}")
        config = dataclasses.replace(config or S3StoreConfig(), single_publisher=_truthy(value))
    bucket, _, prefix = uri_rest.partition("/")
    return S3Store(bucket, prefix, endpoint_url=endpoint_url, config=config)
