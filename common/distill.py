"""Ensemble distillation on an unlabelled proxy set (FedDF, Lin et al. 2020; FedMD, Li & Wang 2019).

Factories predict on the proxy set with their locally trained models; the server only ever sees the
*sum* of those temperature-scaled probabilities (through the secure sum when it is on) and distils
the averaged ensemble into each architecture's global model. Both sides use this module: factories
call `predict_proxy`, the server calls `distill`.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


class ProxySetError(ValueError):
    """A proxy set that is missing, malformed, or does not match its content hash."""


@dataclass(frozen=True)
class ProxySet:
    """Unlabelled images (N, 1, H, W) float32 in [0, 1], identified by the sha256 of their bytes."""

    images: np.ndarray

    def __post_init__(self) -> None:
        if self.images.ndim != 4 or self.images.shape[0] == 0 or self.images.dtype != np.float32:
            raise ProxySetError(f"a proxy set is a non-empty float32 array (N, C, H, W), got {self.images.dtype} {self.images.shape}")
        if not np.isfinite(self.images).all():
            raise ProxySetError("the proxy set contains NaN or Inf pixels")

    @cached_property
    def sha256(self) -> str:
        """Computed once: the server sends it with every distillation round's messages."""
        return content_hash(self.images)

    def __len__(self) -> int:
        return int(self.images.shape[0])


def content_hash(images: np.ndarray) -> str:
    h = hashlib.sha256(f"{images.dtype.str}{images.shape}".encode())
    h.update(np.ascontiguousarray(images).tobytes())
    return h.hexdigest()


class ProxyCache:
    """A factory's proxy sets on disk, by content hash: each travels to the factory once."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self._loaded: dict[str, ProxySet] = {}

    def get(self, sha256: str) -> ProxySet | None:
        if sha256 in self._loaded:
            return self._loaded[sha256]
        path = self.root / f"{sha256}.npy"
        if not path.exists():
            return None
        try:
            proxy = ProxySet(np.load(path, allow_pickle=False))
        except (ValueError, OSError) as exc:
            log.warning("proxy set %s on disk is unreadable (%s); it will be fetched again", path, exc)
            return None
        if proxy.sha256 != sha256:
            log.warning("proxy set %s on disk does not match its hash; it will be fetched again", path)
            return None
        self._loaded[sha256] = proxy
        return proxy

    def put(self, sha256: str, images: np.ndarray) -> ProxySet:
        proxy = ProxySet(np.ascontiguousarray(images, dtype=np.float32))
        if proxy.sha256 != sha256:
            raise ProxySetError(f"proxy set content hashes to {proxy.sha256[:12]}..., not the announced {sha256[:12]}...")
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".{sha256}.tmp.npy"
        np.save(tmp, proxy.images, allow_pickle=False)
        tmp.replace(self.root / f"{sha256}.npy")  # atomic: a crash never leaves a half-written set under its hash
        self._loaded[sha256] = proxy
        return proxy


def _inputs(proxy: ProxySet | np.ndarray) -> np.ndarray:
    """The proxy images, or what a model consumes instead of them (a pretrained head: their backbone features)."""
    return proxy.images if isinstance(proxy, ProxySet) else np.asarray(proxy, dtype=np.float32)


@torch.no_grad()
def predict_proxy(model: torch.nn.Module, proxy: ProxySet | np.ndarray, temperature: float, batch_size: int = 256) -> np.ndarray:
    """softmax(logits / T) on every proxy input, float64 (N, classes)."""
    model.eval()
    inputs = _inputs(proxy)
    out = []
    for start in range(0, len(inputs), batch_size):
        logits = model(torch.from_numpy(inputs[start : start + batch_size]))
        out.append(F.softmax(logits.double() / temperature, dim=1))
    return torch.cat(out).numpy()


def balanced_predictions(probabilities: np.ndarray, class_counts: np.ndarray, smoothing: float = 0.5,
                         trained_adjustment: float = 0.0) -> np.ndarray:
    """A factory's predictions with its own label prior divided out, over the classes it has seen.

    Under strong label skew a local model says "my majority class" for most images; dividing by the
    local prior (logit adjustment, Menon et al. 2021) leaves how much each image looks like each
    class. The prior is smoothed with ``smoothing`` x a uniform share of pseudo-counts per class, so a
    class seen twice is not amplified into noise. Classes the factory never saw get 0: it has no
    opinion on them. Rows sum to 1.

    ``trained_adjustment`` is the tau of the logit-adjusted loss the model trained on (logits + tau log prior, as the
    pretrained head does by default): such a model's own logits already have tau log prior taken out, so only the rest,
    prior ** (1 - tau), is divided out here (for tau > 1, multiplied back in). Dividing the whole prior out again
    counted a factory's label skew twice and made it speak loudest for the classes it has fewest images of:
    distillation-only rounds of the pretrained head reached 0.568 instead of 0.630 (3 factories, alpha 1) and 0.223
    instead of 0.510 (5 factories, alpha 0.1; see docs/benchmarks.md).
    """
    if not trained_adjustment >= 0.0:
        raise ValueError(f"trained_adjustment must be >= 0 (the tau a model trained with), got {trained_adjustment}")
    counts = np.asarray(class_counts, dtype=np.float64)
    seen = counts > 0
    if not seen.any():
        raise ValueError("a factory with no labelled examples cannot predict for distillation")
    pseudo = smoothing * counts.sum() / len(counts)
    prior = (counts + pseudo) / (counts.sum() + pseudo * len(counts))
    remaining = prior[None, :] ** (1.0 - trained_adjustment)
    adjusted = np.where(seen[None, :], np.asarray(probabilities, dtype=np.float64) / remaining, 0.0)
    return adjusted / np.maximum(adjusted.sum(axis=1, keepdims=True), 1e-12)


def ensemble_of(weighted_sum: np.ndarray, count_sum: np.ndarray) -> np.ndarray:
    """The teacher: for each class, the factories' balanced predictions averaged with weights n_k(class).

    ``weighted_sum`` is sum_k n_k(y) * q_k(y|x) (N, C) and ``count_sum`` is sum_k n_k(y) (C,): exactly what
    the secure sum reveals. A factory only speaks for the classes it has examples of, in proportion to
    how many. Rows are renormalised; a class no factory has seen gets probability 0.
    """
    counts = np.asarray(count_sum, dtype=np.float64)
    per_class = np.where(counts[None, :] > 0, weighted_sum / np.maximum(counts, 1e-12)[None, :], 0.0)
    per_class = np.clip(per_class, 0.0, None)
    return per_class / np.maximum(per_class.sum(axis=1, keepdims=True), 1e-12)


def check_predictions(predictions: np.ndarray, num_images: int, num_classes: int, source: str) -> np.ndarray:
    """Probabilities of the right shape, finite, each row a distribution; raises naming ``source``."""
    p = np.asarray(predictions, dtype=np.float64)
    if p.shape != (num_images, num_classes):
        raise ValueError(f"{source}: predictions of shape {p.shape}, expected {(num_images, num_classes)}")
    if not np.isfinite(p).all():
        raise ValueError(f"{source}: predictions contain NaN or Inf")
    if (p < -1e-6).any() or not np.allclose(p.sum(axis=1), 1.0, atol=1e-3):  # balanced predictions sum to 1 too
        raise ValueError(f"{source}: predictions are not probability distributions (rows must be >= 0 and sum to 1)")
    return p


@dataclass(frozen=True)
class DistillConfig:
    temperature: float = 2.0
    epochs: int = 30
    patience: int = 3
    lr: float = 1e-3
    batch_size: int = 64
    val_fraction: float = 0.2
    seed: int = 0


@dataclass(frozen=True)
class DistillReport:
    epochs: int
    best_epoch: int
    val_kl_before: float
    val_kl_after: float


def distill(model: torch.nn.Module, proxy: ProxySet | np.ndarray, teacher: np.ndarray, cfg: DistillConfig) -> tuple[OrderedDict[str, np.ndarray], DistillReport]:
    """Train ``model`` to match the ensemble's probabilities ``teacher`` (N, C) at temperature T.

    ``proxy`` is the proxy images, or for a pretrained model's head their (cached) backbone features.

    KL(teacher || student) * T^2 on a training split of the proxy set, early stopping on the KL of a
    held-out split; returns the best weights (by held-out KL) and what happened.
    """
    images = torch.from_numpy(_inputs(proxy))
    n = len(images)
    order = np.random.default_rng(cfg.seed).permutation(n)
    n_val = max(1, round(n * cfg.val_fraction))
    val_idx, train_idx = order[:n_val], order[n_val:]
    target = torch.from_numpy(np.asarray(teacher, dtype=np.float32))
    t = cfg.temperature

    def val_kl() -> float:
        model.eval()
        with torch.no_grad():
            log_p = F.log_softmax(model(images[val_idx]) / t, dim=1)
            return float(F.kl_div(log_p, target[val_idx], reduction="batchmean")) * t * t

    best_state = OrderedDict((k, v.detach().clone()) for k, v in model.state_dict().items())
    before = best = val_kl()
    best_epoch, since_best, epoch = 0, 0, 0
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    gen = torch.Generator().manual_seed(cfg.seed)
    for epoch in range(1, cfg.epochs + 1):
        model.train()
        perm = torch.from_numpy(train_idx)[torch.randperm(len(train_idx), generator=gen)]
        for start in range(0, len(perm), cfg.batch_size):
            idx = perm[start : start + cfg.batch_size]
            log_p = F.log_softmax(model(images[idx]) / t, dim=1)
            loss = F.kl_div(log_p, target[idx], reduction="batchmean") * t * t
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        current = val_kl()
        if not math.isfinite(current):
            break
        if current < best - 1e-6:
            best, best_epoch, since_best = current, epoch, 0
            best_state = OrderedDict((k, v.detach().clone()) for k, v in model.state_dict().items())
        else:
            since_best += 1
            if since_best >= cfg.patience:
                break
    model.load_state_dict(best_state)
    weights = OrderedDict((k, v.numpy().copy()) for k, v in best_state.items())
    return weights, DistillReport(epochs=epoch, best_epoch=best_epoch, val_kl_before=before, val_kl_after=best)
