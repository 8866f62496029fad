"""FedForge ServerApp: reads the run config and hands the grid to `Federation`."""

from __future__ import annotations

import logging
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from common.flower_waits import shorten_object_pull_backoff
from server.federation import Federation, FederationConfig

app = ServerApp()


def _log_to_registry(registry_dir: str) -> None:
    """Server logs also go to ``<registry>/server.log``: the SuperLink runs us as a subprocess."""
    directory = Path(registry_dir or "fedforge-registry").resolve()
    directory.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(directory / "server.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("fedforge")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = FederationConfig.from_run_config(dict(context.run_config))
    _log_to_registry(cfg.registry_dir)
    shorten_object_pull_backoff()  # replies' objects: poll from 50 ms, not Flower's 1 s
    Federation(grid, cfg, flwr_run_id=str(context.run_id)).run()
