"""Signed model manifests: the central site signs, edge nodes verify against a pinned public key.

A manifest is canonical JSON (sorted keys, no whitespace, UTF-8) of a version's metadata including
the sha256 of its weights file. The signature envelope names the signer's key id (sha256 of the raw
public key), so a wrong key is told apart from a tampered manifest.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey


class VerificationError(RuntimeError):
    """A model artifact failed verification; never load it."""


class WrongKeyError(VerificationError):
    """Signed by a key other than the pinned one."""


class TamperedManifestError(VerificationError):
    """The manifest does not match its signature."""


class TamperedWeightsError(VerificationError):
    """The weights do not match the sha256 in the (valid) manifest."""


class TruncatedDownloadError(VerificationError):
    """Fewer bytes than the manifest announces."""


def canonical(manifest: dict[str, Any]) -> bytes:
    return json.dumps(manifest, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def key_id(public: Ed25519PublicKey) -> str:
    return hashlib.sha256(public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)).hexdigest()[:32]


def sign(manifest: dict[str, Any], private: Ed25519PrivateKey) -> str:
    """A JSON envelope {key_id, signature(hex)} over the canonical manifest."""
    return json.dumps({"key_id": key_id(private.public_key()), "signature": private.sign(canonical(manifest)).hex()}, sort_keys=True)


def verify_document(data: bytes, envelope: str, pinned: Ed25519PublicKey, what: str = "manifest") -> dict[str, Any]:
    """Check a signed canonical-JSON document (a model manifest, a release statement) against a pinned key."""
    try:
        env = json.loads(envelope)
        signature = bytes.fromhex(env["signature"])
    except (ValueError, KeyError, TypeError) as exc:
        raise TamperedManifestError(f"signature envelope of the {what} is malformed: {exc}") from exc
    if env.get("key_id") != key_id(pinned):
        raise WrongKeyError(f"{what} signed by key {env.get('key_id')}, but this node pins key {key_id(pinned)}")
    try:
        pinned.verify(signature, data)
    except InvalidSignature as exc:
        raise TamperedManifestError(f"{what} signature is invalid: the {what} was altered after signing") from exc
    try:
        document = json.loads(data)
    except ValueError as exc:
        raise TamperedManifestError(f"{what} is not JSON: {exc}") from exc
    if not isinstance(document, dict) or canonical(document) != data:
        raise TamperedManifestError(f"{what} is not in canonical form")
    return document


def verify_manifest(manifest_bytes: bytes, envelope: str, pinned: Ed25519PublicKey) -> dict[str, Any]:
    return verify_document(manifest_bytes, envelope, pinned, "manifest")


def verify_weights(blob_path: Path, manifest: dict[str, Any]) -> None:
    size = blob_path.stat().st_size
    if size < int(manifest["size_bytes"]):
        raise TruncatedDownloadError(f"{blob_path}: {size} of {manifest['size_bytes']} bytes")
    digest = hashlib.sha256()
    with open(blob_path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    if size != int(manifest["size_bytes"]) or digest.hexdigest() != manifest["sha256"]:
        raise TamperedWeightsError(f"{blob_path}: sha256 {digest.hexdigest()} does not match the signed {manifest['sha256']}")


# key files ---------------------------------------------------------------------------------------

def create_keypair(directory: str | Path, name: str = "signing") -> tuple[Path, Path]:
    """Write ``name.key`` (PKCS8 PEM, mode 0600) and ``name.pub`` (PEM); refuses to overwrite."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    key_path, pub_path = directory / f"{name}.key", directory / f"{name}.pub"
    if key_path.exists():
        raise FileExistsError(f"{key_path} exists; refusing to replace a signing key (edge nodes pin its public half)")
    private = Ed25519PrivateKey.generate()
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    pub_path.write_bytes(private.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return key_path, pub_path


def load_private(path: str | Path) -> Ed25519PrivateKey:
    key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise TypeError(f"{path} is not an Ed25519 private key")
    return key


def load_public(path: str | Path) -> Ed25519PublicKey:
    key = serialization.load_pem_public_key(Path(path).read_bytes())
    if not isinstance(key, Ed25519PublicKey):
        raise TypeError(f"{path} is not an Ed25519 public key")
    return key
