"""The secure-aggregation messages, typed: one schema for the server, the ClientApp and the edge agent.

Each stage's request and answer is a frozen dataclass whose fields name their wire key; `to_fields`
gives the plain dict that travels as a Flower ConfigRecord (server <-> ClientApp) and as `Value`s
over the agent's gRPC channel (`common.secagg.wire`), and `from_fields` rebuilds it, refusing a
missing or mistyped field with an error that names the stage and the field. The protocol's policy
checks (threshold floor, mask once, unmask subset, ...) act on these objects in `client.secagg`
(factory) and `server.secure_sum` (server).

| stage | server sends | factory answers |
| --- | --- | --- |
| advertise | `Advertise` | `Keys` |
| share | `Share` | `Boxes` |
| masked input (rides on train / evaluate) | `MaskedInput` | the masked vector (an array record) |
| unmask | `Unmask` | `Shares` |

Pipelining: the next session's advertise (or share) request rides on this phase's masked input (or
unmask) request under `next/` keys of the same record, and its answer rides under `next/` keys of the
reply's `info` record (`with_next`, `split_next`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Self

from common.secagg.layout import SecureLayout
from common.secagg.terms import round_terms

RECORD = "secagg"  # the ConfigRecord (and gRPC map) that carries this phase's message
NEXT = "next/"  # key prefix of the next session's stage riding on this phase's message (pipelined key exchange)
STAGES = ("advertise", "share", "unmask")  # stages with a message of their own (`query.secagg_<stage>`)


def with_next(fields: Mapping[str, Any], ahead: Mapping[str, Any]) -> dict[str, Any]:
    """``fields`` with the next session's stage (or its answer) riding along under the ``next/`` prefix.

    It rides inside a record the message has anyway, not in a record of its own: Flower moves every record
    as its own object, one request at every hop, and a secure round's second phase is bound by such requests
    (docs/benchmarks.md).
    """
    return {**fields, **{NEXT + key: value for key, value in ahead.items()}}


def split_next(fields: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(this phase's own fields, the next session's riding stage without its prefix); the latter empty if none rode."""
    own = {k: v for k, v in fields.items() if not k.startswith(NEXT)}
    return own, {k.removeprefix(NEXT): v for k, v in fields.items() if k.startswith(NEXT)}


class MessageError(ValueError):
    """A secure-aggregation message with a missing or mistyped field: treated as that factory dropping out."""


def _wire(name: str, kind: str) -> dict[str, str]:
    """A field's wire key and its kind (int, float, str, bytes, ints, blobs), kept in the dataclass field's metadata."""
    return {"wire": name, "kind": kind}


_CHECKS = {
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "bytes": lambda v: isinstance(v, bytes),
    "ints": lambda v: isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v),
    "blobs": lambda v: isinstance(v, list) and all(isinstance(x, bytes) for x in v),
}


class _Message:
    stage: ClassVar[str]

    def to_fields(self) -> dict[str, Any]:
        out = {f.metadata["wire"]: getattr(self, f.name) for f in fields(self) if "wire" in f.metadata}  # type: ignore[arg-type]
        return {k: (float(v) if isinstance(v, int) and self._kind(k) == "float" else v) for k, v in out.items()}

    @classmethod
    def _kind(cls, wire: str) -> str:
        return next(f.metadata["kind"] for f in fields(cls) if f.metadata.get("wire") == wire)  # type: ignore[arg-type]

    @classmethod
    def from_fields(cls, values: Mapping[str, Any], **extra: Any) -> Self:
        kwargs = dict(extra)
        for f in fields(cls):  # type: ignore[arg-type]
            if "wire" not in f.metadata:
                continue
            key, kind = f.metadata["wire"], f.metadata["kind"]
            if key not in values:
                raise MessageError(f"secagg {cls.stage}: field {key!r} is missing")
            value = values[key]
            if isinstance(value, tuple):
                value = list(value)
            if not _CHECKS[kind](value):
                raise MessageError(f"secagg {cls.stage}: field {key!r} must be {kind}, got {type(value).__name__}")
            kwargs[f.name] = float(value) if kind == "float" else value
        return cls(**kwargs)


@dataclass(frozen=True)
class Advertise(_Message):
    """Stage 1, server -> factory: open a session in which this factory holds ``slot``."""

    stage: ClassVar[str] = "advertise"
    session: str = field(metadata=_wire("session", "str"))
    slot: int = field(metadata=_wire("slot", "int"))
    threshold: int = field(metadata=_wire("threshold", "int"))


@dataclass(frozen=True)
class Keys(_Message):
    """Stage 1, factory -> server: two X25519 public keys and a commitment to the self-mask seed."""

    stage: ClassVar[str] = "advertise"
    enc_pk: bytes = field(metadata=_wire("enc-pk", "bytes"))
    mask_pk: bytes = field(metadata=_wire("mask-pk", "bytes"))
    seed_commit: bytes = field(metadata=_wire("seed-commit", "bytes"))


@dataclass(frozen=True)
class Share(_Message):
    """Stage 2, server -> factory: its neighbours in the session's graph and their public keys."""

    stage: ClassVar[str] = "share"
    session: str = field(metadata=_wire("session", "str"))
    neighbors: list[int] = field(metadata=_wire("neighbors", "ints"))
    enc_pks: list[bytes] = field(metadata=_wire("enc-pks", "blobs"))
    mask_pks: list[bytes] = field(metadata=_wire("mask-pks", "blobs"))

    def __post_init__(self) -> None:
        if not len(self.neighbors) == len(self.enc_pks) == len(self.mask_pks):
            raise MessageError("secagg share: 'neighbors', 'enc-pks' and 'mask-pks' differ in length")


@dataclass(frozen=True)
class Boxes(_Message):
    """Stage 2, factory -> server: one sealed share pair per neighbour, for the server to route."""

    stage: ClassVar[str] = "share"
    to: list[int] = field(metadata=_wire("to", "ints"))
    boxes: list[bytes] = field(metadata=_wire("boxes", "blobs"))

    def __post_init__(self) -> None:
        if len(self.to) != len(self.boxes):
            raise MessageError("secagg share: 'to' and 'boxes' differ in length")

    @classmethod
    def of(cls, boxes: Mapping[int, bytes]) -> Boxes:
        return cls(list(boxes), list(boxes.values()))

    def routed(self) -> dict[int, bytes]:
        return dict(zip(self.to, self.boxes, strict=True))


@dataclass(frozen=True)
class MaskedInput(_Message):
    """Stage 3, server -> factory (on the train or evaluate message): the boxes routed to it, the live set, and how
    to encode its contribution (clip, fixed-point scale, weight cap, the secure vector's layout)."""

    stage: ClassVar[str] = "masked input"
    session: str = field(metadata=_wire("session", "str"))
    alive: list[int] = field(metadata=_wire("alive", "ints"))
    clip: float = field(metadata=_wire("clip", "float"))
    scale: float = field(metadata=_wire("scale", "float"))
    max_weight: int = field(metadata=_wire("max-weight", "int"))
    senders: list[int] = field(metadata=_wire("from", "ints"))
    boxes: list[bytes] = field(metadata=_wire("boxes", "blobs"))
    layout: SecureLayout = field(default=None)  # type: ignore[assignment]  # travels as its own fields

    def __post_init__(self) -> None:
        if len(self.senders) != len(self.boxes):
            raise MessageError("secagg masked input: 'from' and 'boxes' differ in length")

    def to_fields(self) -> dict[str, Any]:
        return {**super().to_fields(), **self.layout.fields()}

    @classmethod
    def from_fields(cls, values: Mapping[str, Any], **extra: Any) -> MaskedInput:
        try:
            layout = SecureLayout.from_fields(values)
        except (TypeError, ValueError) as exc:
            raise MessageError(f"secagg masked input: malformed layout: {exc}") from exc
        return super().from_fields(values, layout=layout, **extra)

    def routed(self) -> dict[int, bytes]:
        return dict(zip(self.senders, self.boxes, strict=True))

    def terms(self, config: Mapping[str, Any]) -> bytes:
        """The digest of the round's terms this input is made under: ``config`` (the message's) and this encoding
        (`common.secagg.terms`); the factory binds its pairwise masks to it."""
        return round_terms(config, self.clip, self.scale, self.max_weight, self.layout)


@dataclass(frozen=True)
class Unmask(_Message):
    """Stage 4, server -> factory: who survived (their self-mask seeds are wanted) and who dropped (their mask keys)."""

    stage: ClassVar[str] = "unmask"
    session: str = field(metadata=_wire("session", "str"))
    survivors: list[int] = field(metadata=_wire("survivors", "ints"))
    dropped: list[int] = field(metadata=_wire("dropped", "ints"))


@dataclass(frozen=True)
class Shares(_Message):
    """Stage 4, factory -> server: (share index, share) of each survivor's seed and each dropped factory's mask key."""

    stage: ClassVar[str] = "unmask"
    seed_slots: list[int] = field(metadata=_wire("seed-slots", "ints"))
    seed_index: list[int] = field(metadata=_wire("seed-index", "ints"))
    seed_shares: list[bytes] = field(metadata=_wire("seed-shares", "blobs"))
    key_slots: list[int] = field(metadata=_wire("key-slots", "ints"))
    key_index: list[int] = field(metadata=_wire("key-index", "ints"))
    key_shares: list[bytes] = field(metadata=_wire("key-shares", "blobs"))

    def __post_init__(self) -> None:
        if not (len(self.seed_slots) == len(self.seed_index) == len(self.seed_shares)
                and len(self.key_slots) == len(self.key_index) == len(self.key_shares)):
            raise MessageError("secagg unmask: share columns of different lengths")

    @classmethod
    def of(cls, seeds: Mapping[int, tuple[int, bytes]], keys: Mapping[int, tuple[int, bytes]]) -> Shares:
        return cls(list(seeds), [i for i, _ in seeds.values()], [s for _, s in seeds.values()],
                   list(keys), [i for i, _ in keys.values()], [s for _, s in keys.values()])

    def seeds(self) -> dict[int, tuple[int, bytes]]:
        return {u: (i, s) for u, i, s in zip(self.seed_slots, self.seed_index, self.seed_shares, strict=True)}

    def keys(self) -> dict[int, tuple[int, bytes]]:
        return {u: (i, s) for u, i, s in zip(self.key_slots, self.key_index, self.key_shares, strict=True)}
