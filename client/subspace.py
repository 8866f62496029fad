"""DP-SGD on the head within a subspace learnt from public images: the noise shrinks with the dimension.

DP-SGD adds Gaussian noise of the same scale to every trained value, so the noise in a step grows with
the square root of the number of values while the signal does not: for the pretrained family's linear
head that is 6,176 features x classes, and the noise, not the clipping, is what DP costs there
(docs/benchmarks.md). The images of a factory's line vary along far fewer directions than 6,176.
Their principal directions can be learnt from *public* images of the same domain, the run's proxy
set, which the server holds and sends every factory (Yu et al. 2021, "Do not let privacy overbill
utility"; Zhou et al. 2021, "Bypassing the ambient dimension"): a factory then trains, with DP-SGD,
only the head's coordinates in the top-k directions (k x classes values), and folds them back into
a whole head. What leaves the factory is the same kind of head as without DP, so secure aggregation,
the registry, export and inspection are unchanged.

Privacy: the subspace is computed from the proxy set alone, never from the factory's images, so
training within it is DP-SGD on a fixed (data-independent) reparametrisation of the head, and
folding back is post-processing. A proxy set chosen badly, or by a hostile server, can only cost
accuracy, not privacy; the factory computes the subspace itself, from images it holds.

`fit_subspace` finds the directions; `SubspaceHead` is the module DP-SGD trains; `fold` returns the
whole head.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import skip_init

MIN_PUBLIC_IMAGES = 16  # fewer public images say too little about the domain to choose directions from


class SubspaceError(ValueError):
    """The public images cannot give the subspace asked for; the message says what to change."""


@dataclass(frozen=True)
class PublicSubspace:
    """The centre of the public features and the k directions DP-SGD trains in, each scaled (see `fit_subspace`)."""

    mean: np.ndarray  # (d,) float32
    basis: np.ndarray  # (d, k) float32: orthonormal principal directions times their scale
    source: str  # what it was computed from (the proxy set's sha256 and the backbone), for logs
    # The median over the public images of |(P^T (x - mean), 1)|, what an example's gradient norm in the subspace head
    # scales with (the gradient of a linear map is the residual times its input): a clipping norm set from public images
    feature_norm: float = 1.0

    @property
    def dims(self) -> int:
        return int(self.basis.shape[1])

    def digest(self) -> str:
        h = hashlib.sha256(self.mean.tobytes())
        h.update(self.basis.tobytes())
        return h.hexdigest()


def fit_subspace(features: np.ndarray, dims: int, whitening: float, source: str = "") -> PublicSubspace:
    """The top ``dims`` principal directions of public ``features`` (N, d), centred on their mean.

    Each direction j is scaled by (s_j / s_1)^(-whitening), s_j its singular value: 0 keeps the
    coordinates as they are, 1 gives every direction unit variance. Partial whitening helps DP-SGD
    because the noise is the same in every trained coordinate while the signal is not; measured on
    the built-in data, 0.125 to 0.5 were within a point of each other, 0 about a point below them and
    full whitening about four; on a second generator's images 0.5 (the default) with a decaying
    learning rate was about three points above 0.25 (docs/benchmarks.md). Signs are fixed (largest component positive) so that every factory
    computing it from the same images gets the same basis. ``feature_norm`` is the median norm of the public images'
    coordinates (with the bias's constant input), the public scale of a per-example gradient (`PrivacyBudget.clip_norm`).
    """
    x = np.asarray(features, dtype=np.float64)
    if x.ndim != 2 or not np.isfinite(x).all():
        raise SubspaceError(f"public features must be a finite (N, d) array, got shape {x.shape}")
    if len(x) < MIN_PUBLIC_IMAGES:
        raise SubspaceError(f"the proxy set holds {len(x)} images; a public subspace needs at least {MIN_PUBLIC_IMAGES}")
    if dims < 1:
        raise SubspaceError(f"public-subspace must be >= 1 to fit a subspace, got {dims}")
    mean = x.mean(axis=0)
    s, directions = _principal_directions(x - mean, dims)
    k = len(s)
    if k < 1:
        raise SubspaceError("the proxy set's features do not vary (all images alike): no subspace to train in")
    signs = np.sign(directions[np.arange(k), np.abs(directions).argmax(axis=1)])
    directions = directions * signs[:, None]
    scale = (s / s[0]) ** (-float(whitening))
    basis = (directions.T * scale[None, :]).astype(np.float32)
    coordinates = (x - mean) @ basis.astype(np.float64)
    feature_norm = float(np.median(np.sqrt((coordinates**2).sum(axis=1) + 1.0)))  # the delta's input with its bias's 1
    return PublicSubspace(mean.astype(np.float32), basis, source, feature_norm)


def _principal_directions(centred: np.ndarray, dims: int) -> tuple[np.ndarray, np.ndarray]:
    """The top singular values of ``centred`` (N, d), largest first, and their right singular vectors (rows): at most
    ``dims``, and only those the images span (s > 1e-6 s_1).

    With fewer images than features (hundreds of proxy images, 6,176 features) they come from the N x N Gram matrix:
    the same directions (to 1e-15) as the thin SVD, 25 times faster (0.04 s against 0.97 s for 500 images), which a DP
    factory's first round waits for while other factories share its cores."""
    n, d = centred.shape
    if n >= d:
        _, s, vt = np.linalg.svd(centred, full_matrices=False)
    else:
        eigenvalues, u = np.linalg.eigh(centred @ centred.T)
        order = np.argsort(eigenvalues)[::-1]
        s, u = np.sqrt(np.maximum(eigenvalues[order], 0.0)), u[:, order]
    k = min(dims, int((s > s[0] * 1e-6).sum()) if s[0] > 0 else 0)
    directions = vt[:k] if n >= d else (u[:, :k].T @ centred) / s[:k, None]
    return s[:k], directions


class SubspaceHead(nn.Module):
    """``head(x) + delta(P^T (x - mean))``: the received head, frozen, plus a trainable linear map in the subspace.

    ``delta`` starts at zero, so the module starts as the received model. Only ``delta`` has
    parameters (k x classes + classes), which is all that DP-SGD clips, noises and accounts for.
    """

    def __init__(self, head: nn.Linear, subspace: PublicSubspace) -> None:
        super().__init__()
        if head.in_features != subspace.mean.shape[0]:
            raise SubspaceError(f"the public subspace is over {subspace.mean.shape[0]} features, the head over {head.in_features}")
        self.register_buffer("base_weight", head.weight.detach().clone())
        self.register_buffer("base_bias", head.bias.detach().clone())
        self.register_buffer("mean", torch.from_numpy(subspace.mean.copy()))
        self.register_buffer("basis", torch.from_numpy(subspace.basis.copy()))
        self.delta = skip_init(nn.Linear, subspace.dims, head.out_features)  # no draw from torch's global stream (common/rng.py)
        nn.init.zeros_(self.delta.weight)
        nn.init.zeros_(self.delta.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return F.linear(x, self.base_weight, self.base_bias) + self.delta((x - self.mean) @ self.basis)

    @torch.no_grad()
    def fold(self) -> OrderedDict[str, np.ndarray]:
        """The whole head this module computes: ``weight = W + V P^T``, ``bias = b + c - V P^T mean`` (exact up to rounding)."""
        extra = self.delta.weight.double() @ self.basis.double().T
        weight = self.base_weight.double() + extra
        bias = self.base_bias.double() + self.delta.bias.double() - extra @ self.mean.double()
        return OrderedDict(weight=weight.to(self.base_weight.dtype).numpy().copy(), bias=bias.to(self.base_bias.dtype).numpy().copy())
