"""The server's own data: an optional central test set, and inputs for models that sit on a frozen backbone.

Federated evaluation (on the factories' held-out images) is the figure that matters; a central test
set is optional: an operator's labelled folder (``test-data``), or, only when the factories' data
is the project's generated data (the demo), a generated one. For the pretrained family every
server-side set (test, validation, proxy) is turned into backbone features once, cached on disk,
so each round evaluates or distils the head alone.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import numpy as np
from torch import nn

from common.backbones import feature_extractor
from common.data import datasets
from common.data.datasets import ImageDataset, ImageSet
from common.data.folder import load_image_folder
from common.data.images import grey_to_channels
from common.features import FeatureCache, array_keys, cache_path, features_of
from common.models import federated_part, is_pretrained
from common.training import EvalResult, evaluate
from server.config import FederationConfig

log = logging.getLogger("fedforge.server")


def generated(data: ImageDataset, cfg: FederationConfig) -> ImageDataset:
    """Generated images (grey, the generator's class list) as the run's channels and class list."""
    return ImageDataset(grey_to_channels(data.images, cfg.channels), datasets.relabel(data.labels, data.classes, cfg.class_list), cfg.class_list)


class CentralData:
    def __init__(self, cfg: FederationConfig, directory: Path) -> None:
        self.cfg = cfg
        self.features = FeatureCache(cache_path(directory / "features.db"))
        self.test: ImageSet | None = None
        self._inputs: dict[tuple[str, int], ImageSet] = {}  # (architecture, id of the set) -> what its model consumes
        self._lock = threading.Lock()

    def warm_up(self, model: nn.Module, architecture: str) -> None:
        """Compute the test set's backbone features in the background (round 1's key exchange runs meanwhile)."""
        if self.test is not None and is_pretrained(architecture):
            test = self.test
            threading.Thread(target=lambda: self.inputs(model, architecture, test), daemon=True, name="fedforge-test-features").start()

    def choose_test_set(self, factories_generated: bool) -> None:
        """``test-data`` when given; a generated set only when every factory's data is generated; else none."""
        cfg = self.cfg
        if cfg.test_data:
            self.test, report = load_image_folder(cfg.test_data, cfg.image_size, cfg.class_list, cfg.channels, bit_depth=cfg.data_bit_depth)
            log.info("central test set: %d images from %s (%d left out: unreadable, filed under two classes or in a format not read)", len(self.test), cfg.test_data, len(report.skipped))
        elif factories_generated and cfg.test_size > 0:
            self.test = generated(datasets.test_dataset(cfg.spec, cfg.test_size), cfg)
        else:
            self.test = None
            log.info("no central test set (no test-data folder, and the factories hold their own images): "
                     "the factories' federated evaluation is the only measure")

    def inputs(self, model: nn.Module, architecture: str, data: ImageSet) -> ImageSet:
        """What ``federated_part(model)`` consumes for ``data``: the images, or their cached backbone features
        (computed once per set; a second caller waits for the first)."""
        if not is_pretrained(architecture):
            return data
        key = (architecture, id(data))
        with self._lock:
            if key not in self._inputs:
                keys = array_keys(data.images) if isinstance(data, ImageDataset) else None
                extract = feature_extractor(model.backbone.spec, self.cfg.feature_device)  # type: ignore[union-attr,arg-type]
                self._inputs[key] = features_of(data, extract.backbone.spec.ident, extract, self.features, keys, batch=extract.batch)
            return self._inputs[key]

    def proxy_inputs(self, model: nn.Module, architecture: str, images: np.ndarray) -> np.ndarray:
        if not is_pretrained(architecture):
            return images
        fake = ImageDataset(images, np.zeros(len(images), dtype=np.int64), self.cfg.class_list)
        feats = self.inputs(model, architecture, fake)
        return feats.images_at(np.arange(len(feats)))

    def evaluate(self, model: nn.Module, architecture: str) -> EvalResult | None:
        """The model (its federated weights loaded) on the central test set, or None without one."""
        if self.test is None:
            return None
        return evaluate(federated_part(model), self.inputs(model, architecture, self.test))
