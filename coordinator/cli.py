"""``vpool-coordinator``: serve the pool, add users, initialise the state directory."""

from __future__ import annotations

import datetime as dt
import logging
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import click
import trio

from vpool import paths, sizes
from vpool.config import SettingsError
from vpool.coordinator import keys, pooldir
from vpool.coordinator.errors import CoordinatorError
from vpool.coordinator.service import agent_info
from vpool.coordinator.settings import CoordinatorSettings, load
from vpool.coordinator.sqlite_store import SqliteStore
from vpool.protocol import api, pki
from vpool.protocol.tokens import public_key_text
from vpool.readyfile import Ready, ready_options

USER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}")
config_option = click.option(
    "--config",
    type=click.Path(dir_okay=False, path_type=Path),
    help="TOML settings file (see docs/configuration.md); default: the one `init "
    "--public-url` wrote when given no --dir, if any.",
)


def _config_file(config: Path | None) -> Path | None:
    """``--config``, else the settings of the pool ``init`` made in the default directory."""
    if config is not None:
        return config
    default = pooldir.PoolDir(pooldir.default_dir()).settings
    return default if default.exists() else None


def _settings(config: Path | None, **overrides: object) -> CoordinatorSettings:
    config = _config_file(config)
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
      vpool-coordinator init --public-url https://pool.example.org:8443 --dir /srv/pool
      vpool-coordinator relay add relay-1 --address relay1.example.org:7700 \\
          --config /srv/pool/coordinator.toml
      vpool-coordinator join-token create --uses 10 --config /srv/pool/coordinator.toml
      vpool-coordinator user add alice --config /srv/pool/coordinator.toml
      vpool-coordinator serve --config /srv/pool/coordinator.toml

    docs/operating.md walks through a pool of several machines.
    """


@main.command()
@config_option
@ready_options("{host, port, pid, url}")
@click.option("--host", help="Address to listen on (overrides the settings).")
@click.option("--port", type=int, help="Port to listen on; 0 picks a free one.")
def serve(config: Path | None, ready: Ready, host: str | None, port: int | None) -> None:
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
        trio.run(run_server, settings, ready)
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
    settings = _settings(config)
    with _store(config) as store:
        info = store.create_join_token(token_hash, label, now, uses=uses, expires=until)
    click.echo(token)
    admits = "any number of agents" if uses is None else f"{uses} agent(s)"
    click.echo(f"join token {info.id}: admits {admits}, expires {_when(until)}", err=True)
    click.echo("\n".join(_join_command(settings, token)), err=True)


def _join_command(settings: CoordinatorSettings, token: str) -> list[str]:
    """What a volunteer runs to join with ``token``, and what to fill in if the settings do not
    say it (no public_url; no tls_ca, or one that cannot be read)."""
    url = settings.public_url or "https://HOST:PORT"
    notes = []
    if not settings.public_url:
        notes.append("  (no public_url is set: HOST:PORT is where volunteers reach this pool)")
    ca = ""
    if url.startswith("https:"):
        try:
            ca = f" --ca-sha256 {pki.fingerprint(Path(settings.tls_ca).read_bytes())}"
        except (OSError, ValueError):
            ca = " --ca ca.pem"
            notes.append(
                "  (tls_ca does not name the pool CA: give volunteers its ca.pem; with tls_ca "
                "set, --ca-sha256 lets them fetch it from the coordinator)"
            )
    return [
        'On a volunteer\'s machine (pip install "vpool[agent]", bubblewrap), it joins with:',
        f"  vpool-agent join {url} {token}{ca}",
        *notes,
    ]


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
@click.option(
    "--address",
    metavar="HOST:PORT",
    help="Where agents reach the relay: also write its bundle (a certificate for HOST from "
    "the pool CA, the CA, settings with the key) instead of printing the key.",
)
@click.option(
    "--bundle",
    type=click.Path(file_okay=False, path_type=Path),
    help="Directory of the bundle (default: relays/NAME next to the settings file).",
)
@click.option(
    "--install-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Where the bundle goes on the relay machine; its settings name their files there "
    f"(default: {pooldir.RELAY_INSTALL_DIR}, as packaging/vpool-relay.service expects).",
)
@config_option
def relay_add(
    name: str,
    rotate: bool,
    address: str | None,
    bundle: Path | None,
    install_dir: Path | None,
    config: Path | None,
) -> None:
    """Make a key for relay NAME: print it (shown only once), or with --address write the
    relay's whole bundle.

    The relay presents the key to the coordinator and may then speak for relay NAME only:
    register as NAME and report lost ranks, divergence and checkpoint images of the jobs it
    serves. --address needs the pool made by `init --public-url`.

    \b
    Example:
      vpool-coordinator relay add relay-eu-1 --config pool.toml
      vpool-coordinator relay add relay-eu-1 --address relay1.example.org:7700 \\
          --config /srv/pool/coordinator.toml
    """
    if not RELAY_NAME.fullmatch(name):
        raise click.ClickException(
            f"{name!r} is not a relay name (letters, digits, _ . -; at most 64)"
        )
    if address is None:
        if bundle is not None or install_dir is not None:
            raise click.UsageError("--bundle and --install-dir go with --address")
        key, key_hash = keys.new_api_token(keys.RELAY_PREFIX)
        with _store(config) as store:
            store.add_relay_key(name, key_hash, time.time(), replace=rotate)
        click.echo(key)
        return
    _relay_bundle(name, address, rotate, bundle, install_dir, config)


def _relay_bundle(
    name: str,
    address: str,
    rotate: bool,
    bundle: Path | None,
    install_dir: Path | None,
    config: Path | None,
) -> None:
    config = _config_file(config)
    if config is None:
        raise click.ClickException(
            "--address needs the pool made by `vpool-coordinator init --public-url "
            f"https://HOST:PORT`, and there is none in {pooldir.default_dir()}: give that "
            f"pool's {pooldir.SETTINGS_FILE} as --config"
        )
    install = install_dir or pooldir.RELAY_INSTALL_DIR
    if not install.is_absolute():
        raise click.BadParameter("must be an absolute path", param_hint="--install-dir")
    settings = _settings(config)
    pool = pooldir.PoolDir(config.absolute().parent)
    target = (bundle or pool.relay_bundle(name)).absolute()
    with _click_errors():
        host, port = pooldir.split_host_port(address)
        pooldir.check_relay_bundle(pool, config, settings.public_url, target, replace=rotate)
    key, key_hash = keys.new_api_token(keys.RELAY_PREFIX)
    with _store(config) as store:
        store.add_relay_key(name, key_hash, time.time(), replace=rotate)
    try:
        made = pooldir.make_relay_bundle(
            pool,
            name=name,
            address=(host, port),
            relay_key=key,
            coordinator_url=settings.public_url,
            bundle=target,
            install_dir=install,
            now=dt.datetime.now(dt.UTC),
        )
    except OSError as exc:
        raise click.ClickException(
            f"relay {name}'s key is made, but its bundle could not be written ({exc}): "
            "run again with --rotate"
        ) from exc
    _echo_lines(
        f"relay {name}: bundle written to {made.dir}",
        "  relay.toml          its settings, with its key (keep it private)",
        f"  cert.pem, key.pem   its certificate for {host}, from the pool CA",
        "  ca.pem              the pool CA (the relay checks the coordinator with it)",
        f"Next, on {host}:",
        f"  1. copy the directory to {made.install_dir} (the settings name their files "
        "there), owned by the user the relay runs as",
        "  2. start it: systemctl enable --now vpool-relay (packaging/vpool-relay.service), "
        f"or vpool-relay --config {made.install_dir / pooldir.RELAY_SETTINGS_FILE}",
        f"  3. let volunteers' machines reach TCP port {port} there",
    )


@main.group()
def cert() -> None:
    """The coordinator's TLS certificate."""


@cert.command("renew")
@config_option
def cert_renew(config: Path | None) -> None:
    """Make the coordinator a new certificate (and key) from the pool CA, for the host of its
    public_url: before the old one expires (825 days), or for a pool made before 2026-11-26,
    whose certificates lack what strict verification needs (agents on Python 3.13, and every
    agent since, refuse them). Volunteers and users keep their ca.pem. Relays get theirs with
    `relay add NAME --address HOST:PORT --rotate`. Restart the coordinator afterwards."""
    config = _config_file(config)
    if config is None:
        raise click.ClickException(
            f"no pool made by `init --public-url` in {pooldir.default_dir()}: give its "
            f"{pooldir.SETTINGS_FILE} as --config"
        )
    settings = _settings(config)
    pool = pooldir.PoolDir(config.absolute().parent)
    with _click_errors():
        host = pooldir.renew_coordinator_cert(
            pool, settings.public_url, now=dt.datetime.now(dt.UTC)
        )
    _echo_lines(
        f"new certificate for {host} in {pool.cert} (key {pool.key})",
        "Next: restart the coordinator (systemctl restart vpool-coordinator)",
    )


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
    """List the agents: id, name, state (alive, lost, gone: it left cleanly, banned), what its
    volunteer lets it do now (available, busy, suspended: why, leaving), slots, ranks running,
    last seen, join token, and its record in validation by replay (agreed in all, in a row,
    found wrong)."""
    with _store(config) as store:
        rows = store.list_agents()
    click.echo(
        "id\tname\tstate\tactivity\tslots\tranks\tlast seen\tjoin token\tagreed\tin a row\twrong"
    )
    for r in rows:
        state = f"banned ({r['banned']})" if r["state"] == "banned" else r["state"]
        token = "-" if r["join_token"] is None else str(r["join_token"])
        doing = agent_info(r).doing()
        click.echo(
            f"{r['id']}\t{r['name']}\t{state}\t{doing}\t{r['slots']}\t{r['active']}\t"
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
def _click_errors() -> Iterator[None]:
    """Coordinator errors (unknown user, a pool there already, ...) as click errors."""
    try:
        yield
    except CoordinatorError as exc:
        raise click.ClickException(exc.message) from exc


@contextmanager
def _store(config: Path | None) -> Iterator[SqliteStore]:
    """The store, with store errors as click errors."""
    store = _open(_settings(config))
    try:
        with _click_errors():
            yield store
    finally:
        store.close()


def _echo_lines(*lines: str) -> None:
    click.echo("\n".join(lines))


@main.command()
@click.option(
    "--public-url",
    metavar="https://HOST[:PORT]",
    help="Make a new pool whose coordinator clients reach at this URL (HOST: a DNS name or "
    "an IP address, which its certificate names).",
)
@click.option(
    "--dir",
    "dir_",
    type=click.Path(file_okay=False, path_type=Path),
    help="Directory of the new pool's files, its state in DIR/state (default: "
    "coordinator/ in vpool's config directory, the state in vpool's state directory).",
)
@click.option("--pool-name", help="Name of the new pool, shown to users and volunteers.")
@click.option("--host", help="Address the new pool's coordinator listens on (0.0.0.0).")
@click.option("--force", is_flag=True, help="Replace the CA, certificates and settings of a pool.")
@config_option
def init(
    public_url: str | None,
    dir_: Path | None,
    pool_name: str | None,
    host: str | None,
    force: bool,
    config: Path | None,
) -> None:
    """Make a new pool (--public-url), or the state of the pool a settings file describes.

    With --public-url: the pool's CA (its key stays here, readable by you only), the
    coordinator's certificate for the URL's host, the settings, the database and the signing
    key, in DIR; then says what to do next. An existing pool is replaced only with --force
    (which keeps its database: users, join tokens, relay keys).

    With --config alone: the state directory, the database and the signing key.

    \b
    Example:
      vpool-coordinator init --public-url https://pool.example.org:8443 --dir /srv/pool
      vpool-coordinator init --public-url https://192.0.2.10:8443 --pool-name physics
      vpool-coordinator init --config pool.toml
    """
    if public_url is None:
        if dir_ is not None or pool_name is not None or host is not None or force:
            raise click.UsageError("--dir, --pool-name, --host and --force go with --public-url")
        settings = _settings(config)
        _echo_lines(*_init_state(settings))
        return
    if config is not None:
        raise click.UsageError(
            "--config names the settings of a pool that exists; a new pool's go in --dir"
        )
    pool = pooldir.PoolDir((dir_ or pooldir.default_dir()).absolute())
    state = pool.root / "state" if dir_ else paths.state_dir() / "coordinator"
    with _click_errors():
        written = pooldir.make_pool(
            pool,
            public_url=public_url,
            host=host or "0.0.0.0",
            pool_name=pool_name or "vpool",
            state_dir=state,
            now=dt.datetime.now(dt.UTC),
            force=force,
        )
    settings = _settings(pool.settings)
    conf = f"--config {pool.settings}"
    url_host, _ = pooldir.parse_public_url(public_url)
    _echo_lines(
        f"pool {settings.pool_name} made in {pool.root}:",
        f"  {pool.settings.name}    settings: listens on {written['host']}:{written['port']}, "
        f"public_url {written['public_url']}",
        "  ca.pem              the pool CA: relays, volunteers and users need it",
        "  ca.key              the CA's key (mode 0600): signs the servers' certificates, "
        "never copy it",
        f"  cert.pem, key.pem   the coordinator's certificate for {url_host}",
        *_init_state(settings),
        "Next:",
        f"  vpool-coordinator relay add relay-1 --address RELAY-HOST:7700 {conf}",
        "      (a bundle to copy to the relay machine; one per relay)",
        f"  vpool-coordinator join-token create --uses 10 --expires 7d {conf}",
        "      (for volunteers: it prints the `vpool-agent join` command their machines run)",
        f"  vpool-coordinator user add alice --operator {conf}",
        "  start the coordinator: systemctl enable --now vpool-coordinator "
        f"(packaging/vpool-coordinator.service), or vpool-coordinator serve {conf}",
        f"  let relays, volunteers and users reach TCP port {written['port']} here",
    )


def _init_state(settings: CoordinatorSettings) -> list[str]:
    """Create the state directory, the database and the signing key; say what they are."""
    store = _open(settings)
    version = store.schema_version
    store.close()
    key = keys.load_or_create_signing_key(settings.state_path() / "signing.key")
    return [
        f"state directory: {settings.state_path()}",
        f"schema version:  {version}",
        f"signing key:     {public_key_text(key.public_key())}",
    ]


def _open(settings: CoordinatorSettings) -> SqliteStore:
    state = settings.state_path()
    state.mkdir(parents=True, exist_ok=True)
    return SqliteStore(state / "vpool.db")


if __name__ == "__main__":
    sys.exit(main())
