"""Edge agent configuration: one typed dataclass, filled from flags, FEDFORGE_* env vars or TOML."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AgentConfig:
    factory_id: str
    listen: str = "127.0.0.1:50061"  # host:port or unix:/path
    data: str = "synthetic"  # "synthetic" or the path of an image folder (one sub-folder per class)
    factory_index: int = 0  # which synthetic partition this factory holds
    num_factories: int = 3
    data_seed: int = 0
    alpha: float = 1.0
    train_size: int = 600
    image_size: int = 64
    val_fraction: float = 0.1
    torch_threads: int = 1
    architecture: str = ""  # the model this factory trains; empty: the server's run config decides
    parallelism: str = "none"  # none | ddp | fsdp
    local_world_size: int = 1  # ranks of the DDP/FSDP worker group
    state_dir: str = "fedforge-factory"  # durable factory state (the privacy ledger, pulled models)
    registry: str = ""  # the central ModelRegistry (host:port); with it, the agent serves Inspection
    registry_public_key: str = ""  # the central site's pinned signing.pub
    registry_ca: str = ""  # CA certificate for TLS to the registry (empty: plain gRPC on a trusted network)
    # Differential privacy: factory-side settings the server cannot change.
    dp: bool = False
    dp_epsilon: float = 8.0
    dp_delta: float = 1e-5
    dp_max_grad_norm: float = 1.0
    dp_planned_rounds: int = 20
    dp_grad_sample_mode: str = "hooks"
    dp_fix_model: bool = False

    def validated(self) -> AgentConfig:
        self.privacy_budget()  # raises ValueError naming the bad --dp-* option
        return self

    def privacy_budget(self):  # type: ignore[no-untyped-def]
        from client.privacy import PrivacyBudget

        if not self.dp:
            return None
        return PrivacyBudget(self.dp_epsilon, self.dp_delta, self.dp_max_grad_norm, self.dp_planned_rounds, self.dp_grad_sample_mode)

    def __post_init__(self) -> None:
        if not self.factory_id or any(c.isspace() or c in "'\"" for c in self.factory_id):
            raise ValueError(f"factory id {self.factory_id!r} must be non-empty, without spaces or quotes")
        if self.parallelism not in ("none", "ddp", "fsdp"):
            raise ValueError(f"--parallelism must be none, ddp or fsdp, got {self.parallelism!r}")
        if self.local_world_size < 1:
            raise ValueError(f"--local-world-size must be >= 1, got {self.local_world_size}")
        if bool(self.registry) != bool(self.registry_public_key):
            raise ValueError("--registry and --registry-public-key go together: models are only loaded after verification")
        if self.architecture:
            from common.models import ARCHITECTURES

            if self.architecture not in ARCHITECTURES:
                raise ValueError(f"--architecture {self.architecture!r} is not one of {sorted(ARCHITECTURES)}")
        if not 0.0 <= self.val_fraction < 0.9:
            raise ValueError(f"val_fraction must be in [0, 0.9), got {self.val_fraction}")
