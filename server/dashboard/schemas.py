"""Pydantic schemas at the API's edge (the OpenAPI schema is generated from these)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, Field


class RoundOut(BaseModel):
    server_round: int
    status: str
    accuracy: float | None
    loss: float | None
    participants: list[str]
    failures: dict[str, str]
    seconds: float
    version_id: str | None
    metrics: dict[str, Any]


class RunOut(BaseModel):
    id: str
    flwr_run_id: str
    status: str
    started_at: datetime
    finished_at: datetime | None
    error: str
    rounds_completed: int
    rounds_planned: int
    last_accuracy: float | None
    resumed_from: str  # the version a run continued from after a crash ("" for a fresh start)


class RunDetail(RunOut):
    rounds: list[RoundOut]
    config: dict[str, Any]


class VersionOut(BaseModel):
    id: str
    run_id: str
    server_round: int
    parent_id: str | None
    kind: str
    architecture: str
    status: str
    accuracy: float | None  # central test set (None without one)
    secure_aggregation: bool
    created_at: datetime
    sha256: str
    size_bytes: int
    federated_accuracy: float | None = None  # on the factories' own held-out images (latest federated evaluation)
    escape_rate: float | None = None  # defects predicted as the good class
    false_reject_rate: float | None = None  # good parts predicted as a defect


class EvaluationOut(BaseModel):
    """A version's figures on the factories' held-out images, summed over factories (never one factory's)."""

    server_round: int
    phase: str  # round (measured before local training) | final (the evaluate-only phase)
    factories: int
    examples: int
    classes: list[str]
    confusion: list[list[int]]
    accuracy: float | None
    recall: dict[str, float | None]
    escape_rate: float | None
    false_reject_rate: float | None
    secure_aggregation: bool
    shared: dict[str, Any]  # per-factory figures, only of factories that chose --share-metrics


class ActionOut(BaseModel):
    id: int
    version_id: str
    action: str
    actor: str
    note: str
    at: datetime


class VersionDetail(VersionOut):
    manifest: dict[str, Any]
    signature_status: str  # valid | invalid | unsigned
    lineage: list[VersionOut]  # this version, its parent, ... back to the initial model
    children: list[VersionOut]
    actions: list[ActionOut]
    participants: list[str]
    privacy: dict[str, Any]
    metrics: dict[str, Any]
    model_input: dict[str, Any]
    evaluations: list[EvaluationOut]  # newest first


class FactoryOut(BaseModel):
    name: str
    status: str  # ok | failed | idle (in the latest round of the latest run)
    rounds_participated: int
    rounds_failed: int
    last_failure: str
    epsilon_spent: float | None
    epsilon_max: float | None


class PrivacyPoint(BaseModel):
    server_round: int
    epsilon_spent: float


class PrivacyOut(BaseModel):
    factory: str
    epsilon_max: float | None
    epsilon_spent: float | None
    subspace_dims: int | None = None  # the public directions its head last trained in under DP; 0: the whole head (client/subspace.py)
    # --dp-secure-sum: the honest inputs of the secure sum it last shared the noise with, and epsilon on its own noise alone
    noise_holders: int | None = None
    epsilon_alone: float | None = None
    max_grad_norm: float | None = None  # the per-example clipping norm of its last DP round (client.privacy.PrivacyBudget.clip_norm)
    history: list[PrivacyPoint] | None = None  # per round; in the list only with ?history=true (a deferred column)


class Overview(BaseModel):
    current_run: RunOut | None
    factories_ok: int
    factories_failed: int
    versions: int
    approved_version: str | None
    admin_actions_enabled: bool


class ActionIn(BaseModel):
    note: str = Field(default="", max_length=1000)
    actor: str = Field(default="dashboard-admin", min_length=1, max_length=100, pattern=r"^[\w .@-]+$")
