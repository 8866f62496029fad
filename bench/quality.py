#!/usr/bin/env python3
"""Is every factory better off in the federation? Recipes side by side, several seeds and skews.

Each federation runs in one process over the production code of both sides: every factory is a real
`client.trainer.FactoryTrainer` (data split, held-out evaluation, feature cache, local training, DP
ledger, personal model), the server averages with `server.aggregate.fedavg` and steps with
`server.optimizers.ServerOptimizer`. Only the transport is left out (the end-to-end tests and
bench/secagg.py cover it). For every setting the baselines run on the *same* data in the same run:

- pooled: one model trained on the union of the factories' training splits (what the federation
  would reach if the images could leave the factories), for as many epochs as a factory trains in all,
  with the federation's loss (each image's logits adjusted by its own factory's label prior); "pooled,
  plain" is the same on plain cross-entropy;
- local only: each factory trains alone for as many epochs, from the same initial model;
- served: what a factory's inspection would serve after the run (its personal model, unless the global
  model validates clearly better on its held-out split: `client.personal`), judged on a separate test
  set drawn from that factory's own distribution (its optics, its label mix);
- centralised: at each factory, the pooled model predicting with that factory's label prior added to its
  logits (what a site that could see every image would serve there), scored like the served model. Where
  it does not beat local-only either, other factories' images do not help that factory on this data.

With `--dp` the first recipe also runs with DP-SGD at epsilon 8 per factory: its global model, and
what each factory then serves. The personal model never leaves its factory and is trained without
DP, so "DP served - served" is what DP costs on a factory's line, beside what it costs the global model.
Under DP each factory trains the head within the principal subspace of the public proxy set's features
(`client.subspace`; the run's `public-subspace`), as a deployment does: the generator's proxy images, or
ROOT/proxy with `--folders`; `--no-public` trains the whole head instead (what DP gets without public images).
`--dp-max-grad-norm` is the factories' clipping norm (`public`: client.privacy.PrivacyBudget.clip_norm).
`--dp-secure-sum` runs the DP factories as `fedforge client --dp-secure-sum` does: one full-batch DP step per round, each
adding its share of the noise of a secure sum over the complete graph with the default threshold and no tolerated
colluders (docs/security.md), for `--dp-rounds` rounds (default 30 with it, else the recipe's).

Accuracy of the global and pooled models is on a balanced test set drawn from every factory's optics.

    python bench/quality.py --seeds 0,1,2                       # the table in docs/benchmarks.md
    python bench/quality.py --settings skewed --recipes default --seeds 0
    python bench/quality.py --settings skewed --recipes default --set personal-epochs=5   # a factory training key, every factory

Your own image folders instead of the built-in generator (seeds then vary the models and the training
order, not the data):

    python bench/quality.py --folders ROOT --recipes default --dp
    python bench/quality.py --folders ROOT --recipes default --channels 1 --image-size 96   # as grey, at 96 px
    python bench/quality.py --folders ROOT --recipes default --bit-depth 12   # a Mono12 camera's 16-bit files (0..4095)

`--channels auto` (the default) reads the images as RGB when any factory's are in colour, else as grey.

    ROOT/<factory>/train/<class>/*.png   one directory per factory (any name; sorted), its training images (or training/;
                                         any case: Training/, Validation/)
    ROOT/<factory>/test/<class>/*.png    images of that factory's own distribution, never trained on (or val/, valid/,
                                         validation/, holdout/)
    ROOT/<factory>/<class>/*.png         instead of the two: every 4th image of each class, in a fixed order (the hash of
                                         its path, not the seeds), is held out as the factory's test set
    ROOT/test/<class>/*.png              optional: the central test set (default: every factory's test images; or
                                         central_test/, global_test/, holdout/, eval/)
    ROOT/proxy/**/*.png                  optional: unlabelled public images of the domain (the run's proxy set; or public/,
                                         unlabeled/), never a factory's; under --dp the factories learn the subspace they
                                         train in from them

(`common.data.layout`, which also takes the factories in one folder, ROOT/sites/<factory>/..., or split first,
ROOT/train/<factory>/<class> beside ROOT/test/<factory>/<class>, or all of it inside ROOT's only folder, and other
names for the two optional folders; `fedforge demo --folders ROOT` runs the same federation over real processes.)
Class names are the folders' (any factory may lack any class); `--classes a,b,c` fixes their order, and
`--class-alias OK-parts=good` maps a folder named otherwise (repeatable).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import click
import numpy as np
import torch
from torch import nn

from client.config import AgentConfig
from client.data import DataRequest
from client.personal import global_clearly_better
from client.trainer import FactoryTrainer, data_request_from
from common.clip import DEFAULT_CLIP_NORM, parse_clip_norm
from common.data import datasets, synth
from common.data.classes import format_classes, parse_aliases
from common.data.datasets import ImageDataset
from common.data.folder import load_unlabelled_folder
from common.data.layout import FolderFederation as Folders
from common.distill import ProxySet
from common.features import FeatureCache, array_keys, features_of
from common.models import build_model, federated_part, is_pretrained, load_weights, natural_image_size, weights_of
from common.training import TrainConfig, evaluate, predict_logits, prior_adjustment, set_torch_threads, train
from server.aggregate import FactoryUpdate, fedavg
from server.cli import parse_overrides
from server.config import SECURE_SUM_DP_ROUNDS, FederationConfig
from server.optimizers import ServerOptimizer
from server.secure_sum import default_threshold


@dataclass(frozen=True)
class Recipe:
    name: str
    architecture: str
    rounds: int
    local_epochs: int
    lr: float = 1e-3
    server_optimizer: str = "fedavg"
    server_lr: float = 1.0
    server_momentum: float = 0.0
    proximal_mu: float = 0.0
    lr_schedule: str = "constant"
    settings: tuple[tuple[str, object], ...] = ()  # factory training keys set with --set (`with_settings`)

    def federation(self, seed: int) -> FederationConfig:
        """The run configuration this recipe is (what `fedforge run --set ...` would submit)."""
        training = TrainConfig(epochs=self.local_epochs, lr=self.lr, proximal_mu=self.proximal_mu)
        if self.settings:
            training = TrainConfig.from_run_config({**training.to_run_config(), **dict(self.settings)}, seed=training.seed)
        # the recipe's server step is its line's: head-server-lr for the pretrained family, server-lr for cnn-*; the other
        # keeps the product's default (FederationConfig.server_lr_for)
        step = {"head_server_lr": self.server_lr} if is_pretrained(self.architecture) else {"server_lr": self.server_lr}
        return FederationConfig(num_server_rounds=self.rounds, architecture=self.architecture, seed=seed, server_optimizer=self.server_optimizer,
                                server_momentum=self.server_momentum, lr_schedule=self.lr_schedule, training=training, **step)

    def with_settings(self, settings: dict[str, object]) -> Recipe:
        """The recipe with factory training keys of the run config set (`--set personal-epochs=5`), checked now.

        Only keys a factory trains with: the recipe's own (rounds, local epochs, learning rate, server optimiser) are what
        the pooled and local-only baselines are trained with too, so they are chosen with --recipes."""
        settable = set(TrainConfig.run_config_defaults()) - SET_BY_RECIPE
        recipes_own = sorted(set(settings) & SET_BY_RECIPE)
        if recipes_own:
            raise ValueError(f"--set {', '.join(recipes_own)}: the recipe's, which the pooled and local-only baselines train with too; "
                             "choose a recipe with --recipes")
        unknown = sorted(set(settings) - settable)
        if unknown:
            raise ValueError(f"--set {', '.join(unknown)}: not a factory training key this bench can set; one of {', '.join(sorted(settable))}")
        recipe = replace(self, settings=tuple(sorted({**dict(self.settings), **settings}.items())))  # on top of the recipe's own
        recipe.federation(0)  # a value of the wrong type raises ValueError naming its key
        return recipe


RECIPES = {
    # the defaults ([tool.flwr.app.config]): frozen backbone + federated head, FedAvgM 0.7 at the head's server step, cosine local lr over 20 x 2
    "default": Recipe("effnet-lite0 head, FedAvgM 0.7 (server lr 2), 20x2, cosine lr", "effnet-lite0", rounds=20, local_epochs=2,
                      server_optimizer="fedavgm", server_lr=FederationConfig.head_server_lr, server_momentum=0.7, lr_schedule="cosine"),
    "head-fedavg": Recipe("effnet-lite0 head, FedAvg 20x2", "effnet-lite0", rounds=20, local_epochs=2),
    # the from-scratch family, with the recipe it had before (FedAvg 5 x 2) and with server momentum over more, shorter rounds
    "cnn": Recipe("cnn-small, FedAvg 5x2", "cnn-small", rounds=5, local_epochs=2),
    "cnn-m": Recipe("cnn-small, FedAvgM 0.7 24x1", "cnn-small", rounds=24, local_epochs=1, server_optimizer="fedavgm", server_momentum=0.7),
}

SET_BY_RECIPE = {"local-epochs", "lr", "proximal-mu"}  # the baselines train with these as the recipe says
SETTINGS = {"iid-ish": (3, 1.0), "skewed": (5, 0.1)}
PROXY_SIZE = FederationConfig.proxy_size  # the run's default proxy set: what the server generates for the demo


def factory_test_set(spec: datasets.SyntheticSpec, index: int, size: int) -> ImageDataset:
    """Fresh images of factory ``index``'s own distribution (its label mix and optics), never seen in training."""
    mix = datasets.label_mix(spec.seed, spec.num_factories, spec.alpha)[index]
    rng = synth.rng_for(spec.seed, 7, index)
    labels = rng.choice(len(synth.CLASSES), size=size, p=mix).astype(np.int64)
    return ImageDataset(synth.render_many(rng, labels, [synth.factory_profile(spec.seed, index)], spec.image_size), labels)


class Bench:
    def __init__(self, seed: int, factories: int, alpha: float, train_size: int, workdir: Path, tag: str, dp_epsilon: float = 0.0,
                 rounds: int = 1, folders: Folders | None = None, public: bool = True, secure_sum: bool = False, channels: int = 1,
                 image_size: int = 0, max_grad_norm: float | str = DEFAULT_CLIP_NORM, bit_depth: int = 16) -> None:
        spec = datasets.SyntheticSpec(seed=seed, num_factories=factories, alpha=alpha, train_size=train_size)
        self.spec = replace(spec, image_size=image_size) if image_size else spec
        self.seed, self.folders, self.channels = seed, folders, channels
        self.classes = folders.classes if folders else tuple(synth.CLASSES)
        if folders:
            factories = len(folders.factories)
        state = workdir / f"{tag}-seed{seed}-a{alpha}-n{factories}-dp{dp_epsilon}-{time.time_ns()}"
        self.trainers = [FactoryTrainer(AgentConfig(
            factory_id=f"f{i}", factory_index=i, num_factories=factories, data_seed=seed, alpha=alpha, train_size=train_size,
            data=str(folders.trains[i]) if folders else "synthetic", classes=",".join(self.classes),
            class_alias=folders.alias_pairs() if folders else (),
            state_dir=str(state / f"f{i}"), dp=dp_epsilon > 0, dp_epsilon=dp_epsilon or 8.0, dp_planned_rounds=rounds, dp_secure_sum=secure_sum,
            dp_max_grad_norm=max_grad_norm, bit_depth=bit_depth))
            for i in range(factories)]
        # the honest inputs of a secure round's sum over the complete graph, default threshold, no tolerated colluders
        self.noise_holders = default_threshold(factories) if secure_sum else 1
        for trainer in self.trainers:  # one feature cache for every run of the bench (features depend on the images only)
            trainer.features = FeatureCache(workdir / "bench-features.db")
        if folders:
            self.factory_tests = [folders.test_set(d, self.spec.image_size, channels, bit_depth) for d in folders.tests]
            self.test = (folders.test_set(folders.central_test, self.spec.image_size, channels, bit_depth) if folders.central_test else
                         ImageDataset(np.concatenate([t.images for t in self.factory_tests]), np.concatenate([t.labels for t in self.factory_tests]),
                                      self.classes))
        else:
            self.test = datasets.test_dataset(self.spec, 1200)
            self.factory_tests = [factory_test_set(self.spec, i, 300) for i in range(factories)]
        self.cache = FeatureCache(workdir / "bench-features.db")
        self.public = None  # the run's proxy set: public images the factories may learn their DP subspace from
        if public and folders and folders.proxy:
            self.public = ProxySet(load_unlabelled_folder(folders.proxy, self.spec.image_size, channels, bit_depth)[0])
        elif public and not folders:
            self.public = ProxySet(datasets.proxy_images(self.spec, PROXY_SIZE))

    def config(self, recipe: Recipe, server_round: int) -> dict:
        run = replace(recipe.federation(self.seed), classes=format_classes(self.classes), image_size=self.spec.image_size, channels=self.channels)
        return run.train_config(server_round, recipe.architecture)

    @property
    def request(self) -> DataRequest:
        """How the run wants the factories' images (its class list, image size, channels)."""
        return data_request_from(self.config(RECIPES["default"], 1))

    def model(self, arch: str, seed: int | None = None):
        return build_model(arch, len(self.classes), seed=seed, in_channels=self.channels)

    def inputs(self, model, arch: str, data: ImageDataset):
        if not is_pretrained(arch):
            return data
        return features_of(data, model.backbone.spec.ident, model.encode, self.cache, array_keys(data.images))

    def accuracy(self, arch: str, weights, data: ImageDataset) -> float:
        model = load_weights(self.model(arch), weights)
        return evaluate(federated_part(model), self.inputs(model, arch, data)).accuracy

    def federate(self, recipe: Recipe) -> dict:
        """The federation: returns the global model's accuracy per round, seconds of training, and each factory's served accuracy."""
        weights = weights_of(self.model(recipe.architecture, self.seed))
        optimizer = ServerOptimizer(recipe.server_optimizer, recipe.server_lr, recipe.server_momentum)
        per_round, train_seconds = [], 0.0
        for r in range(1, recipe.rounds + 1):
            updates = []
            for i, trainer in enumerate(self.trainers):
                local = trainer.train(weights, self.config(recipe, r), r, run_id=f"bench-{recipe.name}", public=self.public,
                                      noise_holders=self.noise_holders)
                train_seconds += local.metrics["train-seconds"]
                updates.append(FactoryUpdate(f"f{i}", i, local.weights, local.examples))
            weights = optimizer.step(weights, fedavg(updates, like=weights))
            per_round.append(self.accuracy(recipe.architecture, weights, self.test))
        served = []
        request = self.request
        for i, trainer in enumerate(self.trainers):
            # what inspection serves (client.agent.personal_chooser): the personal model of the final global model, unless
            # the global one validates clearly better on the factory's held-out split
            trainer.evaluate(weights, self.config(recipe, recipe.rounds + 1))  # the evaluate-only phase: nothing changes
            personal = self.personal_of(trainer, recipe, weights)
            clearly = global_clearly_better(trainer.held_out_hits(recipe.architecture, weights, request),
                                            trainer.held_out_hits(recipe.architecture, personal, request))
            served.append(self.accuracy(recipe.architecture, weights if clearly else personal, self.factory_tests[i]))
        return {"accuracy": per_round[-1], "per_round": per_round, "served": served, "train_seconds": train_seconds,
                "payload_values": int(sum(v.size for v in weights.values())),
                **({"subspace_dims": int(local.privacy["dp-subspace-dims"])} if "dp-subspace-dims" in local.privacy else {})}

    def personal_of(self, trainer: FactoryTrainer, recipe: Recipe, weights: OrderedDict) -> OrderedDict:
        """The factory's personal model of the final global model (what its agent keeps after a round with it), with the
        run's proxy set as a deployment with proxy-data sends it."""
        config = self.config(recipe, recipe.rounds)
        head = trainer.personal_head(trainer.prepare(weights, config), weights, TrainConfig.from_run_config(config, seed=self.seed), self.public)
        return weights_of(head)

    def pooled_and_local(self, recipe: Recipe) -> dict:
        """The baselines. Pooled training uses the federation's loss: each image's logits adjusted by its own factory's label
        prior (`train`'s ``groups``), as that factory's head trains on them in the federation (tau of the recipe's
        `TrainConfig.for_head` for the pretrained family, ``logit-adjustment`` for a CNN). On plain cross-entropy under label
        skew it scored 0.96 on the factories' held-out images and 0.55 on the central test set (every class under every
        optics), 9 points below the same training on the federation's loss (docs/benchmarks.md); ``pooled_plain``, plain
        cross-entropy on the union, is kept for comparison."""
        epochs = recipe.rounds * recipe.local_epochs
        cfg = TrainConfig(epochs=epochs, lr=recipe.lr, seed=self.seed)
        federation = recipe.federation(self.seed).training
        tau = (federation.for_head() if is_pretrained(recipe.architecture) else federation).logit_adjustment
        splits = [t.data.split(self.request).train for t in self.trainers]
        union = ImageDataset(np.concatenate([s.images_at(np.arange(len(s))) for s in splits]), np.concatenate([s.labels for s in splits]),
                             self.classes)
        factory_of = np.concatenate([np.full(len(s), i) for i, s in enumerate(splits)])

        def pooled_with(tau: float) -> tuple[float, nn.Module]:
            model = self.model(recipe.architecture, self.seed)
            train(federated_part(model), self.inputs(model, recipe.architecture, union), replace(cfg, logit_adjustment=tau), groups=factory_of)
            return evaluate(federated_part(model), self.inputs(model, recipe.architecture, self.test)).accuracy, model

        pooled, pooled_model = pooled_with(tau)
        pooled_plain = pooled_with(0.0)[0] if tau > 0 else pooled
        local, pooled_at_factory = [], []
        for i, split in enumerate(splits):
            model = self.model(recipe.architecture, self.seed)
            train(federated_part(model), self.inputs(model, recipe.architecture, split), replace(cfg, seed=self.seed * 10 + i))
            local.append(evaluate(federated_part(model), self.inputs(model, recipe.architecture, self.factory_tests[i])).accuracy)
            own_prior = prior_adjustment(np.bincount(np.asarray(split.labels, dtype=np.int64), minlength=len(self.classes)), tau)
            pooled_at_factory.append(self.accuracy_with_prior(recipe.architecture, pooled_model, self.factory_tests[i], own_prior))
        return {"pooled": pooled, "pooled_plain": pooled_plain, "pooled_tau": tau, "local": local, "pooled_at_factory": pooled_at_factory,
                "factory_test_images": [len(t) for t in self.factory_tests]}

    def accuracy_with_prior(self, arch: str, model: nn.Module, data: ImageDataset, prior: torch.Tensor) -> float:
        """The centralised reference at a factory: the pooled model (trained on everyone's images, each adjusted by its own
        factory's prior) predicting with this factory's label prior added to its logits, as a model trained on this
        factory's mix would. What a site that could see every image would serve this factory: where even it does not beat
        the factory's local-only model, the images other factories hold do not help there, whatever the federation does."""
        logits = predict_logits(federated_part(model), self.inputs(model, arch, data)) + prior.numpy()
        return float((logits.argmax(1) == np.asarray(data.labels)).mean()) if len(data) else 0.0


def clip_norm(value: str) -> float | str:
    """``--dp-max-grad-norm`` as `fedforge client` reads it, refused as argparse refuses."""
    try:
        return parse_clip_norm(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def served_vs_local(pairs: list[tuple[float, float]]) -> str:
    """Factories whose served model beats / ties / loses to their local-only model on their own test images. A tie where
    local-only is already perfect (a factory that sees one class scores 1.000 alone) cannot become a win, so it is
    counted apart."""
    better = sum(s > loc for s, loc in pairs)
    tied = [loc for s, loc in pairs if s == loc]
    return f"{better} / {len(tied)} ({sum(loc == 1.0 for loc in tied)}) / {len(pairs) - better - len(tied)}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--settings", default="iid-ish,skewed", help=f"comma-separated of {sorted(SETTINGS)}")
    p.add_argument("--recipes", default="default,cnn", help=f"comma-separated of {sorted(RECIPES)}")
    p.add_argument("--dp", action="store_true", help="also run the first recipe with DP-SGD at epsilon 8 per factory over the run")
    p.add_argument("--no-public", action="store_true", help="with --dp: no public proxy set, DP-SGD trains the whole head")
    p.add_argument("--dp-secure-sum", action="store_true", help="with --dp: the factories share the secure sum's DP noise (--dp-secure-sum)")
    p.add_argument("--dp-max-grad-norm", type=clip_norm, default=DEFAULT_CLIP_NORM, help="with --dp: the factories' --dp-max-grad-norm "
                   "(a number, or public, the default: with --dp-secure-sum a fifth of the public images' feature norm, else 1.0)")
    p.add_argument("--dp-rounds", type=int, default=0, help="with --dp: rounds of the DP run (default: 30 with --dp-secure-sum, else the recipe's)")
    p.add_argument("--train-size", type=int, default=600)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--workdir", default=None, help="feature cache and factory state (default: a temporary directory)")
    p.add_argument("--folders", default=None, help="run on these image folders instead of the built-in generator (layout: see above)")
    p.add_argument("--classes", default="", help="with --folders: the run's ordered class list (default: the folders' names, sorted)")
    p.add_argument("--class-alias", action="append", default=[], metavar="FOLDER=CLASS",
                   help="with --folders: a folder that holds a class under another name, at any factory or test folder (repeatable)")
    p.add_argument("--channels", default="auto", choices=("auto", "1", "3"), help="with --folders: 1 reads every image as grey, 3 as RGB (the run's "
                   "channels); auto (the default) 3 if any factory's training images are in colour (common.data.layout), else 1")
    p.add_argument("--image-size", type=int, default=0, help="the run's image-size (default: the run config's); the built-in generator "
                   "draws its images at that size")
    p.add_argument("--bit-depth", type=int, default=16, choices=range(8, 17), metavar="{8..16}",
                   help="with --folders: significant bits of their 16-bit grey images (12: Mono12 written as 0..4095), at every site")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a factory training key of the run config for every recipe, e.g. --set personal-epochs=5 (repeatable)")
    a = p.parse_args()
    try:
        overrides = parse_overrides(tuple(a.overrides))
        recipes = {key: RECIPES[key].with_settings(overrides) for key in a.recipes.split(",")}
    except KeyError as exc:
        p.error(f"--recipes: unknown recipe {exc}; one of {', '.join(sorted(RECIPES))}")
    except click.BadParameter as exc:
        p.error(exc.format_message())
    except ValueError as exc:
        p.error(str(exc))
    if (a.channels != "auto" or a.class_alias or a.bit_depth != 16) and not a.folders:
        p.error("--channels, --bit-depth and --class-alias apply to --folders (the built-in generator draws grey 8-bit images of its own classes)")
    set_torch_threads(a.threads)
    # a temporary working directory (its feature caches hold hundreds of MB) goes when the bench ends, however it ends
    with contextlib.nullcontext(a.workdir) if a.workdir else tempfile.TemporaryDirectory(prefix="fedforge-quality-", ignore_cleanup_errors=True) as workdir:
        try:
            folders = Folders.at(a.folders, a.classes, split_dir=Path(workdir) / "split", aliases=parse_aliases(a.class_alias)) if a.folders else None
        except ValueError as exc:  # DatasetError, ClassListError: the message names the folder
            p.error(f"--folders: {exc}")
        a.channels = 1 if folders is None else folders.channels() if a.channels == "auto" else int(a.channels)
        if folders:
            for line in (folders.describe_split(), folders.describe_ignored(), folders.case_clashes()):
                if line:
                    print(f"--folders {a.folders}: {line}", flush=True)
            a.settings = "folders"
            sizes = sorted({image_size_of(a, recipes[key]) for key in a.recipes.split(",")})
            size = " / ".join(map(str, sizes))
            central = f"{folders.central_test.name}/" if folders.central_test else "every factory's test images"
            proxy = f"{folders.proxy.name}/" if folders.proxy else "none"
            print(f"{len(folders.factories)} factories from {a.folders}, classes {list(folders.classes)}, read as "
                  f"{'RGB' if a.channels == 3 else 'grey'} at {size} px{f', {a.bit_depth}-bit' if a.bit_depth != 16 else ''}; central test set {central}; "
                  f"proxy set {proxy}", flush=True)
            if a.dp and not a.no_public and (line := folders.no_public_images()):
                print(f"--folders {a.folders}: {line}", flush=True)
        rows = run_all(a, recipes, overrides, folders, Path(workdir))
    print_tables(a, rows, overrides)


def image_size_of(a: argparse.Namespace, recipe: Recipe) -> int:
    """The image size a recipe's runs read at: ``--image-size``, else what the run config's default (0) gives its
    architecture (`common.models.natural_image_size`)."""
    return a.image_size or natural_image_size(recipe.architecture)


def run_all(a: argparse.Namespace, recipes: dict[str, Recipe], overrides: dict[str, object], folders: Folders | None, workdir: Path) -> list[dict]:
    """Every setting x recipe x seed of the command line, one JSON line each as it finishes."""
    rows = []
    for setting in a.settings.split(","):
        factories, alpha = (len(folders.factories), 0.0) if folders else SETTINGS[setting]
        for key in a.recipes.split(","):
            recipe = recipes[key]
            for seed in map(int, a.seeds.split(",")):
                t0 = time.perf_counter()
                image_size = image_size_of(a, recipe)
                bench = Bench(seed, factories, alpha, a.train_size, workdir, key, folders=folders, channels=a.channels, image_size=image_size,
                              bit_depth=a.bit_depth)
                fed, base = bench.federate(recipe), bench.pooled_and_local(recipe)
                row = {"setting": setting, "recipe": recipe.name, "seed": seed, **fed, **base, "seconds": time.perf_counter() - t0,
                       **({"set": overrides} if overrides else {})}
                if a.dp and key == a.recipes.split(",")[0]:
                    dp_recipe = replace(recipe, name=recipe.name + " DP", rounds=a.dp_rounds or (SECURE_SUM_DP_ROUNDS if a.dp_secure_sum else recipe.rounds))
                    dp_bench = Bench(seed, factories, alpha, a.train_size, workdir, key, dp_epsilon=8.0, rounds=dp_recipe.rounds, folders=folders,
                                     public=not a.no_public, secure_sum=a.dp_secure_sum, channels=a.channels, image_size=image_size, bit_depth=a.bit_depth,
                                     max_grad_norm=a.dp_max_grad_norm)
                    row["dp_public_images"] = len(dp_bench.public) if dp_bench.public is not None else 0
                    row["dp_rounds"], row["dp_noise_holders"] = dp_recipe.rounds, dp_bench.noise_holders
                    dp = dp_bench.federate(dp_recipe)
                    # the personal model never leaves its factory, so it is trained without DP: what the line gets under DP
                    row["dp_accuracy"], row["dp_served"] = dp["accuracy"], dp["served"]
                    row["dp_subspace_dims"] = dp.get("subspace_dims", 0)  # 0: DP-SGD trained the whole head
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def print_tables(a: argparse.Namespace, rows: list[dict], overrides: dict[str, object]) -> None:
    """The issue's table (means over the seeds) and each factory's served - local-only in test images."""
    print()
    if overrides:
        print("Set for every factory: " + ", ".join(f"{k} = {v}" for k, v in sorted(overrides.items())))
        print()
    print("| setting | recipe | global | pooled | pooled, plain | global/pooled | served > local at every factory | served vs local: better / tied "
          "(at 1.000) / worse | served - local (min) | DP global | DP served - served (mean, min) | centralised vs local: better / tied "
          "(at 1.000) / worse |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for setting in a.settings.split(","):
        for key in a.recipes.split(","):
            rs = [r for r in rows if r["setting"] == setting and r["recipe"] == RECIPES[key].name]
            g, pooled = statistics.mean(r["accuracy"] for r in rs), statistics.mean(r["pooled"] for r in rs)
            better = sum(all(s > loc for s, loc in zip(r["served"], r["local"])) for r in rs)
            margin = min(min(s - loc for s, loc in zip(r["served"], r["local"])) for r in rs)
            counts = served_vs_local([(s, loc) for r in rs for s, loc in zip(r["served"], r["local"])])
            dp_columns = "– | – |"
            if all("dp_accuracy" in r for r in rs):
                cost = [d - s for r in rs for d, s in zip(r["dp_served"], r["served"])]
                dp_columns = f"{statistics.mean(r['dp_accuracy'] for r in rs):.3f} | {statistics.mean(cost):+.3f}, {min(cost):+.3f} |"
            plain = statistics.mean(r["pooled_plain"] for r in rs)
            central = served_vs_local([(c, loc) for r in rs for c, loc in zip(r["pooled_at_factory"], r["local"])])
            print(f"| {setting} | {RECIPES[key].name} | {g:.3f} | {pooled:.3f} | {plain:.3f} | {g / pooled:.2f} | {better}/{len(rs)} seeds | {counts} | {margin:+.3f} | "
                  + dp_columns + f" {central} |")
    print()
    print("Served - local-only, in test images of each factory's own test set (factories in order; * : local-only already 1.000), and the")
    print("same for the centralised reference (the pooled model with the factory's own prior: what a site seeing every image would serve):")
    print()
    print("| setting | recipe | seed | served - local per factory | centralised - local per factory |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        images = r["factory_test_images"]
        print(f"| {r['setting']} | {r['recipe']} | {r['seed']} | {images_gained(r['served'], r['local'], images)} | "
              f"{images_gained(r['pooled_at_factory'], r['local'], images)} |")


def images_gained(served: list[float], local: list[float], images: list[int]) -> str:
    """Per factory, how many more of its test images the served model classifies right than its local-only model."""
    gained = [round((s - loc) * n) for s, loc, n in zip(served, local, images)]
    return " ".join((f"{g:+d}" if g else "0") + ("*" if loc == 1.0 else "") for g, loc in zip(gained, local))


if __name__ == "__main__":
    main()
