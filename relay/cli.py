"""``vpool-relay``: run one relay (channel memory) of a pool."""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import resource
import signal
import sys
from functools import partial
from pathlib import Path

import click
import trio

from vpool.config import SettingsError
from vpool.logsetup import quiet_routine_requests
from vpool.protocol import pki
from vpool.readyfile import Ready, ready_options
from vpool.relay.errors import RelayError
from vpool.relay.server import serve_relay
from vpool.relay.settings import RelaySettings, load

EXAMPLE = """\b
Example:
  vpool-relay --config relay.toml --ready-file /tmp/relay.json
  VPOOL_RELAY_COORDINATOR_URL=https://coord:8443 VPOOL_RELAY_RELAY_SECRET=s3cret \\
    VPOOL_RELAY_TLS_CERT=relay.pem VPOOL_RELAY_TLS_KEY=relay.key vpool-relay --port 7700

Exit codes: 0 stopped by SIGTERM/SIGINT, 1 bad settings or unusable data directory,
2 bad command line.
"""


def _raise_fd_limit() -> None:
    # Every destination rank's log keeps its segment files open.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            pass


def _is_wildcard(host: str) -> bool:
    try:
        return not host or ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def checked_advertise(settings: RelaySettings) -> RelaySettings:
    """``settings`` with the host the coordinator will tell agents to connect to, refused
    unless the relay's certificate names it: every agent would refuse the connection.

    Listening on every address with no advertise_host, the relay takes its certificate's
    name if it has exactly one, and guesses nothing otherwise."""
    if not settings.coordinator_url or not (settings.tls_cert and settings.tls_key):
        return settings  # advertises nothing, or has no certificate to check against
    try:
        pem = Path(settings.tls_cert).read_bytes()
        names = pki.cert_names(pem)
    except (OSError, ValueError) as exc:
        raise RelayError(
            f"cannot read the certificate tls_cert {settings.tls_cert}: {exc}"
        ) from exc
    named = ", ".join(names) or "nothing"
    if settings.advertise_host:
        setting, host = "advertise_host", settings.advertise_host
    elif _is_wildcard(settings.host):
        if len(names) == 1:
            return dataclasses.replace(settings, advertise_host=names[0])
        raise RelayError(
            f"host is {settings.host or 'empty'} (every address) and advertise_host is not "
            "set: set advertise_host to the name agents reach this relay by, one that its "
            f"certificate {settings.tls_cert} names ({named})"
        )
    else:
        setting, host = "host", settings.host
    if not pki.covers(pem, host):
        raise RelayError(
            f"{setting} {host} is not a name of the certificate tls_cert "
            f"{settings.tls_cert} (it names {named}): agents told to connect to {host} would "
            "refuse the connection. Set advertise_host to one of its names, or issue a "
            "certificate for this one (vpool-coordinator relay add NAME --address HOST:PORT)"
        )
    return settings


async def _run(settings: RelaySettings, ready: Ready) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            host, port = await nursery.start(partial(serve_relay, settings))
            ready.announce(
                {"host": host, "port": port, "pid": os.getpid(), "name": settings.relay_name(port)}
            )
            async for signum in signals:
                logging.getLogger(__name__).info("signal %d: stopping", signum)
                break
            nursery.cancel_scope.cancel()


@click.command(epilog=EXAMPLE)
@click.option(
    "--config",
    type=click.Path(dir_okay=False, path_type=Path),
    help="TOML settings file (see docs/configuration.md).",
)
@ready_options('{"host", "port", "pid", "name"}')
@click.option("--host", help="Address to listen on.")
@click.option("--port", type=int, help="TCP port (0 = any free port).")
@click.option("--name", help="Relay name registered with the coordinator.")
@click.option("--data-dir", help="Directory of the message logs.")
@click.option(
    "--log-level",
    default="INFO",
    show_default=True,
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"]),
)
def main(
    config: Path | None,
    ready: Ready,
    host: str | None,
    port: int | None,
    name: str | None,
    data_dir: str | None,
    log_level: str,
) -> None:
    """Run a relay: store every rank's incoming messages in a log and push them to it."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    quiet_routine_requests(verbose=log_level == "DEBUG")
    try:
        settings = load(config, host=host, port=port, name=name, data_dir=data_dir)
    except SettingsError as exc:
        raise click.ClickException(str(exc)) from exc
    _raise_fd_limit()
    try:
        settings = checked_advertise(settings)
        trio.run(_run, settings, ready)
    except (RelayError, OSError) as exc:
        click.echo(f"vpool-relay: {exc}", err=True)
        sys.exit(1)
    except BaseExceptionGroup as group:
        fatal, rest = group.split((RelayError, OSError))
        if fatal is None or rest is not None:
            raise
        for leaf in _leaves(fatal):
            click.echo(f"vpool-relay: {leaf}", err=True)
        sys.exit(1)


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out


if __name__ == "__main__":
    main()
