"""errors: the one exception hierarchy of weightsync.

Every error the library raises on purpose derives from `WeightsyncError`; each subclass also
inherits the stdlib type it refines, so callers can catch either. All are picklable (plain
message arguments only) because they cross thread and process boundaries.
"""

from __future__ import annotations


class WeightsyncError(Exception):
    """Root of every error weightsync raises on purpose."""


class FormatError(WeightsyncError, ValueError):
    """Bytes or documents that do not follow docs/format.md (malformed, truncated, oversized)."""


class UnsupportedFormatError(FormatError):
    """A format version, codec or dtype this build does not know."""


class IntegrityError(WeightsyncError, ValueError):
    """Data that parsed but whose hash or digest does not match what was published."""


class LayoutError(WeightsyncError, ValueError):
    """Tensors whose names, dtypes or shapes do not fit what the operation expects."""


class ConfigError(WeightsyncError, ValueError):
    """A configuration file or setting that cannot be used; the message names the key and the fix."""


class StoreError(WeightsyncError, OSError):
    """A store could not do what was asked (I/O failure, bad key, bad URI)."""


class ListenError(WeightsyncError, OSError):
    """An address a server must listen on cannot be bound (taken, not on this host, privileged);
    the message names the setting."""


class StoreUriError(StoreError, ConfigError):
    """A store URI this build cannot open (unknown scheme, a scheme with its `//` missing): a
    setting to fix, not a failure of the store."""


class UnsafeCommitError(StoreError):
    """A store whose server ignores create-only writes (If-None-Match), so a commit could overwrite."""


class ObjectNotFound(StoreError, KeyError):
    """A store key that does not exist."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0]) if self.args else "object not found"


class ObjectTooShort(StoreError):
    """A ranged read that runs past the end of its object (a truncated pack, or a bad index)."""


class ObjectExists(StoreError, FileExistsError):
    """A create-only write found the key already present (another writer won)."""


class VersionNotFound(WeightsyncError, KeyError):
    """A model version that the store does not hold."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "version not found"


class VersionConflict(WeightsyncError, RuntimeError):
    """Another publisher committed the same version first; nothing was overwritten."""


class PublishError(WeightsyncError, RuntimeError):
    """A version could not be published (its cause is chained)."""


class SignatureError(IntegrityError):
    """A manifest whose signature is missing, malformed or not made by a trusted key."""


class StaleVersion(WeightsyncError, ValueError):
    """A version older than (or a replay of) what the receiver already serves."""


class AccessDenied(WeightsyncError, PermissionError):
    """A caller without a valid token (or certificate) for the endpoint."""


class ResourceExhausted(WeightsyncError, RuntimeError):
    """A receiver's bound (pending bytes, queue length) is reached; the sender retries later."""


class RpcUnavailable(WeightsyncError, ConnectionError):
    """A peer could not be reached, or a call failed in transport (timeout, reset, shutdown)."""
