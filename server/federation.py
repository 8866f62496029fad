"""The FedForge round loop on Flower's Message API: sample, train, validate, average, distil, record.

Reads top to bottom as one round does. Factories are grouped by the architecture they train; each
group's global model is its own line of versions, averaged within the group (FedAvg, through the
secure sum when it is on). In distillation rounds every factory also predicts on the proxy set and
the server distils the ensemble (it learns only the sum of the predictions) into each group's model,
keeping the result only if it does not validate worse. Factories that fail, time out or send a
malformed update are logged by factory id and left out; a round with fewer than ``min_factories``
good factories is aborted and the global models stay as they were.
"""

from __future__ import annotations

import logging
import math
import os
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
from common.distill import DistillConfig, ProxySet, check_predictions, ensemble_of
from common.models import build_model, load_weights, weights_of
from common.secagg.layout import SecureLayout, apply_group_sum
from common.secagg.primitives import session_id
from common.tensors import UpdateError, check_like
from common.training import evaluate, set_torch_threads, torch_threads
from server.aggregate import FactoryUpdate, fedavg, validate_update
from server.distillation import MODES, distil_into, load_proxy, load_validation
from server.groups import Line, RoundResult
from server.messaging import push_and_collect
from server.registry.service import NewVersion, Registry
from server.secure_sum import KeyedSession, KeyExchange, SecAggAborted

log = logging.getLogger("fedforge.server")

NUM_CLASSES = 6  # the inspection task's classes (common.data.synth.CLASSES)
AHEAD = "keyed-ahead"  # session-id use for a round's session keyed during the previous round (a fresh exchange uses its own id)
PRIVACY_KEYS = ("epsilon-spent", "epsilon-remaining", "epsilon-max", "delta", "noise-multiplier")


@dataclass(frozen=True)
class FederationConfig:
    """Run configuration; keys match ``[tool.flwr.app.config]`` with '-' for '_'."""

    num_server_rounds: int = 3
    min_factories: int = 2
    expected_factories: int = 0  # wait for this many factories before round 1 (0: min_factories)
    wait_for_factories: float = 120.0
    round_timeout: float = 300.0
    architecture: str = "cnn-small"  # for factories that do not declare one
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
    # Distillation: "off", "after" (FedAvg, then distil the ensemble every `distill_every` rounds),
    # or "only" (factories send predictions, never weights; every round distils).
    distill: str = "off"
    distill_every: int = 1
    distill_temperature: float = 2.0
    distill_epochs: int = 30
    distill_patience: int = 3
    distill_lr: float = 1e-3
    proxy_size: int = 500  # generated proxy images (demo); ignored with proxy_data
    proxy_data: str = ""  # a folder of unlabelled images of the domain, held by the server
    validation_size: int = 600  # generated labelled images for keep-or-drop decisions
    validation_data: str = ""  # an image folder (one sub-folder per class) for those decisions
    proxy_timeout: float = 300.0
    distill_threads: int = 0  # torch threads while distilling (the factories are idle then); 0: every core

    def __post_init__(self) -> None:
        if self.distill not in MODES:
            raise ValueError(f"distill must be one of {MODES}, got {self.distill!r}")
        if self.distill_every < 1:
            raise ValueError(f"distill-every must be >= 1, got {self.distill_every}")

    @classmethod
    def from_run_config(cls, run_config: dict[str, Any]) -> FederationConfig:
        known = {f.name: f.type for f in fields(cls)}
        values = {}
        for key, value in run_config.items():
            name = key.replace("-", "_")
            if name in known:
                values[name] = value
        return cls(**values)

    def train_config(self, server_round: int, architecture: str | None = None) -> dict[str, Any]:
        return {
            "server-round": server_round, "architecture": architecture or self.architecture, "local-epochs": self.local_epochs,
            "batch-size": self.batch_size, "lr": self.lr, "optimizer": self.optimizer, "seed": self.seed,
        }

    def distills_in(self, server_round: int) -> bool:
        return self.distill == "only" or (self.distill == "after" and server_round % self.distill_every == 0)

    @property
    def spec(self) -> datasets.SyntheticSpec:
        return datasets.SyntheticSpec(seed=self.data_seed, num_factories=self.num_factories, alpha=self.alpha)


def _test_set(cfg: FederationConfig) -> ImageDataset:
    if cfg.test_data:
        data, _ = load_image_folder(cfg.test_data)
        return data
    return datasets.test_dataset(cfg.spec, cfg.test_size)


def _arrays(weights: "OrderedDict[str, np.ndarray]") -> ArrayRecord:
    return ArrayRecord(OrderedDict((k, Array(v)) for k, v in weights.items()))


class RoundAborted(RuntimeError):
    """The round cannot produce a model; the global models stay as they were."""

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
        self.architecture_of_node: dict[int, str] = {}
        self.lines: dict[str, Line] = {}
        self.models: dict[str, torch.nn.Module] = {}
        self.test_data = _test_set(cfg)
        self.resumed_round = 0
        self.proxy: ProxySet | None = None
        self.validation: ImageDataset | None = None
        self.proxy_ready: set[int] = set()  # nodes holding this run's proxy set (it travels once per run)
        self._pipelined: KeyedSession | None = None  # the next round's session, keyed during this round
        self.phase_seconds: dict[str, float] = {}  # this round's wall time per message type (recorded as seconds/<type>)
        if cfg.distill != "off":
            self.proxy = load_proxy(cfg.proxy_data, cfg.spec, cfg.proxy_size)
            self.validation = load_validation(cfg.validation_data, cfg.test_data, cfg.spec, cfg.validation_size)

    # ---------------------------------------------------------------------------------------
    def run(self) -> None:
        cfg = self.cfg
        self.registry.start_run(self.run_id, self.flwr_run_id, asdict(cfg))
        log.info("run %s: %d rounds (default architecture %s, distillation %s), registry %s", self.run_id, cfg.num_server_rounds,
                 cfg.architecture, cfg.distill, cfg.registry_dir)
        try:
            if cfg.resume_from:
                version = self.registry.get_version(cfg.resume_from)
                if version is None:
                    raise ValueError(f"cannot resume from {cfg.resume_from!r}: no such version in the registry")
                self.resumed_round = version.server_round
                log.info("run %s resumes the federation from version %s (round %d)", self.run_id, version.id, version.server_round)
            self._line(cfg.architecture)
            self._wait_for_factories()
            for server_round in range(self.resumed_round + 1, cfg.num_server_rounds + 1):
                self._round(server_round)
        except BaseException as exc:
            status = ending_for(exc)
            log.exception("run %s %s", self.run_id, status)
            self.registry.finish_run(self.run_id, status, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
            raise
        self.registry.finish_run(self.run_id, "finished")
        log.info("run %s finished", self.run_id)

    def _round(self, server_round: int) -> None:
        t0 = time.perf_counter()
        cfg, failures = self.cfg, {}
        self.phase_seconds = {}
        distilling = cfg.distills_in(server_round) and self.proxy is not None
        nodes = self._describe(sorted(self.grid.get_node_ids()), server_round, failures)
        if distilling:
            nodes = self._deliver_proxy(nodes, server_round, failures)
        aggregate = self._secure_round if cfg.secure_aggregation else self._plain_round
        try:
            result = aggregate(server_round, nodes, distilling, failures)
        except RoundAborted as exc:
            self._log_failures(server_round, exc.failures)
            log.error("round %d aborted: %s; the global models are unchanged", server_round, exc)
            self.registry.record_round(
                self.run_id, server_round, status="aborted", participants=exc.participants, failures=exc.failures,
                seconds=time.perf_counter() - t0, version_id=None, metrics={"reason": str(exc), **self._phase_metrics()},
            )
            return
        self._log_failures(server_round, result.failures)
        metrics = {**result.metrics, **self._phase_metrics()}
        versions = {}
        for arch in sorted({self.architecture_of_node[n] for n in nodes} | set(result.group_weights)):
            line = self._line(arch)
            weights, kind = result.group_weights.get(arch), "fedavg"
            if distilling and result.ensemble is not None:
                with torch_threads(cfg.distill_threads or os.cpu_count() or 1):
                    outcome = distil_into(self._model(arch), weights if weights is not None else line.weights, self.proxy, result.ensemble,
                                          self.validation, self._distill_config(server_round))
                metrics |= outcome.metrics(f"{arch}/")
                log.info("round %d: distilled the ensemble of %d factories into %s: validation accuracy %.4f -> %.4f, %s",
                         server_round, result.ensemble_size, arch, outcome.val_accuracy_before, outcome.val_accuracy_after,
                         "kept" if outcome.kept else "dropped (kept the undistilled model)")
                if outcome.kept:
                    weights, kind = outcome.weights, "distilled"
            if weights is None:
                continue  # nothing new for this group this round
            central = self._evaluate(arch, weights)
            metrics |= {f"{arch}/accuracy": central["accuracy"], f"{arch}/loss": central["loss"]}
            line.version = self._record_version(server_round, line.version.id, kind, arch, weights,
                                                {**central, **metrics}, result.participants, result.privacy)
            line.weights = weights
            versions[arch] = line.version
        seconds = time.perf_counter() - t0
        primary = versions.get(cfg.architecture) or (next(iter(versions.values())) if versions else None)
        if primary is None:
            log.error("round %d aborted: no group received an update or a kept distillation; the global models are unchanged", server_round)
            self.registry.record_round(self.run_id, server_round, status="aborted", participants=result.participants, failures=result.failures,
                                       seconds=seconds, version_id=None, metrics={**metrics, "reason": "no group produced a model"})
            return
        self.registry.record_round(
            self.run_id, server_round, status="completed", accuracy=primary.metrics["accuracy"], loss=primary.metrics["loss"],
            participants=result.participants, failures=result.failures, metrics=metrics, seconds=seconds, version_id=primary.id,
        )
        log.info("round %d: %s from %s in %.2fs%s", server_round,
                 ", ".join(f"{a} accuracy {v.metrics['accuracy']:.4f}" for a, v in versions.items()), result.participants, seconds,
                 " (secure aggregation)" if cfg.secure_aggregation else "")

    def _phase_metrics(self) -> dict[str, float]:
        """Where the round's time went, per message type: e.g. seconds/train, seconds/query.secagg_unmask."""
        return {f"seconds/{kind}": round(t, 3) for kind, t in self.phase_seconds.items()}

    # groups ----------------------------------------------------------------------------------
    def _line(self, arch: str) -> Line:
        """The group's line: loaded from the registry when resuming, else a fresh initial version."""
        if arch in self.lines:
            return self.lines[arch]
        if self.resumed_round:
            candidates = [v for v in self.registry.versions() if v.architecture == arch and v.server_round <= self.resumed_round]
            if candidates:
                head = max(candidates, key=lambda v: (v.server_round, v.created_at))
                self.lines[arch] = Line(arch, self.registry.load_weights(head.id), head)  # sha256-verified
                return self.lines[arch]
        weights = weights_of(build_model(arch, num_classes=NUM_CLASSES, seed=self.cfg.seed))
        version = self._record_version(self.resumed_round, None, "initial", arch, weights, self._evaluate(arch, weights), [])
        self.lines[arch] = Line(arch, weights, version)
        return self.lines[arch]

    def _model(self, arch: str) -> torch.nn.Module:
        if arch not in self.models:
            self.models[arch] = build_model(arch, num_classes=NUM_CLASSES, seed=self.cfg.seed)
        return self.models[arch]

    def _describe(self, node_ids: list[int], server_round: int, failures: dict[str, str]) -> list[int]:
        """Learn the architecture of nodes seen for the first time; returns the nodes that can take part."""
        new = [n for n in node_ids if n not in self.architecture_of_node]
        if new:
            timeout = min(self.cfg.secagg_timeout, self.cfg.round_timeout)  # a light query: never wait longer than a round would
            replies = self._exchange(new, "query.describe", server_round, lambda n: RecordDict(), timeout, failures)
            for node, reply in replies.items():
                arch = str(reply.content["info"].get("architecture", "")) or self.cfg.architecture
                try:
                    self._line(arch)
                except ValueError as exc:
                    failures[self._name(node)] = f"declares an unusable architecture: {exc}"
                    continue
                self.architecture_of_node[node] = arch
                log.info("factory %s trains %s", self._name(node), arch)
        return [n for n in node_ids if n in self.architecture_of_node]

    def _deliver_proxy(self, node_ids: list[int], server_round: int, failures: dict[str, str]) -> list[int]:
        """Make sure every node holds the proxy set: the hash first, the images only to nodes that lack them."""
        assert self.proxy is not None
        sha = ConfigRecord({"sha256": self.proxy.sha256})
        pending = [n for n in node_ids if n not in self.proxy_ready]
        if pending:
            replies = self._exchange(pending, "query.proxy", server_round, lambda n: RecordDict({"proxy": sha}), self.cfg.secagg_timeout, failures)
            self.proxy_ready |= {n for n, r in replies.items() if r.content["proxy"]["have"]}
            missing = [n for n in replies if n not in self.proxy_ready]
            if missing:
                images = ArrayRecord(OrderedDict(images=Array(self.proxy.images)))
                replies = self._exchange(missing, "query.proxy", server_round, lambda n: RecordDict({"proxy": sha, "images": images}),
                                         self.cfg.proxy_timeout, failures)
                self.proxy_ready |= {n for n, r in replies.items() if r.content["proxy"]["have"]}
                log.info("round %d: sent the proxy set (%d images, %.1f MB) to %d factories", server_round, len(self.proxy),
                         self.proxy.images.nbytes / 1e6, len(missing))
        return [n for n in node_ids if n in self.proxy_ready]

    def _distill_config(self, server_round: int) -> DistillConfig:
        c = self.cfg
        return DistillConfig(temperature=c.distill_temperature, epochs=c.distill_epochs, patience=c.distill_patience, lr=c.distill_lr,
                             seed=c.seed * 1000 + server_round)

    def _round_config(self, server_round: int, arch: str, distilling: bool, send_weights: bool) -> ConfigRecord:
        config = self.cfg.train_config(server_round, arch)
        if distilling:
            assert self.proxy is not None
            config |= {"proxy-sha256": self.proxy.sha256, "temperature": self.cfg.distill_temperature}
        config["send-weights"] = send_weights
        return ConfigRecord(config)

    # messaging ---------------------------------------------------------------------------------
    def _log_failures(self, server_round: int, failures: dict[str, str]) -> None:
        for name, reason in sorted(failures.items()):
            log.warning("round %d: factory %s failed and is left out: %s", server_round, name, reason)

    def _exchange(self, node_ids: list[int], message_type: str, server_round: int, records: Any, timeout: float,
                  failures: dict[str, str]) -> dict[int, Message]:
        """Send one message per node (``records(node) -> RecordDict``); return good replies, note failures."""
        messages = [Message(records(n), dst_node_id=n, message_type=message_type, group_id=str(server_round)) for n in node_ids]
        started = time.perf_counter()
        replies, timed_out = push_and_collect(self.grid, messages, timeout)
        self.phase_seconds[message_type] = self.phase_seconds.get(message_type, 0.0) + time.perf_counter() - started
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

    # aggregation -------------------------------------------------------------------------------
    def _plain_round(self, server_round: int, nodes: list[int], distilling: bool, failures: dict[str, str]) -> RoundResult:
        cfg = self.cfg
        send_weights = cfg.distill != "only"
        contents = {
            arch: RecordDict({"arrays": _arrays(line.weights), "config": self._round_config(server_round, arch, distilling, send_weights)})
            for arch, line in self.lines.items()
        }
        replies = self._exchange(nodes, MessageType.TRAIN, server_round, lambda n: contents[self.architecture_of_node[n]], cfg.round_timeout, failures)
        updates: dict[str, list[FactoryUpdate]] = {}
        predictions: list[tuple[np.ndarray, np.ndarray]] = []
        good: list[FactoryUpdate] = []
        for node_id, reply in replies.items():
            arch = self.architecture_of_node[node_id]
            try:
                update = self._parse_update(node_id, reply, self.lines[arch].weights if send_weights else None)
                if distilling:
                    predictions.append(self._parse_predictions(reply, update.factory_id))
            except (UpdateError, KeyError, TypeError, ValueError) as exc:
                failures[self._name(node_id)] = str(exc)
                continue
            good.append(update)
            if send_weights:
                updates.setdefault(arch, []).append(update)
        participants = sorted(u.factory_id for u in good)
        if len(good) < cfg.min_factories:
            raise RoundAborted(f"{len(good)} good updates, {cfg.min_factories} required", failures, participants)
        result = RoundResult(participants=participants, failures=failures)
        result.privacy = {u.factory_id: {k: u.metrics[k] for k in PRIVACY_KEYS if k in u.metrics} for u in good if "epsilon-spent" in u.metrics}
        for arch, group in updates.items():
            result.group_weights[arch] = fedavg(group, like=self.lines[arch].weights)
            result.group_examples[arch] = float(sum(u.num_examples for u in group))
        if predictions:
            weighted_sum = sum(counts[None, :] * q for q, counts in predictions)
            result.ensemble, result.ensemble_size = ensemble_of(weighted_sum, sum(c for _, c in predictions)), len(predictions)
        received = sum(a.nbytes for u in good for a in u.weights.values()) + sum(q.size * 4 + c.size * 8 for q, c in predictions)
        result.metrics = {**_weighted_metrics(good), "bytes-received": float(received),
                          "uplink-bytes-per-factory": float(received) / len(good)}
        return result

    def _secure_round(self, server_round: int, nodes: list[int], distilling: bool, failures: dict[str, str]) -> RoundResult:
        """Every group's FedAvg and the prediction ensemble through one SecAgg+ session: the server learns sums only.

        Four message phases (advertise, share, train + masked input, unmask) when keys must be exchanged;
        two (train, unmask) when the previous round already carried this round's keys and share boxes.
        """
        cfg = self.cfg
        keyed = self._take_pipelined(server_round, nodes)
        threshold = keyed.secure.threshold if keyed else self._threshold(len(nodes))
        if len(nodes) < max(threshold, cfg.min_factories):
            raise RoundAborted(f"{len(nodes)} factories connected, secure aggregation needs {max(threshold, cfg.min_factories)}", failures, [])
        # A group of one would have its member's update revealed by its slot of the sum: it sends predictions only.
        members = {arch: [m for m in nodes if self.architecture_of_node[m] == arch] for arch in self.lines}
        sends_weights = {m: cfg.distill != "only" and len(members[self.architecture_of_node[m]]) >= 2 for m in nodes}
        for arch, group in members.items():
            if len(group) == 1 and cfg.distill != "only":
                log.warning("round %d: %s is the only factory training %s; under secure aggregation it %s", server_round,
                            self._name(group[0]), arch, "contributes predictions only" if distilling else "cannot contribute this round")
        layout = SecureLayout.of({a: self.lines[a].num_parameters for a, g in members.items() if any(sends_weights[m] for m in g)},
                                 len(self.proxy) * NUM_CLASSES if distilling and self.proxy is not None else 0, NUM_CLASSES)
        if not layout.groups and not layout.predictions:
            raise RoundAborted("no factory can contribute under secure aggregation (groups of one, no distillation)", failures, [])
        phases = 2 if keyed else 4
        try:
            if keyed is None:
                keyed = self._exchange_keys(server_round, nodes, threshold, failures)
            secure, node_of, slot_of = keyed.secure, keyed.node_of, keyed.slot_of
            base = {"session": secure.session.decode()}
            ahead = self._open_next_session(server_round, nodes)
            secagg_common = {**base, "alive": secure.u2, "clip": float(cfg.update_clip), "scale": float(cfg.secagg_scale), "max-weight": cfg.max_weight,
                             "groups": [a.encode() for a, _ in layout.groups], "group-sizes": [size for _, size in layout.groups],
                             "predictions": layout.predictions, "classes": layout.classes}

            arrays = {arch: _arrays(line.weights) for arch, line in self.lines.items()}  # once per group, not per factory

            def train_message(node: int) -> RecordDict:
                arch = self.architecture_of_node[node]
                content = RecordDict({
                    "arrays": arrays[arch],
                    "config": self._round_config(server_round, arch, distilling, sends_weights[node]),
                    "secagg": ConfigRecord({**secagg_common, "from": list(keyed.routed[slot_of[node]]), "boxes": list(keyed.routed[slot_of[node]].values())}),
                })
                if ahead is not None:  # the next round's key advertisement rides on this message
                    content["secagg-next"] = ConfigRecord({"stage": "advertise", **ahead.advertise_request(node)})
                return content

            present = set(nodes)  # a session member that has disconnected is not sent anything: it counts as dropped
            targets = [node_of[s] for s in secure.u2 if node_of[s] in present]
            replies = self._exchange(targets, MessageType.TRAIN, server_round, train_message, cfg.round_timeout, failures)
            if ahead is not None:
                try:
                    ahead.add_public_keys(_ahead_fields(replies))
                except SecAggAborted as exc:  # never fails this round: the next one exchanges its own keys
                    log.info("round %d: the next round will exchange its own keys: %s", server_round, exc)
                    ahead = None
            masked_inputs: dict[int, np.ndarray] = {}
            metrics: dict[int, dict[str, float]] = {}
            for node, reply in replies.items():
                try:
                    metrics[node] = {k: float(v) for k, v in reply.content["metrics"].items()}
                    masked_inputs[node] = reply.content["arrays"]["masked"].numpy()
                except (KeyError, TypeError, ValueError) as exc:
                    failures[self._name(node)] = f"malformed masked input: {exc}"
            # An honest server never unmasks a group slot that holds a single factory's update.
            for arch, group in members.items():
                senders = [m for m in group if m in masked_inputs and sends_weights[m]]
                if len(senders) == 1:
                    failures[self._name(senders[0])] = f"the only {arch} factory left in the round: its update would be revealed, so it is treated as dropped"
                    del masked_inputs[senders[0]]
            for node, masked in masked_inputs.items():
                try:
                    secure.add_masked_input(slot_of[node], masked)
                except ValueError as exc:
                    failures[self._name(node)] = f"malformed masked input: {exc}"
            survivors, dropped = secure.unmask_request()
            participants = sorted(self._name(node_of[s]) for s in survivors)
            if len(survivors) < cfg.min_factories:
                raise RoundAborted(f"{len(survivors)} masked inputs, {cfg.min_factories} required", failures, participants)

            def unmask_message(node: int) -> RecordDict:
                content = RecordDict({"secagg": ConfigRecord({**base, "survivors": survivors, "dropped": dropped})})
                share = ahead.share_request(node) if ahead is not None else None
                if share is not None:  # the next round's share distribution rides on this message
                    content["secagg-next"] = ConfigRecord({"stage": "share", **share})
                return content

            replies = self._exchange([node_of[s] for s in survivors], "query.secagg_unmask", server_round, unmask_message, cfg.secagg_timeout, failures)
            if ahead is not None:
                try:
                    self._pipelined = ahead.finish(_ahead_fields(replies))
                except SecAggAborted as exc:
                    log.info("round %d: the next round will exchange its own keys: %s", server_round, exc)
            answers = {slot_of[node]: dict(r.content["secagg"]) for node, r in replies.items()}
            total = secure.result({slot: (
                {u: (i, s) for u, i, s in zip(r["seed-slots"], r["seed-index"], r["seed-shares"])},
                {u: (i, s) for u, i, s in zip(r["key-slots"], r["key-index"], r["key-shares"])},
            ) for slot, r in answers.items()})
        except SecAggAborted as exc:
            raise RoundAborted(str(exc), failures, []) from exc
        result = self._decode_secure_sum(total, layout, participants, failures, {node_of[s]: metrics.get(node_of[s], {}) for s in survivors},
                                         bytes_received=sum(masked_inputs[node_of[s]].nbytes for s in survivors))
        result.metrics["secagg-phases"] = float(phases)
        return result

    def _threshold(self, n: int) -> int:
        return self.cfg.secagg_threshold or max(2, math.ceil(2 * n / 3))

    def _exchange_keys(self, server_round: int, nodes: list[int], threshold: int, failures: dict[str, str]) -> KeyedSession:
        """The two key phases of a session: advertise the public keys, then route the sealed share boxes."""
        exchange = KeyExchange.of(session_id(self.run_id, server_round), nodes, threshold, self.cfg.secagg_degree)

        def stage(name: str, request: Any) -> dict[int, dict[str, Any]]:
            requests = {n: fields for n in nodes if (fields := request(n)) is not None}
            replies = self._exchange(list(requests), f"query.secagg_{name}", server_round, lambda node: RecordDict({"secagg": ConfigRecord(requests[node])}),
                                     self.cfg.secagg_timeout, failures)
            return {node: dict(r.content["secagg"]) for node, r in replies.items()}

        exchange.add_public_keys(stage("advertise", exchange.advertise_request))
        return exchange.finish(stage("share", exchange.share_request))

    def _open_next_session(self, server_round: int, nodes: list[int]) -> KeyExchange | None:
        """The next round's session, to be keyed during this round (none after the last round)."""
        if server_round >= self.cfg.num_server_rounds:
            return None
        return KeyExchange.of(session_id(self.run_id, server_round + 1, AHEAD), nodes, self._threshold(len(nodes)), self.cfg.secagg_degree)

    def _take_pipelined(self, server_round: int, nodes: list[int]) -> KeyedSession | None:
        """This round's session if the previous round keyed it for every node taking part now."""
        keyed, self._pipelined = self._pipelined, None
        if keyed is None or keyed.secure.session != session_id(self.run_id, server_round, AHEAD):
            return None
        if not keyed.covers(nodes):
            log.info("round %d: factories without shares in the prepared session; exchanging keys afresh", server_round)
            return None
        return keyed

    def _decode_secure_sum(self, total: np.ndarray, layout: SecureLayout, participants: list[str], failures: dict[str, str],
                           metrics: dict[int, dict[str, float]], bytes_received: int) -> RoundResult:
        """Turn the one vector the server may see (the sum) into group models and the ensemble."""
        result = RoundResult(participants=participants, failures=failures)
        groups, ensemble = layout.decode(total, self.cfg.secagg_scale)
        for arch, (weighted_sum, total_weight) in groups.items():
            if total_weight <= 0:
                continue
            new = apply_group_sum(self.lines[arch].weights, weighted_sum, total_weight)
            check_like(self.lines[arch].weights, new, source=f"securely aggregated {arch} model")
            result.group_weights[arch], result.group_examples[arch] = new, total_weight
        if ensemble is not None:
            weighted_sum, count_sum = ensemble
            if count_sum.sum() > 0:  # decoded fixed point is always finite
                result.ensemble, result.ensemble_size = ensemble_of(weighted_sum, count_sum), len(participants)
        result.privacy = {self._name(node): {k: v for k, v in m.items() if k in PRIVACY_KEYS} for node, m in metrics.items() if "epsilon-spent" in m}
        per_factory = [m for m in metrics.values() if m]
        common_keys = set.intersection(*(set(m) for m in per_factory)) - set(PRIVACY_KEYS) if per_factory else set()
        result.metrics = {f"factory-{k}": float(np.mean([m[k] for m in per_factory])) for k in sorted(common_keys)}
        result.metrics |= {"total-examples": float(sum(result.group_examples.values())), "bytes-received": float(bytes_received),
                           "uplink-bytes-per-factory": float(bytes_received) / max(1, len(participants))}
        return result

    # ---------------------------------------------------------------------------------------
    def _parse_update(self, node_id: int, reply: Message, like: "OrderedDict[str, np.ndarray] | None") -> FactoryUpdate:
        if reply.has_error():
            raise UpdateError(f"error reply: {reply.error.reason}")
        content = reply.content
        factory_id = str(content["info"]["factory-id"]) if "info" in content else self._name(node_id)
        self.factory_of_node[node_id] = factory_id
        metrics = {k: float(v) for k, v in content["metrics"].items()}
        update = FactoryUpdate(
            factory_id=factory_id, node_id=node_id,
            weights=OrderedDict((k, a.numpy()) for k, a in content["arrays"].items()) if like is not None else OrderedDict(),
            num_examples=int(metrics.pop("num-examples", 0)), metrics=metrics,
        )
        if like is not None:
            validate_update(like, update)
        return update

    def _parse_predictions(self, reply: Message, factory_id: str) -> tuple[np.ndarray, np.ndarray]:
        """A factory's balanced proxy-set predictions and class counts, checked (raises naming the factory)."""
        assert self.proxy is not None
        if "predictions" not in reply.content:
            raise UpdateError(f"factory {factory_id}: no predictions in a distillation round")
        record = reply.content["predictions"]
        q = check_predictions(record["probabilities"].numpy(), len(self.proxy), NUM_CLASSES, f"factory {factory_id}")
        counts = np.asarray(record["class-counts"].numpy(), dtype=np.float64)
        if counts.shape != (NUM_CLASSES,) or not np.isfinite(counts).all() or (counts < 0).any() or counts.sum() <= 0:
            raise UpdateError(f"factory {factory_id}: class counts {counts.tolist()} are not {NUM_CLASSES} non-negative numbers")
        return q, np.minimum(counts, float(self.cfg.max_weight))

    def _name(self, node_id: int) -> str:
        return self.factory_of_node.get(node_id, f"node-{node_id}")

    def _evaluate(self, arch: str, weights: "OrderedDict[str, np.ndarray]") -> dict[str, float]:
        result = evaluate(load_weights(self._model(arch), weights), self.test_data)
        return {"accuracy": result.accuracy, "loss": result.loss}

    def _record_version(self, server_round: int, parent_id: str | None, kind: str, arch: str, weights: Any, metrics: dict[str, float],
                        participants: list[str], privacy: dict[str, Any] | None = None) -> Any:
        return self.registry.add_version(NewVersion(
            run_id=self.run_id, server_round=server_round, parent_id=parent_id, kind=kind, architecture=arch,
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


def _ahead_fields(replies: dict[int, Message]) -> dict[int, dict[str, Any]]:
    """The next session's stage answers that rode on these replies, by node."""
    return {node: dict(r.content["secagg-next"]) for node, r in replies.items() if "secagg-next" in r.content}


def _weighted_metrics(updates: list[FactoryUpdate]) -> dict[str, float]:
    """Example-weighted means of the factories' own metrics (prefixed ``factory-``; privacy is per factory)."""
    total = sum(u.num_examples for u in updates)
    if total <= 0:
        return {}
    keys = set.intersection(*(set(u.metrics) for u in updates)) - set(PRIVACY_KEYS)
    return {f"factory-{k}": sum(u.metrics[k] * u.num_examples for u in updates) / total for k in sorted(keys)}
