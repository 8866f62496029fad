"""The factory's side of a SecAgg+ session: keys, shares, the masked input, and the unmask answer.

Secrets (the mask private key and the self-mask seed) never leave the agent except as Shamir shares
sealed to individual neighbours. The answer to the unmask request is checked so that the server can
never obtain both the self-mask seed and the mask key of the same factory (which would unmask it).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np

from common.secagg.primitives import (
    ShareBoxError,
    SharePair,
    agree,
    expand_mask,
    new_keypair,
    open_box,
    private_bytes,
    seal,
    self_mask_seed,
    share_secret,
)

log = logging.getLogger(__name__)


class SecAggProtocolError(ValueError):
    """A request that an honest server would never send (e.g. asks to unmask one factory twice over)."""


@dataclass
class SecAggClient:
    session: bytes
    slot: int
    threshold: int
    created: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self._enc_sk, self._enc_pk = new_keypair()
        self._mask_sk, self._mask_pk = new_keypair()
        self._seed = self_mask_seed()
        self.neighbors: list[int] = []
        self.mask_pks: dict[int, bytes] = {}
        self.enc_pks: dict[int, bytes] = {}
        self.received: dict[int, SharePair] = {}  # sender slot -> the shares it gave us
        self.rejected: dict[int, str] = {}  # sender slot -> why its box was refused
        self.masked_with: list[int] = []
        self.answered_unmask = False

    # stage 1 -------------------------------------------------------------------------------
    def advertise(self) -> dict[str, bytes]:
        return {"enc-pk": self._enc_pk, "mask-pk": self._mask_pk}

    # stage 2 -------------------------------------------------------------------------------
    def share_keys(self, neighbors: list[int], enc_pks: list[bytes], mask_pks: list[bytes]) -> dict[int, bytes]:
        """Shamir-share the mask key and self-mask seed among the neighbours (and self); seal each share."""
        if self.slot in neighbors or len(set(neighbors)) != len(neighbors):
            raise SecAggProtocolError("the neighbour list must not contain this factory or duplicates")
        holders = sorted([*neighbors, self.slot])
        if self.threshold > len(holders):
            raise SecAggProtocolError(f"threshold {self.threshold} exceeds the {len(holders)} share holders")
        self.neighbors = sorted(neighbors)
        self.enc_pks = dict(zip(neighbors, enc_pks))
        self.mask_pks = dict(zip(neighbors, mask_pks))
        key_shares = share_secret(private_bytes(self._mask_sk), self.threshold, len(holders))
        seed_shares = share_secret(self._seed, self.threshold, len(holders))
        boxes = {}
        for holder, (index, key_share), (_, seed_share) in zip(holders, key_shares, seed_shares):
            pair = SharePair(self.slot, holder, index, key_share, seed_share)
            if holder == self.slot:
                self.received[self.slot] = pair
                continue
            key = agree(self._enc_sk, self.enc_pks[holder], b"enc", self.session, self.slot, holder)
            boxes[holder] = seal(pair, key, self.session)
        return boxes

    # stage 3 -------------------------------------------------------------------------------
    def receive_boxes(self, boxes: dict[int, bytes]) -> None:
        """Open the share boxes routed to us; a bad box counts as that sender dropping out for us."""
        for sender, box in boxes.items():
            if sender not in self.enc_pks:
                self.rejected[sender] = "not a neighbour"
                continue
            key = agree(self._enc_sk, self.enc_pks[sender], b"enc", self.session, self.slot, sender)
            try:
                self.received[sender] = open_box(box, key, self.session, sender, self.slot)
            except ShareBoxError as exc:
                self.rejected[sender] = str(exc)
                log.warning("secagg %s: %s; treating slot %d as dropped for this pair", self.session.decode(), exc, sender)

    def mask(self, encoded: np.ndarray, alive: list[int]) -> np.ndarray:
        """Add the self mask and the signed pairwise masks with neighbours still in the session."""
        if encoded.dtype != np.uint64:
            raise TypeError("mask() takes a fixed-point uint64 vector")
        n = len(encoded)
        masked = encoded + expand_mask(self._seed, n)
        self.masked_with = [v for v in self.neighbors if v in set(alive)]
        for v in self.masked_with:
            pair_mask = expand_mask(agree(self._mask_sk, self.mask_pks[v], b"mask", self.session, self.slot, v), n)
            masked = masked + pair_mask if self.slot < v else masked - pair_mask
        return masked

    # stage 4 -------------------------------------------------------------------------------
    def unmask(self, survivors: list[int], dropped: list[int]) -> tuple[dict[int, tuple[int, bytes]], dict[int, tuple[int, bytes]]]:
        """Seed shares of survivors and mask-key shares of dropped factories, never both for one factory."""
        if self.answered_unmask:
            raise SecAggProtocolError("this session's unmask request was already answered")
        s, d = set(survivors), set(dropped)
        if s & d:
            raise SecAggProtocolError(f"slots {sorted(s & d)} are claimed both to have survived and to have dropped")
        if self.slot not in s:
            raise SecAggProtocolError("asked to unmask a session this factory is told it dropped out of")
        if len(s) < self.threshold:
            raise SecAggProtocolError(f"only {len(s)} survivors, below the threshold {self.threshold}")
        unknown = (d - set(self.neighbors))
        if unknown:
            raise SecAggProtocolError(f"slots {sorted(unknown)} are not neighbours of this factory")
        self.answered_unmask = True
        seeds = {u: (p.share_index, p.seed_share) for u, p in self.received.items() if u in s}
        keys = {u: (p.share_index, p.mask_key_share) for u, p in self.received.items() if u in d}
        return seeds, keys


class SecAggSessions:
    """The agent's open sessions, by session id; old ones expire so secrets do not linger."""

    def __init__(self, ttl_seconds: float = 3600.0) -> None:
        self.ttl = ttl_seconds
        self._sessions: dict[bytes, SecAggClient] = {}

    def start(self, session: bytes, slot: int, threshold: int) -> SecAggClient:
        self._expire()
        if session in self._sessions:
            raise SecAggProtocolError(f"session {session.decode()} already started: a replayed setup is refused")
        client = self._sessions[session] = SecAggClient(session, slot, threshold)
        return client

    def get(self, session: bytes) -> SecAggClient:
        self._expire()
        if session not in self._sessions:
            raise SecAggProtocolError(f"unknown or expired secure-aggregation session {session.decode()!r}")
        return self._sessions[session]

    def _expire(self) -> None:
        now = time.monotonic()
        for key in [k for k, c in self._sessions.items() if now - c.created > self.ttl]:
            del self._sessions[key]

    def __len__(self) -> int:
        return len(self._sessions)

