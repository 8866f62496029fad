"""Schema migrations (Alembic), applied when a registry is opened: every database is at head."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect
from sqlalchemy.engine import Engine

MIGRATIONS = Path(__file__).parent / "migrations"


class SchemaError(RuntimeError):
    """The database holds tables Alembic did not create; refuse rather than guess."""


def _config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    return cfg


def head() -> str:
    return ScriptDirectory.from_config(_config()).get_current_head() or ""


def upgrade(engine: Engine) -> None:
    with engine.begin() as connection:
        current = MigrationContext.configure(connection).get_current_revision()
        if current == head():
            return
        if current is None and inspect(connection).get_table_names():
            raise SchemaError(f"{engine.url.render_as_string(hide_password=True)} has tables but no migration history; "
                              "it was not created by this FedForge version. Point --registry-dir at a new directory.")
        cfg = _config()
        cfg.attributes["connection"] = connection
        try:
            command.upgrade(cfg, "head")
        except Exception:
            # Another process (the ServerApp, the dashboard) may have migrated the same database
            # between our check and our upgrade; that is success, anything else is not.
            with engine.connect() as again:
                if MigrationContext.configure(again).get_current_revision() != head():
                    raise
