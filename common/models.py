"""The model families FedForge federates, and the weights that travel between sites.

- ``cnn-small`` / ``cnn-medium`` / ``cnn-large``: GroupNorm CNNs trained from scratch (every weight is
  federated). BatchNorm mixes statistics across the samples of a batch, which per-sample gradients
  (DP-SGD) and FedAvg over non-IID factories both dislike, so every normalisation layer is a GroupNorm.
  Parallelism, DP wrappers and checkpointing are applied to these models from outside.
- ``effnet-lite0``: the pinned, frozen ImageNet EfficientNet-Lite0 with a linear head over pooled
  multi-scale features (`common.backbones`); only the head is federated.

`weights_of` / `load_weights` are the one conversion between a model and the named arrays that are
averaged, masked, versioned, signed and sent: for the pretrained family that is the head alone.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from common.backbones import LITE0_SHA256, BackboneSpec, PretrainedClassifier
from common.rng import global_torch_rng


@dataclass(frozen=True)
class ArchSpec:
    """Widths of the convolution stages; each stage is two 3x3 convs then a 2x down-sampling."""

    widths: tuple[int, ...]
    head_hidden: int


CNN_ARCHITECTURES: dict[str, ArchSpec] = {
    "cnn-small": ArchSpec(widths=(16, 32, 64), head_hidden=64),
    "cnn-medium": ArchSpec(widths=(32, 64, 128), head_hidden=128),
    "cnn-large": ArchSpec(widths=(64, 128, 256), head_hidden=256),
}

PRETRAINED_ARCHITECTURES: dict[str, BackboneSpec] = {
    # every MBConv block and the head conv, mean + max pooled: 6,176 features at 128 px input
    "effnet-lite0": BackboneSpec("efficientnet-lite0", LITE0_SHA256, input_size=128, blocks=(*range(16), -1)),
}

ARCHITECTURES: dict[str, object] = {**CNN_ARCHITECTURES, **PRETRAINED_ARCHITECTURES}


def is_pretrained(architecture: str) -> bool:
    return architecture in PRETRAINED_ARCHITECTURES


CNN_IMAGE_SIZE = 64  # what the from-scratch family was measured and tuned at; its cost grows with the pixels


def natural_image_size(*architectures: str) -> int:
    """The image size a run uses unless it sets ``image-size``: the backbone's input size (128 px for effnet-lite0) when
    every architecture is pretrained, else `CNN_IMAGE_SIZE`. The backbone resizes whatever it is given to its input
    size, so smaller images only lose detail before it, at no saving in its cost: on three held-out data sets with small
    defects 128 px gave the global model 0.8 to 2.6 points over 64 px (docs/benchmarks.md)."""
    sizes = [PRETRAINED_ARCHITECTURES[a].input_size if a in PRETRAINED_ARCHITECTURES else CNN_IMAGE_SIZE for a in architectures]
    return min(sizes) if sizes else CNN_IMAGE_SIZE


def backbone_of(architecture: str) -> dict[str, str] | None:
    """What a version's manifest records about the frozen part it sits on (None for from-scratch models)."""
    spec = PRETRAINED_ARCHITECTURES.get(architecture)
    return {"name": spec.name, "sha256": spec.sha256, "features": spec.ident} if spec else None


def _groups(channels: int) -> int:
    return min(8, channels // 4) or 1


class ConvBlock(nn.Sequential):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__(
            nn.Conv2d(cin, cout, 3, padding=1, bias=False),
            nn.GroupNorm(_groups(cout), cout),
            nn.ReLU(inplace=False),
            nn.Conv2d(cout, cout, 3, padding=1, bias=False),
            nn.GroupNorm(_groups(cout), cout),
            nn.ReLU(inplace=False),
        )


class DefectCNN(nn.Module):
    """Conv stages, then global average *and* max pooling (small defects need the max) and an MLP head."""

    def __init__(self, spec: ArchSpec, num_classes: int, in_channels: int = 1) -> None:
        super().__init__()
        stages: list[nn.Module] = []
        cin = in_channels
        for i, width in enumerate(spec.widths):
            stages.append(ConvBlock(cin, width))
            if i < len(spec.widths) - 1:
                stages.append(nn.MaxPool2d(2))
            cin = width
        self.features = nn.Sequential(*stages)
        self.head = nn.Sequential(
            nn.Linear(2 * cin, spec.head_hidden),
            nn.ReLU(inplace=False),
            nn.Linear(spec.head_hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Per-image standardisation: removes each factory's gain, offset and exposure before the
        # first conv, and has no parameters (nothing for DP or FedAvg to handle).
        mean = x.mean(dim=(2, 3), keepdim=True)
        x = (x - mean) / (((x - mean) ** 2).mean(dim=(2, 3), keepdim=True).sqrt() + 1e-5)
        h = self.features(x)
        pooled = torch.cat([h.mean(dim=(2, 3)), h.amax(dim=(2, 3))], dim=1)
        return self.head(pooled)


def _build(architecture: str, num_classes: int, in_channels: int) -> nn.Module:
    if architecture in CNN_ARCHITECTURES:
        return DefectCNN(CNN_ARCHITECTURES[architecture], num_classes, in_channels)
    if architecture in PRETRAINED_ARCHITECTURES:
        return PretrainedClassifier(PRETRAINED_ARCHITECTURES[architecture], num_classes)
    raise ValueError(f"unknown architecture {architecture!r}; choose one of {sorted(ARCHITECTURES)}")


def build_model(architecture: str, num_classes: int, seed: int | None = None, in_channels: int = 1) -> nn.Module:
    """A freshly initialised model for images with ``in_channels`` channels; with ``seed`` the
    initial (trainable) weights are reproducible. The pretrained family takes grey or RGB input."""
    if num_classes < 2:
        raise ValueError(f"a classifier needs at least two classes, got {num_classes}")
    with global_torch_rng(seed):
        return _build(architecture, num_classes, in_channels)


def federated_part(model: nn.Module) -> nn.Module:
    """The module whose weights are federated: the head of a pretrained model, else the whole model."""
    return model.trainable if isinstance(model, PretrainedClassifier) else model


def weights_of(model: nn.Module) -> OrderedDict[str, np.ndarray]:
    """A copy of the federated weights as numpy arrays: what travels between sites and what the registry stores."""
    return OrderedDict((k, v.detach().cpu().numpy().copy()) for k, v in federated_part(model).state_dict().items())


def load_weights(model: nn.Module, weights: Mapping[str, np.ndarray]) -> nn.Module:
    """Load numpy weights (as `weights_of` returns them) into ``model``; returns the model."""
    federated_part(model).load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in weights.items()})
    return model
