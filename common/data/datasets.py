"""Labelled image sets (in memory or streamed from disk), and the synthetic federation's data.

Training and evaluation read images through one small interface, `ImageSet`: labels are always in
memory (a 100,000-image factory holds 800 KB of them), images come from `images_at(indices)`, so a
folder too large for memory is decoded batch by batch from disk (`StreamedImages`) while a small one
is decoded once (`ImageDataset`).

Synthetic factories are non-IID twice over: each draws its label mix from Dirichlet(alpha) and its
images through its own `FactoryProfile` (materials and optics). The central test set is balanced and
mixes every factory's appearance, so it measures the federation, not one site.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from common.data import synth
from common.data.images import DEFAULT_BIT_DEPTH, read_image


@runtime_checkable
class ImageSet(Protocol):
    """What training and evaluation need from a labelled image set."""

    labels: np.ndarray  # int64 indices into ``classes``
    classes: tuple[str, ...]

    def __len__(self) -> int: ...

    @property
    def image_shape(self) -> tuple[int, int, int]: ...  # (channels, height, width)

    def images_at(self, indices: np.ndarray) -> np.ndarray: ...  # float32 (k, C, H, W) in [0, 1]

    def subset(self, indices: np.ndarray) -> ImageSet: ...


def class_counts(data: ImageSet) -> np.ndarray:
    return np.bincount(np.asarray(data.labels, dtype=np.int64), minlength=len(data.classes))


@dataclass(frozen=True)
class ImageDataset:
    """Images as float32 (N, C, H, W) in [0, 1], C = 1 (grey) or 3 (RGB), and labels indexing ``classes``."""

    images: np.ndarray
    labels: np.ndarray
    classes: tuple[str, ...] = synth.CLASSES

    def __post_init__(self) -> None:
        if self.images.ndim != 4 or self.images.shape[1] not in (1, 3):
            raise ValueError(f"images must have shape (N, 1 or 3, H, W), got {self.images.shape}")
        if len(self.images) != len(self.labels):
            raise ValueError(f"{len(self.images)} images but {len(self.labels)} labels")

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return tuple(self.images.shape[1:])  # type: ignore[return-value]

    def images_at(self, indices: np.ndarray) -> np.ndarray:
        return self.images[np.asarray(indices, dtype=np.int64)]

    def subset(self, indices: np.ndarray) -> ImageDataset:
        idx = np.asarray(indices, dtype=np.int64)
        return ImageDataset(self.images[idx], self.labels[idx], self.classes)

    def class_counts(self) -> np.ndarray:
        return class_counts(self)


@dataclass(frozen=True)
class StreamedImages:
    """A labelled set of image files decoded on demand: what a factory with more images than memory trains on.

    Each call to `images_at` decodes those files (see `common.data.images` for the resize policy); the
    loader checked every file once when the set was built, so a failure here means the file changed on
    disk, and the error names it.
    """

    paths: tuple[Path, ...]
    labels: np.ndarray
    classes: tuple[str, ...]
    size: int
    channels: int = 1
    bit_depth: int = DEFAULT_BIT_DEPTH  # significant bits of 16-bit grey images (`common.data.images.read_image`)

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return (self.channels, self.size, self.size)

    def images_at(self, indices: np.ndarray) -> np.ndarray:
        idx = np.asarray(indices, dtype=np.int64)
        out = np.empty((len(idx), self.channels, self.size, self.size), dtype=np.float32)
        for j, i in enumerate(idx):
            out[j] = read_image(self.paths[int(i)], self.size, self.channels, self.bit_depth)
        return out

    def subset(self, indices: np.ndarray) -> StreamedImages:
        idx = np.asarray(indices, dtype=np.int64)
        return StreamedImages(tuple(self.paths[int(i)] for i in idx), self.labels[idx], self.classes, self.size, self.channels, self.bit_depth)

    def class_counts(self) -> np.ndarray:
        return class_counts(self)


def stratified_split(labels: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, held-out indices): ``fraction`` of every class held out, at least one image of a
    class with two or more, so every class a factory has can be evaluated there. Deterministic in ``seed``."""
    rng = np.random.default_rng(seed)
    train, held = [], []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        n_held = round(len(idx) * fraction) if fraction > 0 else 0
        if fraction > 0 and n_held == 0 and len(idx) >= 2:
            n_held = 1
        held.append(idx[:n_held])
        train.append(idx[n_held:])
    cat = lambda parts: np.sort(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.int64)
    return cat(train).astype(np.int64), cat(held).astype(np.int64)


def keyed_split(keys: Sequence[str], labels: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, held-out indices) of images named by ``keys`` (a folder's relative paths): an image is held out when
    the SHA-256 of (``seed``, its key) falls in the lowest ``fraction`` of the range, so adding or removing other images
    never moves it from one split to the other (`stratified_split` reshuffles a class when its count changes, and a model
    trained on the old split would then be scored on images it trained on). As with `stratified_split`, a class's only
    image trains, and a class of two or more has at least one image in each split; only these adjustments can move an
    image, in a class of a handful of images."""
    labels = np.asarray(labels)
    if len(keys) != len(labels):
        raise ValueError(f"{len(keys)} keys for {len(labels)} labels")
    draw = np.array([int.from_bytes(hashlib.sha256(f"{seed}|{k}".encode()).digest()[:8], "big") / 2.0**64 for k in keys])
    held = draw < fraction if fraction > 0 else np.zeros(len(keys), dtype=bool)
    if fraction > 0:
        for c in np.unique(labels):
            idx = np.flatnonzero(labels == c)
            if len(idx) < 2:  # a class's only image trains
                held[idx] = False
                continue
            if not held[idx].any():
                held[idx[np.argmin(draw[idx])]] = True
            if held[idx].all():
                held[idx[np.argmax(draw[idx])]] = False
    return np.flatnonzero(~held).astype(np.int64), np.flatnonzero(held).astype(np.int64)


def relabel(labels: np.ndarray, source_classes: Sequence[str], target_classes: Sequence[str]) -> np.ndarray:
    """Labels indexing ``source_classes`` -> the same names' indices in ``target_classes`` (names must all exist there)."""
    index = {c: i for i, c in enumerate(target_classes)}
    missing = sorted({source_classes[int(i)] for i in np.unique(labels)} - set(index))
    if missing:
        raise ValueError(f"classes {missing} are not in the class list {list(target_classes)}")
    lookup = np.array([index.get(c, -1) for c in source_classes], dtype=np.int64)
    return lookup[np.asarray(labels, dtype=np.int64)]


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


def _factory_rng_and_labels(spec: SyntheticSpec, factory_index: int) -> tuple[np.random.Generator, np.ndarray]:
    if not 0 <= factory_index < spec.num_factories:
        raise ValueError(f"factory index {factory_index} outside 0..{spec.num_factories - 1}")
    mix = label_mix(spec.seed, spec.num_factories, spec.alpha)[factory_index]
    rng = synth.rng_for(spec.seed, 3, factory_index)
    return rng, rng.choice(len(synth.CLASSES), size=spec.train_size, p=mix).astype(np.int64)


def factory_labels(spec: SyntheticSpec, factory_index: int) -> np.ndarray:
    """The labels of `factory_dataset` without rendering its images (cheap)."""
    return _factory_rng_and_labels(spec, factory_index)[1]


def factory_dataset(spec: SyntheticSpec, factory_index: int) -> ImageDataset:
    """The private training data of factory ``factory_index`` (0-based); the labels do not depend on the image size."""
    rng, labels = _factory_rng_and_labels(spec, factory_index)
    profile = synth.factory_profile(spec.seed, factory_index)
    images = synth.render_many(rng, labels, [profile], spec.image_size)
    return ImageDataset(images, labels)


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
