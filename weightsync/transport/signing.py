"""signing: Ed25519 signatures over manifest bytes, so agents can refuse versions nobody trusted wrote.

xxh3 catches corruption, not malice: whoever can write the bucket could write a consistent
manifest and chunks. A publisher holding a private key signs each manifest's canonical bytes
(the manifest names every chunk's hashes, so the signature covers every byte of the version);
agents configured with the public keys they trust refuse versions without a valid signature.

A signature is a small JSON document, stored beside the manifest (`layout.signature_key`) and
sent with push offers:

    {"alg":"ed25519","key_id":"<16 hex: sha256 of the raw public key>","sig":"<128 hex>"}

The key id lets an agent trust several keys at once (rotation). Keys are PEM files (PKCS#8
private, SubjectPublicKeyInfo public), made by `weightsync keygen`. Not here: where signatures
are stored or when they are checked (publisher, agent).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from weightsync.errors import ConfigError, SignatureError

ALGORITHM = "ed25519"
MAX_SIGNATURE_BYTES = 1024


def _key_id(public_key: Ed25519PublicKey) -> str:
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


class Signer:
    """Signs manifests with one private key."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._key = private_key
        self.key_id = _key_id(private_key.public_key())

    @classmethod
    def generate(cls) -> Signer:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_pem(cls, path: str | os.PathLike) -> Signer:
        try:
            key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
        except (OSError, ValueError, TypeError) as e:
            raise SignatureError(f"cannot load a signing key from {path}: {e}") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise SignatureError(f"{path} holds a {type(key).__name__}; weightsync signs with Ed25519 keys")
        return cls(key)

    def sign(self, data: bytes) -> bytes:
        """The signature document for `data` (manifest bytes)."""
        doc = {"alg": ALGORITHM, "key_id": self.key_id, "sig": self._key.sign(data).hex()}
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    def public_pem(self) -> bytes:
        return self._key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )

    def private_pem(self) -> bytes:
        return self._key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    def write(self, private_path: str | os.PathLike, public_path: str | os.PathLike) -> None:
        """Writes the key pair; the private key file is readable by its owner only. Never
        overwrites a key: ConfigError (naming the file and the fix) if either file exists or the
        directory does not, before anything is written."""
        private_path, public_path = Path(private_path), Path(public_path)
        for path in (private_path, public_path):
            if not path.parent.is_dir():
                raise ConfigError(f"cannot write {path}: the directory {path.parent} does not exist (create it first)")
            if path.exists():
                raise ConfigError(
                    f"{path} already exists, and a key is never overwritten: remove it or pick another "
                    "path for the key pair"
                )
        try:
            fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # created since the check above
            raise ConfigError(f"{private_path} already exists, and a key is never overwritten") from None
        with os.fdopen(fd, "wb") as f:
            f.write(self.private_pem())
        public_path.write_bytes(self.public_pem())


class Verifier:
    """Checks signatures against a set of trusted public keys."""

    def __init__(self, public_keys: Iterable[Ed25519PublicKey]) -> None:
        self._keys = {_key_id(k): k for k in public_keys}
        if not self._keys:
            raise SignatureError("a verifier needs at least one trusted public key")

    @classmethod
    def from_pem(cls, paths: Iterable[str | os.PathLike]) -> Verifier:
        keys = []
        for path in paths:
            try:
                key = serialization.load_pem_public_key(Path(path).read_bytes())
            except (OSError, ValueError, TypeError) as e:
                raise SignatureError(f"cannot load a public key from {path}: {e}") from None
            if not isinstance(key, Ed25519PublicKey):
                raise SignatureError(f"{path} holds a {type(key).__name__}; weightsync verifies Ed25519 keys")
            keys.append(key)
        return cls(keys)

    @property
    def key_ids(self) -> list[str]:
        return sorted(self._keys)

    def verify(self, data: bytes, signature: bytes | None) -> str:
        """Returns the signing key's id; raises SignatureError unless a trusted key signed `data`."""
        if not signature:
            raise SignatureError("the version is not signed, and this receiver requires signatures")
        if len(signature) > MAX_SIGNATURE_BYTES:
            raise SignatureError(f"signature document of {len(signature)} bytes is over {MAX_SIGNATURE_BYTES}")
        try:
            doc = json.loads(signature)
            alg, key_id, sig_hex = doc["alg"], doc["key_id"], doc["sig"]
            # Every field is a string; a list or object here would otherwise surface later as an
            # unhashable-key TypeError, i.e. an INTERNAL error instead of a refused signature.
            if not all(isinstance(field, str) for field in (alg, key_id, sig_hex)):
                raise TypeError("signature fields must be strings")
            sig = bytes.fromhex(sig_hex)
        except (ValueError, KeyError, TypeError):
            raise SignatureError("malformed signature document") from None
        if alg != ALGORITHM:
            raise SignatureError(f"signature algorithm {alg!r} is not supported; supported: {ALGORITHM}")
        key = self._keys.get(key_id)
        if key is None:
            raise SignatureError(f"signed by key {key_id!r}, which is not trusted (trusted: {self.key_ids})")
        try:
            key.verify(sig, data)
        except InvalidSignature:
            raise SignatureError(f"signature by key {key_id} does not match the manifest") from None
        return key_id
