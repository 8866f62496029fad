"""The per-example clipping norm option, ``--dp-max-grad-norm``, read alike by ``fedforge client``, ``fedforge demo`` and the benches.

A positive number, or ``public`` (the default): the one full-batch step of ``--dp-secure-sum`` in a public subspace clips
at `PUBLIC_NORM_FRACTION` of the public images' feature norm there, every other DP path at 1.0
(`client.privacy.PrivacyBudget.clip_norm` says when and why).
"""

from __future__ import annotations

import math
from typing import Any

import click

PUBLIC_NORM = "public"
# The shared-noise step's clipping norm under ``public``, as a fraction of the public feature norm: an example keeps its own
# gradient while its residual ||p - y|| is below a fifth, i.e. while the model is already fairly sure of it (docs/benchmarks.md)
PUBLIC_NORM_FRACTION = 0.2
DEFAULT_CLIP_NORM = PUBLIC_NORM


def parse_clip_norm(value: Any) -> float | str:
    """``PUBLIC_NORM`` or a positive finite float; raises ValueError saying what was wrong."""
    if isinstance(value, str) and value.strip().lower() == PUBLIC_NORM:
        return PUBLIC_NORM
    try:
        norm = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{value!r} is neither a number nor {PUBLIC_NORM!r}") from None
    if not 0 < norm < math.inf:
        raise ValueError(f"{value!r} must be a positive number or {PUBLIC_NORM!r}")
    return norm


class ClipNorm(click.ParamType):
    """``--dp-max-grad-norm`` as a click type (flags, env vars and the TOML file alike)."""

    name = "NORM|public"

    def convert(self, value, param, ctx):  # type: ignore[no-untyped-def]
        try:
            return parse_clip_norm(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


CLIP_NORM = ClipNorm()
