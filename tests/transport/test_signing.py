"""Ed25519 manifest signatures (weightsync/transport/signing.py): a trusted key's signature verifies; a
tampered manifest, an untrusted or unknown key, a malformed or missing signature are refused
with a SignatureError; keys round-trip through PEM files."""

from __future__ import annotations

import json
import os
import stat

import pytest

from weightsync.errors import IntegrityError, SignatureError
from weightsync.transport.signing import Signer, Verifier

DATA = b'{"format":1,"model":"m","version":3}'


def test_a_trusted_signature_verifies_and_names_its_key(tmp_path):
    signer = Signer.generate()
    signer.write(tmp_path / "key.pem", tmp_path / "key.pub")
    assert stat.S_IMODE(os.stat(tmp_path / "key.pem").st_mode) == 0o600
    loaded = Signer.from_pem(tmp_path / "key.pem")
    verifier = Verifier.from_pem([tmp_path / "key.pub"])
    assert verifier.verify(DATA, loaded.sign(DATA)) == signer.key_id == loaded.key_id


def test_rotation_trusts_several_keys():
    old, new = Signer.generate(), Signer.generate()
    verifier = Verifier([old._key.public_key(), new._key.public_key()])
    assert verifier.verify(DATA, old.sign(DATA)) == old.key_id
    assert verifier.verify(DATA, new.sign(DATA)) == new.key_id


@pytest.mark.parametrize(
    "case",
    [
        "tampered",
        "untrusted",
        "unsigned",
        "malformed",
        "alg",
        "oversized",
        "bad_hex",
        "not_an_object",
        "key_id_list",
        "alg_object",
        "sig_number",
    ],
)
def test_bad_signatures_are_refused(case):
    signer = Signer.generate()
    verifier = Verifier([signer._key.public_key()])
    sig = signer.sign(DATA)
    data = DATA
    if case == "tampered":
        data = DATA.replace(b"3", b"4")
    elif case == "untrusted":
        sig = Signer.generate().sign(DATA)
    elif case == "unsigned":
        sig = None
    elif case == "malformed":
        sig = b"not json"
    elif case == "alg":
        sig = json.dumps({**json.loads(sig), "alg": "rsa"}).encode()
    elif case == "oversized":
        sig = b" " * 5000
    elif case == "bad_hex":
        sig = json.dumps({**json.loads(sig), "sig": "zz"}).encode()
    elif case == "not_an_object":
        sig = json.dumps([json.loads(sig)]).encode()
    elif case == "key_id_list":  # found by the RPC fuzz test: once an INTERNAL TypeError (unhashable)
        sig = json.dumps({**json.loads(sig), "key_id": []}).encode()
    elif case == "alg_object":
        sig = json.dumps({**json.loads(sig), "alg": {"name": "ed25519"}}).encode()
    elif case == "sig_number":
        sig = json.dumps({**json.loads(sig), "sig": 7}).encode()
    with pytest.raises(SignatureError) as info:
        verifier.verify(data, sig)
    assert isinstance(info.value, IntegrityError)


def test_wrong_key_files_are_refused_clearly(tmp_path):
    (tmp_path / "junk.pem").write_text("-----BEGIN PRIVATE KEY-----\nnope\n-----END PRIVATE KEY-----\n")
    with pytest.raises(SignatureError, match="cannot load"):
        Signer.from_pem(tmp_path / "junk.pem")
    with pytest.raises(SignatureError, match="cannot load"):
        Verifier.from_pem([tmp_path / "missing.pub"])
    with pytest.raises(SignatureError, match="at least one"):
        Verifier([])
