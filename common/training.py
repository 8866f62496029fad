"""Local training and evaluation loops shared by the edge agent, the server and the benchmarks.

The loop reads top to bottom: batches, forward, loss, backward, clip, step, schedule. Everything a
factory can tune is in `TrainConfig`; parallelism and DP are applied around this loop by the agent.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from common.data.datasets import ImageSet


def set_torch_threads(threads: int | None = None) -> int:
    """Pin torch's intra-op threads (env FEDFORGE_TORCH_THREADS, default 1).

    Several torch processes on a 2-core machine that each take every core make small ops about
    1000x slower, so every FedForge process that runs torch calls this first.
    """
    n = int(threads if threads is not None else os.environ.get("FEDFORGE_TORCH_THREADS", "1"))
    torch.set_num_threads(max(1, n))
    return torch.get_num_threads()


@contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """Use ``threads`` intra-op threads for a block (e.g. while everything else is idle), then restore."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, int(threads)))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _key(name: str, help_text: str) -> dict[str, str]:
    return {"key": name, "help": help_text}


@dataclass(frozen=True)
class TrainConfig:
    """Everything a factory's local training accepts, with its default: the one place both are written.

    Each field's ``key`` metadata is its name in the run configuration (``[tool.flwr.app.config]``,
    ``fedforge run --set key=value``); the server sends those keys with every train message and the
    factory builds this from them (`from_run_config`). ``seed`` is derived per round, not configured.
    """

    epochs: int = field(default=2, metadata=_key("local-epochs", "local epochs per round"))
    batch_size: int = field(default=16, metadata=_key("batch-size", "local mini-batch size"))
    lr: float = field(default=1e-3, metadata=_key("lr", "local learning rate"))
    optimizer: str = field(default="adamw", metadata=_key("optimizer", "local optimiser: adamw | sgd"))
    momentum: float = field(default=0.9, metadata=_key("momentum", "SGD momentum (local)"))
    weight_decay: float = field(default=1e-4, metadata=_key("weight-decay", "decoupled weight decay"))
    warmup_fraction: float = field(default=0.1, metadata=_key("warmup-fraction", "share of a round's steps spent warming up"))
    grad_clip: float = field(default=5.0, metadata=_key("grad-clip", "max global L2 norm of the gradient, 0 = off"))
    augment: bool = field(default=False, metadata=_key("augment", "random flips and 90-degree rotations"))
    bf16: bool = field(default=False, metadata=_key("bf16", "bf16 autocast for the forward pass"))
    activation_checkpointing: bool = field(default=False, metadata=_key("activation-checkpointing", "recompute activations in backward"))
    proximal_mu: float = field(default=0.0, metadata=_key(
        "proximal-mu", "FedProx for the cnn-* family and a head trained with DP: weight of mu/2 ||w - w_global||^2, 0 = off"))
    logit_adjustment: float = field(default=0.0, metadata=_key(
        "logit-adjustment", "tau of the cnn-* family (trained from scratch): train on logits + tau log(local label prior), 0 = off"))
    # The pretrained family's head, trained without DP, on logits + tau log(this factory's label prior): the averaged head is then
    # not pulled to each factory's label mix (measured on six data settings, 3 seeds each: the global model +1.2 to +3.3 points,
    # what factories serve unchanged within a few images; docs/benchmarks.md). The cnn-* family was not measured with it.
    head_logit_adjustment: float = field(default=1.0, metadata=_key(
        "head-logit-adjustment", "tau of the pretrained family's head trained without DP: logits + tau log(this factory's label prior); "
                                 "0 = off"))
    # ...and with FedProx's proximal term, which keeps a factory's two local epochs from drifting to its own label mix: the global
    # model +0.4 to +12 points on six data settings of three generators, most where factories are many, small and skewed
    # (docs/benchmarks.md). A head trained with DP (about 4 steps a round) keeps proximal-mu: in a simulator mu only cost it accuracy.
    head_proximal_mu: float = field(default=1.0, metadata=_key(
        "head-proximal-mu", "FedProx for the pretrained family's head trained without DP: weight of mu/2 ||w - w_global||^2, 0 = off"))
    personal_epochs: int = field(default=10, metadata=_key("personal-epochs", "epochs of a factory's personal fine-tune of each global model"))
    personal_lr: float = field(default=1e-3, metadata=_key("personal-lr", "learning rate of that fine-tune (not decayed over rounds)"))
    local_only_epochs: int = field(default=20, metadata=_key(
        "local-only-epochs", "epochs of the head a factory trains on its own images alone; its personal model is the mean of that head "
                             "and the fine-tuned global one (pretrained family; 0: the fine-tune alone)"))
    # The personal fine-tune also learns, from the run's public proxy images, the classes this factory rarely sees: those images the
    # global model labels, at least this sure, as a class under personal-public-rare of the factory's training images (measured on four
    # data sets: personal models better than local-only at 35 of 42 factories against 31; docs/benchmarks.md)
    personal_public_confidence: float = field(default=0.8, metadata=_key(
        "personal-public-confidence", "the personal fine-tune also trains on the run's public proxy images that the global model labels "
                                      "with at least this probability as a class rare at this factory (0: off)"))
    personal_public_rare: float = field(default=0.05, metadata=_key(
        "personal-public-rare", "a class is rare at a factory when it holds fewer than this share of its training images"))
    # DP-SGD on the pretrained family's linear head (client.subspace): its own optimiser settings, because the noise, not the
    # data, sets the step there (measured at epsilon 8, 3 factories: on the whole head SGD lr 0.3 over batches of 256 reached 0.614,
    # AdamW lr 3e-3 over 16 0.559; in the public subspace lr 0.6 under the run's lr-schedule with whitening 0.5; docs/benchmarks.md).
    # Halved to 0.3 when the head's server step doubled (head-server-lr 2): the global model moves by the same amount a round
    private_head_optimizer: str = field(default="sgd", metadata=_key("private-head-optimizer", "optimiser of a head trained with DP-SGD: adamw | sgd"))
    private_head_lr: float = field(default=0.3, metadata=_key("private-head-lr", "learning rate of a head trained with DP-SGD (decayed over rounds "
                                                                                           "like lr, under lr-schedule)"))
    private_head_batch_size: int = field(default=256, metadata=_key("private-head-batch-size", "expected batch of a head trained with DP-SGD"))
    # DP-SGD clips every example's gradient to the same norm, which caps what a factory's few images of a rare class can teach
    # and leaves its head leaning to its majority classes; training on logits + tau log(prior), the prior being the class counts
    # the factory released with noise, takes that lean out (built-in skewed data, epsilon 8: docs/benchmarks.md)
    private_head_logit_adjustment: float = field(default=1.0, metadata=_key(
        "private-head-logit-adjustment", "tau of the logit adjustment a head trained with DP-SGD trains with: logits + tau log(the "
                                         "factory's released class prior); 0 = off"))
    # A factory that shares the secure sum's DP noise (--dp-secure-sum) takes one full-batch DP gradient step per round instead:
    # its step size (30 rounds, server momentum 0.7: 2, 3 and 4 within a point of each other on three data sets; docs/benchmarks.md),
    # halved to 1.5 when the head's server step doubled (head-server-lr 2): the same step on the global model, exactly
    secure_sum_lr: float = field(default=1.5, metadata=_key(
        "secure-sum-lr", "step size of the one DP gradient step per round of a factory that shares the secure sum's noise "
                         "(--dp-secure-sum; decayed over rounds like lr, under lr-schedule)"))
    # Fewer directions, less noise, a lower ceiling: at epsilon 8 and 270 to 540 images per factory, 32 to 48 directions beat
    # 128 by 1 to 9 points on four data sets of three generators and tied it on the fifth; 24 fell off on three (docs/benchmarks.md)
    public_subspace: int = field(default=40, metadata=_key(
        "public-subspace", "a head trained with DP-SGD trains within this many principal directions of the proxy set's features "
                           "(public images; 0: the whole head)"))
    public_subspace_whitening: float = field(default=0.5, metadata=_key(
        "public-subspace-whitening", "scale each public direction by (its singular value / the first)^-w: 0 none, 1 full whitening"))
    seed: int = 0

    def __post_init__(self) -> None:
        if self.optimizer not in ("adamw", "sgd"):
            raise ValueError(f"optimizer must be 'adamw' or 'sgd', got {self.optimizer!r}")
        if self.epochs < 0 or self.batch_size < 1 or self.lr <= 0:
            raise ValueError(f"local-epochs must be >= 0, batch-size >= 1 and lr > 0 (got {self.epochs}, {self.batch_size}, {self.lr})")
        if self.personal_epochs < 0 or self.personal_lr <= 0 or self.local_only_epochs < 0:
            raise ValueError(f"personal-epochs and local-only-epochs must be >= 0 and personal-lr > 0 "
                             f"(got {self.personal_epochs}, {self.local_only_epochs}, {self.personal_lr})")
        if not 0 <= self.personal_public_confidence < 1 or not 0 <= self.personal_public_rare <= 1:
            raise ValueError(f"personal-public-confidence must be in [0, 1) and personal-public-rare in [0, 1] "
                             f"(got {self.personal_public_confidence}, {self.personal_public_rare})")
        if self.private_head_optimizer not in ("adamw", "sgd"):
            raise ValueError(f"private-head-optimizer must be 'adamw' or 'sgd', got {self.private_head_optimizer!r}")
        if min(self.logit_adjustment, self.head_logit_adjustment, self.private_head_logit_adjustment) < 0:
            raise ValueError(f"logit-adjustment, head-logit-adjustment and private-head-logit-adjustment must be >= 0 (got {self.logit_adjustment}, "
                             f"{self.head_logit_adjustment}, {self.private_head_logit_adjustment})")
        if self.private_head_lr <= 0 or self.private_head_batch_size < 1 or self.public_subspace < 0 or not 0 <= self.public_subspace_whitening <= 1:
            raise ValueError(f"private-head-lr must be > 0, private-head-batch-size >= 1, public-subspace >= 0 and public-subspace-whitening in "
                             f"[0, 1] (got {self.private_head_lr}, {self.private_head_batch_size}, {self.public_subspace}, "
                             f"{self.public_subspace_whitening})")
        if self.secure_sum_lr <= 0:
            raise ValueError(f"secure-sum-lr must be > 0, got {self.secure_sum_lr}")
        if min(self.proximal_mu, self.head_proximal_mu) < 0 or self.weight_decay < 0 or self.grad_clip < 0 or not 0 <= self.warmup_fraction < 1:
            raise ValueError("proximal-mu, head-proximal-mu, weight-decay and grad-clip must be >= 0 and warmup-fraction in [0, 1)")

    @classmethod
    def run_config_defaults(cls) -> dict[str, Any]:
        """{run-config key: default} for every configurable field."""
        return {f.metadata["key"]: f.default for f in fields(cls) if "key" in f.metadata}

    @classmethod
    def from_run_config(cls, config: Mapping[str, Any], seed: int = 0) -> TrainConfig:
        """Build from run-config keys (missing ones take their defaults); raises ValueError naming a bad key."""
        values: dict[str, Any] = {"seed": seed}
        for f in fields(cls):
            key = f.metadata.get("key")
            if key is None or key not in config:
                continue
            raw = config[key]
            try:
                values[f.name] = coerce(raw, type(f.default))
            except (TypeError, ValueError):
                raise ValueError(f"run-config key {key!r} must be a {type(f.default).__name__}, got {raw!r}") from None
        return cls(**values)

    def for_head(self) -> TrainConfig:
        """Training the pretrained family's head without DP: its own logit adjustment and proximal term (``head-logit-adjustment``,
        ``head-proximal-mu``)."""
        return replace(self, logit_adjustment=self.head_logit_adjustment, proximal_mu=self.head_proximal_mu)

    def personal(self) -> TrainConfig:
        """The fine-tune that makes a factory's personal model: its own epochs and learning rate, plain cross-entropy."""
        return replace(self, epochs=self.personal_epochs, lr=self.personal_lr, proximal_mu=0.0, logit_adjustment=0.0)

    def local_only(self) -> TrainConfig:
        """Training a head on the factory's images alone, from scratch (blended into its personal model)."""
        return replace(self.personal(), epochs=self.local_only_epochs)

    def private_head(self) -> TrainConfig:
        """Training a linear head with DP-SGD: the private-head optimiser, learning rate and batch."""
        return replace(self, optimizer=self.private_head_optimizer, lr=self.private_head_lr, batch_size=self.private_head_batch_size)

    def to_run_config(self) -> dict[str, Any]:
        return {f.metadata["key"]: getattr(self, f.name) for f in fields(self) if "key" in f.metadata}


def coerce(value: Any, kind: type) -> Any:
    if kind is bool:
        if isinstance(value, str):
            if value.lower() in ("true", "1", "yes"):
                return True
            if value.lower() in ("false", "0", "no"):
                return False
            raise ValueError(value)
        return bool(value)
    if kind is int and isinstance(value, float) and not value.is_integer():
        raise ValueError(value)
    return kind(value)


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """The local optimiser over the parameters that train (a frozen backbone's are left out)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def warmup_cosine(step: int, total: int, warmup_fraction: float) -> float:
    """Multiplier of the base learning rate: linear warm-up, then cosine decay to 10%."""
    warmup = max(1, int(total * warmup_fraction))
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def augment_batch(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Random flips and 90-degree rotations: surfaces have no preferred orientation."""
    k = int(torch.randint(0, 4, (1,), generator=generator))
    x = torch.rot90(x, k, dims=(2, 3))
    if bool(torch.randint(0, 2, (1,), generator=generator)):
        x = torch.flip(x, dims=(3,))
    return x


@dataclass
class TrainResult:
    loss: float
    accuracy: float
    steps: int
    examples: int


def _batch(data: ImageSet, idx: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    i = idx.numpy()
    return torch.from_numpy(data.images_at(i)).to(device), torch.from_numpy(np.asarray(data.labels)[i]).to(device)


def label_prior_adjustment(labels: np.ndarray, classes: int, tau: float) -> torch.Tensor:
    """tau * log(prior) of this factory's labels (add-one smoothed), added to the logits in the training loss.

    Logit-adjusted cross-entropy (Menon et al. 2021; FedLC, Zhang et al. 2022): a factory that has seen
    mostly one class learns how much an image looks like each class rather than "my majority class",
    so the averaged model is not dragged towards each factory's label mix. Predictions use the plain
    logits. 0 leaves the loss unchanged.
    """
    return prior_adjustment(np.bincount(labels.astype(np.int64), minlength=classes), tau)


def group_prior_adjustment(labels: np.ndarray, groups: np.ndarray, classes: int, tau: float) -> torch.Tensor:
    """Per example (N, classes): tau * log(prior) of the labels of the example's own group (`label_prior_adjustment`).

    What training on several factories' images pooled needs to train with the loss each factory's head trains with in
    the federation: every image adjusted by its own factory's label mix, not by the union's."""
    labels, groups = np.asarray(labels, dtype=np.int64), np.asarray(groups)
    if groups.shape != labels.shape:
        raise ValueError(f"groups must give one group per example: {groups.shape} groups for {labels.shape} labels")
    out = torch.zeros((len(labels), classes))
    for group in np.unique(groups):
        members = groups == group
        out[torch.from_numpy(members)] = label_prior_adjustment(labels[members], classes, tau)
    return out


def prior_adjustment(counts: np.ndarray, tau: float) -> torch.Tensor:
    """tau * log(prior) of class ``counts`` (add-one smoothed; a noisy release's negative counts read as 0)."""
    counts = np.asarray(counts, dtype=np.float64)
    if tau <= 0:
        return torch.zeros(len(counts))
    smoothed = np.maximum(counts, 0.0) + 1.0
    return torch.from_numpy(tau * np.log(smoothed / smoothed.sum())).float()


def proximal_term(model: nn.Module, anchor: list[torch.Tensor]) -> torch.Tensor:
    """FedProx (Li et al. 2020): ||w - w_global||^2 over the trainable parameters (times mu/2 by the caller)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return sum(((p - a) ** 2).sum() for p, a in zip(params, anchor))  # type: ignore[return-value]


def train(model: nn.Module, data: ImageSet, cfg: TrainConfig, shard: tuple[int, int] = (0, 1), groups: np.ndarray | None = None) -> TrainResult:
    """Train ``model`` in place for ``cfg.epochs`` epochs over ``data``.

    With ``shard=(rank, world_size)`` every rank walks the same global batches (same seed) and
    computes on its slice ``batch[rank::world_size]``; DDP/FSDP average the gradients, so the
    step equals a single process's step on the whole global batch. With ``cfg.proximal_mu`` the loss
    gains FedProx's mu/2 ||w - w_global||^2, w_global being the weights the model starts with. With ``groups`` (one
    per example: the factory it comes from, when images are pooled) the logit adjustment is each group's own
    (`group_prior_adjustment`) instead of the whole set's.
    """
    rank, world_size = shard
    generator = torch.Generator().manual_seed(cfg.seed)
    n = len(data)
    steps_per_epoch = math.ceil(n / cfg.batch_size)
    total = max(1, steps_per_epoch * cfg.epochs)
    optimizer = make_optimizer(model, cfg)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_cosine(s, total, cfg.warmup_fraction))
    model.train()
    device = next(iter(model.parameters())).device
    anchor = [p.detach().clone() for p in model.parameters() if p.requires_grad] if cfg.proximal_mu > 0 else []
    if groups is None:
        adjust = label_prior_adjustment(np.asarray(data.labels), len(data.classes), cfg.logit_adjustment).to(device)
    else:
        per_example = group_prior_adjustment(np.asarray(data.labels), groups, len(data.classes), cfg.logit_adjustment).to(device)
    loss_sum, correct, seen, step = 0.0, 0, 0, 0
    for _ in range(cfg.epochs):
        order = torch.randperm(n, generator=generator)
        for start in range(0, n, cfg.batch_size):
            batch = order[start : start + cfg.batch_size]
            x, y = _batch(data, batch[rank::world_size], device)
            if groups is not None:
                adjust = per_example[batch[rank::world_size].to(device)]
            if cfg.augment:
                x = augment_batch(x, generator)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
                logits = model(x)
            # Sum over this rank's slice, divided by the *global* batch size (times world size, which
            # DDP/FSDP divide back out when they average): exactly the single-process mean loss,
            # whatever the slice sizes, and an empty slice contributes zero.
            loss_sum_local = F.cross_entropy(logits.float() + adjust, y, reduction="sum")
            loss = loss_sum_local * (world_size / len(batch))
            if anchor:
                loss = loss + 0.5 * cfg.proximal_mu * proximal_term(model, anchor)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.grad_clip > 0:
                nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optimizer.step()
            schedule.step()
            step += 1
            loss_sum += float(loss_sum_local.detach())
            correct += int((logits.argmax(1) == y).sum())
            seen += len(y)
    return TrainResult(loss=loss_sum / max(1, seen), accuracy=correct / max(1, seen), steps=step, examples=n)


@dataclass
class EvalResult:
    loss: float
    accuracy: float
    examples: int
    confusion: np.ndarray  # (classes, classes) counts: row = true class, column = predicted class


@torch.no_grad()
def predict_logits(model: nn.Module, data: ImageSet, batch_size: int = 256) -> np.ndarray:
    model.eval()
    out = [model(torch.from_numpy(data.images_at(np.arange(s, min(s + batch_size, len(data)))))).float()
           for s in range(0, len(data), batch_size)]
    return torch.cat(out).numpy() if out else np.zeros((0, len(data.classes)), dtype=np.float32)


def evaluate(model: nn.Module, data: ImageSet, batch_size: int = 256) -> EvalResult:
    """Loss, accuracy and the confusion matrix of ``model`` on ``data``."""
    logits = predict_logits(model, data, batch_size)
    truth = np.asarray(data.labels, dtype=np.int64)
    pred = logits.argmax(1)
    k = len(data.classes)
    confusion = np.bincount(truth * k + pred, minlength=k * k).reshape(k, k) if len(truth) else np.zeros((k, k), dtype=np.int64)
    loss = float(F.cross_entropy(torch.from_numpy(logits), torch.from_numpy(truth), reduction="sum")) if len(truth) else 0.0
    n = max(1, len(truth))
    return EvalResult(loss=loss / n, accuracy=float((pred == truth).sum()) / n, examples=len(truth), confusion=confusion.astype(np.int64))
