"""The FedForge round loop on Flower's Message API: the recipe a run follows, top to bottom.

A run: wait for factories, learn who they are (`_describe`: the model each trains, whether its
classes fit the run's list), then rounds, then one evaluate-only phase. A round:

1. describe factories seen for the first time; hand out the proxy set in distillation rounds, and to
   factories that train with DP (they train the head within its principal subspace: `client.subspace`);
2. send every factory its group's global model (`plain_round`, or `SecureRounds.train` where the
   server learns sums only); each factory evaluates the model it received on its own held-out
   images, then trains, and replies;
3. record the federated figures of the models that were sent (summed confusion matrices);
4. per architecture group: apply the server optimiser to the average, distil the ensemble into it
   (distillation rounds, kept only if it validates no worse), evaluate centrally when a test set
   exists, and record a signed version;
5. record the round (who took part, who failed and why, where the time went).

Factories that fail, time out or send a malformed update are logged by factory id and left out; a
round with fewer than ``min_factories`` good factories is aborted and the global models stay as they
were. A run whose every round aborted ends as ``failed``, with the reason.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections import OrderedDict
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.inflatable.inflatable_utils import ObjectPullError, ObjectPushError, ObjectUnavailableError

from common.data.images import DECODE_VERSION
from common.distill import DistillConfig, ProxySet
from common.evaluation import figures
from common.models import ARCHITECTURES, backbone_of, build_model, federated_part, is_pretrained, load_weights, weights_of
from common.procs import process_identity
from common.training import set_torch_threads, torch_threads
from server.central import CentralData
from server.config import FederationConfig
from server.distillation import distil_into, load_proxy, load_validation
from server.groups import Line, RoundPlan, RoundResult
from server.messaging import Messenger
from server.optimizers import ServerOptimizer
from server.plain_round import RoundAborted, plain_evaluation, plain_round
from server.reduce import evaluation_metrics
from server.registry.artifacts import decode_weights, encode_weights
from server.registry.service import NewEvaluation, NewVersion, Registry
from server.secure_round import SecureRounds
from server.supervisor import SERVERAPP_KEY

log = logging.getLogger("fedforge.server")

__all__ = ["Federation", "FederationConfig", "RoundAborted", "ending_for"]

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
        self.cfg = cfg
        registry_dir = Path(cfg.registry_dir or "fedforge-registry").resolve()
        self.registry = Registry.at(registry_dir, create_key=True)  # every version is signed
        self.run_id = f"run-{flwr_run_id}" if flwr_run_id else f"run-{uuid.uuid4().hex[:12]}"
        self.flwr_run_id = flwr_run_id
        self.messenger = Messenger(grid)
        self.secure = SecureRounds(self.messenger, cfg, self.run_id)
        self.central = CentralData(cfg, registry_dir)
        self.classes = cfg.class_list
        self.architecture_of_node: dict[int, str] = {}
        self.generated_data: dict[int, bool] = {}  # node -> its data comes from the project's generator
        self.left_out: dict[int, str] = {}  # node -> why it cannot take part (its classes do not fit)
        self.lines: dict[str, Line] = {}
        self.models: dict[str, torch.nn.Module] = {}
        self.resumed_round = 0
        self.completed_rounds = 0
        self.last_abort = ""
        self.first_failures: dict[str, str] = {}  # describe failures before round 1, reported with it
        self.proxy: ProxySet | None = None
        self.validation: Any = None
        self.proxy_ready: set[int] = set()  # nodes holding this run's proxy set (it travels once per run)
        self.private_nodes: set[int] = set()  # nodes that declared they train with DP-SGD
        self.unpersonalized_nodes: set[int] = set()  # nodes that declared they keep no personal model (--no-personalize)
        self.public_sha256 = ""  # the proxy set DP factories train their head's subspace from, once sent
        self.no_public_reason = ""  # why DP factories get no public proxy set (said once)

    # ---------------------------------------------------------------------------------------
    def run(self) -> None:
        cfg = self.cfg
        self.registry.start_run(self.run_id, self.flwr_run_id, {**asdict(cfg), "training": asdict(cfg.training),
                                                                SERVERAPP_KEY: process_identity()})
        log.info("run %s: %d rounds (default architecture %s, classes %s, %d px x %d channel(s), server optimiser %s, distillation %s), registry %s",
                 self.run_id, cfg.num_server_rounds, cfg.architecture, list(self.classes), cfg.image_size, cfg.channels, cfg.server_optimizer,
                 cfg.distill, cfg.registry_dir)
        if cfg.good_class not in self.classes:
            log.warning("good-class %r is not in the class list %s: escape and false-reject rates are undefined; set good-class",
                        cfg.good_class, list(self.classes))
        try:
            self._resume()
            self._wait_for_factories()
            first = self.resumed_round + 1
            self._describe(self.messenger.node_ids(), first, self.first_failures)
            self.central.choose_test_set(bool(self.generated_data) and all(self.generated_data.values()))
            for arch in sorted(set(self.architecture_of_node.values())):
                self.central.warm_up(self._model(arch), arch)
            if cfg.distill != "off":
                self.proxy, self.validation = load_proxy(cfg), load_validation(cfg)
            for server_round in range(first, cfg.num_server_rounds + 1):
                self._round(server_round)
            if cfg.federated_evaluation and self.completed_rounds:
                self._final_evaluation(cfg.num_server_rounds + 1)
            for line in self.lines.values():  # a run whose rounds all aborted still records where it started
                self._version_of(line)
        except BaseException as exc:
            status = ending_for(exc)
            log.exception("run %s %s", self.run_id, status)
            self.registry.finish_run(self.run_id, status, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
            raise
        planned = cfg.num_server_rounds - self.resumed_round
        if planned > 0 and self.completed_rounds == 0:
            reason = f"all {planned} rounds aborted; the last because: {self.last_abort}"
            log.error("run %s failed: %s", self.run_id, reason)
            self.registry.finish_run(self.run_id, "failed", reason)
            return
        self.registry.finish_run(self.run_id, "finished")
        log.info("run %s finished", self.run_id)

    def _round(self, server_round: int) -> None:
        t0 = time.perf_counter()
        cfg, failures = self.cfg, dict(self.first_failures)
        self.first_failures = {}
        self.messenger.new_round()
        distilling = cfg.distills_in(server_round) and self.proxy is not None
        nodes = self._describe(self.messenger.node_ids(), server_round, failures)
        if distilling:
            nodes = self._deliver_proxy(nodes, server_round, failures)
        self._share_public(nodes, server_round)
        plan = self._plan(server_round, nodes, distilling)
        sent = dict(self.lines)  # whose models the factories evaluate this round (recorded versions after the round)
        try:
            if cfg.secure_aggregation:
                result = self.secure.train(plan, failures, key_next=self._keys_next(server_round))
            else:
                result = plain_round(self.messenger, plan, cfg.distill != "only", cfg.min_factories, cfg.round_timeout, cfg.max_weight, failures)
        except RoundAborted as exc:
            self._abort(server_round, str(exc), exc.failures, exc.participants, time.perf_counter() - t0, {})
            return
        self._log_failures(server_round, result.failures)
        metrics = {**result.metrics, **self.messenger.phase_metrics(), **self._record_evaluations(server_round, "round", sent, plan, result)}
        versions = {}
        for arch in sorted({plan.architecture_of[n] for n in nodes} | set(result.group_weights)):
            version = self._new_version(arch, server_round, result, distilling, metrics)
            if version is not None:
                versions[arch] = version
        seconds = time.perf_counter() - t0
        primary = versions.get(cfg.architecture) or (next(iter(versions.values())) if versions else None)
        if primary is None:
            self._abort(server_round, "no group produced a model (no update and no kept distillation)", result.failures, result.participants,
                        seconds, metrics)
            return
        self.completed_rounds += 1
        self.registry.record_round(
            self.run_id, server_round, status="completed", accuracy=primary.metrics.get("accuracy"), loss=primary.metrics.get("loss"),
            participants=result.participants, failures=result.failures, metrics=metrics, seconds=seconds, version_id=primary.id,
        )
        federated = f", federated accuracy of the previous model {metrics['federated-accuracy']:.4f}" if "federated-accuracy" in metrics else ""
        log.info("round %d: %s from %s in %.2fs%s%s", server_round,
                 ", ".join(f"{a} accuracy {v.metrics['accuracy']:.4f}" if "accuracy" in v.metrics else f"{a} version {v.id[:8]}"
                           for a, v in versions.items()),
                 result.participants, seconds, federated, " (secure aggregation)" if cfg.secure_aggregation else "")

    def _new_version(self, arch: str, server_round: int, result: RoundResult, distilling: bool, metrics: dict[str, Any]) -> Any:
        """The group's next global model: server optimiser on the average, then distillation; None if nothing changed."""
        cfg, line = self.cfg, self._line(arch)
        weights, kind = None, "fedavg"
        if arch in result.group_weights:
            weights = line.optimizer.step(line.weights, result.group_weights[arch])
        if distilling and result.ensemble is not None and self.proxy is not None:
            base = weights if weights is not None else line.weights
            model = self._model(arch)
            load_weights(model, base)
            proxy, validation = self.central.proxy_inputs(model, arch, self.proxy.images), self.central.inputs(model, arch, self.validation)
            with torch_threads(cfg.distill_threads or os.cpu_count() or 1):
                outcome = distil_into(federated_part(model), base, proxy, result.ensemble, validation, self._distill_config(server_round))
            metrics |= outcome.metrics(f"{arch}/")
            log.info("round %d: distilled the ensemble of %d factories into %s: validation accuracy %.4f -> %.4f, %s",
                     server_round, result.ensemble_size, arch, outcome.val_accuracy_before, outcome.val_accuracy_after,
                     "kept" if outcome.kept else "dropped (kept the undistilled model)")
            if outcome.kept:
                weights, kind = outcome.weights, "distilled"
        if weights is None:
            return None
        central = self._evaluate(arch, weights)
        metrics |= {f"{arch}/{k}": v for k, v in central.items()}
        if line.optimizer.kind != "fedavg":
            state = self.registry.artifacts.put(encode_weights(OrderedDict(line.optimizer.state_arrays())))
            metrics.setdefault("server-optimizer-state", {})[arch] = state
        line.version = self._record_version(server_round, self._version_of(line).id, kind, arch, weights, {**central, **_scalars(metrics)},
                                            result.participants, result.privacy)
        line.weights = weights
        return line.version

    def _abort(self, server_round: int, reason: str, failures: dict[str, str], participants: list[str], seconds: float, metrics: dict[str, Any]) -> None:
        self._log_failures(server_round, failures)
        log.error("round %d aborted: %s; the global models are unchanged", server_round, reason)
        self.last_abort = reason
        self.registry.record_round(self.run_id, server_round, status="aborted", participants=participants, failures=failures, seconds=seconds,
                                   version_id=None, metrics={**metrics, "reason": reason, **self.messenger.phase_metrics()})

    def _final_evaluation(self, phase_round: int) -> None:
        """One evaluate-only message after the last round: the final versions get their federated figures."""
        failures: dict[str, str] = {}
        self.messenger.new_round()
        nodes = self._describe(self.messenger.node_ids(), phase_round, failures)
        plan = self._plan(phase_round, nodes, distilling=False)
        sent = dict(self.lines)
        try:
            if self.cfg.secure_aggregation:
                result = self.secure.evaluate(plan, failures)
            else:
                result = plain_evaluation(self.messenger, plan, self.cfg.round_timeout, failures)
        except RoundAborted as exc:
            log.error("final evaluation failed: %s", exc)
            return
        self._log_failures(phase_round, result.failures)
        metrics = self._record_evaluations(self.cfg.num_server_rounds, "final", sent, plan, result)
        if "federated-accuracy" in metrics:
            log.info("final evaluation on %d factories' held-out images: accuracy %.4f, escape rate %s, false-reject rate %s",
                     len(result.participants), metrics["federated-accuracy"], metrics.get("federated-escape-rate"),
                     metrics.get("federated-false-reject-rate"))

    def _record_evaluations(self, server_round: int, phase: str, sent: dict[str, Line], plan: RoundPlan, result: RoundResult) -> dict[str, Any]:
        """Store each group's summed confusion matrix with the version it measured; return the round's metrics for them."""
        cfg, metrics = self.cfg, {}
        names = {self.messenger.name(n): plan.architecture_of[n] for n in plan.nodes}
        for arch, confusion in sorted(result.confusion.items()):
            if arch not in sent or int(np.asarray(confusion).sum()) == 0:
                continue
            f = figures(confusion, self.classes, cfg.good_class)
            members = [p for p in result.participants if names.get(p) == arch]
            self.registry.record_evaluation(NewEvaluation(
                version_id=self._version_of(sent[arch]).id, run_id=self.run_id, server_round=server_round, phase=phase, factories=len(members),
                classes=list(self.classes), confusion=confusion, figures=f,
                shared={k: v for k, v in result.shared.items() if names.get(k) == arch}, secure_aggregation=cfg.secure_aggregation))
            metrics |= evaluation_metrics(f"federated/{arch}/", confusion, self.classes, cfg.good_class)
            if arch == cfg.architecture or len(result.confusion) == 1:
                metrics |= evaluation_metrics("federated-", confusion, self.classes, cfg.good_class)
        return metrics

    # factories ---------------------------------------------------------------------------------
    def _describe(self, node_ids: list[int], server_round: int, failures: dict[str, str]) -> list[int]:
        """Learn the architecture and data fit of nodes seen for the first time; returns the nodes that can take part."""
        new = [n for n in node_ids if n not in self.architecture_of_node and n not in self.left_out]
        if new:
            timeout = min(self.cfg.secagg_timeout, self.cfg.round_timeout)  # a light query: never wait longer than a round would
            request = RecordDict({"config": ConfigRecord({**self.cfg.data_config(), "architecture": self.cfg.architecture})})
            for node, reply in self.messenger.exchange(new, "query.describe", server_round, lambda n: request, timeout, failures).items():
                info = reply.content["info"]
                arch = str(info.get("architecture", "")) or self.cfg.architecture
                if not bool(info.get("fits", True)):
                    self.left_out[node] = str(info.get("reason", "its classes do not fit the run's class list"))
                elif arch not in ARCHITECTURES:
                    self.left_out[node] = f"declares an unknown architecture {arch!r}; this server knows {sorted(ARCHITECTURES)}"
                else:
                    self.architecture_of_node[node] = arch
                    if bool(info.get("dp", False)):
                        self.private_nodes.add(node)
                    if not bool(info.get("personalizes", True)):  # a factory that does not say keeps one, as before it could say
                        self.unpersonalized_nodes.add(node)
                    self.generated_data[node] = str(info.get("data-source", "")) == "synthetic"
                    log.info("factory %s trains %s on %s data", self.messenger.name(node), arch, info.get("data-source", "its own"))
                    continue
                log.warning("factory %s is left out of this run: %s", self.messenger.name(node), self.left_out[node])
        for node in node_ids:
            if node in self.left_out:
                failures[self.messenger.name(node)] = f"left out: {self.left_out[node]}"
        return [n for n in node_ids if n in self.architecture_of_node]

    def _deliver_proxy(self, node_ids: list[int], server_round: int, failures: dict[str, str]) -> list[int]:
        """Make sure every node holds the proxy set: the hash first, the images only to nodes that lack them."""
        assert self.proxy is not None
        sha = ConfigRecord({"sha256": self.proxy.sha256})
        pending = [n for n in node_ids if n not in self.proxy_ready]
        if pending:
            timeout = self.cfg.secagg_timeout
            replies = self.messenger.exchange(pending, "query.proxy", server_round, lambda n: RecordDict({"proxy": sha}), timeout, failures)
            self.proxy_ready |= {n for n, r in replies.items() if r.content["proxy"]["have"]}
            missing = [n for n in replies if n not in self.proxy_ready]
            if missing:
                images = ArrayRecord(OrderedDict(images=Array(self.proxy.images)))
                replies = self.messenger.exchange(missing, "query.proxy", server_round, lambda n: RecordDict({"proxy": sha, "images": images}),
                                                  self.cfg.proxy_timeout, failures)
                self.proxy_ready |= {n for n, r in replies.items() if r.content["proxy"]["have"]}
                log.info("round %d: sent the proxy set (%d images, %.1f MB) to %d factories", server_round, len(self.proxy),
                         self.proxy.images.nbytes / 1e6, len(missing))
        return [n for n in node_ids if n in self.proxy_ready]

    def _share_public(self, nodes: list[int], server_round: int) -> None:
        """Send the proxy set (public images) to the pretrained factories that learn from it: one that trains the head with DP
        learns the subspace it trains in (`client.subspace`), and each one's personal model learns from it the classes rare
        there (`client.personal.public_examples`). Without it they train as before, so a failed delivery is logged, not fatal."""
        training = self.cfg.training
        personal = training.personal_epochs > 0 and training.personal_public_confidence > 0
        takers = [n for n in nodes if is_pretrained(self.architecture_of_node[n])
                  and ((personal and n not in self.unpersonalized_nodes) or (n in self.private_nodes and training.public_subspace > 0))]
        if not takers:
            return
        if self.proxy is None:
            if not self.cfg.proxy_data and not all(self.generated_data.values()):
                if not self.no_public_reason:
                    self.no_public_reason = "no proxy-data folder: factories with their own images need public images of their domain"
                    log.warning("factories get no public images (%s): those that train with DP train the whole head, and personal models "
                                "learn rare classes only from their own images; set proxy-data to a folder of unlabelled public images of "
                                "the domain (docs/security.md)", self.no_public_reason)
                return
            self.proxy = load_proxy(self.cfg)
        missed: dict[str, str] = {}
        self._deliver_proxy(takers, server_round, missed)
        for name, reason in missed.items():
            log.warning("round %d: factory %s did not take the public proxy set (%s); it trains without it (under DP: the whole head)",
                        server_round, name, reason)
        self.public_sha256 = self.proxy.sha256

    def _plan(self, server_round: int, nodes: list[int], distilling: bool) -> RoundPlan:
        for arch in {self.architecture_of_node[n] for n in nodes}:
            self._line(arch)
        return RoundPlan(server_round, nodes, self.architecture_of_node, self.lines, distilling, self.proxy, len(self.classes),
                         lambda arch, send_weights: self._message_config(server_round, arch, distilling, send_weights))

    def _message_config(self, server_round: int, arch: str, distilling: bool, send_weights: bool) -> ConfigRecord:
        config = self.cfg.train_config(server_round, arch)
        if distilling:
            assert self.proxy is not None
            config |= {"proxy-sha256": self.proxy.sha256, "temperature": self.cfg.distill_temperature}
        if self.public_sha256:  # a factory uses it as its own settings say (DP subspace, personal model's rare classes)
            config["public-proxy-sha256"] = self.public_sha256
        config["send-weights"] = send_weights
        return ConfigRecord(config)

    def _keys_next(self, server_round: int) -> bool:
        """Whether this round keys the next secure phase in flight: another round, or the final evaluation."""
        return server_round < self.cfg.num_server_rounds or self.cfg.federated_evaluation

    # groups ----------------------------------------------------------------------------------
    def _resume(self) -> None:
        cfg = self.cfg
        if not cfg.resume_from:
            return
        version = self.registry.get_version(cfg.resume_from)
        if version is None:
            raise ValueError(f"cannot resume from {cfg.resume_from!r}: no such version in the registry")
        self.resumed_round = version.server_round
        log.info("run %s resumes the federation from version %s (round %d)", self.run_id, version.id, version.server_round)

    def _line(self, arch: str) -> Line:
        """The group's line: loaded from the registry when resuming, else a fresh initial version."""
        if arch in self.lines:
            return self.lines[arch]
        optimizer = ServerOptimizer(self.cfg.server_optimizer, self.cfg.server_lr_for(arch), self.cfg.server_momentum, self.cfg.server_beta2, self.cfg.server_tau)
        if self.resumed_round:
            candidates = [v for v in self.registry.versions() if v.architecture == arch and v.server_round <= self.resumed_round]
            if candidates:
                head = max(candidates, key=lambda v: (v.server_round, v.created_at))
                self._load_optimizer_state(optimizer, head, arch)
                self.lines[arch] = Line(arch, self.registry.load_weights(head.id), head, optimizer)  # sha256-verified
                return self.lines[arch]
        weights = weights_of(build_model(arch, num_classes=len(self.classes), seed=self.cfg.seed, in_channels=self.cfg.channels))
        self.lines[arch] = Line(arch, weights, None, optimizer)
        return self.lines[arch]

    def _version_of(self, line: Line) -> Any:
        """The line's registry version; the initial model is recorded (with its central test figures) when first needed,
        so that a pretrained model's test-set features are computed while round 1 exchanges keys, not before it."""
        if line.version is None:
            line.version = self._record_version(self.resumed_round, None, "initial", line.architecture, line.weights,
                                                self._evaluate(line.architecture, line.weights), [])
        return line.version

    def _load_optimizer_state(self, optimizer: ServerOptimizer, version: Any, arch: str) -> None:
        """A resumed line continues with the server optimiser's state saved with the round that made its head."""
        if optimizer.kind == "fedavg":
            return
        for r in self.registry.rounds(version.run_id):
            sha = (r.metrics.get("server-optimizer-state") or {}).get(arch) if isinstance(r.metrics, dict) else None
            if sha and r.server_round == version.server_round:
                optimizer.load_state(decode_weights(self.registry.artifacts.get(sha)))
                log.info("resumed the %s server optimiser state of %s from round %d", optimizer.kind, arch, r.server_round)
                return
        log.warning("no saved %s server optimiser state for %s version %s: starting it from zero", optimizer.kind, arch, version.id)

    def _model(self, arch: str) -> torch.nn.Module:
        if arch not in self.models:
            self.models[arch] = build_model(arch, num_classes=len(self.classes), seed=self.cfg.seed, in_channels=self.cfg.channels)
        return self.models[arch]

    def _distill_config(self, server_round: int) -> DistillConfig:
        c = self.cfg
        return DistillConfig(temperature=c.distill_temperature, epochs=c.distill_epochs, patience=c.distill_patience, lr=c.distill_lr,
                             seed=c.seed * 1000 + server_round)

    def _evaluate(self, arch: str, weights: OrderedDict[str, np.ndarray]) -> dict[str, float]:
        model = self._model(arch)
        result = self.central.evaluate(load_weights(model, weights), arch)
        return {"accuracy": result.accuracy, "loss": result.loss} if result is not None else {}

    def _record_version(self, server_round: int, parent_id: str | None, kind: str, arch: str, weights: Any, metrics: dict[str, Any],
                        participants: list[str], privacy: dict[str, Any] | None = None) -> Any:
        model_input = {"classes": list(self.classes), "image_size": self.cfg.image_size, "channels": self.cfg.channels,
                       "good_class": self.cfg.good_class, "backbone": backbone_of(arch),
                       "decoding": DECODE_VERSION}  # how images became inputs: inspection reads requests alike (client.inspection)
        return self.registry.add_version(NewVersion(
            run_id=self.run_id, server_round=server_round, parent_id=parent_id, kind=kind, architecture=arch,
            weights=weights, metrics=metrics, participants=participants, privacy=privacy,
            secure_aggregation=self.cfg.secure_aggregation and kind != "initial", model_input=model_input,
        ))

    def _log_failures(self, server_round: int, failures: dict[str, str]) -> None:
        for name, reason in sorted(failures.items()):
            log.warning("round %d: factory %s failed and is left out: %s", server_round, name, reason)

    def _wait_for_factories(self) -> None:
        """Wait until enough factories are connected. A resumed run (after a crash, often of the SuperLink) also waits, within
        the same time, until they have sent a heartbeat since it started: a restarted SuperLink lists the factories of its
        database as online until their last heartbeats run out, and a round sent to one that has not reconnected yet fails
        with "Node Unavailable" when they do."""
        wanted = self.cfg.expected_factories or self.cfg.min_factories
        started = time.time()
        deadline = time.monotonic() + self.cfg.wait_for_factories
        while len(self.messenger.node_ids()) < wanted:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(self.messenger.node_ids())} of {wanted} factories connected within {self.cfg.wait_for_factories:.0f}s")
            time.sleep(0.2)
        if not self.cfg.resume_from:
            return
        while len(heard := self.messenger.heard_since(started)) < wanted:
            if time.monotonic() > deadline:
                log.warning("resuming with factories that have not reported since the restart (%d of %d have): their first messages may "
                            "fail", len(heard), wanted)
                return
            time.sleep(0.2)
        log.info("resumed run: %d factories have reported since it started", len(heard))


def _scalars(metrics: dict[str, Any]) -> dict[str, Any]:
    """The round metrics that belong in a version's signed manifest (numbers, not bookkeeping)."""
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
