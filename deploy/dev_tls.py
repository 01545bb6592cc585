"""A development certificate authority: a CA, one certificate per node and client
certificates, written as PEM files (keys 0600) for a local or Docker cluster and its tests.

Node certificates name the node's alias, its host and `localhost`/`127.0.0.1` (peers and
clients verify the name they dial) and carry both serverAuth and clientAuth (with
`tlsClientAuth=require` a node is also a client of its peers). Not for production: the CA
key sits beside the certificates.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from hastream.tls import ClientTls

VALID_DAYS: Final = 365


@dataclass(frozen=True, slots=True)
class Issued:
    cert_file: Path
    key_file: Path


@dataclass(frozen=True, slots=True)
class DevCA:
    """A CA whose files live in `directory` (`ca.pem`, `ca.key`)."""

    directory: Path

    @property
    def ca_file(self) -> Path:
        return self.directory / "ca.pem"

    @classmethod
    def create(cls, directory: Path, name: str = "hastream development CA") -> DevCA:
        """A new CA in `directory` (created); an existing one there is kept."""
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        ca = cls(directory)
        if ca.ca_file.exists():
            return ca
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.UTC)
        certificate = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(key, hashes.SHA256())
        )
        _write_key(directory / "ca.key", key)
        _write(ca.ca_file, certificate.public_bytes(serialization.Encoding.PEM), 0o644)
        return ca

    def issue(self, name: str, hosts: tuple[str, ...] = ()) -> Issued:
        """A certificate for `name` (its common name and first DNS name) valid for `hosts`
        (names or IP addresses) and localhost, signed by this CA; `<name>.pem`/`.key`."""
        ca_key = serialization.load_pem_private_key((self.directory / "ca.key").read_bytes(), None)
        assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
        ca_cert = x509.load_pem_x509_certificate(self.ca_file.read_bytes())
        key = ec.generate_private_key(ec.SECP256R1())
        names: list[x509.GeneralName] = []
        for host in dict.fromkeys((name, *hosts, "localhost", "127.0.0.1")):
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                names.append(x509.DNSName(host))
        now = datetime.datetime.now(datetime.UTC)
        certificate = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())
        )
        issued = Issued(self.directory / f"{name}.pem", self.directory / f"{name}.key")
        _write_key(issued.key_file, key)
        _write(issued.cert_file, certificate.public_bytes(serialization.Encoding.PEM), 0o644)
        return issued

    def client(self, name: str) -> ClientTls:
        """Client settings trusting this CA and presenting a certificate of its own."""
        issued = self.issue(name)
        return ClientTls(
            ca_file=str(self.ca_file),
            cert_file=str(issued.cert_file),
            key_file=str(issued.key_file),
        )


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    data = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    _write(path, data, 0o600)


def _write(path: Path, data: bytes, mode: int) -> None:
    """Write `path` with `mode` from the start (a key is never world-readable, not even
    for a moment), durably."""
    temporary = path.with_name(path.name + ".tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temporary, path)
