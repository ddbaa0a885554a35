"""s3_store: the `Store` contract over S3-compatible object storage (`s3://BUCKET/PREFIX`).

Endpoint, region, credentials and addressing style come from boto3's standard mechanisms
(`AWS_ENDPOINT_URL`, `AWS_REGION`, profiles, environment, instance roles); `endpoint_url`
overrides the endpoint. The client is tuned for many parallel chunk transfers (a connection
pool as large as the worker pools, standard retries with backoff on 5xx/SlowDown/resets).

Create-only writes use `If-None-Match: *` (AWS S3, MinIO, R2 and moto enforce it): of two
racing writers exactly one succeeds and the other gets ObjectExists. `touch` copies an object
onto itself (server side, no data transfer) to refresh its LastModified.
Not here: manifests or versions (stores are bytes in, bytes out).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from weightsync.errors import ObjectExists, ObjectNotFound, StoreError
from weightsync.store import ObjectInfo, check_key

log = logging.getLogger(__name__)

_NOT_FOUND = {"404", "NoSuchKey", "NotFound"}
_PRECONDITION = {"412", "PreconditionFailed", "ConditionalRequestConflict"}


class S3Store:
    """Objects under `s3://bucket/prefix/`."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        max_connections: int = 64,
        io_concurrency: int = 32,
        max_attempts: int = 8,
        connect_timeout_s: float = 10.0,
        read_timeout_s: float = 60.0,
    ) -> None:
        import boto3
        import botocore.config

        if not bucket:
            raise StoreError("s3:// URI needs a bucket, e.g. s3://my-bucket/weights")
        self.bucket = bucket
        self.io_concurrency = io_concurrency  # object transfers are latency-bound: many in parallel
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        if self.prefix:
            check_key(self.prefix.rstrip("/"))
        self.uri = f"s3://{bucket}/{self.prefix}".rstrip("/")
        config = botocore.config.Config(
            max_pool_connections=max_connections,
            retries={"mode": "standard", "max_attempts": max_attempts},
            connect_timeout=connect_timeout_s,
            read_timeout=read_timeout_s,
            # Checksums only when the operation requires them: some S3-compatible servers
            # reject the trailing-checksum encoding newer botocore sends by default.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        self._client = boto3.session.Session().client("s3", endpoint_url=endpoint_url, config=config)
        self._errors = self._client.exceptions

    def __repr__(self) -> str:
        return f"S3Store({self.uri!r})"

    def _key(self, key: str) -> str:
        return self.prefix + check_key(key)

    def get(self, key: str) -> bytes:
        try:
            response = self._client.get_object(Bucket=self.bucket, Key=self._key(key))
            data = response["Body"].read()
        except Exception as e:  # botocore raises many types; map them in one place
            raise self._map(e, key, "read") from None
        if len(data) != response.get("ContentLength", len(data)):
            raise StoreError(f"{self.uri}/{key}: truncated read ({len(data)} of {response['ContentLength']} bytes)")
        return data

    def put(self, key: str, data: bytes | memoryview) -> None:
        try:
            self._client.put_object(Bucket=self.bucket, Key=self._key(key), Body=bytes(data))
        except Exception as e:
            raise self._map(e, key, "write") from None

    def put_new(self, key: str, data: bytes | memoryview) -> None:
        try:
            self._client.put_object(Bucket=self.bucket, Key=self._key(key), Body=bytes(data), IfNoneMatch="*")
        except Exception as e:
            error = self._map(e, key, "create")
            if isinstance(error, _Precondition):
                raise ObjectExists(f"{self.uri}/{key} already exists") from None
            raise error from None

    def touch(self, key: str) -> None:
        full = self._key(key)
        try:
            self._client.copy_object(
                Bucket=self.bucket, Key=full, CopySource={"Bucket": self.bucket, "Key": full},
                MetadataDirective="REPLACE",
            )
        except Exception as e:
            raise self._map(e, key, "touch") from None

    def exists(self, key: str) -> bool:
        try:
            self._client.head_object(Bucket=self.bucket, Key=self._key(key))
            return True
        except Exception as e:
            error = self._map(e, key, "stat")
            if isinstance(error, ObjectNotFound):
                return False
            raise error from None

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        if prefix:
            check_key(prefix.rstrip("/") or "x")
        paginator = self._client.get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix + prefix):
                for item in page.get("Contents", []):
                    yield ObjectInfo(item["Key"][len(self.prefix):], item["Size"], item["LastModified"].timestamp())
        except Exception as e:
            raise self._map(e, prefix, "list") from None

    def delete(self, key: str) -> None:
        try:
            self._client.delete_object(Bucket=self.bucket, Key=self._key(key))
        except Exception as e:
            error = self._map(e, key, "delete")
            if not isinstance(error, ObjectNotFound):
                raise error from None

    def _map(self, e: Exception, key: str, action: str) -> Exception:
        """The one table from boto errors to the store contract's errors."""
        if isinstance(e, StoreError):
            return e
        response = getattr(e, "response", None) or {}
        code = str(response.get("Error", {}).get("Code", ""))
        status = str(response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
        if code in _NOT_FOUND or status == "404":
            return ObjectNotFound(f"{self.uri}/{key} does not exist")
        if code in _PRECONDITION or status == "412":
            return _Precondition(f"{self.uri}/{key}: precondition failed")
        if code == "NoSuchBucket":
            return StoreError(f"bucket {self.bucket!r} does not exist ({self.uri})")
        return StoreError(f"cannot {action} {self.uri}/{key}: {type(e).__name__}: {e}")


class _Precondition(StoreError):
    """A conditional write lost (mapped to ObjectExists by put_new)."""


def open_s3(uri_rest: str, endpoint_url: str | None = None) -> S3Store:
    """`BUCKET/PREFIX` (the part after `s3://`) as a store."""
    bucket, _, prefix = uri_rest.partition("/")
    return S3Store(bucket, prefix, endpoint_url=endpoint_url)
