"""What the dashboard shows, computed from the registry (routes stay thin; logic lives here)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from common.signing import VerificationError, load_public, verify_manifest
from server.dashboard import schemas
from server.registry.schema import Evaluation, Run, Version
from server.registry.service import Registry


def _run_out(reg: Registry, run: Run) -> schemas.RunOut:
    rounds = reg.rounds(run.id)
    done = [r for r in rounds if r.status == "completed"]
    return schemas.RunOut(
        id=run.id, flwr_run_id=run.flwr_run_id, status=run.status, started_at=run.started_at, finished_at=run.finished_at, error=run.error,
        rounds_completed=len(rounds), rounds_planned=int(run.config.get("num_server_rounds", len(rounds))),
        last_accuracy=done[-1].accuracy if done else None, resumed_from=str(run.config.get("resume_from") or ""),
    )


T = TypeVar("T")


@dataclass(frozen=True)
class Page(Generic[T]):
    """One page of a list, newest first; ``total`` counts every item (the API sends it as X-Total-Count)."""

    items: list[T]
    total: int
    limit: int
    offset: int

    @property
    def next_offset(self) -> int | None:
        return self.offset + self.limit if self.offset + self.limit < self.total else None

    @property
    def previous_offset(self) -> int | None:
        return max(0, self.offset - self.limit) if self.offset > 0 else None


def paged(items: list[T], limit: int, offset: int) -> Page[T]:
    """A page of a list computed in full (per-factory lists: at most one entry per factory)."""
    return Page(items[offset : offset + limit], len(items), limit, offset)


def runs(reg: Registry, limit: int, offset: int = 0) -> Page[schemas.RunOut]:
    page, total = reg.run_page(limit, offset)
    return Page([_run_out(reg, r) for r in page], total, limit, offset)


def run_detail(reg: Registry, run_id: str) -> schemas.RunDetail | None:
    run = reg.get_run(run_id)
    if run is None:
        return None
    rounds = [schemas.RoundOut(server_round=r.server_round, status=r.status, accuracy=r.accuracy, loss=r.loss, participants=r.participants,
                               failures=r.failures, seconds=r.seconds, version_id=r.version_id, metrics=r.metrics) for r in reg.rounds(run_id)]
    return schemas.RunDetail(**_run_out(reg, run).model_dump(), rounds=rounds, config=run.config)


def version_out(v: Version, evaluation: Evaluation | None = None) -> schemas.VersionOut:
    f = evaluation.figures if evaluation is not None else {}
    return schemas.VersionOut(id=v.id, run_id=v.run_id, server_round=v.server_round, parent_id=v.parent_id, kind=v.kind,
                              architecture=v.architecture, status=v.status, accuracy=v.metrics.get("accuracy"),
                              secure_aggregation=v.secure_aggregation, created_at=v.created_at, sha256=v.sha256, size_bytes=v.size_bytes,
                              federated_accuracy=f.get("accuracy"), escape_rate=f.get("escape-rate"), false_reject_rate=f.get("false-reject-rate"))


def evaluation_out(e: Evaluation) -> schemas.EvaluationOut:
    f = e.figures
    return schemas.EvaluationOut(server_round=e.server_round, phase=e.phase, factories=e.factories, examples=e.examples, classes=e.classes,
                                 confusion=e.confusion, accuracy=f.get("accuracy"), recall=f.get("recall") or {}, escape_rate=f.get("escape-rate"),
                                 false_reject_rate=f.get("false-reject-rate"), secure_aggregation=e.secure_aggregation, shared=e.shared)


def versions(reg: Registry, limit: int, offset: int = 0, status: str | None = None) -> Page[schemas.VersionOut]:
    """One page of versions, newest first: manifests stay in the database, evaluations are read for this page only."""
    page, total = reg.version_page(limit, offset, status)
    latest = reg.latest_evaluations([v.id for v in page])
    return Page([version_out(v, latest.get(v.id)) for v in page], total, limit, offset)


def federated_series(reg: Registry, run_id: str) -> dict[str, list[tuple[float, float]]]:
    """Per version round of a run: federated accuracy, escape and false-reject rates (the latest evaluation of each version)."""
    rounds = {v.id: v.server_round for v in reg.versions(run_id)}
    latest = reg.latest_evaluations(list(rounds))
    out: dict[str, list[tuple[float, float]]] = {"accuracy": [], "escape rate": [], "false-reject rate": []}
    for version_id, e in sorted(latest.items(), key=lambda item: rounds[item[0]]):
        for name, key in (("accuracy", "accuracy"), ("escape rate", "escape-rate"), ("false-reject rate", "false-reject-rate")):
            if e.figures.get(key) is not None:
                out[name].append((float(rounds[version_id]), float(e.figures[key])))
    return out


def signature_status(v: Version, public_key_path: Path | None) -> str:
    if not v.signature:
        return "unsigned"
    if public_key_path is None or not public_key_path.exists():
        return "unknown key"
    try:
        verify_manifest(v.manifest.encode(), v.signature, load_public(public_key_path))
        return "valid"
    except VerificationError:
        return "invalid"


def version_detail(reg: Registry, version_id: str, public_key_path: Path | None) -> schemas.VersionDetail | None:
    v = reg.get_version(version_id)
    if v is None:
        return None
    evaluations = reg.evaluations(version_id=v.id)
    lineage, cursor = [], v
    while cursor is not None and len(lineage) < 10_000:
        lineage.append(version_out(cursor, evaluations[-1] if cursor is v and evaluations else None))
        cursor = reg.get_version(cursor.parent_id) if cursor.parent_id else None
    children = [version_out(c) for c in reg.versions() if c.parent_id == v.id]
    actions = [schemas.ActionOut(id=a.id, version_id=a.version_id, action=a.action, actor=a.actor, note=a.note, at=a.at)
               for a in reg.actions(version_id=v.id)]
    return schemas.VersionDetail(
        **version_out(v, evaluations[-1] if evaluations else None).model_dump(), manifest=json.loads(v.manifest) if v.manifest else {},
        signature_status=signature_status(v, public_key_path), lineage=lineage, children=children, actions=actions, participants=v.participants,
        privacy=v.privacy, metrics=v.metrics, model_input=v.model_input or {}, evaluations=[evaluation_out(e) for e in reversed(evaluations)],
    )


def factories(reg: Registry) -> list[schemas.FactoryOut]:
    all_runs = reg.runs()
    stats: dict[str, dict[str, Any]] = {}
    for run in all_runs:
        for r in reg.rounds(run.id):
            for name in r.participants:
                stats.setdefault(name, {"ok": 0, "failed": 0, "last_failure": ""})["ok"] += 1
            for name, reason in r.failures.items():
                s = stats.setdefault(name, {"ok": 0, "failed": 0, "last_failure": ""})
                s["failed"] += 1
                s["last_failure"] = reason
    latest_round = None
    if all_runs:
        rounds = reg.rounds(all_runs[-1].id)
        latest_round = rounds[-1] if rounds else None
    spent = latest_privacy(reg)
    out = []
    for name in sorted(stats):
        status = "idle"
        if latest_round is not None:
            status = "ok" if name in latest_round.participants else "failed" if name in latest_round.failures else "idle"
        p = spent.get(name, {})
        out.append(schemas.FactoryOut(name=name, status=status, rounds_participated=stats[name]["ok"], rounds_failed=stats[name]["failed"],
                                      last_failure=stats[name]["last_failure"][:300], epsilon_spent=p.get("epsilon-spent"), epsilon_max=p.get("epsilon-max")))
    return out


def latest_privacy(reg: Registry) -> dict[str, dict[str, float]]:
    latest: dict[str, dict[str, float]] = {}
    for v in reg.versions():
        for factory, p in (v.privacy or {}).items():
            latest[factory] = p
    return latest


def privacy(reg: Registry, history: bool = True) -> list[schemas.PrivacyOut]:
    by_factory: dict[str, list[schemas.PrivacyPoint]] = {}
    for v in reg.versions():
        for factory, p in (v.privacy or {}).items():
            if "epsilon-spent" in p:
                by_factory.setdefault(factory, []).append(schemas.PrivacyPoint(server_round=v.server_round, epsilon_spent=p["epsilon-spent"]))
    latest = latest_privacy(reg)
    return [schemas.PrivacyOut(factory=f, epsilon_max=latest[f].get("epsilon-max"), epsilon_spent=latest[f].get("epsilon-spent"),
                               subspace_dims=int(latest[f]["dp-subspace-dims"]) if "dp-subspace-dims" in latest[f] else None,
                               noise_holders=int(latest[f]["dp-noise-holders"]) if "dp-noise-holders" in latest[f] else None,
                               epsilon_alone=latest[f].get("epsilon-alone"), max_grad_norm=latest[f].get("dp-max-grad-norm"),
                               history=points if history else None)
            for f, points in sorted(by_factory.items())]


def overview(reg: Registry, admin_enabled: bool) -> schemas.Overview:
    all_runs = reg.runs()
    current = _run_out(reg, all_runs[-1]) if all_runs else None
    facs = factories(reg)
    approved = reg.current_approved()
    return schemas.Overview(current_run=current, factories_ok=sum(f.status == "ok" for f in facs), factories_failed=sum(f.status == "failed" for f in facs),
                            versions=reg.version_page(1, 0)[1], approved_version=approved.id if approved else None, admin_actions_enabled=admin_enabled)


def fingerprint(reg: Registry) -> str:
    """Changes whenever anything the pages show changes (what the live-update stream watches)."""
    all_runs = reg.runs()
    last = all_runs[-1] if all_runs else None
    actions = reg.actions()
    evaluations = reg.evaluations(run_id=last.id) if last else []
    return json.dumps([len(all_runs), last.status if last else "", len(reg.rounds(last.id)) if last else 0, len(reg.versions()),
                       actions[-1].id if actions else 0, len(evaluations)])


def prometheus(reg: Registry) -> str:
    lines = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[dict[str, str], float]]) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            label = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
            lines.append(f"{name}{{{label}}} {value}" if label else f"{name} {value}")

    rounds = [r for run in reg.runs() for r in reg.rounds(run.id)]
    completed = [r for r in rounds if r.status == "completed"]
    metric("fedforge_rounds_completed_total", "counter", "Rounds that produced a model.", [({}, len(completed))])
    metric("fedforge_rounds_aborted_total", "counter", "Rounds aborted below the minimum of factories.", [({}, len(rounds) - len(completed))])
    last = rounds[-1] if rounds else None
    metric("fedforge_round_duration_seconds", "gauge", "Wall time of the latest round.", [({}, last.seconds if last else 0.0)])
    metric("fedforge_round_participants", "gauge", "Factories in the latest round's aggregate.", [({}, len(last.participants) if last else 0)])
    metric("fedforge_factory_failures_total", "counter", "Factory failures across rounds.", [({}, sum(len(r.failures) for r in rounds))])
    metric("fedforge_bytes_received_total", "counter", "Update bytes received from factories (masked vectors when secure).",
           [({}, sum(float(r.metrics.get("bytes-received", 0.0)) for r in rounds))])
    versions = reg.versions()
    metric("fedforge_versions_created_total", "counter", "Model versions written to the registry.", [({}, len(versions))])
    metric("fedforge_model_bytes_total", "counter", "Bytes of model versions stored.", [({}, sum(v.size_bytes for v in versions))])
    metric("fedforge_latest_accuracy", "gauge", "Central accuracy of the latest completed round.", [({}, completed[-1].accuracy if completed else 0.0)])
    spend = latest_privacy(reg)
    metric("fedforge_privacy_epsilon_spent", "gauge", "Privacy budget spent per factory.",
           [({"factory": f}, p.get("epsilon-spent", 0.0)) for f, p in sorted(spend.items())])
    metric("fedforge_privacy_epsilon_max", "gauge", "Privacy budget per factory.", [({"factory": f}, p.get("epsilon-max", 0.0)) for f, p in sorted(spend.items())])
    return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
