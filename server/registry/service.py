"""The registry: the one place runs, rounds and model versions are recorded and read back."""

from __future__ import annotations

import subprocess
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from sqlalchemy import create_engine, event, select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import sessionmaker

from server.registry.artifacts import ArtifactStore, decode_weights, encode_weights
from server.registry.schema import Base, Round, Run, Version, utcnow


def code_version() -> str:
    """Package version plus the git commit when running from a checkout."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        v = version("fedforge")
    except PackageNotFoundError:
        v = "0+unknown"
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=5
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return f"{v}+g{commit}" if commit else v


def make_engine(url: str) -> Engine:
    engine = create_engine(url, future=True)
    if engine.dialect.name == "sqlite":
        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")  # readers (dashboard, demo) never block the writer
            cur.execute("PRAGMA busy_timeout=10000")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()
    return engine


@dataclass
class NewVersion:
    run_id: str
    server_round: int
    parent_id: str | None
    kind: str
    architecture: str
    weights: "OrderedDict[str, np.ndarray]"
    metrics: dict[str, Any]
    participants: list[str]
    secure_aggregation: bool = False
    privacy: dict[str, Any] | None = None


class Registry:
    def __init__(self, url: str, artifact_dir: str | Path) -> None:
        self.engine = make_engine(url)
        Base.metadata.create_all(self.engine)
        self.session = sessionmaker(self.engine, expire_on_commit=False)
        self.artifacts = ArtifactStore(artifact_dir)
        self._code_version = code_version()

    @classmethod
    def at(cls, directory: str | Path) -> Registry:
        """The default layout: ``<dir>/registry.db`` and ``<dir>/artifacts``."""
        directory = Path(directory).resolve()
        directory.mkdir(parents=True, exist_ok=True)
        return cls(f"sqlite:///{directory / 'registry.db'}", directory / "artifacts")

    # runs and rounds -----------------------------------------------------------------------
    def start_run(self, run_id: str, flwr_run_id: str, config: dict[str, Any]) -> Run:
        with self.session.begin() as s:
            run = Run(id=run_id, flwr_run_id=flwr_run_id, config=config, status="running")
            s.add(run)
        return run

    def finish_run(self, run_id: str, status: str, error: str = "") -> None:
        with self.session.begin() as s:
            run = s.get(Run, run_id)
            if run is not None:
                run.status, run.error, run.finished_at = status, error[:2000], utcnow()

    def record_round(self, run_id: str, server_round: int, **fields: Any) -> None:
        with self.session.begin() as s:
            s.add(Round(run_id=run_id, server_round=server_round, **fields))

    def runs(self) -> list[Run]:
        with self.session() as s:
            return list(s.scalars(select(Run).order_by(Run.started_at)))

    def get_run(self, run_id: str) -> Run | None:
        with self.session() as s:
            return s.get(Run, run_id)

    def rounds(self, run_id: str) -> list[Round]:
        with self.session() as s:
            return list(s.scalars(select(Round).where(Round.run_id == run_id).order_by(Round.server_round)))

    # versions ------------------------------------------------------------------------------
    def add_version(self, new: NewVersion) -> Version:
        """Write the weights file first, then the row: a crash in between leaves only an orphan file."""
        blob = encode_weights(new.weights)
        digest = self.artifacts.put(blob)
        version = Version(
            id=uuid.uuid4().hex, run_id=new.run_id, server_round=new.server_round, parent_id=new.parent_id, kind=new.kind,
            architecture=new.architecture, num_parameters=int(sum(a.size for a in new.weights.values())), sha256=digest,
            size_bytes=len(blob), metrics=new.metrics, participants=new.participants,
            secure_aggregation=new.secure_aggregation, privacy=new.privacy or {}, code_version=self._code_version,
        )
        with self.session.begin() as s:
            s.add(version)
        return version

    def versions(self, run_id: str | None = None) -> list[Version]:
        with self.session() as s:
            q = select(Version).order_by(Version.created_at)
            if run_id is not None:
                q = q.where(Version.run_id == run_id)
            return list(s.scalars(q))

    def get_version(self, version_id: str) -> Version | None:
        with self.session() as s:
            return s.get(Version, version_id)

    def load_weights(self, version_id: str) -> "OrderedDict[str, np.ndarray]":
        version = self.get_version(version_id)
        if version is None:
            raise KeyError(f"no version {version_id!r} in the registry")
        return decode_weights(self.artifacts.get(version.sha256))
