"""Backbone features computed once per image and kept on disk: what a pretrained-family round trains on.

The backbone is frozen, so an image's features never change while the backbone and the image stay
the same. `FeatureCache` keeps them in SQLite, one row per (backbone, image content, resize) key:

- the key is the sha256 of the backbone's identity (name, weights hash, input size, pooled blocks),
  the image's content (the file's bytes, or the decoded array for generated images) and how it is
  resized; change any of them and the old row is simply never asked for again;
- each row stores a checksum of its vector; a row that does not match (a tampered or damaged cache)
  is dropped and recomputed, with a log line;
- vectors are float16 on disk (half the space; the features are layer-normed, so the rounding is
  far below what training notices) and float32 in memory.

A process keeps its cache in its own state (a factory's state directory, the central site's registry
directory) unless ``FEDFORGE_FEATURE_CACHE`` names one file for it (`cache_path`): an operator who runs
several FedForge processes on one host over the same images (the demo, a test suite, a restarted edge
node with its state on a small disk) can point them at one cache, so each image is run through the
backbone once on that host. Rows are keyed by content, so sharing never mixes up two images; it does
put every process's features in one file, so only point processes at one cache that may read each
other's images.

`features_of` returns a `FeatureSet`, an `ImageSet` whose "images" are feature vectors: the ordinary
training and evaluation loops then train and evaluate the head alone.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from common.data import images as decoding
from common.data.datasets import ImageSet

log = logging.getLogger(__name__)

BATCH = 32  # images per forward pass unless the extractor says otherwise (a GPU takes more: common.backbones.GPU_BATCH)
CACHE_ENV = "FEDFORGE_FEATURE_CACHE"
SHARED_WAIT_S = 60.0  # how long a writer waits for another process holding the shared cache's write lock


def cache_path(default: str | Path) -> Path:
    """The feature cache a process uses: ``FEDFORGE_FEATURE_CACHE`` when set, else ``default`` (its own state)."""
    return Path(os.environ.get(CACHE_ENV) or default)


@dataclass(frozen=True)
class FeatureSet:
    """Feature vectors (N, D), float16 in memory (half of float32; what the cache holds), float32 out."""

    images: np.ndarray  # named like ImageDataset's so the training loops need no special case
    labels: np.ndarray
    classes: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def image_shape(self) -> tuple[int, ...]:
        return tuple(self.images.shape[1:])

    def images_at(self, indices: np.ndarray) -> np.ndarray:
        return self.images[np.asarray(indices, dtype=np.int64)].astype(np.float32)

    def subset(self, indices: np.ndarray) -> FeatureSet:
        idx = np.asarray(indices, dtype=np.int64)
        return FeatureSet(self.images[idx], self.labels[idx], self.classes)


def content_keys(data: ImageSet) -> list[str]:
    """One key per image of ``data``: its file's bytes (with the size it is read at and how files are decoded:
    `common.data.images.DECODE_VERSION`, the set's ``bit_depth``) when it has one, else its decoded pixels."""
    paths = getattr(data, "paths", None)
    if paths is not None:
        bits = getattr(data, "bit_depth", decoding.DEFAULT_BIT_DEPTH)
        suffix = f"|{data.image_shape}|decode-{decoding.DECODE_VERSION}".encode() + (f"|bits-{bits}".encode() if bits != decoding.DEFAULT_BIT_DEPTH else b"")
        return [hashlib.sha256(Path(p).read_bytes() + suffix).hexdigest() for p in paths]
    return [hashlib.sha256(np.ascontiguousarray(data.images_at(np.array([i]))).tobytes()).hexdigest() for i in range(len(data))]


def array_keys(images: np.ndarray) -> list[str]:
    return [hashlib.sha256(np.ascontiguousarray(images[i]).tobytes()).hexdigest() for i in range(len(images))]


class FeatureCache:
    """Backbone features on disk (SQLite), by backbone identity and image key; safe to share between threads."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=SHARED_WAIT_S)
        self._prepare()
        self._lock = threading.Lock()
        self.hits = self.misses = self.rebuilt = 0

    def _prepare(self) -> None:
        """WAL mode and the table. Another process creating the same file at the same moment can make SQLite answer
        "locked" at once, without waiting (it does so where waiting could deadlock), so this retries for a while."""
        deadline = time.monotonic() + SHARED_WAIT_S
        while True:
            try:
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute("CREATE TABLE IF NOT EXISTS features (backbone TEXT NOT NULL, image TEXT NOT NULL, dim INTEGER NOT NULL,"
                                 " vector BLOB NOT NULL, checksum TEXT NOT NULL, PRIMARY KEY (backbone, image))")
                return
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    @staticmethod
    def _checksum(backbone: str, image: str, blob: bytes) -> str:
        return hashlib.sha256(backbone.encode() + b"|" + image.encode() + b"|" + blob).hexdigest()

    def lookup(self, backbone: str, keys: Sequence[str]) -> dict[str, np.ndarray]:
        """The cached vectors of ``keys`` that verify; damaged rows are deleted (and so recomputed)."""
        found: dict[str, np.ndarray] = {}
        with self._lock:
            for start in range(0, len(keys), 500):
                chunk = list(keys[start : start + 500])
                rows = self._db.execute(
                    f"SELECT image, dim, vector, checksum FROM features WHERE backbone=? AND image IN ({','.join('?' * len(chunk))})",
                    (backbone, *chunk)).fetchall()
                for image, dim, blob, checksum in rows:
                    if checksum != self._checksum(backbone, image, blob) or len(blob) != 2 * dim:
                        self.rebuilt += 1
                        log.warning("feature cache %s: the entry for image %s... does not match its checksum; recomputing it", self.path, image[:12])
                        self._db.execute("DELETE FROM features WHERE backbone=? AND image=?", (backbone, image))
                        continue
                    found[image] = np.frombuffer(blob, dtype="<f2")
        return found

    def store(self, backbone: str, keys: Sequence[str], vectors: np.ndarray) -> None:
        rows = []
        for key, vector in zip(keys, vectors):
            blob = np.asarray(vector, dtype="<f2").tobytes()
            rows.append((backbone, key, int(vector.shape[0]), blob, self._checksum(backbone, key, blob)))
        with self._lock, self._db:
            self._db.executemany("INSERT OR REPLACE INTO features VALUES (?, ?, ?, ?, ?)", rows)

    def close(self) -> None:
        self._db.close()


def compute(encode: Callable[[torch.Tensor], torch.Tensor], images_at: Callable[[np.ndarray], np.ndarray], indices: np.ndarray,
            batch: int = BATCH) -> np.ndarray:
    """Run the frozen encoder over the images at ``indices``, ``batch`` at a time."""
    out = []
    with torch.no_grad():
        for start in range(0, len(indices), batch):
            out.append(encode(torch.from_numpy(images_at(indices[start : start + batch]))).float().numpy())
    return np.concatenate(out) if out else np.zeros((0, 0), dtype=np.float32)


def features_of(data: ImageSet, backbone: str, encode: Callable[[torch.Tensor], torch.Tensor], cache: FeatureCache | None,
                keys: Sequence[str] | None = None, batch: int = BATCH) -> FeatureSet:
    """``data`` as backbone features: cached rows are read, the rest computed (and stored), ``batch`` images per pass
    (a `common.backbones.FeatureExtractor` says how many suit its device)."""
    keys = list(keys) if keys is not None else content_keys(data)
    cached = cache.lookup(backbone, keys) if cache is not None else {}
    missing = np.array([i for i, k in enumerate(keys) if k not in cached], dtype=np.int64)
    if cache is not None:
        cache.hits += len(keys) - len(missing)
        cache.misses += len(missing)
    fresh = (compute(encode, data.images_at, missing, batch) if len(missing) else np.zeros((0, 0))).astype(np.float16)
    if cache is not None and len(missing):
        cache.store(backbone, [keys[i] for i in missing], fresh)
        log.info("computed backbone features of %d images (%d read from the cache)", len(missing), len(keys) - len(missing))
    dim = fresh.shape[1] if len(missing) else next(iter(cached.values())).shape[0] if cached else 0
    features = np.empty((len(keys), dim), dtype=np.float16)
    for j, i in enumerate(missing):
        features[i] = fresh[j]
    for i, k in enumerate(keys):
        if k in cached:
            features[i] = cached[k]
    return FeatureSet(features, np.asarray(data.labels), tuple(data.classes))
