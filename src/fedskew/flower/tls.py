"""Throwaway TLS and SuperNode-authentication material for a Flower federation on one machine
(:class:`fedskew.flower.loopback.Loopback` with ``secure=True``): a CA and a server certificate it signed
(:func:`write_tls`; the CA's key is never written), and a SuperNode's EC P-384 key pair in the OpenSSH format Flower
reads (:func:`write_node_key`). Private keys are written with mode 0600."""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of a throwaway certificate authority and of a server certificate it signed."""

    ca: Path  # the CA certificate: the SuperLink's --ssl-ca-certfile, the nodes' and flwr's root certificates
    cert: Path  # the server certificate (SANs: the hosts given)
    key: Path  # the server's private key


def _write_private(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


_KEY_USES = (
    "digital_signature",
    "content_commitment",
    "key_encipherment",
    "data_encipherment",
    "key_agreement",
    "key_cert_sign",
    "crl_sign",
    "encipher_only",
    "decipher_only",
)


def _key_usage(*allowed: str) -> Any:
    """An X.509 KeyUsage extension allowing exactly ``allowed`` (the others false)."""
    from cryptography import x509

    return x509.KeyUsage(**{use: use in allowed for use in _KEY_USES})


def write_tls(folder: Path, hosts: tuple[str, ...] = ("127.0.0.1", "localhost"), days: float = 2.0) -> TlsFiles:
    """A new CA (``ca.crt``) and a server certificate it signed (``server.pem``, key ``server.key``) for ``hosts``
    (IP addresses become IP SANs, names DNS SANs), valid for ``days``, in ``folder``. EC P-256 keys; nothing of it
    outlives the folder: the CA's own private key is never written."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedskew loopback CA")])
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            _key_usage("digital_signature", "key_cert_sign", "crl_sign"),
            critical=True,
        )
        .add_extension(ca_ski, critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    sans: list[x509.GeneralName] = []
    for host in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            sans.append(x509.DNSName(host))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            _key_usage("digital_signature", "key_agreement"),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    files = TlsFiles(ca=folder / "ca.crt", cert=folder / "server.pem", key=folder / "server.key")
    files.ca.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_private(
        files.key,
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
    )
    return files


def write_node_key(folder: Path, name: str) -> tuple[Path, Path]:
    """A SuperNode authentication key pair as Flower reads it: an EC P-384 private key in OpenSSH format
    (``NAME``, for ``flower-supernode --auth-supernode-private-key``) and its public key in OpenSSH format
    (``NAME.pub``, for ``flwr supernode register``). Returns (private, public)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    folder = Path(folder)
    key = ec.generate_private_key(ec.SECP384R1())
    private, public = folder / name, folder / f"{name}.pub"
    _write_private(
        private,
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
        ),
    )
    public.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH) + b"\n"
    )
    return private, public
