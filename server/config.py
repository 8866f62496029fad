"""The run configuration: what ``[tool.flwr.app.config]`` and ``fedforge run --set key=value`` control.

Three typed parts, each with its defaults written once:

- `FederationConfig` (here): rounds, cohort, timeouts, the data contract (class list, image size,
  channels), the server optimiser, secure aggregation, distillation;
- `common.training.TrainConfig`: every local-training option a factory accepts, sent to factories
  with each train message;
- the factories' own limits (privacy budget, whether figures leave the site) are *not* here: they are
  the factory's configuration (`client.config.AgentConfig`) and no run can change them.

Run-config keys are the field names with '-' for '_'; pyproject's table must list exactly these keys
with these defaults (a test checks it).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, fields
from typing import Any

from common.backbones import feature_device
from common.data.classes import DEFAULT_CLASSES, format_classes, parse_classes
from common.data.datasets import SyntheticSpec
from common.data.images import check_bit_depth
from common.evaluation import DEFAULT_GOOD_CLASS
from common.models import is_pretrained, natural_image_size
from common.simulation import RUN_CONFIG_DEFAULTS as SIMULATION_KEYS
from common.training import TrainConfig, coerce

log = logging.getLogger("fedforge.server")

DISTILL_MODES = ("off", "after", "only")
SERVER_OPTIMIZERS = ("fedavg", "fedavgm", "fedadam")
LR_SCHEDULES = ("constant", "cosine")
# Rounds of a run whose factories share the secure sum's DP noise (--dp-secure-sum): each round is one DP step, and 30 of
# them came within 5.5 to 6.7 points of the 10-round run without DP on three data sets (docs/benchmarks.md)
SECURE_SUM_DP_ROUNDS = 30


@dataclass(frozen=True)
class FederationConfig:
    """Server-side run configuration; keys match ``[tool.flwr.app.config]`` with '-' for '_'."""

    num_server_rounds: int = 20
    min_factories: int = 2
    expected_factories: int = 0  # wait for this many factories before round 1 (0: min_factories)
    wait_for_factories: float = 120.0
    round_timeout: float = 300.0
    architecture: str = "effnet-lite0"  # for factories that do not declare one (docs/benchmarks.md: the recipe's measurements)
    seed: int = 0  # model initialisation and local-training seeds
    # The data contract every factory and the server share.
    classes: str = format_classes(DEFAULT_CLASSES)  # ordered class names; a label is a position in this list
    image_size: int = 0  # images are letterboxed to image_size x image_size (common.data.images); 0: the architecture's (natural_image_size)
    channels: int = 1  # 1: grey, 3: RGB
    good_class: str = DEFAULT_GOOD_CLASS  # the class that is not a defect (escape and false-reject rates)
    # The generated federation (demo, tests) and the central test set.
    data_seed: int = 0
    num_factories: int = 3
    alpha: float = 1.0
    test_size: int = 600  # generated test images, used only when the factories' data is generated
    test_data: str = ""  # an image folder for central evaluation (optional)
    data_bit_depth: int = 16  # significant bits of 16-bit grey images and colour TIFFs in the central site's folders (test, proxy, validation data)
    registry_dir: str = ""  # absolute path; empty: ./fedforge-registry in the SuperLink's directory
    torch_threads: int = 1
    feature_device: str = "auto"  # where the central site's frozen backbone extracts features (test, proxy, validation sets)
    # The server optimiser applied to the averaged update (Reddi et al. 2021).
    server_optimizer: str = "fedavgm"  # fedavg | fedavgm | fedadam
    server_lr: float = 1.0  # the cnn-* family's step on the optimiser's output
    # The pretrained family's (head_server_lr): with many factories whose heads move apart, their average makes about one
    # factory's progress a round, and the frozen backbone's linear head is still learning at round 20 on some data; a
    # larger step there gained up to 8 points and cost at most 1.4 elsewhere (docs/benchmarks.md, "A thirteenth data set").
    # Its DP steps (private-head-lr, secure-sum-lr) were halved with it, so a DP head moves as it was measured to.
    head_server_lr: float = 2.0
    server_momentum: float = 0.7  # FedAvgM's beta; FedAdam's beta1
    server_beta2: float = 0.99  # FedAdam
    server_tau: float = 1e-3  # FedAdam's adaptivity (epsilon)
    lr_schedule: str = "cosine"  # "cosine": the local learning rate decays over the run's rounds, from lr to lr / 10
    federated_evaluation: bool = True  # factories evaluate the model they receive; one evaluate-only phase after the last round
    secure_aggregation: bool = True
    secagg_threshold: int = 0  # 0: max(2, ceil(2m/3)) of a factory's neighbourhood of m (itself and its neighbours)
    secagg_degree: int = 0  # neighbours per factory (even: a circulant graph); 0: automatic (secure_sum.auto_degree: complete graph below ~160)
    secagg_timeout: float = 120.0  # per key-exchange / unmask stage
    secagg_audit_dir: str = ""  # write each secure phase's unmasked sum and its contributors here (what the server learns anyway)
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
    agent_timeout: float = 600.0  # how long a ClientApp waits for its edge agent (read by the ClientApp)
    training: TrainConfig = field(default_factory=TrainConfig)  # every local-training option (its own run-config keys)

    def __post_init__(self) -> None:
        if self.distill not in DISTILL_MODES:
            raise ValueError(f"distill must be one of {DISTILL_MODES}, got {self.distill!r}")
        if self.secagg_degree < 0 or self.secagg_degree % 2:
            raise ValueError(f"secagg-degree must be 0 (automatic) or an even number of neighbours (a circulant graph links each "
                             f"factory to as many on each side), got {self.secagg_degree}")
        if self.distill_every < 1:
            raise ValueError(f"distill-every must be >= 1, got {self.distill_every}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"lr-schedule must be one of {LR_SCHEDULES}, got {self.lr_schedule!r}")
        if self.server_optimizer not in SERVER_OPTIMIZERS:
            raise ValueError(f"server-optimizer must be one of {SERVER_OPTIMIZERS}, got {self.server_optimizer!r}")
        if min(self.server_lr, self.head_server_lr, self.server_tau) <= 0 or not 0 <= self.server_momentum < 1 or not 0 <= self.server_beta2 < 1:
            raise ValueError("server-lr, head-server-lr and server-tau must be > 0, server-momentum and server-beta2 in [0, 1)")
        parse_classes(self.classes)  # raises naming the problem
        feature_device(self.feature_device, option="run-config key feature-device")
        if self.channels not in (1, 3):
            raise ValueError(f"channels must be 1 (grey) or 3 (RGB), got {self.channels}")
        if self.image_size == 0:  # the default: 128 px for the pretrained family, 64 for cnn-*
            object.__setattr__(self, "image_size", natural_image_size(self.architecture))
        if not 8 <= self.image_size <= 1024:
            raise ValueError(f"image-size must be between 8 and 1024, got {self.image_size}")
        try:
            check_bit_depth(self.data_bit_depth)  # the rule every reader of the images applies
        except ValueError as exc:
            raise ValueError(f"run-config key data-bit-depth: {exc}") from None

    @classmethod
    def server_keys(cls) -> dict[str, Any]:
        """{run-config key: default} of the server's own fields."""
        return {f.name.replace("_", "-"): f.default for f in fields(cls) if f.name != "training"}

    @classmethod
    def from_run_config(cls, run_config: dict[str, Any]) -> FederationConfig:
        """Split a run config into the server's keys and the local-training keys; unknown keys are logged and ignored."""
        known = {f.name: f for f in fields(cls) if f.name != "training"}
        training_keys = set(TrainConfig.run_config_defaults())
        values: dict[str, Any] = {}
        unknown = []
        for key, value in run_config.items():
            name = key.replace("-", "_")
            if name in known:
                default = known[name].default
                try:
                    values[name] = coerce(value, type(default)) if default is not None else value
                except (TypeError, ValueError):
                    raise ValueError(f"run-config key {key!r} must be a {type(default).__name__}, got {value!r}") from None
            elif key not in training_keys and key not in SIMULATION_KEYS:  # the virtual factories' own settings
                unknown.append(key)
        if unknown:
            log.warning("ignoring unknown run-config keys %s", sorted(unknown))
        return cls(**values, training=TrainConfig.from_run_config(run_config, seed=int(values.get("seed", 0))))

    def server_lr_for(self, architecture: str) -> float:
        """The server optimiser's step for a line of ``architecture``: head-server-lr for the pretrained family, server-lr
        for the cnn-* family (measured with 1; a larger server step was never measured there)."""
        return self.head_server_lr if is_pretrained(architecture) else self.server_lr

    @property
    def class_list(self) -> tuple[str, ...]:
        return parse_classes(self.classes)

    @property
    def spec(self) -> SyntheticSpec:
        return SyntheticSpec(seed=self.data_seed, num_factories=self.num_factories, alpha=self.alpha, image_size=self.image_size)

    def data_config(self) -> dict[str, Any]:
        """The data contract as message config keys (every describe, train and evaluate message carries it)."""
        return {"classes": self.classes, "image-size": self.image_size, "channels": self.channels}

    def round_lr(self, server_round: int, lr: float | None = None) -> float:
        """The local learning rate of a round: ``lr`` (default: the run's), or with ``lr-schedule = "cosine"`` decayed over
        the run to lr / 10 (FedAvg's local steps then shrink as the federation converges, as a pooled run's schedule would)."""
        lr = self.training.lr if lr is None else lr
        if self.lr_schedule == "constant" or self.num_server_rounds <= 1:
            return lr
        progress = min(1.0, max(0.0, (server_round - 1) / (self.num_server_rounds - 1)))
        return lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))

    def train_config(self, server_round: int, architecture: str | None = None) -> dict[str, Any]:
        """What a train message tells a factory: the round, its architecture, the data contract and every training option.

        The same for every line of a round but for the architecture: factories of all lines add into one secure sum, whose
        masks cancel only between factories that received the same terms (`common.secagg.terms`), so no option may
        depend on the line (a cnn-* line's --dp-secure-sum step is therefore secure-sum-lr too, at its server step of 1).

        Both learning rates follow the schedule: the head a DP factory trains decays too, because the noise each step adds
        to the global model scales with its step, and late rounds refine rather than move (docs/benchmarks.md)."""
        return {"server-round": server_round, "architecture": architecture or self.architecture, "seed": self.seed, **self.data_config(),
                **self.training.to_run_config(), "lr": self.round_lr(server_round),
                "private-head-lr": self.round_lr(server_round, self.training.private_head_lr),
                "secure-sum-lr": self.round_lr(server_round, self.training.secure_sum_lr)}

    def distills_in(self, server_round: int) -> bool:
        return self.distill == "only" or (self.distill == "after" and server_round % self.distill_every == 0)
