"""The ``fedforge`` command root. Sub-commands live beside the code they drive, are declared as entry
points in pyproject.toml, and load lazily.

Options come from flags, then ``FEDFORGE_<COMMAND>_<OPTION>`` environment variables, then the
``[<command>]`` table of a TOML file given with ``--config`` (or ``FEDFORGE_CONFIG``), then defaults.
"""

from __future__ import annotations

import logging
import sys
import tomllib
from typing import Any

import click

# The sub-commands are declared where packaging declares everything: pyproject.toml's
# [project.entry-points."fedforge.commands"] (and "fedforge.models.commands" for `fedforge models ...`).
# This module knows no server or client module; each command's module is imported only when it runs,
# so ``fedforge client`` never imports the server and ``--help`` stays fast.
COMMAND_GROUP = "fedforge.commands"
MODEL_COMMAND_GROUP = "fedforge.models.commands"


def declared_commands(group: str) -> dict[str, Any]:
    """{name: entry point} of the commands installed in ``group``."""
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=group)}


QUIET_LIBRARIES = ("alembic", "sqlalchemy", "httpx", "httpcore", "uvicorn", "flwr", "opacus", "asyncio", "PIL", "urllib3", "selenium")


class LazyGroup(click.Group):
    """A group whose sub-commands are entry points of ``entry_point_group``, loaded only when used."""

    def __init__(self, *args: Any, entry_point_group: str = COMMAND_GROUP, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.entry_point_group = entry_point_group

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*declared_commands(self.entry_point_group), *self.commands})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self.commands:
            return self.commands[name]
        entry = declared_commands(self.entry_point_group).get(name)
        return entry.load() if entry is not None else None


def load_toml_defaults(path: str | None) -> dict[str, Any]:
    if not path:
        return {}
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise click.BadParameter(f"config file {path} does not exist", param_hint="--config") from None
    except tomllib.TOMLDecodeError as exc:
        raise click.BadParameter(f"config file {path} is not valid TOML: {exc}", param_hint="--config") from None
    return {cmd: {k.replace("-", "_"): v for k, v in table.items()} for cmd, table in data.items() if isinstance(table, dict)}


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--config", "config_path", envvar="FEDFORGE_CONFIG", type=click.Path(dir_okay=False), help="TOML file with a [command] table of options.")
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
@click.version_option(package_name="fedforge")
@click.pass_context
def cli(ctx: click.Context, config_path: str | None, verbose: bool) -> None:
    """FedForge: federated learning for visual inspection across factories."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not verbose:  # libraries speak only when something is wrong; FedForge's own progress stays at INFO
        for name in QUIET_LIBRARIES:
            logging.getLogger(name).setLevel(logging.WARNING)
    ctx.default_map = load_toml_defaults(config_path)


@cli.group(cls=LazyGroup, entry_point_group=MODEL_COMMAND_GROUP)
def models() -> None:
    """List, approve, revoke and roll back model versions (central); pull and verify them (edge)."""


def main() -> None:
    sys.exit(cli.main(auto_envvar_prefix="FEDFORGE", standalone_mode=True))


if __name__ == "__main__":
    main()
