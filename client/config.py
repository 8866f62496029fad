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

    def __post_init__(self) -> None:
        if not self.factory_id or any(c.isspace() or c in "'\"" for c in self.factory_id):
            raise ValueError(f"factory id {self.factory_id!r} must be non-empty, without spaces or quotes")
        if not 0.0 <= self.val_fraction < 0.9:
            raise ValueError(f"val_fraction must be in [0, 0.9), got {self.val_fraction}")
