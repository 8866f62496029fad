"""The edge agent: a long-lived gRPC server (protos/fedforge/v1/edge.proto) around `FactoryTrainer`.

SuperNode spawns a fresh ClientApp process for every message; the agent is what stays warm (data in
memory, models built, torch threads set) so that a round costs training time, not start-up time.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import OrderedDict
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from google.protobuf import json_format

from client.config import AgentConfig
from client.dp import DPConfigError
from client.privacy import BudgetExhausted
from client.secagg import SecAggProtocolError, SecAggSessions
from client.trainer import FactoryTrainer, LocalRound
from client.workers import WorkerGroupError
from common.data.folder import DatasetError
from common.distill import ProxyCache, ProxySet, ProxySetError
from common.rpc.fedforge.v1 import edge_pb2, edge_pb2_grpc
from common.secagg.layout import Contribution
from common.secagg.messages import Advertise, Boxes, MaskedInput, Share, Shares, Unmask
from common.secagg.update import flatten
from common.secagg.wire import from_values, to_values
from common.tensors import UpdateError, from_tensor, from_tensors, to_tensor, to_tensors

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 1 << 30
GRPC_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES), ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
DESCRIBE_WAIT_S = 5.0  # how long Describe waits for a round of another run before leaving the re-index to the new run's first round


def _config(struct: Any) -> dict[str, Any]:
    return json_format.MessageToDict(struct) if struct is not None else {}


class EdgeAgentServicer(edge_pb2_grpc.EdgeAgentServicer):
    """Maps RPCs to the trainer; one training job at a time, errors as gRPC status codes."""

    def __init__(self, trainer: FactoryTrainer) -> None:
        self.trainer = trainer
        self.serving_description: Any = None  # set when the agent serves Inspection: which model, and why
        self.after_round: Any = None  # set when the agent serves Inspection: re-choose global vs personal
        self.sessions = SecAggSessions(trainer.cfg.secagg_policy())
        self.proxies = ProxyCache(Path(trainer.cfg.state_dir) / "proxy")
        # Only the simulation sets this (client.simulation, `simulation-audit`): it sees each round's encoded
        # contribution before masking, so a bench can check the server's sum against the factories' inputs.
        self.audit: Any = None
        self._lock = threading.Lock()
        self._data_run: str | None = None  # the run the factory's data was last indexed for (`_follow_run`)

    def _follow_run(self, run_id: str) -> None:
        """A run this agent has not seen before indexes the factory's folder again (`FactoryTrainer.refresh_data`), so
        images copied in since the last run are trained on without a restart. Called holding ``_lock``; within a run
        the images stay as they were at its first message, which keeps a round's DP accounting and split fixed."""
        if not run_id or run_id == self._data_run:
            return
        change = self.trainer.refresh_data()  # cheap when nothing changed: a walk of the folder and a stat of each file
        self._data_run = run_id
        data = self.trainer.data
        log.info("run %s: factory %s trains on %d image files from %s (%s)", run_id, self.trainer.cfg.factory_id, sum(data.counts().values()),
                 data.source.description, f"the folder changed: {change}" if change else "as indexed before")

    def Train(self, request: edge_pb2.TrainRequest, context: grpc.ServicerContext) -> edge_pb2.TrainReply:
        arrived = time.monotonic()
        with self._lock, _status_on_error(context, "train"):
            waited = time.monotonic() - arrived
            self._follow_run(request.run_id)
            config = _config(request.config)
            self._check_architecture(config)
            secure = MaskedInput.from_fields(from_values(request.secagg)) if request.secagg else None
            self._require_secure(secure, "train")
            session = self.sessions.get(secure.session.encode()) if secure else None  # before training: fail fast
            proxy = self._proxy_for(config)  # likewise: a distillation round needs the proxy set already here
            send_weights = bool(config.get("send-weights", True))
            global_weights = from_tensors(request.weights)
            # the honest inputs of the sum this update goes into, from the session this factory checked itself (never the server's word)
            holders = session.honest_inputs() if session is not None else 1
            local = self.trainer.train(global_weights, config, request.server_round, request.run_id, public=self._public_for(config),
                                       noise_holders=holders)
            log.info("round %d: trained, weight %d, loss %.4f%s; %.1fs since the request arrived (%.1fs waiting for the agent, "
                     "%.1fs training)", request.server_round, local.examples, local.metrics["train-loss"], " (secure)" if secure else "",
                     time.monotonic() - arrived, waited, local.metrics["train-seconds"])
            if self.after_round is not None:  # once this round's personal model exists
                threading.Thread(target=self._reconsider, daemon=True, name="fedforge-reconsider").start()
            predictions = (self.trainer.predict(local.weights, config, proxy, float(config.get("temperature", 2.0)), request.run_id,
                                                request.server_round) if proxy is not None else None)
            confusion = local.received.confusion if local.received is not None else np.zeros((len(_classes(config)),) * 2, dtype=np.int64)
            update_norm = float(np.linalg.norm(flatten(local.weights) - flatten(global_weights)))
            metrics = {**local.metrics, "update-norm": update_norm}
            # a factory that trains with DP releases no training statistics, in a sum or in plaintext: its loss, accuracy and
            # update norm on its training images were computed without noise (only what DP-SGD released leaves it)
            summed_metrics = None if local.privacy else metrics
            factory_id = self.trainer.cfg.factory_id
            if session is None:
                reply = edge_pb2.TrainReply(factory_id=factory_id, num_examples=local.examples,
                                            metrics={**(summed_metrics or {}), **local.privacy, **self._own(local)},
                                            confusion=to_tensor("confusion", confusion))
                if send_weights:
                    reply.weights.extend(to_tensors(local.weights))
                if predictions is not None:
                    reply.predictions.CopyFrom(to_tensor("predictions", predictions[0].astype(np.float32)))
                    reply.class_counts.CopyFrom(to_tensor("class-counts", predictions[1]))
                return reply
            # Secure round: only the masked, clipped, fixed-point vector leaves the agent (plus the privacy
            # spend, and this factory's own figures when it chose --share-metrics).
            session.receive_boxes(secure.routed())
            architecture = str(config.get("architecture"))
            contribution = Contribution(architecture if send_weights else None, global_weights, local.weights, local.examples,
                                        predictions, confusion, architecture, summed_metrics)
            encoded, _ = secure.layout.encode(contribution, self._clip_for(secure, local), secure.scale, secure.max_weight)
            if self.audit is not None:
                self.audit(request.server_round, encoded)
            masked = session.mask(encoded, secure.alive, secure.terms(config))
            shared = {**(summed_metrics or {}), **self._own(local)} if self.trainer.cfg.share_metrics else {}
            return edge_pb2.TrainReply(factory_id=factory_id, masked=to_tensor("masked", masked), metrics={**local.privacy, **shared})

    def _clip_for(self, secure: MaskedInput, local: LocalRound) -> float:
        """The bound on this factory's update before masking: the server's, except for a factory that shares the sum's DP noise.

        Such a factory's update carries only its share of the noise, so a clip applied to it alone (or a weight cap that
        scales it) would act on a vector that is not private by itself, and scale its noise apart from the others'; its
        update is bounded already (per-example clipping, one step). It takes no clip, and refuses a weight cap below its
        image count."""
        if not (self.trainer.budget is not None and self.trainer.budget.secure_sum and local.privacy):
            return secure.clip
        if local.examples > secure.max_weight:
            raise PolicyRefusal(f"factory {self.trainer.cfg.factory_id} shares the secure sum's DP noise and weights its update by {local.examples} "
                                f"(its released image count), "
                                f"more than the round's max-weight {secure.max_weight}: its update would be scaled apart from the others'; "
                                f"raise max-weight in the run configuration")
        return math.inf

    def _reconsider(self) -> None:
        self.trainer.wait_personal()
        self.after_round()

    def _require_secure(self, secure: MaskedInput | None, what: str) -> None:
        """A factory that requires secure aggregation answers only inside a secure sum, whatever the server asks."""
        if secure is None and self.trainer.cfg.require_secure_aggregation:
            raise PolicyRefusal(f"factory {self.trainer.cfg.factory_id} requires secure aggregation: a {what} request without it is refused "
                                f"(its answer would leave in plaintext); start the factory with --no-require-secure-aggregation to allow it")

    def _own(self, local: LocalRound) -> dict[str, float]:
        """This factory's own figures on its held-out split: sent only with --share-metrics."""
        if not self.trainer.cfg.share_metrics or local.received is None or local.trained is None:
            return {}
        return {"held-out-accuracy-before": local.received.accuracy, "held-out-loss-before": local.received.loss,
                "held-out-accuracy-after": local.trained.accuracy, "held-out-examples": float(local.received.examples)}

    def _check_architecture(self, config: dict[str, Any]) -> None:
        declared = self.trainer.cfg.architecture
        if declared and str(config.get("architecture", "")) != declared:
            raise UpdateError(f"factory {self.trainer.cfg.factory_id} trains {declared}, the server sent a {config.get('architecture')!r} model")

    def _proxy_for(self, config: dict[str, Any]) -> ProxySet | None:
        sha256 = str(config.get("proxy-sha256", ""))
        if not sha256:
            return None
        proxy = self.proxies.get(sha256)
        if proxy is None:
            raise UpdateError(f"proxy set {sha256[:12]}... is not on factory {self.trainer.cfg.factory_id}; the server must send it first")
        return proxy

    def _public_for(self, config: dict[str, Any]) -> ProxySet | None:
        """The run's public proxy set, where DP-SGD learns the subspace it trains the head in; None if the run names none or
        it is not here (the head then trains whole: a missing public set costs accuracy, never privacy)."""
        sha256 = str(config.get("public-proxy-sha256", ""))
        proxy = self.proxies.get(sha256) if sha256 else None
        if sha256 and proxy is None and self.trainer.budget is not None:
            log.warning("the run's public proxy set %s... is not on this factory: DP-SGD trains the whole head", sha256[:12])
        return proxy

    def Proxy(self, request: edge_pb2.ProxyRequest, context: grpc.ServicerContext) -> edge_pb2.ProxyReply:
        with _status_on_error(context, "proxy"):
            if request.HasField("images"):
                self.proxies.put(request.sha256, from_tensor(request.images))
                log.info("stored proxy set %s... (%d images)", request.sha256[:12], request.images.shape[0])
            return edge_pb2.ProxyReply(factory_id=self.trainer.cfg.factory_id, have=self.proxies.get(request.sha256) is not None)

    def SecAgg(self, request: edge_pb2.SecAggRequest, context: grpc.ServicerContext) -> edge_pb2.SecAggReply:
        with self._lock, _status_on_error(context, f"secagg {request.stage}"):
            f = from_values(request.fields)
            if request.stage == "advertise":
                advertise = Advertise.from_fields(f)
                out = self.sessions.start(advertise.session.encode(), advertise.slot, advertise.threshold).advertise()
            elif request.stage == "share":
                share = Share.from_fields(f)
                out = Boxes.of(self.sessions.get(share.session.encode()).share_keys(share.neighbors, share.enc_pks, share.mask_pks))
            elif request.stage == "unmask":
                unmask = Unmask.from_fields(f)
                out = Shares.of(*self.sessions.get(unmask.session.encode()).unmask(unmask.survivors, unmask.dropped))
            else:
                raise SecAggProtocolError(f"unknown secure-aggregation stage {request.stage!r}")
            return edge_pb2.SecAggReply(factory_id=self.trainer.cfg.factory_id, fields=to_values(out.to_fields()))

    def Evaluate(self, request: edge_pb2.EvaluateRequest, context: grpc.ServicerContext) -> edge_pb2.EvaluateReply:
        with self._lock, _status_on_error(context, "evaluate"):
            self._follow_run(request.run_id)
            config = _config(request.config)
            self._check_architecture(config)
            secure = MaskedInput.from_fields(from_values(request.secagg)) if request.secagg else None
            self._require_secure(secure, "evaluate")
            session = self.sessions.get(secure.session.encode()) if secure else None
            result = self.trainer.evaluate(from_tensors(request.weights), config)
            factory_id = self.trainer.cfg.factory_id
            own = {"held-out-accuracy": result.accuracy, "held-out-loss": result.loss} if self.trainer.cfg.share_metrics else {}
            if session is None:
                return edge_pb2.EvaluateReply(factory_id=factory_id, num_examples=result.examples, metrics=own,
                                              confusion=to_tensor("confusion", result.confusion))
            session.receive_boxes(secure.routed())
            contribution = Contribution(num_examples=result.examples, confusion=result.confusion, confusion_group=str(config.get("architecture")))
            encoded, _ = secure.layout.encode(contribution, secure.clip, secure.scale, secure.max_weight)
            masked = session.mask(encoded, secure.alive, secure.terms(config))
            return edge_pb2.EvaluateReply(factory_id=factory_id, masked=to_tensor("masked", masked), metrics=own)

    def Describe(self, request: edge_pb2.DescribeRequest, context: grpc.ServicerContext) -> edge_pb2.DescribeReply:
        with _status_on_error(context, "describe"):
            # a new run's first message: index the folder again, unless a round of another run holds the agent (then its
            # first train or evaluate message does)
            if self._lock.acquire(timeout=DESCRIBE_WAIT_S):
                try:
                    self._follow_run(request.run_id)
                finally:
                    self._lock.release()
            config = _config(request.config)
            info = self.trainer.describe(config)
            if info["fits"]:  # decode and extract features while the server exchanges keys: round 1 then trains at once
                threading.Thread(target=self._prefetch, args=(config,), daemon=True, name="fedforge-prefetch").start()
            return edge_pb2.DescribeReply(factory_id=self.trainer.cfg.factory_id, architecture=self.trainer.cfg.architecture, fits=info["fits"],
                                          reason=info["reason"], data_source=info["data-source"], class_counts=info.get("class-counts", []),
                                          dp=bool(info.get("dp", False)), personalizes=bool(info.get("personalizes", True)))

    def _prefetch(self, config: dict[str, Any]) -> None:
        with self._lock:  # a train request waits for it rather than doing the same work twice
            self.trainer.prefetch(config)

    def Health(self, request: edge_pb2.HealthRequest, context: grpc.ServicerContext) -> edge_pb2.HealthReply:
        t = self.trainer
        figures = {k: float(v) for k, v in t.last_figures.items() if isinstance(v, (int, float))}
        return edge_pb2.HealthReply(
            factory_id=t.cfg.factory_id, status="serving", num_examples=sum(t.data.counts().values()), data_source=t.data.source.description,
            uptime_seconds=time.time() - t.started, pid=os.getpid(), skipped_files=[p for p, _ in t.data.report.skipped],
            privacy=t.privacy_status(), architecture=t.cfg.architecture, figures=figures,
            serving=self.serving_description() if self.serving_description else "",
        )


def _classes(config: dict[str, Any]) -> tuple[str, ...]:
    from client.data import DataRequest

    return DataRequest.from_config(config).classes


class PolicyRefusal(RuntimeError):
    """The request breaks this factory's own policy (e.g. plaintext while it requires secure aggregation)."""


class _status_on_error:
    """Turn exceptions into gRPC status codes that name the problem (never a bare INTERNAL crash).

    ``context.abort`` raises, so a handler's ``with`` block either returns its reply or ends the RPC.
    """

    def __init__(self, context: grpc.ServicerContext, what: str) -> None:
        self.context, self.what = context, what

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, _tb: object) -> bool:
        if exc is None:
            return False
        if isinstance(exc, WorkerGroupError):
            log.error("%s failed: %s", self.what, exc)
            self.context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.what} failed: {exc}")
        if isinstance(exc, (BudgetExhausted, DPConfigError, PolicyRefusal)):
            log.warning("%s refused: %s", self.what, exc)
            self.context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        if isinstance(exc, (UpdateError, SecAggProtocolError, ProxySetError, DatasetError, KeyError, ValueError)):
            log.warning("%s refused: %s", self.what, exc)
            self.context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        log.exception("%s failed", self.what)
        self.context.abort(grpc.StatusCode.INTERNAL, f"{self.what} failed: {type(exc).__name__}: {exc}")
        return False


class Agent:
    """A running agent: its control-plane server, its Inspection server (with a registry), and the trainer (with its
    worker group) behind them."""

    def __init__(self, server: grpc.Server, trainer: FactoryTrainer, follower: Any = None, inspection: grpc.Server | None = None) -> None:
        self.server, self.trainer, self.follower, self.inspection = server, trainer, follower, inspection

    def wait(self) -> None:
        self.server.wait_for_termination()

    def stop(self, grace: float | None = 2.0) -> None:
        if self.follower is not None:
            self.follower.stop()
        if self.inspection is not None:
            self.inspection.stop(grace).wait()
        self.server.stop(grace).wait()
        self.trainer.close()


def personal_chooser(trainer: FactoryTrainer, lock: threading.Lock, proxies: ProxyCache | None = None) -> Any:
    """Serve the factory's personal model *of the approved version* instead of that version, unless the approved
    version validates clearly better on the held-out split (`client.personal.global_clearly_better`).

    A round leaves a personal model of the global model it received, which nobody has approved; when that is not
    the approved version, the chooser makes the personal model of the approved weights (same training settings,
    about a second on cached features), once per approved version."""
    from client.personal import global_clearly_better, hit_rate, weights_digest
    from client.trainer import model_for_weights
    from common.models import weights_of

    made: dict[tuple[str, Any, str], OrderedDict[str, np.ndarray]] = {}  # the latest approved version's personal model

    def choose(version_id: str, architecture: str, request: Any, global_model: Any) -> tuple[str, Any, str]:
        assert trainer.personal is not None
        found = trainer.personal.get(architecture)
        if found is None or found[1].request != request:
            return version_id, global_model, "global model (no personal model for this input yet)"
        approved = weights_of(global_model)
        digest = weights_digest(approved)
        with lock:  # the same caches the training thread uses
            if found[1].base_sha256 == digest:
                weights = found[0]
            else:
                key = (architecture, request, digest)
                if key not in made:
                    made.clear()
                    sha256 = str(found[1].settings.get("public-proxy-sha256", ""))  # the round's public proxy set, if it had one
                    public = proxies.get(sha256) if proxies is not None and sha256 else None
                    made[key] = trainer.personal_of(architecture, request, approved, found[1].settings, public)
                weights = made[key]
            g_hits = trainer.held_out_hits(architecture, approved, request)
            p_hits = trainer.held_out_hits(architecture, weights, request)
        g, p = hit_rate(g_hits), hit_rate(p_hits)
        if not global_clearly_better(g_hits, p_hits):
            return (f"personal@{version_id}", model_for_weights(weights, architecture, request),
                    (f"this factory's personal model of {version_id[:8]} scores {p:.4f} on its {len(p_hits)} held-out images, "
                     f"the approved model itself {g:.4f} ({p - g:+.4f}; that is served only when clearly better)"))
        return (version_id, global_model, (f"global {version_id[:8]} scores {g:.4f} on this factory's {len(g_hits)} held-out images, clearly "
                                           f"better than its personal model's {p:.4f}"))

    return choose


def serve(cfg: AgentConfig) -> Agent:
    """Load the factory's data, start its worker group, and serve the control plane on ``cfg.listen`` (this host only)
    and, with a registry, Inspection on ``cfg.inspection_listen``."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=GRPC_OPTIONS)
    socket_path = Path(cfg.listen.removeprefix("unix:")) if cfg.listen.startswith("unix:") else None
    if socket_path is not None:  # the socket's directory is what the SuperNode's user or container is given
        socket_path.parent.mkdir(mode=0o770, parents=True, exist_ok=True)
    # Bound before the data and the worker group load (seconds, more with DDP), so that the port is taken at once; nothing
    # is served until start().
    if server.add_insecure_port(cfg.listen) == 0 and socket_path is None:
        raise RuntimeError(f"edge agent could not listen on {cfg.listen}")
    trainer = FactoryTrainer(cfg)
    servicer = EdgeAgentServicer(trainer)
    edge_pb2_grpc.add_EdgeAgentServicer_to_server(servicer, server)
    follower = inspection = None
    if cfg.registry:
        from client.inspection import ApprovalFollower, InspectionServicer, ServingModel
        from client.models import ModelClient
        from common.signing import load_public

        serving = ServingModel()
        inspection = inspection_server(cfg, InspectionServicer(serving, cfg.bit_depth))
        credentials = grpc.ssl_channel_credentials(Path(cfg.registry_ca).read_bytes()) if cfg.registry_ca else None
        client = ModelClient(cfg.registry, load_public(cfg.registry_public_key), Path(cfg.state_dir) / "models", credentials, cfg.registry_token)
        chooser = personal_chooser(trainer, servicer._lock, servicer.proxies) if cfg.personalize else None
        follower = ApprovalFollower(client, serving, load_public(cfg.release_public_key), cfg.architecture, chooser,  # its own architecture's line
                                    state_path=Path(cfg.state_dir) / "releases.json")
        servicer.after_round = follower.reconsider
        servicer.serving_description = lambda: f"{serving.current().label}: {serving.description}" if serving.version else ""
    server.start()
    if socket_path is not None:  # the agent's user and group only (the SuperNode's user is in the group), whatever the umask
        os.chmod(socket_path, 0o660)
    if inspection is not None:
        inspection.start()
    if follower is not None:
        follower.start()
    log.info("edge agent for factory %s serving its control plane on %s%s", cfg.factory_id, cfg.listen,
             f", Inspection on {cfg.inspection_listen}" if inspection else "")
    return Agent(server, trainer, follower, inspection)


def inspection_server(cfg: AgentConfig, servicer: Any) -> grpc.Server:
    """Inspection on its own server and port: a station that may classify images never reaches Train or SecAgg.

    With ``--inspection-token`` every call must carry it; with a certificate the port speaks only TLS. Off loopback
    both are required (`AgentConfig` refuses to start otherwise)."""
    from common.grpc_auth import TokenAuth

    interceptors = [TokenAuth(cfg.inspection_token, "factory's Inspection service", "--inspection-token")] if cfg.inspection_token else []
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=GRPC_OPTIONS, interceptors=interceptors)
    edge_pb2_grpc.add_InspectionServicer_to_server(servicer, server)
    if cfg.inspection_tls_cert:
        credentials = grpc.ssl_server_credentials([(Path(cfg.inspection_tls_key).read_bytes(), Path(cfg.inspection_tls_cert).read_bytes())])
        port = server.add_secure_port(cfg.inspection_listen, credentials)
    else:
        port = server.add_insecure_port(cfg.inspection_listen)
    if port == 0 and not cfg.inspection_listen.startswith("unix:"):
        raise RuntimeError(f"edge agent could not serve Inspection on {cfg.inspection_listen}")
    return server
