"""Test certificates: a CA, a server certificate for 127.0.0.1/localhost and a client certificate,
made with `cryptography` into a directory (for the TLS and mTLS tests; never used outside tests)."""

from __future__ import annotations

import datetime
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )


def make_certificates(directory: Path) -> dict[str, str]:
    """Writes ca.pem, server.pem/.key, client.pem/.key and other-ca.pem (an unrelated CA);
    returns their paths by name."""
    import ipaddress

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("weightsync test CA"))
        .issuer_name(_name("weightsync test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    paths = {"ca": directory / "ca.pem"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))

    def issue(name: str, usage, san=None) -> None:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(name))
            .issuer_name(ca.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())
        paths[name] = directory / f"{name}.pem"
        paths[f"{name}_key"] = directory / f"{name}.key"
        paths[name].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key, paths[f"{name}_key"])

    issue(
        "server",
        ExtendedKeyUsageOID.SERVER_AUTH,
        [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
    )
    issue("client", ExtendedKeyUsageOID.CLIENT_AUTH)
    other_key = ec.generate_private_key(ec.SECP256R1())
    other = (
        x509.CertificateBuilder()
        .subject_name(_name("other CA"))
        .issuer_name(_name("other CA"))
        .public_key(other_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(other_key, hashes.SHA256())
    )
    paths["other_ca"] = directory / "other-ca.pem"
    paths["other_ca"].write_bytes(other.public_bytes(serialization.Encoding.PEM))
    return {k: str(v) for k, v in paths.items()}
