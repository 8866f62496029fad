"""The ``fedforge`` command. Sub-commands live beside the code they drive and load lazily.

Options come from flags, then ``FEDFORGE_<COMMAND>_<OPTION>`` environment variables, then the
``[<command>]`` table of a TOML file given with ``--config`` (or ``FEDFORGE_CONFIG``), then defaults.
"""

from __future__ import annotations

import importlib
import logging
import sys
import tomllib
from typing import Any

import click

# name -> "module:attribute"; modules are imported only when their command runs, so
# ``fedforge client`` never imports the server and ``--help`` stays fast.
COMMANDS: dict[str, str] = {
    "demo": "server.demo:demo",
    "server": "server.cli:server",
    "run": "server.cli:run",
    "keys": "server.models_cli:keys",
    "dashboard": "server.cli:dashboard",
    "certs": "server.cli:certs",
    "factories": "server.cli:factories",
    "client": "client.cli:client",
    "agent": "client.cli:agent",
}

# `fedforge models ...`: central-site operations and edge-side ones under one group.
MODEL_COMMANDS: dict[str, str] = {
    "ls": "server.models_cli:models_ls",
    "approve": "server.models_cli:models_approve",
    "revoke": "server.models_cli:models_revoke",
    "rollback": "server.models_cli:models_rollback",
    "export": "server.models_cli:models_export",
    "pull": "client.models_cli:models_pull",
    "verify": "client.models_cli:models_verify",
}


QUIET_LIBRARIES = ("alembic", "sqlalchemy", "httpx", "httpcore", "uvicorn", "flwr", "opacus", "asyncio", "PIL", "urllib3", "selenium")


class LazyGroup(click.Group):
    """A group whose sub-commands are "module:attribute" strings, imported only when used."""

    def __init__(self, *args: Any, commands: dict[str, str] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy = commands if commands is not None else COMMANDS

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.lazy, *self.commands})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self.commands:
            return self.commands[name]
        target = self.lazy.get(name)
        if target is None:
            return None
        module, attr = target.split(":")
        return getattr(importlib.import_module(module), attr)


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


@cli.group(cls=LazyGroup, commands=MODEL_COMMANDS)
def models() -> None:
    """List, approve, revoke and roll back model versions (central); pull and verify them (edge)."""


def main() -> None:
    sys.exit(cli.main(auto_envvar_prefix="FEDFORGE", standalone_mode=True))


if __name__ == "__main__":
    main()
