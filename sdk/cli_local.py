"""``vsdk local up|down|status``: a whole pool on this machine (see ``vpool.sdk.localpool``)."""

from __future__ import annotations

import click

from vpool import serverstack
from vpool.sdk import localpool
from vpool.sdk.cli_common import (
    Settings,
    VsdkGroup,
    exit_with,
    json_option,
    note,
    pass_settings,
    print_json,
)
from vpool.sdk.errors import LocalPoolError


@click.group(cls=VsdkGroup)
def local() -> None:
    """Run a whole pool (coordinator, relays, agents) on this machine, without root.

    \b
    Example:
      vsdk local up --agents 2 --relays 1
      vsdk submit examples/pi.py --ranks 8 --wait
      vsdk local down
    """


@local.command()
@click.option(
    "--agents",
    type=click.IntRange(min=1),
    default=localpool.DEFAULT_AGENTS,
    show_default=True,
    help="Number of worker agents.",
)
@click.option(
    "--relays",
    type=click.IntRange(min=1),
    default=localpool.DEFAULT_RELAYS,
    show_default=True,
    help="Number of relays.",
)
@click.option(
    "--slots",
    type=click.IntRange(min=1),
    default=localpool.DEFAULT_SLOTS,
    show_default=True,
    help="Rank slots per agent (a local pool may oversubscribe).",
)
@click.option("--force", is_flag=True, help="Stop a running local pool first.")
@click.option(
    "--fresh",
    is_flag=True,
    help="Start with no jobs (by default the jobs of the previous local pool are kept).",
)
@click.option(
    "--package-index",
    default="",
    metavar="URL",
    help="Package index the agents install jobs' requirements from (default: pip's own).",
)
@click.option(
    "--timeout",
    type=float,
    default=localpool.READY_TIMEOUT,
    show_default=True,
    help="Seconds each component may take to become ready.",
)
@click.option(
    "--timers",
    type=click.Choice(sorted(localpool.TIMERS)),
    default="production",
    show_default=True,
    help="Heartbeat, timeout and grace periods: a real pool's, or 'test' (a few times "
    "shorter: a frozen agent is replaced, a relay outage waited out, in seconds).",
)
@click.option(
    "--selftest-cache",
    default=None,
    metavar="FILE",
    help="File where the agents keep their sandbox selftest's findings and reuse them while "
    "nothing they depend on changed (default: local-pool-selftest.json in vpool's cache "
    "directory; '' probes at every start).",
)
@json_option
@pass_settings
def up(
    settings: Settings,
    agents: int,
    relays: int,
    slots: int,
    force: bool,
    fresh: bool,
    package_index: str,
    timeout: float,
    timers: str,
    selftest_cache: str | None,
    as_json: bool,
) -> None:
    """Start a local pool in the background and point vsdk at it.

    Makes a CA and certificates, starts a coordinator, RELAYS relays and AGENTS agents on
    127.0.0.1 (logs in the pool directory's logs/), creates the user "local" and writes the
    client config, so the next `vsdk submit` runs there. Exits 1 if a pool is already running.
    The jobs of the previous local pool are kept (`vsdk jobs`, `vsdk results` still work; any
    it left unfinished are cancelled); --fresh starts with none.

    \b
    Example:
      vsdk local up --agents 3 --relays 2
      vsdk local up --agents 4 --timers test   # then kill an agent: replaced in ~5 s
    """
    try:
        serverstack.require("vsdk local up")
    except serverstack.MissingServerStack as exc:
        raise LocalPoolError(str(exc)) from exc
    started = localpool.up(
        agents=agents,
        relays=relays,
        slots=slots,
        force=force,
        fresh=fresh,
        package_index=package_index,
        timeout=timeout,
        timers=timers,
        selftest_cache=selftest_cache,
        progress=lambda msg: note(settings, msg),
        config_path=settings.config,
    )
    if as_json:
        print_json(
            {
                "url": started.url,
                "ca": str(started.ca),
                "dir": str(started.root),
                "processes": [p.to_json() for p in started.processes],
            }
        )
    else:
        note(
            settings,
            f"local pool up at {started.url} ({agents} agent(s) x {slots} slots, "
            f"{relays} relay(s)); logs in {started.root / 'logs'}",
        )
        note(
            settings,
            f"web portal: {started.url}/ (sign in with the token `vsdk config --show-token` "
            f"prints; the browser has to trust the pool's CA, {started.ca})",
        )


@local.command()
@click.option(
    "--timeout",
    type=float,
    default=localpool.STOP_TIMEOUT,
    show_default=True,
    help="Seconds to wait after SIGTERM before SIGKILL.",
)
@pass_settings
def down(settings: Settings, timeout: float) -> None:
    """Stop the local pool: exactly the processes `vsdk local up` started.

    A recorded pid that now runs another program is left alone.

    \b
    Example:
      vsdk local down
    """
    count, warnings = localpool.down(timeout=timeout, progress=lambda m: note(settings, m))
    for warning in warnings:
        click.echo(f"vsdk: warning: {warning}", err=True)
    note(
        settings,
        f"local pool stopped ({count} process(es))" if count else "no local pool was running",
    )


@local.command()
@click.argument("name")
@click.option(
    "--timeout",
    type=float,
    default=localpool.READY_TIMEOUT,
    show_default=True,
    help="Seconds to wait for it to be ready.",
)
@pass_settings
def restart(settings: Settings, name: str, timeout: float) -> None:
    """Start component NAME (e.g. relay-0, agent-1, coordinator) again after it died.

    It gets its old command line, config and data directory: a relay keeps its message logs and
    the coordinator its database.

    Example:
      vsdk local restart relay-0
    """
    rec = localpool.restart(name, timeout=timeout, progress=lambda m: note(settings, m))
    click.echo(f"{name} running again (pid {rec.pid})")


@local.command()
@json_option
@pass_settings
def status(settings: Settings, as_json: bool) -> None:
    """Show whether the local pool runs, and its processes. Exits 0 if it all runs, else 1.

    \b
    Example:
      vsdk local status
    """
    info = localpool.status()
    if as_json:
        print_json(info)
    elif not info["processes"]:
        click.echo(f"no local pool (directory {info['dir']})")
    else:
        click.echo(f"local pool at {info['url']}  ({info['dir']})")
        for p in info["processes"]:
            click.echo(f"  {p['name']:<12} pid {p['pid']:<8} {p['state']}")
    exit_with(0 if info["running"] else 1)
