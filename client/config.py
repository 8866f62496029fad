"""Edge agent configuration: one typed dataclass, filled from flags, FEDFORGE_* env vars or TOML.

Everything here is the factory's own decision: the server's messages can ask for a class list, an
image size or a learning rate, but never change what the factory's data holds, its privacy budget,
or whether its own figures leave the site.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.clip import DEFAULT_CLIP_NORM
from common.data.synth import CLASSES

DEFAULT_CLASSES = ",".join(CLASSES)


@dataclass(frozen=True)
class AgentConfig:
    factory_id: str
    listen: str = "127.0.0.1:50061"  # the training control plane: loopback host:port or unix:/path, never the network
    data: str = "synthetic"  # "synthetic" or the path of an image folder (one sub-folder per class)
    classes: str = DEFAULT_CLASSES  # the class names this factory's folders may have (comma-separated)
    class_alias: tuple[str, ...] = ()  # "FOLDER=CLASS" renames, e.g. "good=ok"
    memory_limit_mb: int = 2048  # decoded images kept in memory; above this the factory streams from disk
    bit_depth: int = 16  # significant bits of the cameras' 16-bit grey images and colour TIFFs (12: Mono12 written as 0..4095); also for inspection
    factory_index: int = 0  # which synthetic partition this factory holds
    num_factories: int = 3
    data_seed: int = 0
    alpha: float = 1.0
    train_size: int = 600
    val_fraction: float = 0.1  # held out (stratified) for evaluating global models here
    torch_threads: int = 1
    feature_device: str = "auto"  # where the frozen backbone extracts features: auto (a GPU if torch sees one), cpu, cuda, cuda:N
    architecture: str = ""  # the model this factory trains; empty: the server's run config decides
    parallelism: str = "none"  # none | ddp | fsdp
    local_world_size: int = 1  # ranks of the DDP/FSDP worker group
    state_dir: str = "fedforge-factory"  # durable factory state (privacy ledger, feature cache, pulled models)
    share_metrics: bool = False  # send this factory's own figures to the centre (else only federation-wide sums)
    require_secure_aggregation: bool = False  # refuse every request whose answer would leave in plaintext (`fedforge client`: on)
    secagg_min_cohort: int = 3  # refuse secure-aggregation sessions with fewer share holders
    secagg_colluders: int = 0  # tolerated colluding factories: a session's threshold must exceed half its size plus this
    personalize: bool = True  # keep a personal model; inspection serves it unless the global one validates clearly better
    registry: str = ""  # the central ModelRegistry (host:port); with it, the agent serves Inspection
    registry_public_key: str = ""  # the central site's pinned signing.pub (who made a version)
    release_public_key: str = ""  # the federation's pinned release.pub (what may be served: signed approvals)
    registry_token: str = ""  # presented to the registry on every call (the central site's registry/keys/registry.token)
    registry_ca: str = ""  # CA certificate for TLS to the registry (empty: plain gRPC on a trusted network)
    # Inspection (what inspection stations call), served apart from the control plane; off loopback only with TLS and a token
    inspection_listen: str = "127.0.0.1:50062"
    inspection_token: str = ""
    inspection_tls_cert: str = ""
    inspection_tls_key: str = ""
    # Differential privacy: factory-side settings the server cannot change.
    dp: bool = False
    dp_epsilon: float = 8.0
    dp_delta: float = 1e-5
    dp_max_grad_norm: float | str = DEFAULT_CLIP_NORM  # "public" or a number (client.privacy.PrivacyBudget.clip_norm)
    dp_planned_rounds: int = 20
    dp_grad_sample_mode: str = "hooks"
    dp_fix_model: bool = False
    dp_secure_sum: bool = False  # share the secure sum's noise with its other honest inputs (docs/security.md)
    dp_count_noise: float = 4.0  # noise multiplier of the one release of the training class counts (update weight, distillation)

    def validated(self) -> AgentConfig:
        self.privacy_budget()  # raises ValueError naming the bad --dp-* option
        self.secagg_policy()  # and the bad --secagg-* option
        from common.backbones import feature_device

        feature_device(self.feature_device)  # and a GPU this host does not have
        from common.data.classes import parse_aliases, parse_classes

        classes = parse_classes(self.classes)
        aliases = parse_aliases(self.class_alias)
        if unknown := sorted({c for c in aliases.values() if c not in classes}):
            raise ValueError(f"--class-alias targets {unknown} are not in --classes {list(classes)}")
        return self

    def secagg_policy(self):  # type: ignore[no-untyped-def]
        from client.secagg import SecAggPolicy

        return SecAggPolicy(self.secagg_min_cohort, self.secagg_colluders)

    def privacy_budget(self):  # type: ignore[no-untyped-def]
        from client.privacy import PrivacyBudget

        if not self.dp:
            return None
        return PrivacyBudget(self.dp_epsilon, self.dp_delta, self.dp_max_grad_norm, self.dp_planned_rounds, self.dp_grad_sample_mode,
                             secure_sum=self.dp_secure_sum, count_noise=self.dp_count_noise)

    @property
    def memory_limit(self) -> int:
        return int(self.memory_limit_mb) << 20

    def __post_init__(self) -> None:
        if not self.factory_id or any(c.isspace() or c in "'\"" for c in self.factory_id):
            raise ValueError(f"factory id {self.factory_id!r} must be non-empty, without spaces or quotes")
        if isinstance(self.class_alias, str):  # one alias from an env var or the node config
            object.__setattr__(self, "class_alias", tuple(a for a in self.class_alias.split(",") if a))
        if self.parallelism not in ("none", "ddp", "fsdp"):
            raise ValueError(f"--parallelism must be none, ddp or fsdp, got {self.parallelism!r}")
        if self.local_world_size < 1:
            raise ValueError(f"--local-world-size must be >= 1, got {self.local_world_size}")
        if self.memory_limit_mb < 0:
            raise ValueError(f"--memory-limit-mb must be >= 0, got {self.memory_limit_mb}")
        from common.data.images import check_bit_depth

        check_bit_depth(self.bit_depth)
        if self.registry and not (self.registry_public_key and self.release_public_key and self.registry_token):
            raise ValueError("--registry needs --registry-public-key (signing.pub), --release-public-key (release.pub) and --registry-token: "
                             "models are only loaded after verification, and only served with a signed approval")
        self._check_listeners()
        if self.architecture:
            from common.models import ARCHITECTURES

            if self.architecture not in ARCHITECTURES:
                raise ValueError(f"--architecture {self.architecture!r} is not one of {sorted(ARCHITECTURES)}")
        if not 0.0 <= self.val_fraction < 0.9:
            raise ValueError(f"val_fraction must be in [0, 0.9), got {self.val_fraction}")

    def _check_listeners(self) -> None:
        """The control plane (Train, SecAgg, Evaluate, Proxy) answers only on this host; Inspection faces the network
        only with TLS and a token."""
        from common.grpc_auth import faces_network

        if faces_network(self.listen):
            raise ValueError(f"--agent-listen {self.listen}: the agent's training control plane must not face the network; use "
                             "127.0.0.1:PORT, or unix:/path in a directory the SuperNode's user (or container) shares")
        if self.inspection_listen == self.listen:
            raise ValueError(f"--inspection-listen {self.inspection_listen} is the control plane's address; Inspection is served apart from it")
        if bool(self.inspection_tls_cert) != bool(self.inspection_tls_key):
            raise ValueError("--inspection-tls-cert and --inspection-tls-key go together")
        if self.registry and faces_network(self.inspection_listen):
            missing = [flag for flag, value in (("--inspection-token (or FEDFORGE_INSPECTION_TOKEN)", self.inspection_token),
                                                ("--inspection-tls-cert and --inspection-tls-key", self.inspection_tls_cert)) if not value]
            if missing:
                raise ValueError(f"--inspection-listen {self.inspection_listen} faces the network: Inspection there needs {' and '.join(missing)}")
