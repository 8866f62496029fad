"""What a factory does with a global model: train it on local data, evaluate it, report metrics.

This is the library the edge agent serves over gRPC and that the ClientApp calls in-process when no
agent is configured (simulation, unit tests). Data is loaded once, in the constructor.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from pathlib import Path
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from client.config import AgentConfig
from client.parallel import apply_activation_checkpointing
from client.dp import check_dp_compatible, sample_rate, steps_per_epoch, train_private
from client.privacy import PrivacyLedger, noise_for_budget
from client.workers import Job, WorkerGroup
from common.data import datasets
from common.data.datasets import ImageDataset
from common.data.folder import FolderReport, load_image_folder
from common.distill import ProxySet, balanced_predictions, predict_proxy
from common.models import build_model, weights_of
from common.tensors import UpdateError, check_like
from common.training import TrainConfig, TrainResult, evaluate, set_torch_threads, train

log = logging.getLogger(__name__)


def load_factory_data(cfg: AgentConfig) -> tuple[ImageDataset, FolderReport]:
    if cfg.data == "synthetic":
        spec = datasets.SyntheticSpec(
            seed=cfg.data_seed, num_factories=cfg.num_factories, alpha=cfg.alpha, train_size=cfg.train_size, image_size=cfg.image_size
        )
        data = datasets.factory_dataset(spec, cfg.factory_index)
        return data, FolderReport(loaded=len(data))
    return load_image_folder(cfg.data, size=cfg.image_size)


def split_validation(data: ImageDataset, fraction: float, seed: int) -> tuple[ImageDataset, ImageDataset]:
    order = np.random.default_rng(seed).permutation(len(data))
    n_val = int(round(len(data) * fraction))
    val, tr = order[:n_val], order[n_val:]
    return (
        ImageDataset(data.images[tr], data.labels[tr], data.classes),
        ImageDataset(data.images[val], data.labels[val], data.classes),
    )


def train_config_from(config: dict[str, Any], server_round: int) -> TrainConfig:
    """The server's training options; unknown keys are ignored, bad values raise naming the key."""
    try:
        return TrainConfig(
            epochs=int(config.get("local-epochs", 2)),
            batch_size=int(config.get("batch-size", 16)),
            lr=float(config.get("lr", 1e-3)),
            optimizer=str(config.get("optimizer", "adamw")),
            weight_decay=float(config.get("weight-decay", 1e-4)),
            grad_clip=float(config.get("grad-clip", 5.0)),
            augment=bool(config.get("augment", False)),
            bf16=bool(config.get("bf16", False)),
            activation_checkpointing=bool(config.get("activation-checkpointing", False)),
            seed=int(config.get("seed", 0)) * 100_003 + server_round,
        )
    except (TypeError, ValueError) as exc:
        raise UpdateError(f"invalid training config from the server: {exc}") from exc


class FactoryTrainer:
    """One factory's warm state: its data, and a model instance per architecture."""

    def __init__(self, cfg: AgentConfig) -> None:
        set_torch_threads(cfg.torch_threads)
        self.cfg = cfg
        self.started = time.time()
        data, self.report = load_factory_data(cfg)
        self.train_data, self.val_data = split_validation(data, cfg.val_fraction, seed=cfg.data_seed)
        self._models: dict[str, torch.nn.Module] = {}
        self.budget = cfg.privacy_budget()
        self.ledger = PrivacyLedger(Path(cfg.state_dir) / "privacy-ledger.db", cfg.factory_id) if self.budget else None
        self.workers = WorkerGroup(cfg, cfg.parallelism, cfg.local_world_size) if cfg.parallelism != "none" else None
        log.info("factory %s: %d training and %d validation images from %s", cfg.factory_id, len(self.train_data), len(self.val_data), cfg.data)

    def _model_with(self, weights: OrderedDict[str, np.ndarray], config: dict[str, Any], fresh: bool = False) -> torch.nn.Module:
        architecture = str(config.get("architecture", "cnn-small"))
        model = None if fresh else self._models.get(architecture)
        if model is None:
            try:
                model = build_model(architecture, num_classes=len(self.train_data.classes))
            except ValueError as exc:
                raise UpdateError(str(exc)) from exc
            if not fresh:
                self._models[architecture] = model
        reference = {k: v.detach().numpy() for k, v in model.state_dict().items()}
        check_like(reference, weights, source="global model from the server")
        model.load_state_dict({k: torch.from_numpy(np.asarray(v, dtype=reference[k].dtype)) for k, v in weights.items()})
        return model

    def train(self, weights: OrderedDict[str, np.ndarray], config: dict[str, Any], server_round: int, run_id: str = "") -> tuple[OrderedDict[str, np.ndarray], int, dict[str, float]]:
        cfg = train_config_from(config, server_round)
        model = self._model_with(weights, config, fresh=self.budget is not None)
        if cfg.activation_checkpointing:
            apply_activation_checkpointing(model)
        if self.budget is not None:
            model = check_dp_compatible(model, fix=self.cfg.dp_fix_model)
        before = evaluate(model, self.val_data) if len(self.val_data) else None
        t0 = time.perf_counter()
        privacy, dp_job = self._charge_privacy(model, cfg, config, server_round, run_id) if self.budget else ({}, None)
        if self.workers is not None:
            out = self.workers.run(Job(weights=dict(weights), architecture=str(config.get("architecture", "cnn-small")),
                                       train=asdict(cfg), dp=dp_job))
            new, result = out["weights"], TrainResult(out["loss"], out["accuracy"], out["steps"], out["examples"])
        else:
            if dp_job is None:
                result = train(model, self.train_data, cfg)
            else:
                result = train_private(model, self.train_data, cfg, dp_job["noise_multiplier"], dp_job["max_grad_norm"], dp_job["grad_sample_mode"])
            new = weights_of(model)
        seconds = time.perf_counter() - t0
        check_like(weights, new, source=f"factory {self.cfg.factory_id} local training")
        metrics = {"train-loss": result.loss, "train-accuracy": result.accuracy, "train-seconds": seconds, "steps": float(result.steps), **privacy}
        if before is not None:
            metrics |= {"val-accuracy-before": before.accuracy, "val-loss-before": before.loss}
        return new, result.examples, metrics

    def _charge_privacy(self, model: torch.nn.Module, cfg: TrainConfig, config: dict[str, Any], server_round: int, run_id: str) -> tuple[dict[str, float], dict[str, Any]]:
        """Charge the ledger for this round (or refuse it with `BudgetExhausted`) before any training."""
        assert self.budget is not None and self.ledger is not None
        ignored = sorted(k for k in config if k.startswith("dp-") or k in ("noise-multiplier", "max-grad-norm", "epsilon", "delta"))
        if ignored:
            log.warning("ignoring privacy settings sent by the server %s: the budget and noise are factory configuration", ignored)
        n = len(self.train_data)
        rate = sample_rate(n, cfg.batch_size)
        steps = cfg.epochs * steps_per_epoch(n, cfg.batch_size)
        noise = noise_for_budget(self.budget.epsilon_max, self.budget.delta, rate, self.budget.planned_rounds * steps)
        epsilon = self.ledger.charge(self.budget, run_id, server_round, noise, rate, steps)
        mode = "ghost_fsdp" if self.cfg.parallelism == "fsdp" else self.budget.grad_sample_mode
        job = {"noise_multiplier": noise, "max_grad_norm": self.budget.max_grad_norm, "sample_rate": rate, "grad_sample_mode": mode}
        return {
            "epsilon-spent": epsilon, "epsilon-remaining": max(0.0, self.budget.epsilon_max - epsilon), "epsilon-max": self.budget.epsilon_max,
            "delta": self.budget.delta, "noise-multiplier": noise, "dp-steps": float(steps),
        }, job

    def close(self) -> None:
        if self.workers is not None:
            self.workers.close()
        if self.ledger is not None:
            self.ledger.close()

    def privacy_status(self) -> dict[str, float]:
        if self.budget is None or self.ledger is None:
            return {}
        spent = self.ledger.spent(self.budget.delta)
        return {"epsilon-spent": spent, "epsilon-remaining": max(0.0, self.budget.epsilon_max - spent), "epsilon-max": self.budget.epsilon_max}

    def predict(self, weights: OrderedDict[str, np.ndarray], config: dict[str, Any], proxy: ProxySet,
                temperature: float) -> tuple[np.ndarray, np.ndarray]:
        """Balanced predictions on the proxy set with ``weights`` (the model it just trained), and its class counts."""
        if not temperature > 0:
            raise UpdateError(f"distillation temperature must be > 0, got {temperature}")
        probabilities = predict_proxy(self._model_with(weights, config), proxy, temperature)
        if not np.isfinite(probabilities).all():  # a diverged local model: never send it into the secure sum
            raise UpdateError(f"factory {self.cfg.factory_id}: predictions on the proxy set are not finite")
        counts = np.bincount(self.train_data.labels, minlength=len(self.train_data.classes)).astype(np.float64)
        return balanced_predictions(probabilities, counts), counts

    def evaluate(self, weights: OrderedDict[str, np.ndarray], config: dict[str, Any]) -> tuple[int, dict[str, float]]:
        model = self._model_with(weights, config)
        result = evaluate(model, self.val_data)
        return result.examples, {"val-accuracy": result.accuracy, "val-loss": result.loss}
