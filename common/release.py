"""Signed release statements: what may run on the inspection lines, decided by the release key.

A model version is signed when it is created (the registry's signing key, on the central host); that
says "the federation produced these weights", not "serve them". Whether an edge serves a version is
decided by release statements: approve, revoke and rollback, each a canonical-JSON document signed by
a separate *release key* that can live off the central host (``fedforge keys create --name release``).
Every statement carries a release number that only grows, so an edge that has applied release N
ignores any statement numbered N or lower: a registry (or network) that replays an old approval
cannot roll the lines back; only a newer signed statement can.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from common.signing import VerificationError, canonical, sign, verify_document

KIND = "fedforge.release/v1"
ACTIONS = {"approve": "approved", "rollback": "approved", "revoke": "revoked"}


class StatementError(VerificationError):
    """A release statement that must not be acted on (unsigned, forged, replayed or inconsistent)."""


@dataclass(frozen=True)
class Statement:
    release: int
    version_id: str
    sha256: str
    architecture: str
    action: str
    actor: str
    at: str

    @property
    def status(self) -> str:
        return ACTIONS[self.action]

    def document(self) -> dict[str, Any]:
        return {"kind": KIND, "release": self.release, "version_id": self.version_id, "sha256": self.sha256, "architecture": self.architecture,
                "action": self.action, "status": self.status, "actor": self.actor, "at": self.at}


def sign_statement(statement: Statement, key: Ed25519PrivateKey) -> tuple[str, str]:
    """(canonical JSON, signature envelope) for the registry to store and stream to edges."""
    document = statement.document()
    return canonical(document).decode(), sign(document, key)


def new_statement(release: int, version_id: str, sha256: str, architecture: str, action: str, actor: str, at: datetime) -> Statement:
    if action not in ACTIONS:
        raise ValueError(f"unknown release action {action!r}; expected one of {sorted(ACTIONS)}")
    return Statement(release, version_id, sha256, architecture, action, actor, at.isoformat())


def verify_statement(data: bytes, envelope: str, pinned: Ed25519PublicKey) -> Statement:
    """The statement, if the pinned release key signed exactly these bytes; raises `VerificationError` otherwise."""
    if not data or not envelope:
        raise StatementError("the action carries no signed release statement")
    doc = verify_document(data, envelope, pinned, "release statement")
    if doc.get("kind") != KIND or doc.get("action") not in ACTIONS or doc.get("status") != ACTIONS.get(doc.get("action", "")):
        raise StatementError(f"release statement is not a {KIND} document with a known action: {doc}")
    try:
        statement = Statement(int(doc["release"]), str(doc["version_id"]), str(doc["sha256"]), str(doc["architecture"]), str(doc["action"]),
                              str(doc["actor"]), str(doc["at"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise StatementError(f"release statement lacks a field: {exc}") from exc
    if statement.release < 1:
        raise StatementError(f"release number {statement.release} must be positive")
    return statement
