"""``fedforge certs``: a private CA, the central site's TLS certificate, and factory identity keys.

- ``ca.pem`` / ``ca.key``: the federation's CA (ECDSA P-256); factories pin ``ca.pem``.
- ``server.pem`` / ``server.key``: the SuperLink's (and registry's) certificate, with the SANs the
  factories dial (DNS names and IP addresses).
- ``factories/<name>`` / ``<name>.pub``: a factory's SuperNode authentication key pair (ECDSA P-384,
  OpenSSH format, what ``flower-supernode --auth-supernode-private-key`` expects).
Private keys are written with mode 0600 and never overwritten.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def create_ca(directory: Path, days: int = 3650) -> tuple[Path, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = directory / "ca.pem", directory / "ca.key"
    if cert_path.exists():
        return cert_path, key_path
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "FedForge federation CA")])
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    _write_private(key_path, _pem_key(key))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path


def create_server_cert(directory: Path, sans: list[str], days: int = 825) -> tuple[Path, Path]:
    """A serverAuth certificate signed by the CA in ``directory`` covering every address in ``sans``."""
    if not sans:
        raise ValueError("the server certificate needs at least one SAN: the names or addresses factories dial")
    # The Fleet proxy (nginx) reaches the SuperLink on loopback and verifies it by name: loopback is always covered.
    sans = list(dict.fromkeys([*sans, "127.0.0.1", "localhost"]))
    ca_cert = x509.load_pem_x509_certificate((directory / "ca.pem").read_bytes())
    ca_key = serialization.load_pem_private_key((directory / "ca.key").read_bytes(), password=None)
    cert_path, key_path = directory / "server.pem", directory / "server.key"
    if key_path.exists():
        raise FileExistsError(f"{key_path} exists; remove server.pem/server.key to issue a new server certificate")
    names: list[x509.GeneralName] = []
    for san in sans:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(san)))
        except ValueError:
            names.append(x509.DNSName(san))
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, sans[0])]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(ca_key, hashes.SHA256()))  # type: ignore[arg-type]
    _write_private(key_path, _pem_key(key))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path


def create_factory_key(directory: Path, name: str) -> tuple[Path, Path]:
    """A SuperNode authentication key pair (ECDSA P-384, OpenSSH format) for factory ``name``."""
    if not name or not all(c.isalnum() or c in "-_." for c in name):
        raise ValueError(f"factory name {name!r}: use letters, digits, '-', '_' or '.'")
    folder = directory / "factories"
    folder.mkdir(parents=True, exist_ok=True)
    key_path, pub_path = folder / name, folder / f"{name}.pub"
    if key_path.exists():
        raise FileExistsError(f"{key_path} exists; a factory keeps its identity")
    key = ec.generate_private_key(ec.SECP384R1())
    _write_private(key_path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()))
    pub_path.write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH) + b"\n")
    return key_path, pub_path
