"""``vpool-coordinator``: serve the pool, add users, initialise the state directory."""

from __future__ import annotations

import logging
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import click
import trio

from vpool.config import SettingsError
from vpool.coordinator import keys
from vpool.coordinator.errors import CoordinatorError
from vpool.coordinator.settings import CoordinatorSettings, load
from vpool.coordinator.sqlite_store import SqliteStore
from vpool.protocol import api
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
@click.option(
    "--operator", is_flag=True, help="Also let the user see the whole pool (agents, relays, jobs)."
)
@config_option
def user_add(name: str, operator: bool, config: Path | None) -> None:
    """Create user NAME and print a new API token for it (shown only once).

    The token signs in to the web portal and is what `vsdk` uses; the user can make more
    tokens and revoke them on the portal's account page.

    \b
    Example:
      vpool-coordinator user add alice --config pool.toml
      vpool-coordinator user add ops --operator --config pool.toml
    """
    if not USER_NAME.fullmatch(name):
        raise click.ClickException(
            f"{name!r} is not a user name (letters, digits, _ . @ -; at most 64)"
        )
    token, token_hash = keys.new_api_token()
    with _store(config) as store:
        store.add_user(name, token_hash, time.time(), role="operator" if operator else "user")
    click.echo(token)


@user.command("token")
@click.argument("name")
@click.option("--label", default="", help="What the token is for (shown on the account page).")
@config_option
def user_token(name: str, label: str, config: Path | None) -> None:
    """Print a new API token for existing user NAME (for a user who lost theirs).

    \b
    Example:
      vpool-coordinator user token alice --label laptop --config pool.toml
    """
    token, token_hash = keys.new_api_token()
    with _store(config) as store:
        store.create_token(name, token_hash, label or "made by an operator", time.time())
    click.echo(token)


@user.command("role")
@click.argument("name")
@click.argument("role", type=click.Choice(api.ROLES))
@config_option
def user_role(name: str, role: api.Role, config: Path | None) -> None:
    """Make user NAME a plain user or an operator.

    \b
    Example:
      vpool-coordinator user role alice operator --config pool.toml
    """
    with _store(config) as store:
        store.set_role(name, role)
    click.echo(f"{name} is now {'an' if role == 'operator' else 'a'} {role}")


@user.command("list")
@config_option
def user_list(config: Path | None) -> None:
    """List the users, their roles and how many live tokens each has."""
    with _store(config) as store:
        rows = store.list_users()
    for row in rows:
        click.echo(f"{row['name']}\t{row['role']}\t{row['tokens']} token(s)")


@contextmanager
def _store(config: Path | None) -> Iterator[SqliteStore]:
    """The store, with store errors (unknown user, ...) as click errors."""
    store = _open(_settings(config))
    try:
        yield store
    except CoordinatorError as exc:
        raise click.ClickException(exc.message) from exc
    finally:
        store.close()


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
