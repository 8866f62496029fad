"""The server's side of SecAgg+: routes keys and share boxes, and unmasks only the *sum*.

`SecureSum` is transport-free: each stage takes the factories' replies and says what to send next.
It never receives an unmasked input: `add_masked_input` takes masked Z_{2^64} vectors, and the only
vector it can decode is their sum after every mask has been removed (`result`). Share boxes are
opaque ciphertexts to it (sealed between factories with keys it does not have).
"""

from __future__ import annotations

import itertools
import logging
import math
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property, lru_cache

import numpy as np

from common.secagg.messages import Advertise, Boxes, Keys, MessageError, Share
from common.secagg.primitives import (
    SHARE_BYTES,
    X25519PrivateKey,
    agree,
    check_public_key,
    expand_mask,
    public_bytes,
    recover_secret,
    seed_commitment,
)
from common.secagg.terms import bind

log = logging.getLogger("fedforge.server.secagg")


MAX_SHARE_SUBSETS = 64  # subsets of t shares tried before a forged share makes a secret unrecoverable


def _well_formed(share: object) -> bool:
    return (isinstance(share, tuple) and len(share) == 2 and isinstance(share[0], int) and 0 < share[0] < 2**31
            and isinstance(share[1], bytes) and len(share[1]) == SHARE_BYTES)


class SecAggAborted(RuntimeError):
    """Too few factories survived a stage (fewer than the threshold); nothing was learned."""


AUTO_DESIGN_DROPOUT = 0.1  # the dropout rate the automatic degree is sized for
AUTO_FAILURE = 1e-6  # allowed probability that some neighbourhood falls below its threshold at that rate


def default_threshold(neighbourhood: int) -> int:
    """Shares needed to recover a secret when ``secagg-threshold`` is 0: two thirds of a neighbourhood of m factories
    (itself and its neighbours), at least 2; the factories' own floor (more than half of it) accepts it."""
    return max(2, math.ceil(2 * neighbourhood / 3))


def _short_of_threshold(neighbourhood: int, dropout: float) -> float:
    """P[fewer than the default threshold of a neighbourhood of m survive], each dropping independently."""
    need = default_threshold(neighbourhood)
    alive = 1.0 - dropout
    return math.fsum(math.comb(neighbourhood, i) * alive**i * dropout ** (neighbourhood - i) for i in range(need))


@lru_cache(maxsize=256)
def auto_degree(n: int, dropout: float = AUTO_DESIGN_DROPOUT, failure: float = AUTO_FAILURE) -> int:
    """The automatic ``secagg-degree`` for ``n`` factories: 0 (complete graph) unless a sparse graph halves the cost.

    SecAgg+ (Bell et al. 2020) needs each neighbourhood, not the round, to keep a threshold of survivors.
    The smallest even degree k for which, with every factory dropping independently at ``dropout``, the
    union bound n * P[a neighbourhood of k + 1 keeps fewer than ceil(2(k + 1)/3)] stays under ``failure``
    grows with log n (k = 74 at n = 100, 80 at 200, 86 at 1,000 for 10% and 1e-6). A factory's cost (key
    agreements, shares, mask expansions) is proportional to its degree, while a sparse neighbourhood
    tolerates less dropout than the whole round does; so the sparse graph is used only where it at least
    halves the cost (2k <= n - 1, from about 160 factories), and the complete graph below.
    """
    for k in range(2, n - 1, 2):
        if n * _short_of_threshold(k + 1, dropout) <= failure:
            return k if 2 * k <= n - 1 else 0
    return 0


def neighbour_graph(slots: list[int], degree: int) -> dict[int, list[int]]:
    """A random circulant k-regular graph (complete when ``degree >= len(slots) - 1``).

    The order of the ring is drawn with `secrets`, so no factory can choose its neighbours.
    """
    n = len(slots)
    if degree >= n - 1:
        return {u: [v for v in slots if v != u] for u in slots}
    order = list(slots)
    for i in range(n - 1, 0, -1):  # Fisher-Yates with a cryptographic source
        j = secrets.randbelow(i + 1)
        order[i], order[j] = order[j], order[i]
    half = max(1, degree // 2)
    graph = {u: set() for u in slots}
    for i, u in enumerate(order):
        for step in range(1, half + 1):
            v = order[(i + step) % n]
            graph[u].add(v)
            graph[v].add(u)
    return {u: sorted(vs) for u, vs in graph.items()}


@dataclass
class SecureSum:
    session: bytes
    slots: list[int]
    threshold: int
    degree: int
    length: int = 0
    enc_pks: dict[int, bytes] = field(default_factory=dict)
    mask_pks: dict[int, bytes] = field(default_factory=dict)
    seed_commits: dict[int, bytes] = field(default_factory=dict)  # what each recovered self-mask seed must hash to
    graph: dict[int, list[int]] = field(default_factory=dict)
    boxes: dict[int, dict[int, bytes]] = field(default_factory=dict)  # receiver -> sender -> box
    u2: list[int] = field(default_factory=list)
    _masked_total: np.ndarray | None = None
    u3: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not 2 <= self.threshold <= len(self.slots):
            raise ValueError(f"threshold {self.threshold} must be between 2 and the number of factories {len(self.slots)}")

    def _require(self, alive: list[int], stage: str) -> None:
        if len(alive) < self.threshold:
            raise SecAggAborted(f"secure aggregation aborted at {stage}: {len(alive)} factories left, threshold {self.threshold}")

    # stage 1 -> 2 -----------------------------------------------------------------------------
    def add_public_keys(self, keys: dict[int, Keys]) -> dict[int, tuple[list[int], list[bytes], list[bytes]]]:
        """Record each slot's public keys and seed commitment; return for each live factory its neighbours and their keys.

        Malformed or low-order keys, or a missing commitment, leave that slot out of the session (a dropout).
        """
        for slot, advertised in keys.items():
            enc, mask, commit = advertised.enc_pk, advertised.mask_pk, advertised.seed_commit
            try:
                check_public_key(enc)
                check_public_key(mask)
                if not isinstance(commit, bytes) or len(commit) != 32:
                    raise ValueError("no 32-byte seed commitment")
            except ValueError as exc:
                log.warning("slot %d advertised unusable keys (%s); it is left out of the session", slot, exc)
                continue
            self.enc_pks[slot], self.mask_pks[slot], self.seed_commits[slot] = enc, mask, commit
        u1 = sorted(self.enc_pks)
        self._require(u1, "key advertisement")
        degree = min(self.degree, len(u1) - 1)
        if degree + 1 < self.threshold:
            raise SecAggAborted(f"neighbourhood of {degree + 1} cannot reach threshold {self.threshold}")
        self.graph = neighbour_graph(u1, degree)
        return {u: (vs, [self.enc_pks[v] for v in vs], [self.mask_pks[v] for v in vs]) for u, vs in self.graph.items()}

    # stage 2 -> 3 -----------------------------------------------------------------------------
    def add_share_boxes(self, sent: dict[int, dict[int, bytes]]) -> dict[int, dict[int, bytes]]:
        """Route each sealed box to its receiver; factories that sent none have dropped (not in U2)."""
        self.u2 = sorted(u for u, boxes in sent.items() if u in self.graph)
        self._require(self.u2, "share distribution")
        alive = set(self.u2)
        for sender in self.u2:
            for receiver, box in sent[sender].items():
                if receiver in alive and receiver in self.graph[sender]:
                    self.boxes.setdefault(receiver, {})[sender] = box
        return {u: self.boxes.get(u, {}) for u in self.u2}

    # stage 3 -----------------------------------------------------------------------------------
    def add_masked_input(self, slot: int, masked: np.ndarray) -> None:
        """Accumulate one masked vector (uniform in Z_{2^64} to us); only the running sum is kept."""
        if slot not in self.u2 or slot in self.u3:
            raise ValueError(f"slot {slot} cannot send a masked input now")
        if masked.dtype != np.uint64 or masked.ndim != 1 or (self.length and len(masked) != self.length):
            raise ValueError(f"slot {slot} sent a malformed masked vector ({masked.dtype}, {masked.shape})")
        self.length = len(masked)
        self._masked_total = masked.copy() if self._masked_total is None else self._masked_total + masked
        self.u3.append(slot)

    def unmask_request(self) -> tuple[list[int], list[int]]:
        """(survivors, dropped): whose self-mask seeds and whose mask keys the survivors must reveal."""
        self.u3.sort()
        self._require(self.u3, "masked input")
        return self.u3, sorted(set(self.u2) - set(self.u3))

    # stage 4 -----------------------------------------------------------------------------------
    def result(self, answers: dict[int, tuple[dict[int, tuple[int, bytes]], dict[int, tuple[int, bytes]]]], terms: bytes) -> np.ndarray:
        """Remove every mask from the sum of masked inputs; returns sum_{u in U3} x_u in Z_{2^64}.

        ``terms``: the digest of the round's terms the server sent (`common.secagg.terms`); the pairwise masks of dropped
        factories are rebuilt under it, as the factories built them under what they received.

        Every recovered secret is checked before it is used: a self-mask seed against the commitment its
        owner advertised, a mask key against its advertised public key. A forged or malformed share is
        outvoted by other subsets of the shares when there are enough; it never silently corrupts the sum.
        """
        survivors, dropped = self.unmask_request()
        responders = sorted(u for u in answers if u in set(survivors))
        self._require(responders, "unmasking")
        assert self._masked_total is not None
        total = self._masked_total.copy()
        for u in survivors:
            seed = self._recover(u, [answers[r][0].get(u) for r in responders], "self-mask seed",
                                 lambda secret, u=u: seed_commitment(secret, self.session, u) == self.seed_commits.get(u))
            total -= expand_mask(seed, self.length)
        for d in dropped:
            secret = self._recover(d, [answers[r][1].get(d) for r in responders], "mask key",
                                   lambda secret, d=d: public_bytes(X25519PrivateKey.from_private_bytes(secret)) == self.mask_pks[d])
            key = X25519PrivateKey.from_private_bytes(secret)
            for u in self.graph[d]:
                if u in set(survivors):
                    pair_mask = expand_mask(bind(agree(key, self.mask_pks[u], b"mask", self.session, d, u), terms), self.length)
                    # u added +mask if u < d, else -mask: undo exactly that
                    total = total - pair_mask if u < d else total + pair_mask
        return total

    def _recover(self, slot: int, shares: list[tuple[int, bytes] | None], what: str, valid: Callable[[bytes], bool]) -> bytes:
        usable = [(int(i), s) for share in shares if share is not None and _well_formed(share) for i, s in [share]]
        if len(usable) < self.threshold:
            raise SecAggAborted(f"only {len(usable)} well-formed shares of the {what} of slot {slot} returned, threshold {self.threshold}")
        for combo in itertools.islice(itertools.combinations(usable, self.threshold), MAX_SHARE_SUBSETS):
            try:
                secret = recover_secret(list(combo))
            except (ValueError, TypeError):
                continue
            if valid(secret):
                return secret
        raise SecAggAborted(f"no {self.threshold} of the {len(usable)} shares of the {what} of slot {slot} reproduce what it advertised: "
                            f"forged shares; nothing was unmasked")


@dataclass
class SessionMembers:
    """A session and the Flower node behind each of its slots."""

    secure: SecureSum
    node_of: dict[int, int]  # slot -> Flower node id

    @cached_property
    def slot_of(self) -> dict[int, int]:
        return {node: slot for slot, node in self.node_of.items()}


@dataclass
class KeyedSession(SessionMembers):
    """A session past key advertisement and share distribution: ready for masked inputs.

    Keeping it between rounds is what lets a round skip its own two key phases: the next round's keys
    ride on this round's train message and its share boxes on this round's unmask message.
    """

    routed: dict[int, dict[int, bytes]] = field(default_factory=dict)  # receiver slot -> sender slot -> sealed share box

    def covers(self, nodes: list[int]) -> bool:
        """Whether every node that may take part holds shares in this session (else keys are exchanged afresh)."""
        return set(nodes) <= {self.node_of[s] for s in self.secure.u2}


@dataclass
class KeyExchange(SessionMembers):
    """A session while it is being keyed: the advertise and share requests, and what comes back.

    The same steps serve a round that exchanges its own keys (two message phases of their own) and the
    next round's session keyed on this round's train and unmask messages (pipelining). Answers are by
    Flower node; a node whose answer is missing or malformed is simply not in the session. Raises
    `SecAggAborted` when too few factories remain.
    """

    plan: dict[int, tuple[list[int], list[bytes], list[bytes]]] = field(default_factory=dict)

    @classmethod
    def of(cls, session: bytes, nodes: list[int], threshold: int, degree: int) -> KeyExchange:
        """Slots 1..n in node order; ``degree`` 0 means everyone is everyone's neighbour."""
        node_of = {i + 1: n for i, n in enumerate(nodes)}
        return cls(SecureSum(session, list(node_of), threshold, degree or len(nodes) - 1), node_of)

    def advertise_request(self, node: int) -> dict[str, object]:
        return Advertise(self.secure.session.decode(), self.slot_of[node], self.secure.threshold).to_fields()

    def add_public_keys(self, answers: dict[int, dict[str, object]]) -> None:
        """Record the keys that came back and plan the share stage (a malformed answer leaves its node out)."""
        slot_of = self.slot_of
        self.plan = self.secure.add_public_keys({slot_of[n]: keys for n, a in answers.items() if n in slot_of
                                                 and (keys := _parsed(Keys, a, slot_of[n])) is not None})

    def share_request(self, node: int) -> dict[str, object] | None:
        """The share request for ``node``, or None if it did not advertise keys."""
        slot = self.slot_of.get(node)
        if slot not in self.plan:
            return None
        neighbours, enc_pks, mask_pks = self.plan[slot]
        return Share(self.secure.session.decode(), neighbours, enc_pks, mask_pks).to_fields()

    def finish(self, answers: dict[int, dict[str, object]]) -> KeyedSession:
        """Route the share boxes that came back: the session, ready for masked inputs."""
        slot_of = self.slot_of
        routed = self.secure.add_share_boxes({slot_of[n]: boxes.routed() for n, a in answers.items()
                                              if n in slot_of and (boxes := _parsed(Boxes, a, slot_of[n])) is not None})
        return KeyedSession(self.secure, self.node_of, routed)


def _parsed(kind: type, fields: dict[str, object], slot: int):  # type: ignore[no-untyped-def]
    """The typed answer, or None (logged) when it is malformed: that slot then counts as dropped."""
    try:
        return kind.from_fields(fields)
    except MessageError as exc:
        log.warning("slot %d: %s; it is left out of the session", slot, exc)
        return None
