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

from vpool import sizes
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
      vpool-coordinator relay add relay-1 --config pool.toml
      vpool-coordinator join-token create --uses 10 --config pool.toml
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


# -- join tokens ------------------------------------------------------------------------------


def parse_duration(text: str) -> float:
    """Seconds in "90", "30m", "12h", "7d" or "2w" (``sizes.parse_duration``)."""
    try:
        return sizes.parse_duration(text)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc


def _when(t: float | None, never: str = "never") -> str:
    return never if t is None else time.strftime("%Y-%m-%d %H:%M", time.localtime(t))


@main.group("join-token")
def join_token() -> None:
    """Join tokens: what a volunteer needs to enroll an agent in this pool.

    Enrollment is closed unless open_enrollment is set: an agent whose key the pool has not
    seen enrolls with a join token (the agent's join_token setting) and consumes one of its
    uses; from then on its key is its credential.
    """


@join_token.command("create")
@click.option("--uses", type=click.IntRange(min=1), help="Agents it may admit (default: any).")
@click.option("--expires", help="How long it stays valid: 30m, 12h, 7d, 2w (default: for ever).")
@click.option("--label", default="", help="Who or what it is for (shown by `join-token list`).")
@config_option
def join_token_create(
    uses: int | None, expires: str | None, label: str, config: Path | None
) -> None:
    """Print a new join token (shown only once).

    \b
    Example:
      vpool-coordinator join-token create --uses 10 --expires 7d --label "lab machines"
    """
    now = time.time()
    until = now + parse_duration(expires) if expires else None
    token, token_hash = keys.new_api_token(keys.JOIN_PREFIX)
    with _store(config) as store:
        info = store.create_join_token(token_hash, label, now, uses=uses, expires=until)
    click.echo(token)
    admits = "any number of agents" if uses is None else f"{uses} agent(s)"
    click.echo(f"join token {info.id}: admits {admits}, expires {_when(until)}", err=True)


@join_token.command("list")
@config_option
def join_token_list(config: Path | None) -> None:
    """List the join tokens: id, whether usable, uses left, agents admitted, expiry, label."""
    with _store(config) as store:
        infos = store.list_join_tokens(time.time())
    click.echo("id\tstate\tuses left\tused\texpires\tlabel")
    for i in infos:
        state = "revoked" if i.revoked is not None else "usable" if i.usable else "spent"
        left = "any" if i.uses_left is None else str(i.uses_left)
        click.echo(f"{i.id}\t{state}\t{left}\t{i.used}\t{_when(i.expires)}\t{i.label}")


@join_token.command("revoke")
@click.argument("token_id", type=click.IntRange(min=1, max=(1 << 63) - 1))
@config_option
def join_token_revoke(token_id: int, config: Path | None) -> None:
    """Revoke join token TOKEN_ID: it admits no more agents (those it admitted stay)."""
    with _store(config) as store:
        store.revoke_join_token(token_id, time.time())
    click.echo(f"join token {token_id} revoked")


# -- relays -----------------------------------------------------------------------------------

RELAY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


@main.group()
def relay() -> None:
    """The pool's relays: each has its own key, made here and set as its relay_key."""


@relay.command("add")
@click.argument("name")
@click.option("--rotate", is_flag=True, help="Replace the key of a relay that has one.")
@config_option
def relay_add(name: str, rotate: bool, config: Path | None) -> None:
    """Print a new key for relay NAME (shown only once).

    The relay presents it to the coordinator and may then speak for relay NAME only: register
    as NAME and report lost ranks, divergence and checkpoint images of the jobs it serves.

    \b
    Example:
      vpool-coordinator relay add relay-eu-1 --config pool.toml
    """
    if not RELAY_NAME.fullmatch(name):
        raise click.ClickException(
            f"{name!r} is not a relay name (letters, digits, _ . -; at most 64)"
        )
    key, key_hash = keys.new_api_token(keys.RELAY_PREFIX)
    with _store(config) as store:
        store.add_relay_key(name, key_hash, time.time(), replace=rotate)
    click.echo(key)


@relay.command("list")
@config_option
def relay_list(config: Path | None) -> None:
    """List the relays with a key: name, key state, relay state, address, last seen."""
    with _store(config) as store:
        rows = store.list_relay_keys()
    click.echo("name\tkey\tstate\taddress\tlast seen")
    for r in rows:
        key = "revoked" if r["revoked"] is not None else "live"
        where = f"{r['host']}:{r['port']}" if r["host"] else "-"
        state = r["state"] or "never registered"
        click.echo(f"{r['name']}\t{key}\t{state}\t{where}\t{_when(r['last_seen'], '-')}")


@relay.command("revoke")
@click.argument("name")
@config_option
def relay_revoke(name: str, config: Path | None) -> None:
    """Revoke relay NAME's key: the coordinator no longer hears from it, and it counts as
    down once its heartbeats are missed."""
    with _store(config) as store:
        store.revoke_relay_key(name, time.time())
    click.echo(f"relay {name}'s key revoked")


# -- agents -----------------------------------------------------------------------------------


@main.group()
def agent() -> None:
    """The pool's agents (volunteers' machines): list them, ban one."""


@agent.command("list")
@config_option
def agent_list(config: Path | None) -> None:
    """List the agents: id, name, state, slots, ranks running, last seen, join token, and
    its record in validation by replay (agreed in all, in a row, found wrong)."""
    with _store(config) as store:
        rows = store.list_agents()
    click.echo("id\tname\tstate\tslots\tranks\tlast seen\tjoin token\tagreed\tin a row\twrong")
    for r in rows:
        state = f"banned ({r['banned']})" if r["state"] == "banned" else r["state"]
        token = "-" if r["join_token"] is None else str(r["join_token"])
        click.echo(
            f"{r['id']}\t{r['name']}\t{state}\t{r['slots']}\t{r['active']}\t"
            f"{_when(r['last_seen'])}\t{token}\t{r['agreed']}\t{r['agreed_streak']}\t"
            f"{r['wrong']}"
        )


@agent.command("ban")
@click.argument("agent_")
@click.option("--reason", default="", help="Why (recorded, and told to the agent).")
@config_option
def agent_ban(agent_: str, reason: str, config: Path | None) -> None:
    """Ban AGENT (an id, or a name only one agent has).

    Its key can no longer enroll or heartbeat; the ranks it runs are lost and restarted on
    other agents, and every job it ran ranks of records that their results came from a
    banned agent.

    \b
    Example:
      vpool-coordinator agent ban agent-1f2e3d4c5b6a7988 --reason "forged output"
    """
    with _store(config) as store:
        row = store.ban_agent(agent_, reason, time.time())
    jobs = ", ".join(str(j) for j in row["affected"]) or "none"
    click.echo(
        f"agent {row['id']} ({row['name']}) banned; {row['lost']} rank(s) moved; "
        f"jobs it ran ranks of: {jobs}"
    )


@agent.command("unban")
@click.argument("agent_")
@config_option
def agent_unban(agent_: str, config: Path | None) -> None:
    """Lift the ban of AGENT: its key may enroll again."""
    with _store(config) as store:
        row = store.unban_agent(agent_)
    click.echo(f"agent {row['id']} ({row['name']}) may enroll again")


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
