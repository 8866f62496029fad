"""The round's terms: what every input of one secure sum must have been computed under.

The sum of the factories' inputs means what the server takes it to mean only if every factory computed its
input under the same terms: the same training options (step size, epochs, proxy set, public subspace, ...),
the same clipping, fixed-point scale, weight cap and layout. A server that sent different terms to different
factories could otherwise do more than spoil the average: under ``--dp-secure-sum`` each factory adds only its
share of the DP noise, so a server that sent one factory a large step size and the others a tiny one would
scale everyone's noise down but that factory's, and learn its update with a fraction of the noise it counted on.

So each pairwise mask is keyed by the pair's agreed key *and* a digest of the terms (`bind`): the masks of two
factories cancel only if both received the same terms. Otherwise the unmasked "sum" is a uniformly random
vector, which the server recognises (its example counts are not counts) and discards. Keys that legitimately
differ between the factories of one round (their architecture group, whether they send weights) are left out.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from common.secagg.layout import SecureLayout

PER_FACTORY_KEYS = frozenset({"architecture", "send-weights"})  # the only config keys that may differ within one sum
_INFO = b"fedforge/secagg+/v1 pairwise mask under round terms "


def _canonical(value: Any) -> Any:
    """One form for a value however it travelled: a number sent as an int arrives as a float (protobuf Struct)."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).hex()
    if isinstance(value, Mapping):
        return {str(k): _canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    raise TypeError(f"round terms cannot hold a {type(value).__name__}")


def round_terms(config: Mapping[str, Any], clip: float, scale: float, max_weight: int, layout: SecureLayout) -> bytes:
    """A 32-byte digest of the terms of one secure phase: the message's config (less `PER_FACTORY_KEYS`) and how inputs
    are encoded (clip, scale, weight cap, layout). The factory computes it from what it received, the server from what it
    sent: equal only if every factory received the same."""
    terms = {"config": {k: _canonical(v) for k, v in config.items() if k not in PER_FACTORY_KEYS},
             "encoding": _canonical({"clip": clip, "scale": scale, "max-weight": max_weight, **layout.fields()})}
    return hashlib.sha256(json.dumps(terms, sort_keys=True, separators=(",", ":")).encode()).digest()


def bind(pair_key: bytes, terms: bytes) -> bytes:
    """The key a pairwise mask is expanded from: the pair's agreed key bound to the round's terms (HKDF-SHA256)."""
    if len(terms) != 32:
        raise ValueError("round terms are a 32-byte digest")
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_INFO + terms).derive(pair_key)
