"""Keeps a federation going across crashes of the central site.

Flower has no resume: a run whose SuperLink or ServerApp dies ends as failed. The supervisor (run by
``fedforge server --rounds N``) submits the federation, watches it, and when a run ends without
FedForge having recorded its end, marks it ``interrupted`` in the registry and submits a new run that
continues from the last complete version (rounds keep their numbers, none is counted twice) until
version N exists.

A ServerApp that dies is noticed by Flower only when its heartbeat lapses (30 s interval, patience 2:
about a minute). The ServerApp records its process identity in its registry run (`SERVERAPP_KEY`);
when that process is gone from this host, the supervisor stops the Flower run and resumes at once.

Every run that ends without finishing is stopped in Flower too, retried until the SuperLink takes it:
a restarted SuperLink keeps the run of its dead ServerApp ``running`` until that heartbeat lapses, and
until then a SuperNode that was receiving one of its messages when the SuperLink died keeps retrying
the message's lost objects and takes no other message (measured: factory's first message of the
resumed run 46 s late).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from common.procs import process_gone
from server import launch
from server.registry.service import Registry

log = logging.getLogger("fedforge.supervisor")
SERVERAPP_KEY = "serverapp-process"  # in a run's registry config: host, pid and start time of its ServerApp


class FederationSupervisor(threading.Thread):
    def __init__(self, registry: Registry, home: Path, rounds: int, run_config: dict[str, Any], poll_seconds: float = 2.0) -> None:
        super().__init__(daemon=True, name="fedforge-supervisor")
        self.registry, self.home, self.rounds, self.run_config, self.poll = registry, home, rounds, run_config, poll_seconds
        self.active: str | None = None
        self.unstopped: set[str] = set()  # Flower runs that ended in FedForge but that the SuperLink has not stopped yet
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
        self._stop_unstopped()
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
            if run.status != "finished":
                self._stop_in_flower(self.active)
            self.active = None
            return
        if run is not None and process_gone(run.config.get(SERVERAPP_KEY)):
            log.warning("run %s: its ServerApp (pid %s) is gone; stopping the Flower run and resuming", self.active,
                        run.config[SERVERAPP_KEY].get("pid"))
            self._stop_in_flower(self.active)
            self.registry.finish_run(run.id, "interrupted", "the ServerApp process died; the federation resumes from the last version")
            self.active = None
            return
        status = launch.run_status(self.home, self.active)
        if status.startswith("finished"):
            # Flower ended the run (SuperLink restarted, ServerApp killed) before FedForge recorded its end.
            if run is not None:
                self.registry.finish_run(run.id, "interrupted", f"Flower run ended as {status}; the federation resumes from the last version")
            log.warning("run %s was interrupted (%s); resuming", self.active, status)
            self.active = None

    def _stop_in_flower(self, run_id: str) -> None:
        """Stop ``run_id`` in Flower now, or on a later tick if the SuperLink cannot take it yet."""
        self.unstopped.add(run_id)
        self._stop_unstopped()

    def _stop_unstopped(self) -> None:
        """Stop in Flower the runs that ended in FedForge (see the module's docstring); the ones the SuperLink cannot take
        yet (it is restarting) are tried again on the next tick, and a run Flower has ended already counts as stopped."""
        for run_id in sorted(self.unstopped):
            try:
                launch.stop_run(self.home, run_id)
            except Exception as exc:  # noqa: BLE001 - a SuperLink that is restarting, or a run Flower has ended
                if not launch.run_status(self.home, run_id).startswith("finished"):
                    log.info("run %s: the SuperLink has not taken its stop yet; trying again", run_id)
                    log.debug("flwr stop %s: %s", run_id, exc)
                    continue
            log.info("run %s stopped in Flower", run_id)
            self.unstopped.discard(run_id)

    def stop(self) -> None:
        self.stop_event.set()
