"""The FedForge round loop on Flower's Message API: sample, train, validate, average, evaluate, record.

Reads top to bottom as one round does. Factories that fail, time out or send a malformed update
are logged by factory id and left out; a round with fewer than ``min_factories`` good updates is
aborted and the global model stays as it was.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import OrderedDict
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from common.data import datasets
from common.data.datasets import ImageDataset
from common.data.folder import load_image_folder
from common.models import build_model
from common.tensors import UpdateError
from common.training import evaluate, set_torch_threads
from server.aggregate import FactoryUpdate, fedavg, validate_update
from server.messaging import push_and_collect
from server.registry.service import NewVersion, Registry

log = logging.getLogger("fedforge.server")

PRIVACY_KEYS = ("epsilon-spent", "epsilon-remaining", "epsilon-max", "delta", "noise-multiplier")


@dataclass(frozen=True)
class FederationConfig:
    """Run configuration; keys match ``[tool.flwr.app.config]`` with '-' for '_'."""

    num_server_rounds: int = 3
    min_factories: int = 2
    expected_factories: int = 0  # wait for this many factories before round 1 (0: min_factories)
    wait_for_factories: float = 120.0
    round_timeout: float = 300.0
    architecture: str = "cnn-small"
    local_epochs: int = 2
    batch_size: int = 16
    lr: float = 1e-3
    optimizer: str = "adamw"
    seed: int = 0
    data_seed: int = 0
    num_factories: int = 3
    alpha: float = 1.0
    test_size: int = 600
    test_data: str = ""  # an image folder for central evaluation; empty: the synthetic test set
    registry_dir: str = ""  # absolute path; empty: ./fedforge-registry in the SuperLink's directory
    torch_threads: int = 1

    @classmethod
    def from_run_config(cls, run_config: dict[str, Any]) -> FederationConfig:
        known = {f.name: f.type for f in fields(cls)}
        values = {}
        for key, value in run_config.items():
            name = key.replace("-", "_")
            if name in known:
                values[name] = value
        return cls(**values)

    def train_config(self, server_round: int) -> dict[str, Any]:
        return {
            "server-round": server_round, "architecture": self.architecture, "local-epochs": self.local_epochs,
            "batch-size": self.batch_size, "lr": self.lr, "optimizer": self.optimizer, "seed": self.seed,
        }


def _test_set(cfg: FederationConfig) -> ImageDataset:
    if cfg.test_data:
        data, _ = load_image_folder(cfg.test_data)
        return data
    spec = datasets.SyntheticSpec(seed=cfg.data_seed, num_factories=cfg.num_factories, alpha=cfg.alpha)
    return datasets.test_dataset(spec, cfg.test_size)


def _to_state(weights: "OrderedDict[str, np.ndarray]") -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v) for k, v in weights.items()}


class Federation:
    def __init__(self, grid: Grid, cfg: FederationConfig, flwr_run_id: str = "") -> None:
        set_torch_threads(cfg.torch_threads)
        self.grid, self.cfg = grid, cfg
        registry_dir = Path(cfg.registry_dir or "fedforge-registry").resolve()
        self.registry = Registry.at(registry_dir)
        self.run_id = f"run-{flwr_run_id}" if flwr_run_id else f"run-{uuid.uuid4().hex[:12]}"
        self.flwr_run_id = flwr_run_id
        self.factory_of_node: dict[int, str] = {}
        self.model = build_model(cfg.architecture, num_classes=6, seed=cfg.seed)
        self.test_data = _test_set(cfg)

    # ---------------------------------------------------------------------------------------
    def run(self) -> None:
        cfg = self.cfg
        self.registry.start_run(self.run_id, self.flwr_run_id, asdict(cfg))
        log.info("run %s: %d rounds of %s, registry %s", self.run_id, cfg.num_server_rounds, cfg.architecture, cfg.registry_dir)
        try:
            weights = OrderedDict((k, v.detach().numpy().copy()) for k, v in self.model.state_dict().items())
            initial = self._evaluate(weights)
            version = self._record_version(0, None, "initial", weights, initial, participants=[])
            self._wait_for_factories()
            for server_round in range(1, cfg.num_server_rounds + 1):
                weights, version = self._round(server_round, weights, version)
        except BaseException as exc:
            log.exception("run %s failed", self.run_id)
            self.registry.finish_run(self.run_id, "failed", f"{type(exc).__name__}: {exc}")
            raise
        self.registry.finish_run(self.run_id, "finished")
        log.info("run %s finished", self.run_id)

    def _round(self, server_round: int, weights: "OrderedDict[str, np.ndarray]", parent: Any) -> tuple[Any, Any]:
        cfg, t0 = self.cfg, time.perf_counter()
        node_ids = sorted(self.grid.get_node_ids())
        content = RecordDict({
            "arrays": ArrayRecord(OrderedDict((k, Array(v)) for k, v in weights.items())),
            "config": ConfigRecord(cfg.train_config(server_round)),
        })
        messages = [Message(content, dst_node_id=n, message_type=MessageType.TRAIN, group_id=str(server_round)) for n in node_ids]
        replies, timed_out = push_and_collect(self.grid, messages, cfg.round_timeout)

        updates, failures = [], {}
        for node_id in timed_out:
            failures[self._name(node_id)] = f"no reply within {cfg.round_timeout:.0f}s"
        for node_id, reply in replies.items():
            try:
                updates.append(self._parse_update(node_id, reply, weights))
            except (UpdateError, KeyError, TypeError, ValueError) as exc:
                failures[self._name(node_id)] = str(exc)
        for name, reason in sorted(failures.items()):
            log.warning("round %d: factory %s failed and is left out: %s", server_round, name, reason)

        participants = sorted(u.factory_id for u in updates)
        if len(updates) < cfg.min_factories:
            log.error("round %d aborted: %d good updates, %d required; the global model is unchanged", server_round, len(updates), cfg.min_factories)
            self.registry.record_round(
                self.run_id, server_round, status="aborted", participants=participants, failures=failures,
                seconds=time.perf_counter() - t0, version_id=None,
            )
            return weights, parent

        new_weights = fedavg(updates, like=weights)
        central = self._evaluate(new_weights)
        factory_metrics = _weighted_metrics(updates)
        privacy = {u.factory_id: {k: u.metrics[k] for k in PRIVACY_KEYS if k in u.metrics} for u in updates if "epsilon-spent" in u.metrics}
        version = self._record_version(server_round, parent.id, "fedavg", new_weights, {**central, **factory_metrics}, participants, privacy)
        seconds = time.perf_counter() - t0
        self.registry.record_round(
            self.run_id, server_round, status="completed", accuracy=central["accuracy"], loss=central["loss"],
            participants=participants, failures=failures, metrics=factory_metrics, seconds=seconds, version_id=version.id,
        )
        log.info("round %d: accuracy %.4f loss %.4f from %s in %.2fs", server_round, central["accuracy"], central["loss"], participants, seconds)
        return new_weights, version

    # ---------------------------------------------------------------------------------------
    def _parse_update(self, node_id: int, reply: Message, like: "OrderedDict[str, np.ndarray]") -> FactoryUpdate:
        if reply.has_error():
            raise UpdateError(f"error reply: {reply.error.reason}")
        content = reply.content
        factory_id = str(content["info"]["factory-id"]) if "info" in content else self._name(node_id)
        self.factory_of_node[node_id] = factory_id
        metrics = {k: float(v) for k, v in content["metrics"].items()}
        update = FactoryUpdate(
            factory_id=factory_id, node_id=node_id,
            weights=OrderedDict((k, a.numpy()) for k, a in content["arrays"].items()),
            num_examples=int(metrics.pop("num-examples", 0)), metrics=metrics,
        )
        validate_update(like, update)
        return update

    def _name(self, node_id: int) -> str:
        return self.factory_of_node.get(node_id, f"node-{node_id}")

    def _evaluate(self, weights: "OrderedDict[str, np.ndarray]") -> dict[str, float]:
        self.model.load_state_dict(_to_state(weights))
        result = evaluate(self.model, self.test_data)
        return {"accuracy": result.accuracy, "loss": result.loss}

    def _record_version(self, server_round: int, parent_id: str | None, kind: str, weights: Any, metrics: dict[str, float],
                        participants: list[str], privacy: dict[str, Any] | None = None) -> Any:
        return self.registry.add_version(NewVersion(
            run_id=self.run_id, server_round=server_round, parent_id=parent_id, kind=kind, architecture=self.cfg.architecture,
            weights=weights, metrics=metrics, participants=participants, privacy=privacy,
        ))

    def _wait_for_factories(self) -> None:
        wanted = self.cfg.expected_factories or self.cfg.min_factories
        deadline = time.monotonic() + self.cfg.wait_for_factories
        while len(list(self.grid.get_node_ids())) < wanted:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(list(self.grid.get_node_ids()))} of {wanted} factories connected within {self.cfg.wait_for_factories:.0f}s")
            time.sleep(0.2)


def _weighted_metrics(updates: list[FactoryUpdate]) -> dict[str, float]:
    """Example-weighted means of the factories' own metrics (prefixed ``factory-``; privacy is per factory)."""
    total = sum(u.num_examples for u in updates)
    keys = set.intersection(*(set(u.metrics) for u in updates)) - set(PRIVACY_KEYS)
    return {f"factory-{k}": sum(u.metrics[k] * u.num_examples for u in updates) / total for k in sorted(keys)}
