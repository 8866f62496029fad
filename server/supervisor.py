"""Keeps a federation going across crashes of the central site.

Flower has no resume: a run whose SuperLink or ServerApp dies ends as failed. The supervisor (run by
``fedforge server --rounds N``) submits the federation, watches it, and when a run ends without
FedForge having recorded its end, marks it ``interrupted`` in the registry and submits a new run that
continues from the last complete version (rounds keep their numbers, none is counted twice) until
version N exists.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from server import launch
from server.registry.service import Registry

log = logging.getLogger("fedforge.supervisor")


class FederationSupervisor(threading.Thread):
    def __init__(self, registry: Registry, home: Path, rounds: int, run_config: dict[str, Any], poll_seconds: float = 2.0) -> None:
        super().__init__(daemon=True, name="fedforge-supervisor")
        self.registry, self.home, self.rounds, self.run_config, self.poll = registry, home, rounds, run_config, poll_seconds
        self.active: str | None = None
        self.finished = threading.Event()
        self.stop_event = threading.Event()

    def last_version(self) -> Any:
        versions = self.registry.versions()
        return max(versions, key=lambda v: (v.server_round, v.created_at)) if versions else None

    def run(self) -> None:
        while not self.stop_event.is_set() and not self.finished.is_set():
            try:
                self._tick()
            except Exception as exc:  # noqa: BLE001 - a SuperLink that is restarting; try again
                log.warning("federation supervisor: %s", exc)
            self.stop_event.wait(self.poll)

    def _tick(self) -> None:
        if self.active is None:
            last = self.last_version()
            if last is not None and last.server_round >= self.rounds:
                log.info("federation complete: version %s is round %d of %d", last.id, last.server_round, self.rounds)
                self.finished.set()
                return
            config = {**self.run_config, "num-server-rounds": self.rounds, "resume-from": last.id if last is not None else ""}
            self.active = launch.submit_run(self.home, config)
            log.info("submitted run %s (from %s)", self.active, f"version {last.id}, round {last.server_round}" if last else "scratch")
            return
        run = self.registry.get_run(f"run-{self.active}")
        if run is not None and run.status != "running":
            log.info("run %s ended: %s", self.active, run.status)
            self.active = None
            return
        status = launch.run_status(self.home, self.active)
        if status.startswith("finished"):
            # Flower ended the run (SuperLink restarted, ServerApp killed) before FedForge recorded its end.
            if run is not None:
                self.registry.finish_run(run.id, "interrupted", f"Flower run ended as {status}; the federation resumes from the last version")
            log.warning("run %s was interrupted (%s); resuming", self.active, status)
            self.active = None

    def stop(self) -> None:
        self.stop_event.set()
