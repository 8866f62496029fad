"""The CNN family FedForge federates: small GroupNorm CNNs that Opacus can privatise.

BatchNorm mixes statistics across the samples of a batch, which per-sample gradients (DP-SGD) and
FedAvg over non-IID factories both dislike, so every normalisation layer here is a GroupNorm.
Parallelism, DP wrappers and checkpointing are applied to these models from outside; the model code
does not change for them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn


@dataclass(frozen=True)
class ArchSpec:
    """Widths of the convolution stages; each stage is two 3x3 convs then a 2x down-sampling."""

    widths: tuple[int, ...]
    head_hidden: int


ARCHITECTURES: dict[str, ArchSpec] = {
    "cnn-small": ArchSpec(widths=(16, 32, 64), head_hidden=64),
    "cnn-medium": ArchSpec(widths=(32, 64, 128), head_hidden=128),
    "cnn-large": ArchSpec(widths=(64, 128, 256), head_hidden=256),
}


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


def build_model(architecture: str, num_classes: int, seed: int | None = None) -> DefectCNN:
    """A freshly initialised model; with ``seed`` the initial weights are reproducible."""
    if architecture not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {architecture!r}; choose one of {sorted(ARCHITECTURES)}")
    if seed is not None:
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            return DefectCNN(ARCHITECTURES[architecture], num_classes)
    return DefectCNN(ARCHITECTURES[architecture], num_classes)


def weights_of(model: nn.Module) -> OrderedDict[str, np.ndarray]:
    """A copy of the model's parameters and buffers as numpy arrays: what travels between sites and what the registry stores."""
    return OrderedDict((k, v.detach().numpy().copy()) for k, v in model.state_dict().items())


def load_weights(model: nn.Module, weights: Mapping[str, np.ndarray]) -> nn.Module:
    """Load numpy weights (as `weights_of` returns them) into ``model``; returns the model."""
    model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()})
    return model


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
