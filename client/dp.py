"""DP-SGD local training with Opacus: per-sample clipping, Gaussian noise, Poisson sampling.

One `PrivacyEngine` per round on a fresh, plain model (re-privatising last round's module fails in
Opacus, and the ledger, not the engine, carries the history). Sampling and noise generators are
seeded from ``os.urandom``: torchcsprng (Opacus' ``secure_mode``) does not install for this stack.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from common.data.datasets import ImageSet
from common.training import TrainConfig, TrainResult, make_optimizer, warmup_cosine

# Opacus warns on every engine that secure_mode is off (see docs/security.md for why and what we do
# instead) and torch warns that backward hooks fire for inputs without grad: both are expected here.
warnings.filterwarnings("ignore", message=".*Secure RNG turned off.*")
warnings.filterwarnings("ignore", message=".*Full backward hook is firing.*")


class DPConfigError(ValueError):
    """The model or settings cannot be trained with DP-SGD; the message says what to change."""


def check_dp_compatible(model: nn.Module, fix: bool = False) -> nn.Module:
    """Refuse BatchNorm (per-sample gradients need sample-independent layers), or fix it when asked."""
    from opacus.validators import ModuleValidator

    model.train()
    errors = ModuleValidator.validate(model, strict=False)
    if not errors:
        return model
    if fix:
        return ModuleValidator.fix(model)
    raise DPConfigError(
        "the model cannot be trained with DP-SGD: " + "; ".join(str(e) for e in errors[:3])
        + ". Use GroupNorm instead of BatchNorm (FedForge's cnn-* models do), or enable --dp-fix-model."
    )


@dataclass(frozen=True)
class DPPlan:
    """What the factory's budget allows this round: the noise, the clipping bound, the sampling rate.

    ``examples``: the image count the schedule was planned from and the summed gradients are averaged by: the total of
    the factory's *released* (noisy) class counts, never its exact count (0: the data set's own size, for callers that
    plan without a release)."""

    noise_multiplier: float
    max_grad_norm: float
    sample_rate: float
    grad_sample_mode: str = "hooks"
    examples: float = 0.0


def steps_per_epoch(num_examples: int, batch_size: int) -> int:
    """Poisson batches per epoch for an expected batch of ``batch_size``: ceil(n / B), as Opacus' loader would have."""
    return max(1, math.ceil(max(1, num_examples) / batch_size))


def sample_rate(num_examples: int, batch_size: int) -> float:
    """The Poisson sampling rate of that schedule: q = 1 / ceil(n / B) (what the ledger charges).

    A DP factory passes the total of its released class counts as n: the rate, the step count and the noise multiplier
    then depend on that release only, so they tell nothing more about its images (with the exact n, adding one image can
    add a step, which DP's accounting does not cover)."""
    return 1.0 / steps_per_epoch(num_examples, batch_size)


def poisson_steps(rate: float) -> int:
    """Batches per epoch of a Poisson schedule at ``rate`` = 1 / steps: round(1 / q), the steps the ledger charged
    (Opacus' int(1 / q) could round one step away)."""
    return max(1, round(1.0 / rate))


def poisson_loader(dataset: Dataset, rate: float, **kwargs: Any) -> DataLoader:
    """Opacus' Poisson loader at ``rate``, with exactly `poisson_steps` batches per epoch: the schedule the ledger charged,
    whatever the data set's size."""
    from opacus.data_loader import DPDataLoader

    loader = DPDataLoader(dataset, sample_rate=rate, generator=_urandom_generator(), **kwargs)
    loader.batch_sampler.steps = poisson_steps(rate)  # type: ignore[union-attr]
    return loader


def average_by_plan(private_opt: Any, plan: DPPlan, world_size: int = 1) -> None:
    """Average each step's noisy sum over the plan's expected batch (released count x q), not Opacus' len(data) x q: the
    update's scale, too, then depends on the release only."""
    if plan.examples > 0:
        private_opt.expected_batch_size = max(1e-6, plan.examples * plan.sample_rate / world_size)


class ImageSetDataset(Dataset):
    """An `ImageSet` as a torch Dataset; batches are fetched in one call (``__getitems__``), so a
    streamed folder decodes exactly the sampled images."""

    def __init__(self, data: ImageSet) -> None:
        self.data = data
        self.labels = torch.from_numpy(np.asarray(data.labels, dtype=np.int64))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.from_numpy(self.data.images_at(np.array([i]))[0]), self.labels[i]

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        images = torch.from_numpy(self.data.images_at(np.asarray(indices, dtype=np.int64)))
        return [(images[j], self.labels[i]) for j, i in enumerate(indices)]


def _urandom_generator(device: torch.device | str = "cpu") -> torch.Generator:
    """A generator seeded from ``os.urandom``, on ``device``: Opacus draws each step's noise on the parameters' device, and
    torch refuses a generator that lives elsewhere (a CPU generator for a model on a GPU)."""
    return torch.Generator(device=device).manual_seed(int.from_bytes(os.urandom(8), "little") & ((1 << 63) - 1))


def noisy_counts(counts: np.ndarray, noise_multiplier: float) -> np.ndarray:
    """``counts`` (sensitivity 1) plus Gaussian noise of standard deviation ``noise_multiplier``, then rounded and floored
    at 0 (post-processing: costs nothing more). The noise comes from a generator seeded by ``os.urandom``."""
    counts = np.asarray(counts, dtype=np.float64)
    noise = torch.normal(0.0, float(noise_multiplier), size=counts.shape, generator=_urandom_generator(), dtype=torch.float64).numpy()
    return np.maximum(0.0, np.rint(counts + noise))


def make_private(model: nn.Module, optimizer: torch.optim.Optimizer, loader: DataLoader, noise_multiplier: float, max_grad_norm: float,
                 grad_sample_mode: str, poisson_sampling: bool) -> tuple[nn.Module, Any, Any, DataLoader]:
    """Opacus' ``make_private`` with one return shape: (model, optimizer, criterion, loader).

    Ghost clipping modes return a criterion that runs the two backward passes; other modes use
    plain cross-entropy.
    """
    from opacus import PrivacyEngine

    model.train()  # Opacus validates the module in training mode
    engine = PrivacyEngine(accountant="rdp")  # its accountant is never read: the ledger accounts (client.privacy.epsilon_of)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Ss]ecure.*")
        warnings.filterwarnings("ignore", message=".*Optimal order.*")
        made = engine.make_private(
            module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm,
            poisson_sampling=poisson_sampling, noise_generator=_urandom_generator(next(model.parameters()).device),
            grad_sample_mode=grad_sample_mode,
            criterion=nn.CrossEntropyLoss(),
        )
    if "ghost" in grad_sample_mode:
        private_model, private_opt, criterion, private_loader = made
    else:
        (private_model, private_opt, private_loader), criterion = made, nn.CrossEntropyLoss()
    return private_model, private_opt, criterion, private_loader


class LogitShift(nn.Module):
    """``module(x) + shift``: trains ``module`` on shifted logits (logit adjustment) while its own outputs stay plain.

    The shift is a buffer, not a parameter: DP-SGD clips, noises and accounts for ``module``'s parameters only, and it must
    come from data already released (a DP factory's noisy class counts), or it would leak what DP protects."""

    def __init__(self, module: nn.Module, shift: torch.Tensor) -> None:
        super().__init__()
        self.module = module
        device = next(module.parameters()).device
        self.register_buffer("shift", shift.detach().float().to(device).clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x) + self.shift


def train_private(model: nn.Module, data: ImageSet, cfg: TrainConfig, plan: DPPlan, logit_shift: torch.Tensor | None = None) -> TrainResult:
    """Train ``model`` (a plain module; its weights change in place) with DP-SGD for ``cfg.epochs``: Poisson batches at the
    plan's rate, for the plan's steps (`poisson_loader`), averaged by the plan's count (`average_by_plan`). With
    ``logit_shift`` it trains on ``logits + logit_shift`` (`LogitShift`)."""
    if logit_shift is not None:
        model = LogitShift(model, logit_shift)
    loader = poisson_loader(ImageSetDataset(data), plan.sample_rate)
    private_model, private_opt, criterion, private_loader = make_private(
        model, make_optimizer(model, cfg), loader, plan.noise_multiplier, plan.max_grad_norm, plan.grad_sample_mode, poisson_sampling=False
    )
    average_by_plan(private_opt, plan)
    return run_dp_epochs(private_model, private_opt, criterion, private_loader, cfg, examples=len(data), step_on_empty=False)


def noisy_gradient_step(model: nn.Module, data: ImageSet, lr: float, noise_multiplier: float, max_grad_norm: float,
                        chunk: int = 512, normaliser: int | None = None, logit_shift: torch.Tensor | None = None) -> TrainResult:
    """One DP gradient step over the whole of ``data``: the Gaussian mechanism on the sum of per-example gradients.

    Each example's gradient (at the weights ``model`` holds) is clipped to ``max_grad_norm``; their sum gets Gaussian
    noise of standard deviation ``noise_multiplier * max_grad_norm`` (drawn from a generator seeded by ``os.urandom``),
    and the trainable parameters move by ``-lr * (sum + noise) / normaliser``, ``normaliser`` being the weight the update
    is sent with (the total of the factory's released class counts; ``len(data)`` by default). This is what a factory that
    shares the secure sum's noise sends (``--dp-secure-sum``, docs/security.md): its weighted update, summed with the
    others' in the secure sum, is exactly the noisy sum of clipped gradients, one DP-SGD step over every factory's images
    with the noise of all of them. Per-example gradients come
    from ``torch.func`` in chunks, so memory stays bounded whatever the split's size. With ``logit_shift`` the loss is on
    ``logits + logit_shift`` (`LogitShift`).
    """
    from torch.func import functional_call, grad, vmap

    n = len(data)
    if n == 0:
        raise ValueError("a DP gradient step needs at least one training image; this factory's training split is empty")
    trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
    fixed = {name: p.detach() for name, p in model.named_parameters() if not p.requires_grad}
    buffers = dict(model.named_buffers())
    model.train()
    device = next(iter(trainable.values())).device if trainable else torch.device("cpu")
    shift = torch.zeros((), device=device) if logit_shift is None else logit_shift.detach().float().to(device)

    def loss_of(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = functional_call(model, ({**params, **fixed}, buffers), (x.unsqueeze(0),))
        return F.cross_entropy(logits.float() + shift, y.unsqueeze(0))

    per_example = vmap(grad(loss_of), in_dims=(None, 0, 0))
    detached = {name: p.detach() for name, p in trainable.items()}
    total = {name: torch.zeros_like(p) for name, p in detached.items()}
    labels = torch.from_numpy(np.asarray(data.labels, dtype=np.int64))
    loss_sum, correct = 0.0, 0
    for start in range(0, n, chunk):
        index = np.arange(start, min(n, start + chunk))
        x, y = torch.from_numpy(data.images_at(index)), labels[index]
        grads = per_example(detached, x, y)
        norms = torch.sqrt(sum(g.reshape(len(index), -1).pow(2).sum(1) for g in grads.values()))
        factor = (max_grad_norm / (norms + 1e-6)).clamp(max=1.0)  # Opacus' per-example clipping factor
        for name, g in grads.items():
            total[name] += torch.einsum("i,i...->...", factor, g)
        with torch.no_grad():
            logits = functional_call(model, ({**detached, **fixed}, buffers), (x,)).float()
            loss_sum += float(F.cross_entropy(logits + shift, y, reduction="sum"))
            correct += int((logits.argmax(1) == y).sum())
    generator = _urandom_generator()
    with torch.no_grad():
        for name, p in trainable.items():
            noise = torch.normal(0.0, noise_multiplier * max_grad_norm, size=p.shape, generator=generator)
            p.sub_(lr * (total[name] + noise.to(p.device, p.dtype)) / (normaliser or n))
    if not all(torch.isfinite(p).all() for p in trainable.values()):
        raise FloatingPointError("the DP gradient step gave non-finite weights; lower secure-sum-lr")
    return TrainResult(loss=loss_sum / n, accuracy=correct / n, steps=1, examples=n)


def run_dp_epochs(private_model: nn.Module, private_opt: Any, criterion: Any, private_loader: DataLoader, cfg: TrainConfig, examples: int,
                  step_on_empty: bool, on_epoch: Any = None) -> TrainResult:
    """The DP-SGD loop shared by the single-process and the DDP/FSDP paths.

    ``step_on_empty``: an empty Poisson batch still runs forward/backward/step, so that ranks of a
    worker group stay in lockstep (a single process just skips it). ``on_epoch(epoch)`` runs before
    each epoch (e.g. the distributed sampler's ``set_epoch``).
    """
    total = max(1, len(private_loader) * cfg.epochs)
    schedule = torch.optim.lr_scheduler.LambdaLR(private_opt.original_optimizer, lambda s: warmup_cosine(s, total, cfg.warmup_fraction))
    private_model.train()
    device = next(iter(private_model.parameters())).device
    params = [p for p in private_model.parameters() if p.requires_grad]
    # FedProx under DP: the proximal gradient mu (w - w_global) does not depend on any example, so it is
    # applied as its own (decoupled) step after the private one and costs no privacy.
    anchor = [p.detach().clone() for p in params] if cfg.proximal_mu > 0 else []
    loss_sum, correct, seen, steps = 0.0, 0, 0, 0
    for epoch in range(cfg.epochs):
        if on_epoch is not None:
            on_epoch(epoch)
        for x, y in private_loader:
            if len(y) == 0 and not step_on_empty:  # nothing to learn from, still a step of the mechanism
                private_opt.zero_grad(set_to_none=True)
                continue
            x, y = x.to(device), y.to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
                logits = private_model(x)
            loss = criterion(logits, y) if len(y) else logits.sum() * 0.0
            private_opt.zero_grad(set_to_none=True)
            loss.backward()
            private_opt.step()
            if anchor:
                with torch.no_grad():
                    lr = private_opt.original_optimizer.param_groups[0]["lr"]
                    for p, a in zip(params, anchor):
                        p.sub_(lr * cfg.proximal_mu * (p - a))
            schedule.step()
            steps += 1
            if len(y):
                loss_sum += float(loss.detach()) * len(y)
                correct += int((logits.argmax(1) == y).sum())
                seen += len(y)
    if hasattr(private_model, "_close"):
        private_model._close()  # remove Opacus hooks: the plain module's weights are what leave the agent
    if not math.isfinite(loss_sum):
        raise FloatingPointError("DP training diverged (non-finite loss); lower the learning rate")
    return TrainResult(loss=loss_sum / max(1, seen), accuracy=correct / max(1, seen), steps=steps, examples=examples)
