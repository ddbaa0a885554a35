"""weightsync: lossless, chunked, verified weight deltas from a trainer to inference servers.

The library API in one place; heavy modules (torch) load on first use so that the CLI's
`--help` stays instant.
"""

from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "Publisher": "weightsync.publisher",
    "PublisherConfig": "weightsync.publisher",
    "PublishResult": "weightsync.publisher",
    "WriteFormat": "weightsync.format.write_format",
    "Reader": "weightsync.reader",
    "WeightsState": "weightsync.reader",
    "Store": "weightsync.stores",
    "LocalStore": "weightsync.stores",
    "open_store": "weightsync.stores",
    "Manifest": "weightsync.format.manifest",
    "parse_manifest": "weightsync.format.manifest",
    "list_versions": "weightsync.versions",
    "read_manifest": "weightsync.versions",
}

__all__ = ["__version__"] + list(_LAZY)  # lazy names, resolved by __getattr__


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'weightsync' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
