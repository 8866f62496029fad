"""Cryptographic building blocks of FedForge's SecAgg+: keys, masks, shares, sealed share boxes.

X25519 key agreement, HKDF-SHA256, AES-256-GCM and AES-256-CTR come from `cryptography`; Shamir
secret sharing (which `cryptography` does not offer) is the textbook scheme over the prime field
GF(2^521 - 1) with coefficients from `secrets`, and every secret recovered from shares is checked
against what its owner advertised before it is used. Nothing here uses numpy's or Python's `random`:
masks are an AES-256-CTR keystream under a full 256-bit HKDF key, expanded in bulk and viewed as
uint64 words (arithmetic in Z_{2^64}).
"""

from __future__ import annotations

import functools
import os
import secrets
import struct
from dataclasses import dataclass

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

PROTOCOL = b"fedforge/secagg+/v1"
MASK_DTYPE = np.uint64  # masked vectors live in Z_{2^64}


class ShareBoxError(ValueError):
    """A sealed share box failed authentication or does not belong to this (round, sender, receiver)."""


# keys --------------------------------------------------------------------------------------------

def new_keypair() -> tuple[X25519PrivateKey, bytes]:
    private = X25519PrivateKey.generate()
    return private, public_bytes(private)


def public_bytes(private: X25519PrivateKey) -> bytes:
    return private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def private_bytes(private: X25519PrivateKey) -> bytes:
    return private.private_bytes_raw()


def check_public_key(public: bytes) -> None:
    """Raise ValueError unless ``public`` is a 32-byte X25519 key that yields a non-zero shared secret.

    A low-order point (e.g. all zeros) would make every agreement with it the all-zero secret, so
    masks and boxes keyed by it would be known to everyone; ``cryptography`` refuses the exchange.
    """
    if not isinstance(public, bytes) or len(public) != 32:
        raise ValueError(f"an X25519 public key is 32 bytes, got {len(public) if isinstance(public, bytes) else type(public).__name__}")
    _checker().exchange(X25519PublicKey.from_public_bytes(public))


@functools.cache
def _checker() -> X25519PrivateKey:
    """Any clamped scalar maps a low-order point to zero, so one key per process serves every check (never for secrets)."""
    return X25519PrivateKey.generate()


def seed_commitment(seed: bytes, session: bytes, slot: int) -> bytes:
    """SHA-256 commitment to a self-mask seed, bound to its session and slot (advertised with the public keys)."""
    from cryptography.hazmat.primitives.hashes import Hash

    h = Hash(hashes.SHA256())
    h.update(PROTOCOL + b"/seed/" + session + struct.pack(">I", slot) + seed)
    return h.finalize()


def _context(purpose: bytes, session: bytes, a: int, b: int) -> bytes:
    lo, hi = sorted((a, b))
    return PROTOCOL + b"/" + purpose + b"/" + session + struct.pack(">II", lo, hi)


def agree(private: X25519PrivateKey, peer_public: bytes, purpose: bytes, session: bytes, a: int, b: int) -> bytes:
    """A 256-bit key shared by slots a and b for one purpose in one session (run and round)."""
    shared = private.exchange(X25519PublicKey.from_public_bytes(peer_public))
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_context(purpose, session, a, b)).derive(shared)


# masks -------------------------------------------------------------------------------------------

def expand_mask(seed: bytes, length: int) -> np.ndarray:
    """``length`` uint64 words of AES-256-CTR keystream under a 32-byte ``seed``.

    Encrypting zeros straight into a preallocated numpy buffer (``update_into``) runs at AES-NI
    speed with no per-element Python; each seed keys exactly one stream, so a zero counter is safe.
    """
    if len(seed) != 32:
        raise ValueError("mask seeds are 32 bytes")
    nbytes = 8 * length
    out = np.empty(nbytes + 15, dtype=np.uint8)
    Cipher(algorithms.AES(seed), modes.CTR(b"\x00" * 16)).encryptor().update_into(np.zeros(nbytes, dtype=np.uint8), out)
    return out[:nbytes].view("<u8").astype(MASK_DTYPE, copy=False)


def self_mask_seed() -> bytes:
    return os.urandom(32)


# Shamir sharing of 32-byte secrets over GF(2^521 - 1) ---------------------------------------------
#
# Textbook Shamir (1979) over the prime field of the Mersenne prime M521 (NIST P-521's field): every
# 32-byte secret is one field element, the random coefficients come from `secrets` (the OS CSPRNG), and
# Python's C big-integer arithmetic does the work. `cryptography` has no secret sharing; PyCryptodome's
# (GF(2^128), pure Python) took 30 s of CPU for one 50-factory session here, 0.1 s with this.
# Recovered secrets are never trusted as such: callers check them against what their owner advertised.

SHAMIR_PRIME = 2**521 - 1
SHARE_BYTES = 66  # ceil(521 / 8)


def share_secret(secret: bytes, threshold: int, holders: int) -> list[tuple[int, bytes]]:
    """Split a 32-byte secret into ``holders`` shares (indices 1..holders); any ``threshold`` recover it."""
    if len(secret) != 32:
        raise ValueError("secrets are 32 bytes")
    if not 1 <= threshold <= holders:
        raise ValueError(f"threshold {threshold} must be between 1 and the number of holders {holders}")
    coefficients = [int.from_bytes(secret, "big"), *(secrets.randbelow(SHAMIR_PRIME) for _ in range(threshold - 1))]
    shares = []
    for x in range(1, holders + 1):
        y = 0
        for c in reversed(coefficients):  # Horner
            y = (y * x + c) % SHAMIR_PRIME
        shares.append((x, y.to_bytes(SHARE_BYTES, "big")))
    return shares


def recover_secret(shares: list[tuple[int, bytes]]) -> bytes:
    """Lagrange interpolation at 0; raises ValueError for malformed or repeated shares, or ones that do not encode
    a 32-byte secret (what random or too few shares nearly always give). A deliberately changed share can still give
    another 32-byte value: callers check every recovered secret against what its owner advertised."""
    xs = [int(i) for i, _ in shares]
    if not shares or len(set(xs)) != len(xs) or any(not 0 < x < SHAMIR_PRIME for x in xs):
        raise ValueError("shares need distinct indices in 1..p-1")
    if any(len(share) != SHARE_BYTES for _, share in shares):
        raise ValueError(f"shares are {SHARE_BYTES} bytes")
    ys = [int.from_bytes(share, "big") for _, share in shares]
    if any(y >= SHAMIR_PRIME for y in ys):
        raise ValueError("a share is not a field element")
    secret = 0
    for i, (xi, yi) in enumerate(zip(xs, ys)):
        numerator = denominator = 1
        for j, xj in enumerate(xs):
            if j != i:
                numerator = numerator * xj % SHAMIR_PRIME
                denominator = denominator * (xj - xi) % SHAMIR_PRIME
        secret = (secret + yi * numerator * pow(denominator, -1, SHAMIR_PRIME)) % SHAMIR_PRIME
    if secret >> 256:
        raise ValueError("the shares do not encode a 32-byte secret")
    return secret.to_bytes(32, "big")


# sealed share boxes ----------------------------------------------------------------------------

@dataclass(frozen=True)
class SharePair:
    """What slot ``sender`` gives slot ``receiver``: a share of its mask key and of its self-mask seed."""

    sender: int
    receiver: int
    share_index: int
    mask_key_share: bytes
    seed_share: bytes


def _aad(session: bytes, sender: int, receiver: int) -> bytes:
    return PROTOCOL + b"/share/" + session + struct.pack(">II", sender, receiver)


def seal(pair: SharePair, key: bytes, session: bytes) -> bytes:
    """AES-256-GCM under the pair's key, bound to (session, sender, receiver) by the associated data."""
    body = struct.pack(">III", pair.sender, pair.receiver, pair.share_index) + pair.mask_key_share + pair.seed_share
    nonce = os.urandom(12)
    return nonce + AESGCM(key).encrypt(nonce, body, _aad(session, pair.sender, pair.receiver))


def open_box(box: bytes, key: bytes, session: bytes, sender: int, receiver: int) -> SharePair:
    """Decrypt and check a share box; raises `ShareBoxError` if tampered, replayed or misrouted."""
    try:
        body = AESGCM(key).decrypt(box[:12], box[12:], _aad(session, sender, receiver))
    except (InvalidTag, ValueError, TypeError) as exc:
        raise ShareBoxError(f"share box from slot {sender} to slot {receiver} failed authentication") from exc
    if len(body) != 12 + 2 * SHARE_BYTES:
        raise ShareBoxError(f"share box from slot {sender} to slot {receiver} holds {len(body)} bytes, not {12 + 2 * SHARE_BYTES}")
    s, r, index = struct.unpack(">III", body[:12])
    if (s, r) != (sender, receiver):
        raise ShareBoxError(f"share box claims ({s}->{r}), expected ({sender}->{receiver})")
    return SharePair(s, r, index, body[12 : 12 + SHARE_BYTES], body[12 + SHARE_BYTES :])


def session_id(run_id: str, server_round: int, phase: str = "fedavg") -> bytes:
    """Binds keys and boxes to one run, round and use, so nothing can be replayed into another."""
    return f"{run_id}|{server_round}|{phase}".encode()
