"""The server's side of distillation rounds: the proxy set, the validation set, and the keep-or-drop rule."""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from common.data import datasets
from common.data.datasets import ImageDataset
from common.data.folder import load_image_folder, load_unlabelled_folder
from common.distill import DistillConfig, DistillReport, ProxySet, distill
from common.models import load_weights
from common.training import evaluate

log = logging.getLogger("fedforge.server.distill")

MODES = ("off", "after", "only")


def load_proxy(proxy_data: str, spec: datasets.SyntheticSpec, size: int) -> ProxySet:
    """The operator's folder of unlabelled images, or the generator's proxy images for the demo."""
    if proxy_data:
        images, report = load_unlabelled_folder(proxy_data)
        log.info("proxy set: %d images from %s (%d unreadable, skipped)", report.loaded, proxy_data, len(report.skipped))
        return ProxySet(images)
    return ProxySet(datasets.proxy_images(spec, size))


def load_validation(validation_data: str, test_data: str, spec: datasets.SyntheticSpec, size: int) -> ImageDataset:
    """Labelled images for keep-or-drop decisions, kept apart from the reported test set when possible."""
    if validation_data:
        return load_image_folder(validation_data)[0]
    if test_data:
        log.warning("no validation-data folder: distillation decisions use the test folder %s", test_data)
        return load_image_folder(test_data)[0]
    return datasets.validation_dataset(spec, size)


@dataclass(frozen=True)
class DistillOutcome:
    weights: "OrderedDict[str, np.ndarray]"  # the distilled model if kept, else the undistilled one
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


def distil_into(model: torch.nn.Module, weights: "OrderedDict[str, np.ndarray]", proxy: ProxySet, ensemble: np.ndarray,
                validation: ImageDataset, cfg: DistillConfig) -> DistillOutcome:
    """Distil the ensemble into ``weights``; keep the result only if validation accuracy does not drop."""
    before = evaluate(load_weights(model, weights), validation).accuracy
    distilled, report = distill(model, proxy, ensemble, cfg)
    after = evaluate(model, validation).accuracy
    kept = after >= before
    return DistillOutcome(distilled if kept else weights, kept, before, after, report)
