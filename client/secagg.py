"""The factory's side of a SecAgg+ session: keys, shares, the masked input, and the unmask answer.

Secrets (the mask private key and the self-mask seed) never leave the agent except as Shamir shares
sealed to individual neighbours. The server is not trusted to run the protocol honestly: every check
below is the factory's own, from its own configuration (`SecAggPolicy`), never from what the server
sends, and a request that breaks one is refused (`SecAggProtocolError`) before anything is revealed:

- the session must have at least ``min_cohort`` share holders, and its threshold t must be above half
  of them plus the tolerated colluders (t > n/2 + c): then no two disjoint groups of honest factories can
  each hand over t shares, so the server cannot collect both secrets of one factory by telling
  different factories different survivor sets (the split-view attack), and c colluders do not change it;
- a neighbour whose public keys are malformed or of low order is treated as dropped, never a crash;
- the factory masks once per session, and only when the neighbours it is told are alive, plus itself,
  reach the threshold (so its masked input never carries only its self mask);
- it answers the unmask request once, only after masking, and only if the survivors are a subset of the
  set it masked with (and at least t of them), the dropped factories are among the neighbours it masked
  with, and the two sets are disjoint.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np

from common.secagg.messages import Keys
from common.secagg.primitives import (
    ShareBoxError,
    SharePair,
    agree,
    expand_mask,
    new_keypair,
    open_box,
    private_bytes,
    seal,
    seed_commitment,
    self_mask_seed,
    share_secret,
)
from common.secagg.terms import bind

log = logging.getLogger(__name__)


class SecAggProtocolError(ValueError):
    """A request that an honest server would never send (e.g. asks to unmask one factory twice over)."""


@dataclass(frozen=True)
class SecAggPolicy:
    """The factory's own limits on any session it takes part in (`fedforge client --secagg-*`)."""

    min_cohort: int = 3  # share holders (neighbours + itself) below this: refused
    colluders: int = 0  # tolerated colluding factories: the threshold must exceed n/2 + colluders

    def __post_init__(self) -> None:
        if self.min_cohort < 3 or self.colluders < 0:
            raise ValueError(f"--secagg-min-cohort must be >= 3 and --secagg-colluders >= 0, got {self.min_cohort}, {self.colluders}")

    def check(self, threshold: int, holders: int) -> None:
        if holders < self.min_cohort:
            raise SecAggProtocolError(f"a session of {holders} share holders is below this factory's minimum cohort of {self.min_cohort}")
        if not threshold > holders / 2 + self.colluders:
            raise SecAggProtocolError(f"threshold {threshold} is not above half of the {holders} share holders plus {self.colluders} tolerated "
                                      f"colluders: a server could collect both secrets of one factory")


@dataclass
class SecAggClient:
    session: bytes
    slot: int
    threshold: int
    policy: SecAggPolicy = field(default_factory=SecAggPolicy)
    created: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        if self.threshold < 2:
            raise SecAggProtocolError(f"threshold {self.threshold}: with t < 2 every Shamir share is the secret itself")
        self._enc_sk, self._enc_pk = new_keypair()
        self._mask_sk, self._mask_pk = new_keypair()
        self._seed = self_mask_seed()
        self.neighbors: list[int] = []
        self._box_keys: dict[int, bytes] = {}  # per neighbour: the share-box key and the pairwise mask key, agreed once
        self._pair_keys: dict[int, bytes] = {}
        self.received: dict[int, SharePair] = {}  # sender slot -> the shares it gave us
        self.rejected: dict[int, str] = {}  # sender slot -> why its box (or keys) were refused
        self.masked_with: list[int] | None = None  # None until the masked input was made (once per session)
        self.answered_unmask = False

    # stage 1 -------------------------------------------------------------------------------
    def advertise(self) -> Keys:
        """Public keys, and a commitment to the self-mask seed (the server checks the seed it recovers against it)."""
        return Keys(self._enc_pk, self._mask_pk, seed_commitment(self._seed, self.session, self.slot))

    # stage 2 -------------------------------------------------------------------------------
    def share_keys(self, neighbors: list[int], enc_pks: list[bytes], mask_pks: list[bytes]) -> dict[int, bytes]:
        """Shamir-share the mask key and self-mask seed among the neighbours (and self); seal each share."""
        if self.neighbors:
            raise SecAggProtocolError("this session's keys were already shared")
        if self.slot in neighbors or len(set(neighbors)) != len(neighbors) or not (len(neighbors) == len(enc_pks) == len(mask_pks)):
            raise SecAggProtocolError("the neighbour list must not contain this factory or duplicates, and have one key pair each")
        usable = []
        for v, enc, mask in zip(neighbors, enc_pks, mask_pks):
            try:  # agreeing is the check: a wrong-size or low-order key (an all-zero shared secret) raises ValueError
                self._box_keys[v] = agree(self._enc_sk, enc, b"enc", self.session, self.slot, v)
                self._pair_keys[v] = agree(self._mask_sk, mask, b"mask", self.session, self.slot, v)
            except (ValueError, TypeError) as exc:
                self._box_keys.pop(v, None)
                self.rejected[v] = f"unusable public keys: {exc}"
                log.warning("secagg %s: slot %d advertised unusable keys (%s); treating it as dropped", self.session.decode(), v, exc)
                continue
            usable.append(v)
        holders = sorted([*usable, self.slot])
        self.policy.check(self.threshold, len(holders))
        self.neighbors = sorted(usable)
        key_shares = share_secret(private_bytes(self._mask_sk), self.threshold, len(holders))
        seed_shares = share_secret(self._seed, self.threshold, len(holders))
        boxes = {}
        for holder, (index, key_share), (_, seed_share) in zip(holders, key_shares, seed_shares):
            pair = SharePair(self.slot, holder, index, key_share, seed_share)
            if holder == self.slot:
                self.received[self.slot] = pair
                continue
            boxes[holder] = seal(pair, self._box_keys[holder], self.session)
        return boxes

    def honest_inputs(self) -> int:
        """The fewest inputs of honest factories, this one included, in any sum of this session the server can unmask.

        This factory unmasks only sums with at least ``threshold`` survivors of its neighbourhood (``unmask``), the
        threshold it checked against its own policy when it shared its keys, and at most ``colluders`` of them collude
        with the server: so ``threshold - colluders``. A factory that shares the DP noise of the sum (``--dp-secure-sum``)
        adds 1 / this of it (client.trainer). Known only once the keys were shared and the policy checked."""
        if not self.neighbors:
            raise SecAggProtocolError("keys were never shared in this session: its threshold was not checked yet")
        return self.threshold - self.policy.colluders

    # stage 3 -------------------------------------------------------------------------------
    def receive_boxes(self, boxes: dict[int, bytes]) -> None:
        """Open the share boxes routed to us; a bad box counts as that sender dropping out for us."""
        neighbors = set(self.neighbors)
        for sender, box in boxes.items():
            if sender not in neighbors:
                self.rejected[sender] = "not a neighbour"
                continue
            try:
                self.received[sender] = open_box(bytes(box), self._box_keys[sender], self.session, sender, self.slot)
            except (ShareBoxError, ValueError, TypeError) as exc:
                self.rejected[sender] = str(exc)
                log.warning("secagg %s: %s; treating slot %d as dropped for this pair", self.session.decode(), exc, sender)

    def mask(self, encoded: np.ndarray, alive: list[int], terms: bytes) -> np.ndarray:
        """Add the self mask and the signed pairwise masks with neighbours still in the session (once per session).

        Each pairwise mask is bound to ``terms``, the digest of the round's terms this factory received
        (`common.secagg.terms`): it cancels only against a neighbour that received the same."""
        if encoded.dtype != np.uint64:
            raise TypeError("mask() takes a fixed-point uint64 vector")
        if self.masked_with is not None:
            raise SecAggProtocolError("this session's masked input was already made: masking twice would reveal the difference of two inputs")
        if not self.neighbors:
            raise SecAggProtocolError("keys were never shared in this session")
        masked_with = [v for v in self.neighbors if v in set(alive)]
        if len(masked_with) + 1 < self.threshold:
            raise SecAggProtocolError(f"told to mask with {len(masked_with)} neighbours: with itself that is below the threshold {self.threshold}")
        n = len(encoded)
        masked = encoded + expand_mask(self._seed, n)
        for v in masked_with:  # in place: one vector for the whole sum, in Z_2^64 (uint64 wraps)
            (np.add if self.slot < v else np.subtract)(masked, expand_mask(bind(self._pair_keys[v], terms), n), out=masked)
        self.masked_with = masked_with
        return masked

    # stage 4 -------------------------------------------------------------------------------
    def unmask(self, survivors: list[int], dropped: list[int]) -> tuple[dict[int, tuple[int, bytes]], dict[int, tuple[int, bytes]]]:
        """Seed shares of survivors and mask-key shares of dropped factories, never both for one factory."""
        if self.answered_unmask:
            raise SecAggProtocolError("this session's unmask request was already answered")
        if self.masked_with is None:
            raise SecAggProtocolError("asked to unmask before this factory made its masked input")
        s, d = set(survivors), set(dropped)
        if s & d:
            raise SecAggProtocolError(f"slots {sorted(s & d)} are claimed both to have survived and to have dropped")
        if self.slot not in s:
            raise SecAggProtocolError("asked to unmask a session this factory is told it dropped out of")
        neighbours = set(self.neighbors)
        if len((s & neighbours) | {self.slot}) < self.threshold:
            raise SecAggProtocolError(f"only {len((s & neighbours) | {self.slot})} survivors in this factory's neighbourhood, below the "
                                      f"threshold {self.threshold}")
        if outside := sorted((s & neighbours) - set(self.masked_with)):
            raise SecAggProtocolError(f"slots {outside} are called survivors but this factory did not mask with them")
        if unknown := sorted(d - set(self.masked_with)):
            raise SecAggProtocolError(f"slots {unknown} are called dropped but this factory did not mask with them")
        self.answered_unmask = True
        seeds = {u: (p.share_index, p.seed_share) for u, p in self.received.items() if u in s}
        keys = {u: (p.share_index, p.mask_key_share) for u, p in self.received.items() if u in d}
        return seeds, keys


class SecAggSessions:
    """The agent's open sessions, by session id; old ones expire so secrets do not linger."""

    def __init__(self, policy: SecAggPolicy | None = None, ttl_seconds: float = 3600.0) -> None:
        self.policy = policy or SecAggPolicy()
        self.ttl = ttl_seconds
        self._sessions: dict[bytes, SecAggClient] = {}

    def start(self, session: bytes, slot: int, threshold: int) -> SecAggClient:
        self._expire()
        if session in self._sessions:
            raise SecAggProtocolError(f"session {session.decode()} already started: a replayed setup is refused")
        client = self._sessions[session] = SecAggClient(session, slot, threshold, self.policy)
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
