"""Factory partitions, the central test set and the distillation proxy set, built from `synth`.

Factories are non-IID twice over: each draws its label mix from Dirichlet(alpha) and its images
through its own `FactoryProfile` (materials and optics). The central test set is balanced and mixes
every factory's appearance, so it measures the federation, not one site.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from common.data import synth


@dataclass(frozen=True)
class ImageDataset:
    """Images as float32 (N, 1, H, W) in [0, 1] and integer labels indexing ``classes``."""

    images: np.ndarray
    labels: np.ndarray
    classes: tuple[str, ...] = synth.CLASSES

    def __post_init__(self) -> None:
        if self.images.ndim != 4 or self.images.shape[1] != 1:
            raise ValueError(f"images must have shape (N, 1, H, W), got {self.images.shape}")
        if len(self.images) != len(self.labels):
            raise ValueError(f"{len(self.images)} images but {len(self.labels)} labels")

    def __len__(self) -> int:
        return len(self.labels)

    def class_counts(self) -> np.ndarray:
        return np.bincount(self.labels, minlength=len(self.classes))


@dataclass(frozen=True)
class SyntheticSpec:
    """Everything that determines the synthetic federation's data."""

    seed: int = 0
    num_factories: int = 3
    alpha: float = 1.0
    train_size: int = 600
    image_size: int = synth.DEFAULT_SIZE


def label_mix(seed: int, num_factories: int, alpha: float) -> np.ndarray:
    """Per-factory class proportions, one Dirichlet(alpha) row per factory; shape (F, C)."""
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    rng = synth.rng_for(seed, 2)
    return rng.dirichlet(np.full(len(synth.CLASSES), alpha), size=num_factories)


def factory_dataset(spec: SyntheticSpec, factory_index: int) -> ImageDataset:
    """The private training data of factory ``factory_index`` (0-based)."""
    if not 0 <= factory_index < spec.num_factories:
        raise ValueError(f"factory index {factory_index} outside 0..{spec.num_factories - 1}")
    mix = label_mix(spec.seed, spec.num_factories, spec.alpha)[factory_index]
    rng = synth.rng_for(spec.seed, 3, factory_index)
    labels = rng.choice(len(synth.CLASSES), size=spec.train_size, p=mix)
    profile = synth.factory_profile(spec.seed, factory_index)
    images = synth.render_many(rng, labels, [profile], spec.image_size)
    return ImageDataset(images, labels.astype(np.int64))


def _all_profiles(spec: SyntheticSpec) -> list[synth.FactoryProfile]:
    return [synth.factory_profile(spec.seed, i) for i in range(spec.num_factories)]


def _balanced_dataset(spec: SyntheticSpec, size: int, stream: int) -> ImageDataset:
    """``size`` labelled images, classes equally often, drawn from every factory's appearance."""
    rng = synth.rng_for(spec.seed, stream)
    labels = rng.permutation(np.arange(size) % len(synth.CLASSES))
    images = synth.render_many(rng, labels, _all_profiles(spec), spec.image_size)
    return ImageDataset(images, labels.astype(np.int64))


def test_dataset(spec: SyntheticSpec, size: int = 1200) -> ImageDataset:
    """A balanced held-out set drawn from every factory's appearance (never used for training)."""
    return _balanced_dataset(spec, size, stream=4)


def validation_dataset(spec: SyntheticSpec, size: int = 600) -> ImageDataset:
    """A balanced labelled set, disjoint from the test set, for the server's model-selection decisions."""
    return _balanced_dataset(spec, size, stream=6)


def proxy_images(spec: SyntheticSpec, size: int = 1000) -> np.ndarray:
    """Unlabelled images of the domain that the server may hold (for distillation)."""
    rng = synth.rng_for(spec.seed, 5)
    labels = rng.integers(0, len(synth.CLASSES), size=size)
    return synth.render_many(rng, labels, _all_profiles(spec), spec.image_size)
