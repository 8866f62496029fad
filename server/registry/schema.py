"""Registry tables (SQLAlchemy 2 ORM): runs, rounds and model versions with their lineage.

SQLite is the embedded default; any SQLAlchemy URL (PostgreSQL included) selects another backend.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, ClassVar

from sqlalchemy import JSON, Boolean, DateTime, Float, ForeignKey, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


def utcnow() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    type_annotation_map: ClassVar[dict[Any, Any]] = {dict[str, Any]: JSON, list[Any]: JSON}


class Run(Base):
    """One federation run (one Flower run); ``status`` is running, finished, failed (every round aborted, or an
    error), interrupted (the SuperLink went away; resumable) or stopped (by an operator)."""

    __tablename__ = "runs"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    flwr_run_id: Mapped[str] = mapped_column(String(64), default="")
    status: Mapped[str] = mapped_column(String(16), default="running")
    config: Mapped[dict[str, Any]] = mapped_column(default=dict)
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    error: Mapped[str] = mapped_column(String(2000), default="")


class Round(Base):
    """What happened in one server round, including who failed and why."""

    __tablename__ = "rounds"
    __table_args__ = (UniqueConstraint("run_id", "server_round"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"), index=True)
    server_round: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16))  # completed | aborted
    accuracy: Mapped[float | None] = mapped_column(Float, nullable=True)
    loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    participants: Mapped[list[Any]] = mapped_column(default=list)
    failures: Mapped[dict[str, Any]] = mapped_column(default=dict)
    metrics: Mapped[dict[str, Any]] = mapped_column(default=dict)
    seconds: Mapped[float] = mapped_column(Float, default=0.0)
    version_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Version(Base):
    """A global model version: weights file (by sha256) plus where it came from."""

    __tablename__ = "versions"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    run_id: Mapped[str] = mapped_column(String(64), index=True)
    server_round: Mapped[int] = mapped_column(Integer)
    parent_id: Mapped[str | None] = mapped_column(ForeignKey("versions.id"), nullable=True)
    kind: Mapped[str] = mapped_column(String(16))  # initial | fedavg | distilled
    architecture: Mapped[str] = mapped_column(String(64))
    num_parameters: Mapped[int] = mapped_column(Integer)
    sha256: Mapped[str] = mapped_column(String(64), index=True)
    size_bytes: Mapped[int] = mapped_column(Integer)
    metrics: Mapped[dict[str, Any]] = mapped_column(default=dict)
    participants: Mapped[list[Any]] = mapped_column(default=list)
    secure_aggregation: Mapped[bool] = mapped_column(Boolean, default=False)
    privacy: Mapped[dict[str, Any]] = mapped_column(default=dict)
    code_version: Mapped[str] = mapped_column(String(128), default="")
    status: Mapped[str] = mapped_column(String(16), default="candidate")  # candidate | approved | revoked
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    manifest: Mapped[str] = mapped_column(Text, default="")  # canonical JSON, what the signature covers
    signature: Mapped[str] = mapped_column(Text, default="")  # {"key_id", "signature"} envelope
    model_input: Mapped[dict[str, Any]] = mapped_column(default=dict)  # classes, image_size, channels, backbone


class Evaluation(Base):
    """A version's figures on the factories' own held-out images (federated evaluation), summed over factories."""

    __tablename__ = "evaluations"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    version_id: Mapped[str] = mapped_column(ForeignKey("versions.id"), index=True)
    run_id: Mapped[str] = mapped_column(String(64), index=True)
    server_round: Mapped[int] = mapped_column(Integer)  # the round whose messages carried the evaluation
    phase: Mapped[str] = mapped_column(String(16))  # "round" (before local training) | "final" (evaluate-only phase)
    factories: Mapped[int] = mapped_column(Integer)
    examples: Mapped[int] = mapped_column(Integer)
    classes: Mapped[list[Any]] = mapped_column(default=list)
    confusion: Mapped[list[Any]] = mapped_column(default=list)  # rows: true class, columns: predicted class
    figures: Mapped[dict[str, Any]] = mapped_column(default=dict)  # accuracy, recall, escape-rate, false-reject-rate
    shared: Mapped[dict[str, Any]] = mapped_column(default=dict)  # per-factory figures of factories that chose to share them
    secure_aggregation: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Action(Base):
    """Who did what to which version, and when (approve, revoke, rollback), as a statement signed by the release key."""

    __tablename__ = "actions"
    __table_args__ = (UniqueConstraint("release", name="uq_actions_release"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    version_id: Mapped[str] = mapped_column(ForeignKey("versions.id"), index=True)
    action: Mapped[str] = mapped_column(String(16))
    actor: Mapped[str] = mapped_column(String(128))
    note: Mapped[str] = mapped_column(String(1000), default="")
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    release: Mapped[int | None] = mapped_column(Integer, nullable=True)  # only grows; edges refuse anything not above their last
    statement: Mapped[str] = mapped_column(Text, default="")  # canonical JSON (common.release.Statement)
    signature: Mapped[str] = mapped_column(Text, default="")  # the release key's envelope over `statement`
