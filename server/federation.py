"""The FedForge round loop on Flower's Message API: sample, train, validate, average, evaluate, record.

Reads top to bottom as one round does. Factories that fail, time out or send a malformed update
are logged by factory id and left out; a round with fewer than ``min_factories`` good updates is
aborted and the global model stays as it was.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections import OrderedDict
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.inflatable.inflatable_utils import ObjectPullError, ObjectPushError, ObjectUnavailableError

from common.data import datasets
from common.data.datasets import ImageDataset
from common.data.folder import load_image_folder
from common.models import build_model
from common.secagg.primitives import session_id
from common.secagg.update import decode_sum
from common.tensors import UpdateError, check_like
from common.training import evaluate, set_torch_threads
from server.aggregate import FactoryUpdate, fedavg, validate_update
from server.messaging import push_and_collect
from server.registry.service import NewVersion, Registry
from server.secure_sum import SecAggAborted, SecureSum

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
    secure_aggregation: bool = True
    secagg_threshold: int = 0  # 0: max(2, ceil(2n/3)) of the n sampled factories
    secagg_degree: int = 0  # neighbours per factory; 0: everyone (complete graph)
    secagg_timeout: float = 120.0  # per key-exchange / unmask stage
    update_clip: float = 10.0  # L2 bound on each factory's update before masking
    secagg_scale: float = 2.0**24  # fixed-point scale
    max_weight: int = 100_000  # cap on a factory's example-count weight
    resume_from: str = ""  # a version id: continue the federation from it (after a crash); rounds keep their numbers

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


class RoundAborted(RuntimeError):
    """The round cannot produce a model; the global model stays as it was."""

    def __init__(self, reason: str, failures: dict[str, str], participants: list[str]) -> None:
        super().__init__(reason)
        self.failures, self.participants = failures, participants


# Errors that mean the ServerApp lost its SuperLink (killed, restarted, or it ended the run) or was
# told to stop: the federation is interrupted, not broken, and the supervisor resumes it.
LINK_ERRORS = (httpx.HTTPError, ConnectionError, ObjectPullError, ObjectPushError, ObjectUnavailableError,
               KeyboardInterrupt, SystemExit)


def ending_for(exc: BaseException) -> str:
    """How a run that raised ``exc`` ended: ``interrupted`` (resumable) or ``failed`` (a FedForge error)."""
    return "interrupted" if isinstance(exc, LINK_ERRORS) else "failed"


class Federation:
    def __init__(self, grid: Grid, cfg: FederationConfig, flwr_run_id: str = "") -> None:
        set_torch_threads(cfg.torch_threads)
        self.grid, self.cfg = grid, cfg
        registry_dir = Path(cfg.registry_dir or "fedforge-registry").resolve()
        self.registry = Registry.at(registry_dir, create_key=True)  # every version is signed
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
            if cfg.resume_from:
                version = self.registry.get_version(cfg.resume_from)
                if version is None or version.architecture != cfg.architecture:
                    raise ValueError(f"cannot resume from {cfg.resume_from!r}: no such {cfg.architecture} version in the registry")
                weights = self.registry.load_weights(version.id)  # sha256-verified
                log.info("run %s resumes the federation from version %s (round %d)", self.run_id, version.id, version.server_round)
            else:
                weights = OrderedDict((k, v.detach().numpy().copy()) for k, v in self.model.state_dict().items())
                version = self._record_version(0, None, "initial", weights, self._evaluate(weights), participants=[])
            self._wait_for_factories()
            for server_round in range(version.server_round + 1, cfg.num_server_rounds + 1):
                weights, version = self._round(server_round, weights, version)
        except BaseException as exc:
            status = ending_for(exc)
            log.exception("run %s %s", self.run_id, status)
            self.registry.finish_run(self.run_id, status, f"{type(exc).__name__}: {exc}")
            raise
        self.registry.finish_run(self.run_id, "finished")
        log.info("run %s finished", self.run_id)

    def _round(self, server_round: int, weights: "OrderedDict[str, np.ndarray]", parent: Any) -> tuple[Any, Any]:
        t0 = time.perf_counter()
        aggregate = self._secure_fedavg if self.cfg.secure_aggregation else self._plain_fedavg
        try:
            new_weights, participants, failures, factory_metrics, privacy = aggregate(server_round, weights)
        except RoundAborted as exc:
            self._log_failures(server_round, exc.failures)
            log.error("round %d aborted: %s; the global model is unchanged", server_round, exc)
            self.registry.record_round(
                self.run_id, server_round, status="aborted", participants=exc.participants, failures=exc.failures,
                seconds=time.perf_counter() - t0, version_id=None, metrics={"reason": str(exc)},
            )
            return weights, parent
        self._log_failures(server_round, failures)
        central = self._evaluate(new_weights)
        version = self._record_version(server_round, parent.id, "fedavg", new_weights, {**central, **factory_metrics}, participants, privacy)
        seconds = time.perf_counter() - t0
        self.registry.record_round(
            self.run_id, server_round, status="completed", accuracy=central["accuracy"], loss=central["loss"],
            participants=participants, failures=failures, metrics=factory_metrics, seconds=seconds, version_id=version.id,
        )
        log.info("round %d: accuracy %.4f loss %.4f from %s in %.2fs%s", server_round, central["accuracy"], central["loss"], participants,
                 seconds, " (secure aggregation)" if self.cfg.secure_aggregation else "")
        return new_weights, version

    def _log_failures(self, server_round: int, failures: dict[str, str]) -> None:
        for name, reason in sorted(failures.items()):
            log.warning("round %d: factory %s failed and is left out: %s", server_round, name, reason)

    def _exchange(self, node_ids: list[int], message_type: str, server_round: int, records: Any, timeout: float,
                  failures: dict[str, str]) -> dict[int, Message]:
        """Send one message per node (``records(node) -> RecordDict``); return good replies, note failures."""
        messages = [Message(records(n), dst_node_id=n, message_type=message_type, group_id=str(server_round)) for n in node_ids]
        replies, timed_out = push_and_collect(self.grid, messages, timeout)
        for node_id in timed_out:
            failures[self._name(node_id)] = f"no reply to {message_type} within {timeout:.0f}s"
        good = {}
        for node_id, reply in replies.items():
            if reply.has_error():
                failures[self._name(node_id)] = f"error reply to {message_type}: {reply.error.reason}"
                continue
            if "info" in reply.content:
                self.factory_of_node[node_id] = str(reply.content["info"]["factory-id"])
            good[node_id] = reply
        return good

    def _plain_fedavg(self, server_round: int, weights: "OrderedDict[str, np.ndarray]") -> tuple[Any, list[str], dict[str, str], dict[str, float], dict[str, Any]]:
        cfg, failures = self.cfg, {}
        content = RecordDict({
            "arrays": ArrayRecord(OrderedDict((k, Array(v)) for k, v in weights.items())),
            "config": ConfigRecord(cfg.train_config(server_round)),
        })
        replies = self._exchange(sorted(self.grid.get_node_ids()), MessageType.TRAIN, server_round, lambda n: content, cfg.round_timeout, failures)
        updates = []
        for node_id, reply in replies.items():
            try:
                updates.append(self._parse_update(node_id, reply, weights))
            except (UpdateError, KeyError, TypeError, ValueError) as exc:
                failures[self._name(node_id)] = str(exc)
        participants = sorted(u.factory_id for u in updates)
        if len(updates) < cfg.min_factories:
            raise RoundAborted(f"{len(updates)} good updates, {cfg.min_factories} required", failures, participants)
        privacy = {u.factory_id: {k: u.metrics[k] for k in PRIVACY_KEYS if k in u.metrics} for u in updates if "epsilon-spent" in u.metrics}
        metrics = {**_weighted_metrics(updates), "bytes-received": float(sum(a.nbytes for u in updates for a in u.weights.values()))}
        return fedavg(updates, like=weights), participants, failures, metrics, privacy

    def _secure_fedavg(self, server_round: int, weights: "OrderedDict[str, np.ndarray]") -> tuple[Any, list[str], dict[str, str], dict[str, float], dict[str, Any]]:
        """FedAvg through SecAgg+: the server learns sum(n * update) and sum(n), nothing per factory."""
        cfg, failures = self.cfg, {}
        node_ids = sorted(self.grid.get_node_ids())
        slot_of = {n: i + 1 for i, n in enumerate(node_ids)}
        node_of = {s: n for n, s in slot_of.items()}
        n = len(node_ids)
        threshold = cfg.secagg_threshold or max(2, math.ceil(2 * n / 3))
        if n < max(threshold, cfg.min_factories):
            raise RoundAborted(f"{n} factories connected, secure aggregation needs {max(threshold, cfg.min_factories)}", failures, [])
        session = session_id(self.run_id, server_round)
        secure = SecureSum(session, list(node_of), threshold, cfg.secagg_degree or n - 1)
        base = {"session": session.decode()}

        def stage(nodes: list[int], name: str, fields: Any, timeout: float) -> dict[int, dict[str, Any]]:
            replies = self._exchange(nodes, f"query.secagg_{name}", server_round,
                                     lambda node: RecordDict({"secagg": ConfigRecord({**base, **fields(slot_of[node])})}), timeout, failures)
            return {slot_of[node]: dict(r.content["secagg"]) for node, r in replies.items()}

        try:
            keys = stage(node_ids, "advertise", lambda slot: {"slot": slot, "threshold": threshold}, cfg.secagg_timeout)
            plan = secure.add_public_keys({slot: (r["enc-pk"], r["mask-pk"]) for slot, r in keys.items()})
            shared = stage([node_of[s] for s in plan], "share",
                           lambda slot: {"neighbors": plan[slot][0], "enc-pks": plan[slot][1], "mask-pks": plan[slot][2]}, cfg.secagg_timeout)
            routed = secure.add_share_boxes({slot: dict(zip(r["to"], r["boxes"])) for slot, r in shared.items()})

            arrays = ArrayRecord(OrderedDict((k, Array(v)) for k, v in weights.items()))
            train_config = ConfigRecord(cfg.train_config(server_round))
            secagg_common = {**base, "alive": secure.u2, "clip": float(cfg.update_clip), "scale": float(cfg.secagg_scale), "max-weight": cfg.max_weight}
            replies = self._exchange(
                [node_of[s] for s in secure.u2], MessageType.TRAIN, server_round,
                lambda node: RecordDict({"arrays": arrays, "config": train_config, "secagg": ConfigRecord(
                    {**secagg_common, "from": list(routed[slot_of[node]]), "boxes": list(routed[slot_of[node]].values())})}),
                cfg.round_timeout, failures,
            )
            metrics: dict[int, dict[str, float]] = {}
            bytes_received = 0
            for node, reply in replies.items():
                try:
                    factory_metrics = {k: float(v) for k, v in reply.content["metrics"].items()}
                    masked = reply.content["arrays"]["masked"].numpy()
                    secure.add_masked_input(slot_of[node], masked)
                    metrics[slot_of[node]] = factory_metrics
                    bytes_received += masked.nbytes
                except (KeyError, TypeError, ValueError) as exc:
                    failures[self._name(node)] = f"malformed masked input: {exc}"
            survivors, dropped = secure.unmask_request()
            participants = sorted(self._name(node_of[s]) for s in survivors)
            if len(survivors) < cfg.min_factories:
                raise RoundAborted(f"{len(survivors)} masked inputs, {cfg.min_factories} required", failures, participants)
            answers = stage([node_of[s] for s in survivors], "unmask", lambda slot: {"survivors": survivors, "dropped": dropped}, cfg.secagg_timeout)
            total = secure.result({slot: (
                {u: (i, s) for u, i, s in zip(r["seed-slots"], r["seed-index"], r["seed-shares"])},
                {u: (i, s) for u, i, s in zip(r["key-slots"], r["key-index"], r["key-shares"])},
            ) for slot, r in answers.items()})
            new_weights, total_weight = decode_sum(total, weights, cfg.secagg_scale)
        except SecAggAborted as exc:
            raise RoundAborted(str(exc), failures, []) from exc
        check_like(weights, new_weights, source="securely aggregated model")
        privacy = {self._name(node_of[s]): {k: m[k] for k, v in m.items() if k in PRIVACY_KEYS} for s, m in metrics.items() if "epsilon-spent" in m}
        common_keys = set.intersection(*(set(m) for m in metrics.values())) - set(PRIVACY_KEYS)
        factory_metrics = {f"factory-{k}": float(np.mean([m[k] for m in metrics.values()])) for k in sorted(common_keys)}
        factory_metrics["total-examples"] = total_weight
        factory_metrics["bytes-received"] = float(bytes_received)
        return new_weights, participants, failures, factory_metrics, privacy

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
            secure_aggregation=self.cfg.secure_aggregation and kind != "initial",
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
