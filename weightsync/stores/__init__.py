"""stores: where versions live. The `Store` contract, its backends, and choosing one by URI.

`open_store(uri)` picks the backend by the URI's scheme in STORE_SCHEMES, importing the backend's
module on first use (boto3 loads only when S3 is used). Adding a backend (GCS, say) is one module
with an opener plus one line in STORE_SCHEMES: help texts and error messages read the table
(`store_uri_forms`), and the contract suite (tests/stores/test_store_contract.py) runs over it.

Not here: what is stored (weightsync.format), the commit protocol (weightsync.versions).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import re

from weightsync.errors import StoreUriError
from weightsync.stores.base import ObjectInfo, Store, check_key, check_range
from weightsync.stores.local import LocalStore

__all__ = [
    "STORE_SCHEMES",
    "LocalStore",
    "ObjectInfo",
    "Store",
    "check_key",
    "check_range",
    "open_store",
    "store_uri_forms",
]


@dataclasses.dataclass(frozen=True)
class StoreScheme:
    opener: str
    """"module:function": called with the URI's part after `scheme://` and the caller's options."""
    form: str
    """How a user writes such a URI, for help texts and errors."""


STORE_SCHEMES: dict[str, StoreScheme] = {
    "file": StoreScheme("weightsync.stores.local:open_local", "file://DIR (or a plain directory path)"),
    "s3": StoreScheme("weightsync.stores.s3:open_s3", "s3://BUCKET/PREFIX"),
}

# `s3:/bucket` or `file:relative`: a scheme with its `//` missing, which would otherwise be a
# local directory named `s3:` that nobody meant.
_SCHEME_LIKE = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):(.*)", re.DOTALL)


def store_uri_forms() -> str:
    """The URI forms this build opens, e.g. "file://DIR (or a plain directory path), s3://BUCKET/PREFIX"."""
    return ", ".join(scheme.form for scheme in STORE_SCHEMES.values())


def open_store(uri: str | os.PathLike, **options) -> Store:
    """The store a URI names (see STORE_SCHEMES); a URI without a scheme is a local directory.

    Raises StoreUriError (a StoreError and a ConfigError) on a scheme this build does not know,
    listing the ones it does.
    """
    text = os.fspath(uri)
    scheme, sep, rest = text.partition("://")
    if not sep:
        _refuse_scheme_like_path(text)
        scheme, rest = "file", text
    entry = STORE_SCHEMES.get(scheme)
    if entry is None:
        raise StoreUriError(f"unsupported store URI {text!r}; supported: {store_uri_forms()}")
    module, function = entry.opener.split(":")
    return getattr(importlib.import_module(module), function)(rest, **options)


def _refuse_scheme_like_path(text: str) -> None:
    match = _SCHEME_LIKE.fullmatch(text)
    if match is None:
        return
    scheme, rest = match.groups()
    if scheme in STORE_SCHEMES or rest.startswith("/"):
        hint = f"; did you mean {scheme}://{rest.lstrip('/')}?" if scheme in STORE_SCHEMES else ""
        raise StoreUriError(
            f"store URI {text!r} is neither a directory nor a URI this build opens{hint} "
            f"(supported: {store_uri_forms()}; write ./{text} for a directory of that name)"
        )
