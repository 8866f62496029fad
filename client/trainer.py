"""What a factory does with a global model: evaluate it on its held-out images, train it, report.

This is the library the edge agent serves over gRPC and that the ClientApp calls in-process when no
agent is configured (simulation, unit tests). A round reads top to bottom in `FactoryTrainer.train`:
prepare the model and data the run asks for, evaluate the received global model on the held-out
split (federated evaluation rides on the train message), charge the privacy ledger, train (in
process, in the DDP/FSDP worker group, or with DP-SGD), evaluate the result, check the new weights,
report. The personal fine-tune of the received model runs after that, beside the round: it never
leaves the factory, so the round need not wait for it (`wait_personal` does, where its figures are read).

For the pretrained family the frozen backbone's features are computed once per image and cached
(`common.features`), so training and evaluation run on the head alone.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from client.config import AgentConfig
from client.data import DataRequest, factory_data, fit_reason
from client.dp import DPPlan, check_dp_compatible, noisy_counts, noisy_gradient_step, sample_rate, steps_per_epoch, train_private
from client.parallel import apply_activation_checkpointing
from client.personal import PersonalModels, hit_rate, public_examples, weights_digest
from client.privacy import PrivacyLedger, noise_for_budget
from client.subspace import PublicSubspace, SubspaceError, SubspaceHead, fit_subspace
from client.workers import Job, WorkerGroup
from common.backbones import FeatureExtractor, feature_extractor
from common.data import datasets
from common.data.datasets import ImageSet
from common.data.folder import DatasetError
from common.distill import ProxySet, balanced_predictions, predict_proxy
from common.features import FeatureCache, FeatureSet, array_keys, cache_path, features_of
from common.models import build_model, federated_part, is_pretrained, load_weights, weights_of
from common.tensors import UpdateError, check_like
from common.training import EvalResult, TrainConfig, TrainResult, evaluate, predict_logits, prior_adjustment, set_torch_threads, train

log = logging.getLogger(__name__)

ALONE_SEED = 0  # the head a factory trains on its images alone (`FactoryTrainer.personal_head`)


def train_config_from(config: dict[str, Any], server_round: int) -> TrainConfig:
    """The run's training options (`TrainConfig`'s keys); bad values raise naming the key."""
    try:
        return TrainConfig.from_run_config(config, seed=int(config.get("seed", 0)) * 100_003 + server_round)
    except (TypeError, ValueError) as exc:
        raise UpdateError(f"invalid training config from the server: {exc}") from exc


def data_request_from(config: dict[str, Any]) -> DataRequest:
    try:
        return DataRequest.from_config(config)
    except (TypeError, ValueError) as exc:
        raise UpdateError(f"invalid data config from the server: {exc}") from exc


@dataclass
class Prepared:
    """A model holding the global weights, the module that trains, and the data it trains and is judged on."""

    architecture: str
    model: nn.Module  # the whole model
    trainable: nn.Module  # the model itself, or its head (trained over cached backbone features)
    train_set: ImageSet  # images, or their features
    held_out: ImageSet
    request: DataRequest


@dataclass
class LocalRound:
    weights: OrderedDict[str, np.ndarray]  # the new federated weights
    examples: int  # the update's weight: the image count (with DP: the total of the released class counts)
    received: EvalResult | None  # the global model it was sent, on this factory's held-out split
    trained: EvalResult | None  # the model it trained, on the same split (the personal model)
    metrics: dict[str, float]  # train-loss, train-accuracy, steps, train-seconds, eval-seconds
    privacy: dict[str, float]  # epsilon spent / remaining / max, delta, noise multiplier (DP rounds)


def _lower_thread_priority(niceness: int = 10) -> None:
    """Run the calling thread at a lower CPU priority (Linux schedules threads individually): background work on
    an edge node, such as the personal fine-tune, then yields the cores to the round's own messages."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)
    except (AttributeError, OSError) as exc:  # not Linux, or not permitted: same priority as the round
        log.debug("personal fine-tune keeps normal priority: %s", exc)


class FactoryTrainer:
    """One factory's warm state: its data, feature cache, models, privacy ledger and worker group."""

    def __init__(self, cfg: AgentConfig) -> None:
        set_torch_threads(cfg.torch_threads)
        self.cfg = cfg
        self.started = time.time()
        self.data = factory_data(cfg)
        state = Path(cfg.state_dir)
        self.features = FeatureCache(cache_path(state / "features.db"))
        self._feature_sets: dict[tuple[str, DataRequest], tuple[ImageSet, ImageSet]] = {}
        self._models: dict[tuple[str, int, int], nn.Module] = {}
        self.budget = cfg.privacy_budget()
        self.ledger = PrivacyLedger(state / "privacy-ledger.db", cfg.factory_id) if self.budget else None
        self.personal = PersonalModels(state / "personal") if cfg.personalize else None
        self._personal_jobs = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedforge-personal", initializer=_lower_thread_priority)
        self._personal_done: Future[None] | None = None
        self._alone_heads: dict[tuple[Any, ...], OrderedDict[str, np.ndarray]] = {}  # heads trained on this factory's images alone
        self._alone_lock = threading.Lock()
        self._subspaces: dict[tuple[Any, ...], PublicSubspace] = {}  # fitted on the run's public proxy set (client.subspace)
        self._figures_lock = threading.Lock()
        self.workers = WorkerGroup(cfg, cfg.parallelism, cfg.local_world_size) if cfg.parallelism != "none" else None
        self.last_figures: dict[str, Any] = {}  # this factory's own latest evaluation (Health, logs)
        self._dp_warned: set[str] = set()  # architectures whose DP training was warned about (`_warn_dp_from_scratch`)
        counts = self.data.counts()
        log.info("factory %s: %d image files from %s (%s)%s", cfg.factory_id, sum(counts.values()), self.data.source.description,
                 ", ".join(f"{k} {v}" for k, v in sorted(counts.items())),
                 "; each is decoded when a run first asks for its size, and unreadable ones are then skipped by name" if self.data.source.kind == "folder" else "")

    def refresh_data(self) -> str:
        """Index the factory's folder again (a new run begins): images copied in, removed or rewritten since are used from
        now on, without restarting the agent; what was derived from the old images (decoded split, features in memory, the
        head trained on them alone) is dropped. Features cached on disk are keyed by content, so only new images cost a
        pass through the backbone. What changed ("" if nothing did)."""
        change = self.data.refresh()
        if change:
            with self._alone_lock:
                self._alone_heads.clear()
            self._feature_sets = {}
        return change

    # what the server learns when it first meets this factory ------------------------------------
    def describe(self, config: dict[str, Any]) -> dict[str, Any]:
        """Whether this factory's classes fit the run's class list (and why not); its counts only with --share-metrics."""
        request = data_request_from(config)
        reason = fit_reason(self.data.source, request.classes)
        # "dp": whether this factory trains with DP-SGD (its replies carry its privacy spend anyway); the server then sends it the
        # run's public proxy set, in which it trains the head (client.subspace). "personalizes": whether it keeps a personal
        # model, the other use of that set (client.personal.public_examples): a factory with neither is not sent the images
        out: dict[str, Any] = {"fits": not reason, "reason": reason, "data-source": self.data.source.kind, "dp": self.budget is not None,
                               "personalizes": self.personal is not None}
        if self.cfg.share_metrics:
            counts = self.data.counts()
            out["class-counts"] = [int(counts.get(c, 0)) for c in request.classes]
        return out

    # preparing a model and its data ---------------------------------------------------------
    def _model(self, architecture: str, classes: int, channels: int, fresh: bool) -> nn.Module:
        key = (architecture, classes, channels)
        model = None if fresh else self._models.get(key)
        if model is None:
            try:
                model = build_model(architecture, num_classes=classes, in_channels=channels)
            except ValueError as exc:
                raise UpdateError(str(exc)) from exc
            if not fresh:
                self._models[key] = model
        return model

    def prepare(self, weights: OrderedDict[str, np.ndarray], config: dict[str, Any], fresh: bool = False) -> Prepared:
        """The global ``weights`` in a model of the run's architecture, and the data for the run's request."""
        architecture = str(config.get("architecture", "cnn-small"))
        request = data_request_from(config)
        try:
            split = self.data.split(request)
        except DatasetError as exc:
            raise UpdateError(f"factory {self.cfg.factory_id}: {exc}") from exc
        model = self._model(architecture, len(request.classes), request.channels, fresh)
        trainable = federated_part(model)
        reference = {k: v.detach().numpy() for k, v in trainable.state_dict().items()}
        check_like(reference, weights, source="global model from the server")
        load_weights(model, {k: np.asarray(v, dtype=reference[k].dtype) for k, v in weights.items()})
        train_set, held_out = split.train, split.held_out
        if is_pretrained(architecture):
            train_set, held_out = self._features(model, request, split.train, split.held_out)
        return Prepared(architecture, model, trainable, train_set, held_out, request)

    def prefetch(self, config: dict[str, Any]) -> None:
        """Decode the images a run will ask for, and compute their backbone features, before its first round asks.

        Called when the server first meets this factory (describe): the first round then trains at once
        instead of spending its time on feature extraction. Problems are left for the round to report.
        """
        architecture = self.cfg.architecture or str(config.get("architecture", ""))
        try:
            request = data_request_from(config)
            split = self.data.split(request)
            if is_pretrained(architecture):
                model = self._model(architecture, len(request.classes), request.channels, fresh=False)
                self._features(model, request, split.train, split.held_out)
        except (UpdateError, DatasetError, ValueError) as exc:
            log.info("did not prepare data ahead of the first round: %s", exc)

    def _extractor(self, model: nn.Module) -> FeatureExtractor:
        """The model's frozen backbone where this factory extracts features (``--feature-device``)."""
        return feature_extractor(model.backbone.spec, self.cfg.feature_device)  # type: ignore[union-attr,arg-type]

    def _features(self, model: nn.Module, request: DataRequest, train_set: ImageSet, held_out: ImageSet) -> tuple[ImageSet, ImageSet]:
        """Backbone features of the split (cached on disk by backbone and image content; kept in memory per request)."""
        ident = model.backbone.spec.ident  # type: ignore[union-attr]
        key = (ident, request)
        if key not in self._feature_sets:
            t0 = time.perf_counter()
            extract = self._extractor(model)
            self._feature_sets = {key: (features_of(train_set, ident, extract, self.features, batch=extract.batch),
                                        features_of(held_out, ident, extract, self.features, batch=extract.batch))}
            log.info("backbone features for %d + %d images ready in %.1fs on %s (cache hits %d, misses %d, rebuilt %d)", len(train_set),
                     len(held_out), time.perf_counter() - t0, extract.device, self.features.hits, self.features.misses, self.features.rebuilt)
        return self._feature_sets[key]

    # one round ------------------------------------------------------------------------------
    def train(self, weights: OrderedDict[str, np.ndarray], config: dict[str, Any], server_round: int, run_id: str = "",
              public: ProxySet | None = None, noise_holders: int = 1) -> LocalRound:
        """One round's local training. ``public``: the run's proxy set (public images), in whose principal subspace a head
        trained with DP-SGD trains (`client.subspace`); without it such a head trains whole. ``noise_holders``: for a factory
        that shares the secure sum's DP noise (--dp-secure-sum), the honest inputs of the sum this round's update goes into,
        as the agent verified them (`SecAggClient.honest_inputs`; 1 outside a secure sum): it adds 1/noise_holders of the noise.
        A DP factory's update is weighted by the total of its released class counts (`class_counts`), never by its exact
        image count: the release is charged before anything trains, once."""
        cfg = train_config_from(config, server_round)
        prep = self.prepare(weights, config, fresh=self.budget is not None)
        self._warn_dp_from_scratch(prep.architecture)
        released = self.class_counts(prep, run_id, server_round) if self.budget is not None else None
        weight = max(1, int(released.sum())) if released is not None else None
        t0 = time.perf_counter()
        received = evaluate(prep.trainable, prep.held_out) if len(prep.held_out) else None
        eval_seconds = time.perf_counter() - t0
        trainable, private_cfg, subspace = self._trainable(prep, cfg, public)
        # a DP factory plans its schedule from its released count (weight), never from its exact image count
        clip = self.budget.clip_norm(subspace.feature_norm if subspace is not None else None) if self.budget else 1.0
        privacy, dp_plan = (self._charge_privacy(weight or 1, private_cfg, config, server_round, run_id, noise_holders, clip)
                            if self.budget else ({}, None))
        if self.budget is not None and is_pretrained(prep.architecture):  # 0: the whole head trained (no public subspace)
            privacy["dp-subspace-dims"] = float(subspace.dims if subspace is not None else 0)
        t1 = time.perf_counter()
        secure_sum_step = dp_plan is not None and self.budget is not None and self.budget.secure_sum
        if self.workers is not None and not is_pretrained(prep.architecture) and not secure_sum_step:
            out = self.workers.run(Job(weights=dict(weights), architecture=prep.architecture, train=asdict(cfg), request=prep.request,
                                       dp=dp_plan, fix_model=self.cfg.dp_fix_model, data_version=self.data.source.version))
            new, result = out["weights"], TrainResult(out["loss"], out["accuracy"], out["steps"], out["examples"])
            load_weights(prep.model, new)
        else:
            if dp_plan is None:
                result = train(trainable, prep.train_set, cfg.for_head() if is_pretrained(prep.architecture) else cfg)
            elif secure_sum_step:  # one full-batch step, in the agent's process (a worker group is not needed for one step)
                # the step in units of the clipping norm: secure-sum-lr means the same whatever the norm (client.privacy)
                result = noisy_gradient_step(trainable, prep.train_set, private_cfg.secure_sum_lr / clip, dp_plan.noise_multiplier, clip,
                                             normaliser=weight, logit_shift=self._released_prior_shift(prep, private_cfg, released))
            else:
                result = train_private(trainable, prep.train_set, private_cfg, dp_plan, logit_shift=self._released_prior_shift(prep, private_cfg, released))
            if isinstance(trainable, SubspaceHead):  # back to a whole head: what every other site expects
                prep.trainable.load_state_dict({k: torch.from_numpy(v) for k, v in trainable.fold().items()})
                trainable = prep.trainable
            new = OrderedDict((k, v.detach().cpu().numpy().copy()) for k, v in trainable.state_dict().items())
        train_seconds = time.perf_counter() - t1
        check_like(weights, new, source=f"factory {self.cfg.factory_id} local training")
        trained = evaluate(trainable, prep.held_out) if len(prep.held_out) else None
        if received is not None and trained is not None:
            with self._figures_lock:
                self.last_figures = {"round": server_round, "held-out": received.examples, "global-accuracy": received.accuracy,
                                     "local-accuracy": trained.accuracy}
            log.info("round %d: the global model scores %.4f on this factory's %d held-out images; after local training %.4f",
                     server_round, received.accuracy, received.examples, trained.accuracy)
            if self.personal is not None and cfg.personal_epochs > 0:
                self._personal_done = self._personal_jobs.submit(self._personalise, prep, weights, cfg, received, server_round, public)
        metrics = {"train-loss": result.loss, "train-accuracy": result.accuracy, "steps": float(result.steps),
                   "train-seconds": train_seconds, "eval-seconds": eval_seconds}
        return LocalRound(new, weight if weight is not None else result.examples, received, trained, metrics, privacy)

    def wait_personal(self) -> None:
        """Wait for the latest round's personal fine-tune (its model and figures), however it ended."""
        done = self._personal_done
        if done is not None:
            done.exception()

    def _personalise(self, prep: Prepared, received_weights: OrderedDict[str, np.ndarray], cfg: TrainConfig, received: EvalResult,
                     server_round: int, public: ProxySet | None = None) -> None:
        """Make and keep the factory's personal model of this round (it never leaves the factory, so it costs no privacy
        budget); inspection serves it unless the global model validates clearly better (`client.personal`).

        Runs on the personal-jobs thread, one round after another; it only reads the round's prepared data and
        builds its own model, so the next message need not wait for it. A failure is logged, never raised."""
        assert self.personal is not None
        try:
            head = self.personal_head(prep, received_weights, cfg, public)
            score = evaluate(head, prep.held_out)
            settings = cfg.to_run_config() | ({"public-proxy-sha256": public.sha256} if public is not None else {})
            self.personal.offer(prep.architecture, prep.request, weights_of(head), score.accuracy, received.accuracy, server_round,
                                weights_digest(received_weights), settings)
        except Exception:
            log.exception("round %d: the personal fine-tune failed; inspection keeps the previous choice", server_round)
            return
        with self._figures_lock:
            if self.last_figures.get("round") == server_round:
                self.last_figures = {**self.last_figures, "personal-accuracy": score.accuracy}
        log.info("round %d: personal model (%d epochs on this factory's images%s) scores %.4f on the held-out images, the global %.4f",
                 server_round, cfg.personal_epochs, ", blended with a head trained on them alone" if _blends(prep.architecture, cfg) else "",
                 score.accuracy, received.accuracy)

    def personal_head(self, prep: Prepared, received_weights: OrderedDict[str, np.ndarray], cfg: TrainConfig,
                      public: ProxySet | None = None) -> nn.Module:
        """The factory's personal model (its trainable part): the global model it received, fine-tuned on its own images.

        For a linear head (the pretrained family, ``local-only-epochs`` > 0) it is the mean of that fine-tune and a
        head trained on the factory's images alone, i.e. the mean of the two heads' logits: APFL's interpolation of a
        local and a global model (Deng et al. 2020) with weight 1/2. In 48 factory runs over four data sets, the old
        personal model (the fine-tune alone, served when it scored higher than the global one) left 14 factories with a
        model worse than their own, by up to 5.3 points; this one, served as `client.personal` says, 5, by one or two
        test images (docs/benchmarks.md). A from-scratch CNN keeps the fine-tune: averaging two independently trained
        networks' weights does not average their predictions.

        Given the run's ``public`` proxy set, the fine-tune also trains on the proxy images the received model labels,
        confidently, as a class rare at this factory (`client.personal.public_examples`)."""
        model = load_weights(build_model(prep.architecture, len(prep.request.classes), in_channels=prep.request.channels), received_weights)
        head = federated_part(model)
        train(head, self._with_public_examples(prep, head, cfg, public), cfg.personal())
        if _blends(prep.architecture, cfg):
            alone = self._alone_head(prep, cfg.local_only())
            tuned = weights_of(head)
            head.load_state_dict({k: torch.from_numpy((v + alone[k]) / 2) for k, v in tuned.items()})
        return head

    @staticmethod
    def _released_prior_shift(prep: Prepared, cfg: TrainConfig, released: np.ndarray | None) -> torch.Tensor | None:
        """What a DP head adds to its logits in training (``private-head-logit-adjustment``): tau log(prior) of the class counts
        this factory released with noise, never of its exact ones (those would leak what DP protects); None for a CNN."""
        if released is None or not is_pretrained(prep.architecture) or cfg.private_head_logit_adjustment <= 0:
            return None
        return prior_adjustment(released, cfg.private_head_logit_adjustment)

    def personal_of(self, architecture: str, request: DataRequest, base_weights: OrderedDict[str, np.ndarray],
                    settings: dict[str, Any], public: ProxySet | None = None) -> OrderedDict[str, np.ndarray]:
        """The personal model of ``base_weights`` (the approved version inspection follows), made now with the training
        ``settings`` of the round's personal model (and its ``public`` proxy set, when it had one). Inspection serves
        personal models of the approved version only, never one made from a global model nobody approved."""
        config = {**settings, "architecture": architecture, **request.to_config()}
        return weights_of(self.personal_head(self.prepare(base_weights, config), base_weights, train_config_from(config, 0), public))

    def _with_public_examples(self, prep: Prepared, global_head: nn.Module, cfg: TrainConfig, public: ProxySet | None) -> Any:
        """The personal fine-tune's training set: this factory's training split, plus the public proxy images the global
        model (``global_head``, before the fine-tune) labels confidently as a class rare here (`public_examples`)."""
        if public is None or not is_pretrained(prep.architecture) or cfg.personal_public_confidence == 0:
            return prep.train_set
        features = self._proxy_features(prep, public)
        with torch.no_grad():
            logits = global_head(torch.from_numpy(features)).numpy()
        labels = np.asarray(prep.train_set.labels)
        chosen, assigned = public_examples(logits, labels, len(prep.request.classes), cfg.personal_public_confidence, cfg.personal_public_rare)
        if len(chosen) == 0:
            return prep.train_set
        log.info("personal model: also %d public proxy images the global model labels as classes rare here (%s)", len(chosen),
                 ", ".join(f"{prep.request.classes[c]} {int((assigned == c).sum())}" for c in np.unique(assigned)))
        own = prep.train_set.images
        return FeatureSet(np.concatenate([own, features[chosen].astype(own.dtype)]), np.concatenate([labels, assigned]), prep.train_set.classes)

    def _alone_head(self, prep: Prepared, cfg: TrainConfig) -> OrderedDict[str, np.ndarray]:
        """A head trained from scratch on this factory's training split only: once per request and training settings, with
        a fixed seed, so that it does not change from round to round."""
        cfg = replace(cfg, seed=ALONE_SEED)
        key = (prep.architecture, prep.request, cfg.epochs, cfg.lr, cfg.batch_size, cfg.weight_decay)
        with self._alone_lock:
            if key not in self._alone_heads:
                head = federated_part(build_model(prep.architecture, len(prep.request.classes), seed=cfg.seed, in_channels=prep.request.channels))
                train(head, prep.train_set, cfg)
                self._alone_heads[key] = weights_of(head)
            return self._alone_heads[key]

    def _trainable(self, prep: Prepared, cfg: TrainConfig, public: ProxySet | None) -> tuple[nn.Module, TrainConfig, PublicSubspace | None]:
        """What trains this round and with which settings: the prepared module, or under DP the checked module, and for a
        pretrained head its DP settings and, given public images, the head within their subspace (`client.subspace`)."""
        trainable = prep.trainable
        if cfg.activation_checkpointing:
            apply_activation_checkpointing(trainable)
        if self.budget is None:
            return trainable, cfg, None
        trainable = check_dp_compatible(trainable, fix=self.cfg.dp_fix_model)
        if not is_pretrained(prep.architecture):
            return trainable, cfg, None
        private_cfg = cfg.private_head()
        subspace = self._public_subspace(prep, private_cfg, public)
        return (SubspaceHead(trainable, subspace) if subspace is not None else trainable), private_cfg, subspace  # type: ignore[arg-type]

    def _public_subspace(self, prep: Prepared, cfg: TrainConfig, public: ProxySet | None) -> PublicSubspace | None:
        """The principal subspace of the public proxy set's features that DP-SGD trains the head in, or None (the whole head).

        Computed here, from images this factory holds, never from its own training images; once per proxy set, backbone
        and setting."""
        if cfg.public_subspace == 0:
            return None
        if public is None:
            log.info("DP-SGD trains the whole head: the run sent no public proxy set to train it within (client.subspace)")
            return None
        ident = prep.model.backbone.spec.ident  # type: ignore[union-attr]
        key = (public.sha256, ident, cfg.public_subspace, cfg.public_subspace_whitening)
        if key not in self._subspaces:
            features = self._proxy_features(prep, public)
            try:
                subspace = fit_subspace(features, cfg.public_subspace, cfg.public_subspace_whitening, source=f"proxy {public.sha256[:12]}, {ident}")
            except SubspaceError as exc:
                log.warning("DP-SGD trains the whole head: no public subspace from proxy set %s...: %s", public.sha256[:12], exc)
                return None
            self._subspaces = {key: subspace}
            log.info("DP-SGD trains the head within %d principal directions of %d public proxy images (%s)", subspace.dims, len(public),
                     subspace.source)
        return self._subspaces[key]

    def _proxy_features(self, prep: Prepared, proxy: ProxySet) -> np.ndarray:
        """Backbone features of the proxy set's images (cached by content like the factory's own)."""
        ident = prep.model.backbone.spec.ident  # type: ignore[union-attr]
        images = datasets.ImageDataset(proxy.images, np.zeros(len(proxy), dtype=np.int64), prep.request.classes)
        extract = self._extractor(prep.model)
        feats = features_of(images, ident, extract, self.features, keys=array_keys(proxy.images), batch=extract.batch)
        return feats.images_at(np.arange(len(feats)))

    def _warn_dp_from_scratch(self, architecture: str) -> None:
        """Under DP a from-scratch model barely learns from one factory's images: cnn-small at epsilon 8 scored 0.207 with
        local DP-SGD and 0.202 sharing the secure sum's noise (chance: 0.167), against 0.507 without DP (docs/benchmarks.md, "DP
        with a from-scratch model"). The round still runs, as the server asked; the operator is told once per architecture."""
        if self.budget is None or is_pretrained(architecture) or architecture in self._dp_warned:
            return
        self._dp_warned.add(architecture)
        log.warning("DP training of the from-scratch %s: at epsilon %g it learns little or nothing from a factory's images (measured "
                    "near chance, docs/benchmarks.md) while it spends this factory's budget; under DP run a pretrained architecture "
                    "(effnet-lite0), whose head trains in a public subspace", architecture, self.budget.epsilon_max)

    def _charge_privacy(self, n: int, cfg: TrainConfig, config: dict[str, Any], server_round: int, run_id: str,
                        noise_holders: int = 1, clip: float = 1.0) -> tuple[dict[str, float], DPPlan]:
        """Charge the ledger for this round (or refuse it with `BudgetExhausted`) before any training.

        ``n``: the total of the factory's released class counts (`class_counts`), not its exact image count, so that the
        schedule, the noise multiplier and the spend it reports depend on that release only.
        Local DP-SGD: the sample rate and step count are exactly those of the Poisson loader it trains with
        (q = 1 / ceil(n / B), ceil(n / B) steps per epoch: `client.dp.poisson_loader`), so the ledger never under-counts.
        Sharing the secure sum's noise (--dp-secure-sum): one Gaussian mechanism per round (q = 1, one step) whose noise
        multiplier is the sum's; this factory adds that noise divided by sqrt(noise_holders), and the ledger also keeps
        what its own noise alone guarantees (``epsilon-alone``). ``clip``: the round's per-example clipping norm
        (`PrivacyBudget.clip_norm`); the noise multiplier is relative to it, so it does not change what is charged.
        """
        assert self.budget is not None and self.ledger is not None
        ignored = sorted(k for k in config if k.startswith("dp-") or k in ("noise-multiplier", "max-grad-norm", "epsilon", "delta"))
        if ignored:
            log.warning("ignoring privacy settings sent by the server %s: the budget and noise are factory configuration", ignored)
        if self.budget.secure_sum:
            holders, rate, steps = max(1, int(noise_holders)), 1.0, 1
        else:
            holders, rate, steps = 1, sample_rate(n, cfg.batch_size), cfg.epochs * steps_per_epoch(n, cfg.batch_size)
        noise = noise_for_budget(self.budget.epsilon_max, self.budget.delta, rate, self.budget.planned_rounds * steps, self.budget.reserved)
        epsilon = self.ledger.charge(self.budget, run_id, server_round, noise, rate, steps, noise_holders=holders)
        mode = "ghost_fsdp" if self.cfg.parallelism == "fsdp" else self.budget.grad_sample_mode
        plan = DPPlan(noise_multiplier=noise / math.sqrt(holders), max_grad_norm=clip, sample_rate=rate, grad_sample_mode=mode,
                      examples=float(n))
        privacy = {
            "epsilon-spent": epsilon, "epsilon-remaining": max(0.0, self.budget.epsilon_max - epsilon), "epsilon-max": self.budget.epsilon_max,
            "delta": self.budget.delta, "noise-multiplier": noise, "dp-steps": float(steps), "dp-max-grad-norm": clip,
        }
        if self.budget.secure_sum:
            privacy |= {"dp-noise-holders": float(holders), "epsilon-alone": self.ledger.spent_alone(self.budget.delta)}
            log.info("round %d: one DP step sharing the secure sum's noise with %d honest input(s) (noise multiplier %.3f of the sum, "
                     "%.3f added here, gradients clipped at %.3g); epsilon %.3f against the sum, %.3f on this factory's noise alone",
                     server_round, holders, noise, plan.noise_multiplier, clip, epsilon, privacy["epsilon-alone"])
        return privacy, plan

    # evaluation and distillation ------------------------------------------------------------
    def evaluate(self, weights: OrderedDict[str, np.ndarray], config: dict[str, Any]) -> EvalResult:
        prep = self.prepare(weights, config)
        result = evaluate(prep.trainable, prep.held_out)
        log.info("evaluation: the global model scores %.4f on this factory's %d held-out images", result.accuracy, result.examples)
        with self._figures_lock:
            self.last_figures = {**self.last_figures, "final-global-accuracy": result.accuracy, "held-out": result.examples}
        return result

    def score(self, architecture: str, weights: OrderedDict[str, np.ndarray], request: DataRequest) -> float:
        """Accuracy of ``weights`` on this factory's held-out split."""
        return hit_rate(self.held_out_hits(architecture, weights, request))

    def held_out_hits(self, architecture: str, weights: OrderedDict[str, np.ndarray], request: DataRequest) -> np.ndarray:
        """Whether ``weights`` classifies each held-out image right, in a fixed order (personalisation's paired comparison)."""
        prep = self.prepare(weights, {"architecture": architecture, **request.to_config()})
        if not len(prep.held_out):
            return np.zeros(0, dtype=bool)
        return predict_logits(prep.trainable, prep.held_out).argmax(1) == np.asarray(prep.held_out.labels)

    def predict(self, weights: OrderedDict[str, np.ndarray], config: dict[str, Any], proxy: ProxySet,
                temperature: float, run_id: str = "", server_round: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Balanced predictions on the proxy set with ``weights`` (the model it just trained), and its class counts
        (`class_counts`: released with noise by a DP factory)."""
        if not temperature > 0:
            raise UpdateError(f"distillation temperature must be > 0, got {temperature}")
        prep = self.prepare(weights, config)
        if is_pretrained(prep.architecture):
            probabilities = predict_proxy(prep.trainable, self._proxy_features(prep, proxy), temperature)
        else:
            probabilities = predict_proxy(prep.model, proxy, temperature)
        if not np.isfinite(probabilities).all():  # a diverged local model: never send it into the secure sum
            raise UpdateError(f"factory {self.cfg.factory_id}: predictions on the proxy set are not finite")
        counts = self.class_counts(prep, run_id, server_round)
        return balanced_predictions(probabilities, counts, trained_adjustment=self._trained_adjustment(prep.architecture, config)), counts

    def _trained_adjustment(self, architecture: str, config: dict[str, Any]) -> float:
        """The tau of the logit-adjusted loss this factory's models train on (`balanced_predictions`), as `train` reads it:
        without DP the config `train` gets (`TrainConfig.for_head` for the pretrained head), under DP the private head's
        shift on its released counts (`_released_prior_shift`; those are the counts divided by here too), and none for a
        CNN (DP-SGD trains it on plain cross-entropy)."""
        cfg = train_config_from(config, 0)
        pretrained = is_pretrained(architecture)
        if self.budget is not None:
            return cfg.private_head().private_head_logit_adjustment if pretrained else 0.0
        return (cfg.for_head() if pretrained else cfg).logit_adjustment

    def class_counts(self, prep: Prepared, run_id: str = "", server_round: int = 0) -> np.ndarray:
        """The factory's training class counts as they may leave it: exact without DP; with DP one Gaussian release of them
        (``--dp-count-noise``), charged to the ledger the first time and the same noisy counts every time after, until the
        counts change. Exact counts would reveal, e.g., whether the factory holds one image of a rare defect."""
        counts = np.bincount(np.asarray(prep.train_set.labels), minlength=len(prep.request.classes)).astype(np.float64)
        if self.budget is None or self.ledger is None:
            return counts
        key = hashlib.sha256(json.dumps([list(prep.request.classes), counts.astype(np.int64).tolist()]).encode()).hexdigest()
        noise = self.budget.count_noise
        released = self.ledger.release(self.budget, run_id, server_round, "class-counts", key, noise, lambda: noisy_counts(counts, noise).tolist())
        return np.asarray(released, dtype=np.float64)

    def privacy_status(self) -> dict[str, float]:
        if self.budget is None or self.ledger is None:
            return {}
        spent = self.ledger.spent(self.budget.delta)
        return {"epsilon-spent": spent, "epsilon-remaining": max(0.0, self.budget.epsilon_max - spent), "epsilon-max": self.budget.epsilon_max}

    def close(self) -> None:
        self._personal_jobs.shutdown(wait=True)  # a personal model being written is finished, not torn
        if self.workers is not None:
            self.workers.close()
        if self.ledger is not None:
            self.ledger.close()
        self.features.close()


def model_for_weights(weights: OrderedDict[str, np.ndarray], architecture: str, request: DataRequest) -> torch.nn.Module:
    """A whole model of ``architecture`` holding federated ``weights`` (inspection, personal models)."""
    return load_weights(build_model(architecture, len(request.classes), in_channels=request.channels), weights)


def _blends(architecture: str, cfg: TrainConfig) -> bool:
    """Whether the personal model blends in a head trained on the factory's images alone (linear heads only)."""
    return is_pretrained(architecture) and cfg.local_only_epochs > 0
