"""The server's side of distillation rounds: the proxy set, the validation set, and the keep-or-drop rule."""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from common.data import datasets
from common.data.datasets import ImageSet
from common.data.folder import load_image_folder, load_unlabelled_folder
from common.data.images import grey_to_channels
from common.distill import DistillConfig, DistillReport, ProxySet, distill
from common.models import load_weights
from common.training import evaluate
from server.central import generated
from server.config import FederationConfig

log = logging.getLogger("fedforge.server.distill")


def load_proxy(cfg: FederationConfig) -> ProxySet:
    """The operator's folder of unlabelled images, or the generator's proxy images for the demo."""
    if cfg.proxy_data:
        images, report = load_unlabelled_folder(cfg.proxy_data, cfg.image_size, cfg.channels, cfg.data_bit_depth)
        log.info("proxy set: %d images from %s (%d unreadable or in a format not read, skipped)", report.loaded, cfg.proxy_data, len(report.skipped))
        return ProxySet(images)
    return ProxySet(grey_to_channels(datasets.proxy_images(cfg.spec, cfg.proxy_size), cfg.channels))


def load_validation(cfg: FederationConfig) -> ImageSet:
    """Labelled images for keep-or-drop decisions, kept apart from the reported test set when possible."""
    if cfg.validation_data:
        return load_image_folder(cfg.validation_data, cfg.image_size, cfg.class_list, cfg.channels, bit_depth=cfg.data_bit_depth)[0]
    if cfg.test_data:
        log.warning("no validation-data folder: distillation decisions use the test folder %s", cfg.test_data)
        return load_image_folder(cfg.test_data, cfg.image_size, cfg.class_list, cfg.channels, bit_depth=cfg.data_bit_depth)[0]
    return generated(datasets.validation_dataset(cfg.spec, cfg.validation_size), cfg)


@dataclass(frozen=True)
class DistillOutcome:
    weights: OrderedDict[str, np.ndarray]  # the distilled model if kept, else the undistilled one
    kept: bool
    val_accuracy_before: float
    val_accuracy_after: float
    report: DistillReport

    def metrics(self, prefix: str) -> dict[str, float]:
        return {
            f"{prefix}distill-kept": float(self.kept), f"{prefix}distill-val-accuracy-before": self.val_accuracy_before,
            f"{prefix}distill-val-accuracy-after": self.val_accuracy_after, f"{prefix}distill-epochs": float(self.report.epochs),
            f"{prefix}distill-kl-before": self.report.val_kl_before, f"{prefix}distill-kl-after": self.report.val_kl_after,
        }


def distil_into(model: torch.nn.Module, weights: OrderedDict[str, np.ndarray], proxy: np.ndarray, ensemble: np.ndarray,
                validation: ImageSet, cfg: DistillConfig) -> DistillOutcome:
    """Distil the ensemble into ``weights``; keep the result only if validation accuracy does not drop.

    ``model`` is the module that is federated (a CNN, or a pretrained model's head), ``proxy`` and
    ``validation`` what it consumes (images, or their backbone features).
    """
    before = evaluate(load_weights(model, weights), validation).accuracy
    distilled, report = distill(model, proxy, ensemble, cfg)
    after = evaluate(model, validation).accuracy
    kept = after >= before
    return DistillOutcome(distilled if kept else weights, kept, before, after, report)
