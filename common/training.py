"""Local training and evaluation loops shared by the edge agent, the server and the benchmarks.

The loop reads top to bottom: batches, forward, loss, backward, clip, step, schedule. Everything a
factory can tune is in `TrainConfig`; parallelism and DP are applied around this loop by the agent.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from common.data.datasets import ImageDataset


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


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = 1
    batch_size: int = 16
    lr: float = 1e-3
    optimizer: str = "adamw"  # adamw | sgd
    momentum: float = 0.9
    weight_decay: float = 1e-4
    warmup_fraction: float = 0.1
    grad_clip: float = 5.0  # max global L2 norm of the gradient, 0 = off
    augment: bool = False
    bf16: bool = False  # bf16 autocast for the forward pass (CPU and GPU)
    activation_checkpointing: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.optimizer not in ("adamw", "sgd"):
            raise ValueError(f"optimizer must be 'adamw' or 'sgd', got {self.optimizer!r}")
        if self.epochs < 0 or self.batch_size < 1 or self.lr <= 0:
            raise ValueError(f"invalid training config {self}")


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)


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


def train(model: nn.Module, data: ImageDataset, cfg: TrainConfig, shard: tuple[int, int] = (0, 1)) -> TrainResult:
    """Train ``model`` in place for ``cfg.epochs`` epochs over ``data``.

    With ``shard=(rank, world_size)`` every rank walks the same global batches (same seed) and
    computes on its slice ``batch[rank::world_size]``; DDP/FSDP average the gradients, so the
    step equals a single process's step on the whole global batch.
    """
    rank, world_size = shard
    generator = torch.Generator().manual_seed(cfg.seed)
    images = torch.from_numpy(data.images)
    labels = torch.from_numpy(data.labels)
    n = len(labels)
    steps_per_epoch = math.ceil(n / cfg.batch_size)
    total = max(1, steps_per_epoch * cfg.epochs)
    optimizer = make_optimizer(model, cfg)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_cosine(s, total, cfg.warmup_fraction))
    model.train()
    device = next(iter(model.parameters())).device
    loss_sum, correct, seen, step = 0.0, 0, 0, 0
    for _ in range(cfg.epochs):
        order = torch.randperm(n, generator=generator)
        for start in range(0, n, cfg.batch_size):
            batch = order[start : start + cfg.batch_size]
            idx = batch[rank::world_size]
            x, y = images[idx].to(device), labels[idx].to(device)
            if cfg.augment:
                x = augment_batch(x, generator)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
                logits = model(x)
            # Sum over this rank's slice, divided by the *global* batch size (times world size, which
            # DDP/FSDP divide back out when they average): exactly the single-process mean loss,
            # whatever the slice sizes, and an empty slice contributes zero.
            loss_sum_local = F.cross_entropy(logits.float(), y, reduction="sum")
            loss = loss_sum_local * (world_size / len(batch))
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
    per_class_accuracy: list[float]


@torch.no_grad()
def evaluate(model: nn.Module, data: ImageDataset, batch_size: int = 256) -> EvalResult:
    model.eval()
    images = torch.from_numpy(data.images)
    labels = torch.from_numpy(data.labels)
    loss_sum, preds = 0.0, []
    for start in range(0, len(labels), batch_size):
        logits = model(images[start : start + batch_size])
        loss_sum += float(F.cross_entropy(logits, labels[start : start + batch_size], reduction="sum"))
        preds.append(logits.argmax(1))
    pred = torch.cat(preds).numpy() if preds else np.empty(0, dtype=np.int64)
    truth = data.labels
    per_class = [
        float((pred[truth == c] == c).mean()) if (truth == c).any() else float("nan") for c in range(len(data.classes))
    ]
    n = max(1, len(truth))
    return EvalResult(loss=loss_sum / n, accuracy=float((pred == truth).sum()) / n, examples=len(truth), per_class_accuracy=per_class)
