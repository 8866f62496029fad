"""The registry: the one place runs, rounds and model versions are recorded and read back."""

from __future__ import annotations

import subprocess
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from sqlalchemy import create_engine, event, func, select
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import sessionmaker

from common.release import new_statement, sign_statement
from common.signing import canonical, create_keypair, key_id, load_private, load_public, sign
from server.registry.artifacts import ArtifactStore, decode_weights, encode_weights
from server.registry.migrate import upgrade
from server.registry.schema import Action, Evaluation, Round, Run, Version, utcnow

TRANSITIONS = {("candidate", "approved"), ("candidate", "revoked"), ("approved", "revoked"), ("approved", "approved")}


class TransitionError(ValueError):
    """The requested status change is not allowed (e.g. approving a revoked version)."""


class ReleaseKeyError(PermissionError):
    """An approval, revocation or rollback without the federation's release key (or with another key)."""


def manifest_of(v: Version) -> dict[str, Any]:
    """What the signature covers: everything an edge node needs to trust the weights file."""
    return {
        "id": v.id, "run_id": v.run_id, "round": v.server_round, "parent_id": v.parent_id, "kind": v.kind, "architecture": v.architecture,
        "num_parameters": v.num_parameters, "sha256": v.sha256, "size_bytes": v.size_bytes, "metrics": v.metrics,
        "participants": v.participants, "secure_aggregation": v.secure_aggregation, "privacy": v.privacy,
        "code_version": v.code_version, "created_at": v.created_at.isoformat(), "format": "npz",
        "model_input": v.model_input,
    }


def code_version() -> str:
    """Package version plus the git commit when running from a checkout."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        v = version("fedforge")
    except PackageNotFoundError:
        v = "0+unknown"
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=5, check=False).stdout.strip()
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


STAMP = select(*(q.scalar_subquery() for q in (  # built once: SQLAlchemy then reuses its compiled form
    select(func.count()).select_from(Version), select(func.max(Action.id)), select(func.max(Evaluation.id)),
    select(func.max(Round.id)), select(func.count()).select_from(Run), select(func.max(Run.finished_at)))))


@dataclass
class NewVersion:
    run_id: str
    server_round: int
    parent_id: str | None
    kind: str
    architecture: str
    weights: OrderedDict[str, np.ndarray]
    metrics: dict[str, Any]
    participants: list[str]
    secure_aggregation: bool = False
    privacy: dict[str, Any] | None = None
    model_input: dict[str, Any] | None = None  # classes, image_size, channels, backbone: how edges feed the model


@dataclass
class NewEvaluation:
    version_id: str
    run_id: str
    server_round: int
    phase: str  # "round" | "final"
    factories: int
    classes: list[str]
    confusion: np.ndarray
    figures: dict[str, Any]
    shared: dict[str, Any]
    secure_aggregation: bool


class Registry:
    def __init__(self, url: str, artifact_dir: str | Path, signing_key: Any = None, release_key: Any = None, release_public: Any = None) -> None:
        self.engine = make_engine(url)
        upgrade(self.engine)  # Alembic: the schema is always at head
        self.session = sessionmaker(self.engine, expire_on_commit=False)
        self.artifacts = ArtifactStore(artifact_dir)
        self.signing_key = signing_key
        self.release_key = release_key  # None when the release key lives off this host: pass it to each status change
        self.release_public = release_public or (release_key.public_key() if release_key is not None else None)
        self._code_version = code_version()

    @classmethod
    def at(cls, directory: str | Path, create_key: bool = False) -> Registry:
        """The default layout: ``<dir>/registry.db``, ``<dir>/artifacts``, ``<dir>/keys/signing.key`` and the release
        key ``<dir>/keys/release.key`` (or only ``release.pub`` when the operator keeps the private half elsewhere)."""
        directory = Path(directory).resolve()
        directory.mkdir(parents=True, exist_ok=True)
        keys = directory / "keys"
        if create_key and not (keys / "signing.key").exists():
            create_keypair(keys)
        if create_key and not (keys / "release.pub").exists():
            create_keypair(keys, "release")
        key = load_private(keys / "signing.key") if (keys / "signing.key").exists() else None
        release = load_private(keys / "release.key") if (keys / "release.key").exists() else None
        release_public = load_public(keys / "release.pub") if (keys / "release.pub").exists() else None
        return cls(f"sqlite:///{directory / 'registry.db'}", directory / "artifacts", signing_key=key, release_key=release,
                   release_public=release_public)

    # runs and rounds -----------------------------------------------------------------------
    def start_run(self, run_id: str, flwr_run_id: str, config: dict[str, Any]) -> Run:
        with self.session.begin() as s:
            run = Run(id=run_id, flwr_run_id=flwr_run_id, config=config, status="running")
            s.add(run)
        return run

    def finish_run(self, run_id: str, status: str, error: str = "") -> None:
        """Record how a run ended; the first ending wins (a run stopped by an operator stays stopped)."""
        with self.session.begin() as s:
            run = s.get(Run, run_id)
            if run is not None and run.status == "running":
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
            created_at=utcnow(), model_input=new.model_input or {},
        )
        manifest = manifest_of(version)
        version.manifest = canonical(manifest).decode()
        version.signature = sign(manifest, self.signing_key) if self.signing_key is not None else ""
        with self.session.begin() as s:
            s.add(version)
        return version

    # federated evaluation ------------------------------------------------------------------
    def record_evaluation(self, new: NewEvaluation) -> Evaluation:
        row = Evaluation(version_id=new.version_id, run_id=new.run_id, server_round=new.server_round, phase=new.phase, factories=new.factories,
                         examples=int(np.asarray(new.confusion).sum()), classes=list(new.classes),
                         confusion=np.asarray(new.confusion, dtype=np.int64).tolist(), figures=new.figures, shared=new.shared,
                         secure_aggregation=new.secure_aggregation, created_at=utcnow())
        with self.session.begin() as s:
            s.add(row)
        return row

    def evaluations(self, version_id: str | None = None, run_id: str | None = None) -> list[Evaluation]:
        with self.session() as s:
            q = select(Evaluation).order_by(Evaluation.id)
            if version_id is not None:
                q = q.where(Evaluation.version_id == version_id)
            if run_id is not None:
                q = q.where(Evaluation.run_id == run_id)
            return list(s.scalars(q))

    def latest_evaluation(self, version_id: str) -> Evaluation | None:
        """The most recent federated evaluation of a version (the final phase's, when there was one)."""
        with self.session() as s:
            return s.scalars(select(Evaluation).where(Evaluation.version_id == version_id).order_by(Evaluation.id.desc()).limit(1)).first()

    # status --------------------------------------------------------------------------------
    def set_status(self, version_id: str, status: str, actor: str, action: str | None = None, note: str = "",
                   release_key: Any = None) -> Version:
        """Approve, revoke or roll back a version: one release statement, numbered above every earlier one and signed
        with the release key (this registry's, or ``release_key`` brought by the operator); returns the updated version."""
        if not actor:
            raise ValueError("every status change names its actor")
        key = release_key or self.release_key
        if key is None:
            raise ReleaseKeyError("approvals, revocations and rollbacks are signed with the federation's release key, which is not on "
                                  "this host: pass --release-key FILE (made by `fedforge keys create --name release`)")
        if self.release_public is not None and key_id(key.public_key()) != key_id(self.release_public):
            raise ReleaseKeyError(f"this key ({key_id(key.public_key())}) is not the federation's release key ({key_id(self.release_public)}, "
                                  "keys/release.pub); edges would refuse what it signs")
        action = action or {"approved": "approve", "revoked": "revoke"}[status]
        for attempt in range(5):
            try:
                with self.session.begin() as s:
                    version = s.get(Version, version_id)
                    if version is None:
                        raise KeyError(f"no version {version_id!r} in the registry")
                    if (version.status, status) not in TRANSITIONS:
                        raise TransitionError(f"version {version_id} is {version.status}; it cannot become {status}")
                    release = (s.scalar(select(func.max(Action.release))) or 0) + 1
                    at = utcnow()
                    statement, signature = sign_statement(new_statement(release, version.id, version.sha256, version.architecture, action, actor, at), key)
                    version.status = status
                    s.add(Action(version_id=version_id, action=action, actor=actor, note=note, at=at, release=release, statement=statement,
                                 signature=signature))
                break
            except IntegrityError:  # another writer took this release number first: number it again
                if attempt == 4:
                    raise
        return self.get_version(version_id)

    def approve(self, version_id: str, actor: str, note: str = "", release_key: Any = None) -> Version:
        return self.set_status(version_id, "approved", actor, note=note, release_key=release_key)

    def revoke(self, version_id: str, actor: str, note: str = "", release_key: Any = None) -> Version:
        return self.set_status(version_id, "revoked", actor, note=note, release_key=release_key)

    def rollback(self, version_id: str, actor: str, note: str = "", release_key: Any = None) -> Version:
        """Make an older version the current approved one again (it must not be revoked)."""
        return self.set_status(version_id, "approved", actor, action="rollback", note=note, release_key=release_key)

    def actions(self, after_id: int = 0, version_id: str | None = None) -> list[Action]:
        with self.session() as s:
            q = select(Action).where(Action.id > after_id).order_by(Action.id)
            if version_id is not None:
                q = q.where(Action.version_id == version_id)
            return list(s.scalars(q))

    def current_approved(self, architecture: str | None = None) -> Version | None:
        """The version most recently approved (or rolled back to) that is still approved."""
        for action in reversed(self.actions()):
            if action.action in ("approve", "rollback"):
                v = self.get_version(action.version_id)
                if v is not None and v.status == "approved" and (architecture is None or v.architecture == architecture):
                    return v
        return None

    def versions(self, run_id: str | None = None, status: str | None = None, architecture: str | None = None) -> list[Version]:
        with self.session() as s:
            q = select(Version).order_by(Version.created_at)
            if run_id is not None:
                q = q.where(Version.run_id == run_id)
            if status is not None:
                q = q.where(Version.status == status)
            if architecture is not None:
                q = q.where(Version.architecture == architecture)
            return list(s.scalars(q))

    def stamp(self) -> tuple[Any, ...]:
        """Changes whenever anything a list could show changes (a run starting or ending, a round, a version, a status
        change, an evaluation): one cheap query, so list pages can be served from a cache until it moves."""
        with self.engine.connect() as connection:  # no ORM session: this runs on every list request
            return tuple(connection.execute(STAMP).one())

    LISTED_COLUMNS = ("id", "run_id", "server_round", "parent_id", "kind", "architecture", "status", "metrics", "secure_aggregation",
                      "created_at", "sha256", "size_bytes")

    def version_page(self, limit: int, offset: int = 0, status: str | None = None) -> tuple[list[Any], int]:
        """Newest first, one page of versions as rows of `LISTED_COLUMNS` (no manifests, signatures or ORM objects: lists
        are read far more often than versions change), and the total."""
        with self.session() as s:
            where = [Version.status == status] if status is not None else []
            total = s.scalar(select(func.count()).select_from(Version).where(*where)) or 0
            columns = [getattr(Version, c) for c in self.LISTED_COLUMNS]
            q = select(*columns).where(*where).order_by(Version.created_at.desc(), Version.id.desc()).limit(limit).offset(offset)
            return list(s.execute(q)), total

    def latest_evaluations(self, version_ids: list[str]) -> dict[str, Evaluation]:
        """The most recent federated evaluation of each of these versions (those that have one)."""
        if not version_ids:
            return {}
        with self.session() as s:
            newest = select(func.max(Evaluation.id)).where(Evaluation.version_id.in_(version_ids)).group_by(Evaluation.version_id)
            return {e.version_id: e for e in s.scalars(select(Evaluation).where(Evaluation.id.in_(newest)).order_by(Evaluation.id))}

    def run_page(self, limit: int, offset: int = 0) -> tuple[list[Run], int]:
        """Newest first, one page of runs, and the total."""
        with self.session() as s:
            total = s.scalar(select(func.count()).select_from(Run)) or 0
            return list(s.scalars(select(Run).order_by(Run.started_at.desc(), Run.id.desc()).limit(limit).offset(offset))), total

    def get_version(self, version_id: str) -> Version | None:
        with self.session() as s:
            return s.get(Version, version_id)

    def load_weights(self, version_id: str) -> OrderedDict[str, np.ndarray]:
        version = self.get_version(version_id)
        if version is None:
            raise KeyError(f"no version {version_id!r} in the registry")
        return decode_weights(self.artifacts.get(version.sha256))
