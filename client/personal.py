"""A factory's personal model of a global model: that model fine-tuned on this factory's own images.

Every round a factory makes the personal model of the global model it received (for the pretrained
family, blended with a head trained on its images alone, and with the run's public proxy images the global
model labels as classes rare here in the fine-tune: `client.trainer.FactoryTrainer.personal_head`, `public_examples`);
it is kept on disk per architecture with the sha256 of the weights it was made from, its training
settings, its accuracy on the factory's held-out split and that of the global model. Inspection serves
the personal model *of the approved version* (`client.agent.personal_chooser` makes it when the round's
is of another version) unless the approved model validates clearly better on the held-out split
(`global_clearly_better`), and says which and by how much. The personal model never leaves the factory."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from client.data import DataRequest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PersonalRecord:
    architecture: str
    server_round: int
    accuracy: float  # the personal model on the held-out split
    global_accuracy: float  # the global model it was fine-tuned from, on the same split
    classes: tuple[str, ...]
    image_size: int
    channels: int
    base_sha256: str = ""  # `weights_digest` of the global weights it was made from
    settings: dict = field(default_factory=dict)  # the run-config training keys it was made with (`TrainConfig.to_run_config`)

    @property
    def request(self) -> DataRequest:
        return DataRequest(tuple(self.classes), self.image_size, self.channels)


class PersonalModels:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def offer(self, architecture: str, request: DataRequest, weights: OrderedDict[str, np.ndarray], accuracy: float,
              global_accuracy: float, server_round: int, base_sha256: str = "", settings: Mapping[str, object] | None = None) -> PersonalRecord:
        """Keep this round's personal model (written atomically: weights first, then the record naming them)."""
        self.root.mkdir(parents=True, exist_ok=True)
        record = PersonalRecord(architecture, server_round, float(accuracy), float(global_accuracy), tuple(request.classes),
                                request.image_size, request.channels, base_sha256, dict(settings or {}))
        tmp = self.root / f".{architecture}.tmp.npz"
        with open(tmp, "wb") as f:
            np.savez(f, **weights)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(self.root / f"{architecture}.npz")
        meta = self.root / f".{architecture}.tmp.json"
        meta.write_text(json.dumps(asdict(record)))
        meta.replace(self.root / f"{architecture}.json")
        return record

    def get(self, architecture: str) -> tuple[OrderedDict[str, np.ndarray], PersonalRecord] | None:
        weights_path, meta_path = self.root / f"{architecture}.npz", self.root / f"{architecture}.json"
        if not (weights_path.exists() and meta_path.exists()):
            return None
        try:
            record = PersonalRecord(**{**json.loads(meta_path.read_text()), "classes": tuple(json.loads(meta_path.read_text())["classes"])})
            with np.load(weights_path, allow_pickle=False) as npz:
                weights = OrderedDict((k, npz[k]) for k in npz.files)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("personal model %s is unreadable (%s); serving the global model only", weights_path, exc)
            return None
        return weights, record


def weights_digest(weights: Mapping[str, np.ndarray]) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes: which global model a personal model was made from."""
    digest = hashlib.sha256()
    for name in sorted(weights):
        array = np.ascontiguousarray(weights[name])
        digest.update(f"{name}|{array.dtype.str}|{array.shape}|".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def hit_rate(hits: np.ndarray) -> float:
    """Accuracy from per-image hits (0 when there are none)."""
    return float(hits.mean()) if len(hits) else 0.0


CLEARLY_BETTER_LEVEL = 0.05


def global_clearly_better(global_hits: np.ndarray, personal_hits: np.ndarray, level: float = CLEARLY_BETTER_LEVEL) -> bool:
    """Whether the global model beats the personal one on the held-out images by more than chance would: a one-sided
    exact McNemar test on the images exactly one of them gets right (p < ``level``).

    Why not simply the higher accuracy: a factory holds out a few dozen images, so one image is 2-3 points, and the
    global model, trained mostly on other factories' optics and label mixes, served on a tie or a one-image lead lost
    up to 5 points on the factory's own test images where its personal model lost none (docs/benchmarks.md). With
    ``level`` 0.05 the global model needs at least five such images and none the other way."""
    if global_hits.shape != personal_hits.shape:
        raise ValueError(f"held-out hits of different lengths: {global_hits.shape} and {personal_hits.shape}")
    only_global = int(np.sum(global_hits & ~personal_hits))
    only_personal = int(np.sum(personal_hits & ~global_hits))
    n = only_global + only_personal
    if only_global <= only_personal:
        return False
    p_value = sum(math.comb(n, k) for k in range(only_global, n + 1)) / 2**n
    return p_value < level


def public_examples(global_logits: np.ndarray, labels: np.ndarray, num_classes: int, confidence: float,
                    rare: float) -> tuple[np.ndarray, np.ndarray]:
    """Which of the run's public proxy images the personal fine-tune also learns from, and as which class: those the
    global model labels, with probability above ``confidence``, as a class that is rare here (fewer than ``rare`` of
    this factory's training ``labels``). Returns (indices into the proxy set, their labels).

    Why: where a factory tied with, or lost to, training alone, its test errors were images of classes it saw a handful
    of times; the fine-tune on its own images forgets what the global model knew of them. The public images carry
    that knowledge back without shifting the factory's prior for its common classes (pseudo-labels of every class
    helped less). Nothing here leaves the factory, and the proxy set is public: it costs no privacy budget."""
    if global_logits.ndim != 2 or global_logits.shape[1] != num_classes:
        raise ValueError(f"the global model's logits on the proxy set must be (N, {num_classes}), got {global_logits.shape}")
    counts = np.bincount(np.asarray(labels, dtype=np.int64), minlength=num_classes)
    rare_here = counts < rare * max(1, len(labels))
    unnormalised = np.exp(global_logits - global_logits.max(axis=1, keepdims=True))
    probs = unnormalised / unnormalised.sum(axis=1, keepdims=True)
    predicted = probs.argmax(axis=1)
    chosen = np.nonzero(rare_here[predicted] & (probs.max(axis=1) > confidence))[0]
    return chosen, predicted[chosen]
