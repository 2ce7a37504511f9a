"""``vpool-coordinator``: serve the pool, add users, initialise the state directory."""

from __future__ import annotations

import logging
import re
import sys
import time
from pathlib import Path

import click
import trio

from vpool.config import SettingsError
from vpool.coordinator import keys
from vpool.coordinator.errors import Conflict
from vpool.coordinator.settings import CoordinatorSettings, load
from vpool.coordinator.sqlite_store import SqliteStore
from vpool.protocol.tokens import public_key_text

USER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}")
config_option = click.option(
    "--config",
    type=click.Path(dir_okay=False, path_type=Path),
    help="TOML settings file (see docs/configuration.md).",
)


def _settings(config: Path | None, **overrides: object) -> CoordinatorSettings:
    if config is not None and not config.exists():
        raise click.ClickException(f"{config}: no such settings file")
    try:
        return load(config, **overrides)
    except SettingsError as exc:
        raise click.ClickException(str(exc)) from exc


@click.group()
def main() -> None:
    """The vpool coordinator: schedules mpi4py jobs onto volunteer agents.

    \b
    Example:
      vpool-coordinator init --config pool.toml
      vpool-coordinator user add alice --config pool.toml
      vpool-coordinator serve --config pool.toml
    """


@main.command()
@config_option
@click.option(
    "--ready-file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write {host, port, pid, url} as JSON here once listening.",
)
@click.option("--host", help="Address to listen on (overrides the settings).")
@click.option("--port", type=int, help="Port to listen on; 0 picks a free one.")
def serve(config: Path | None, ready_file: Path | None, host: str | None, port: int | None) -> None:
    """Serve the HTTPS API and the dashboard until SIGTERM.

    \b
    Example:
      vpool-coordinator serve --config pool.toml --port 0 --ready-file ready.json
    """
    from vpool.coordinator.serve import ServeError
    from vpool.coordinator.serve import serve as run_server

    settings = _settings(config, host=host, port=port)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        trio.run(run_server, settings, ready_file)
    except (ServeError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc


@main.group()
def user() -> None:
    """Manage the pool's users (the scientists who submit jobs)."""


@user.command("add")
@click.argument("name")
@config_option
def user_add(name: str, config: Path | None) -> None:
    """Create user NAME and print a new API token for it (shown only once).

    \b
    Example:
      vpool-coordinator user add alice --config pool.toml
    """
    if not USER_NAME.fullmatch(name):
        raise click.ClickException(
            f"{name!r} is not a user name (letters, digits, _ . @ -; at most 64)"
        )
    settings = _settings(config)
    store = _open(settings)
    token, token_hash = keys.new_api_token()
    try:
        store.add_user(name, token_hash, time.time())
    except Conflict as exc:
        raise click.ClickException(exc.message) from exc
    finally:
        store.close()
    click.echo(token)


@main.command()
@config_option
def init(config: Path | None) -> None:
    """Create the state directory, the database and the signing key.

    \b
    Example:
      vpool-coordinator init --config pool.toml
    """
    settings = _settings(config)
    store = _open(settings)
    version = store.schema_version
    store.close()
    key = keys.load_or_create_signing_key(settings.state_path() / "signing.key")
    click.echo(f"state directory: {settings.state_path()}")
    click.echo(f"schema version:  {version}")
    click.echo(f"signing key:     {public_key_text(key.public_key())}")


def _open(settings: CoordinatorSettings) -> SqliteStore:
    state = settings.state_path()
    state.mkdir(parents=True, exist_ok=True)
    return SqliteStore(state / "vpool.db")


if __name__ == "__main__":
    sys.exit(main())
