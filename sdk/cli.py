"""``vsdk``: the scientist's command line, a thin layer over ``vpool.sdk``.

Exit codes: 0 ok; a job's own exit code (``submit --wait``, ``wait``); 1 error; 2 usage;
3 job failed without an exit code (a rank was lost); 4 job cancelled; 5 cannot reach the
coordinator or authentication failed.
"""

from __future__ import annotations

from pathlib import Path

import click

from vpool import paths
from vpool.protocol.api import FAILURE_MODES
from vpool.sdk import clientconfig
from vpool.sdk.cli_common import (
    Settings,
    VsdkGroup,
    exit_with,
    json_option,
    note,
    pass_settings,
    print_json,
    quiet_everywhere,
)
from vpool.sdk.cli_jobs import COMMANDS as JOB_COMMANDS
from vpool.sdk.cli_local import local
from vpool.sdk.errors import VsdkError


@click.group(cls=VsdkGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--config",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar="VSDK_CONFIG",
    help="Client config file (default: the one `vsdk login` writes).",
)
@click.option("--url", envvar="VSDK_URL", help="Coordinator URL (overrides the config).")
@click.option("--token", envvar="VSDK_TOKEN", help="API token (overrides the config).")
@click.option(
    "--ca",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar="VSDK_CA",
    help="CA certificate of the pool (overrides the config).",
)
@click.option("-q", "--quiet", is_flag=True, help="No progress messages on stderr.")
@click.version_option(package_name="vpool", prog_name="vsdk")
@click.pass_context
def cli(
    ctx: click.Context,
    config: Path | None,
    url: str | None,
    token: str | None,
    ca: Path | None,
    quiet: bool,
) -> None:
    """Run unmodified mpi4py programs on a vpool volunteer pool.

    \b
    Examples:
      vsdk local up                                  # a pool on this machine
      vsdk submit examples/pi.py --ranks 8 --wait    # output as with mpiexec
      vsdk mpiexec -n 4 python app.py                # same, mpiexec style
      vsdk jobs

    \b
    Exit codes: 0 ok, or the job's own exit code; 1 error; 2 usage; 3 job failed without an
    exit code (rank lost); 4 job cancelled; 5 cannot reach the coordinator or auth error.
    """
    ctx.obj = Settings(config=config, url=url, token=token, ca=ca, quiet=quiet)


for _command in JOB_COMMANDS:
    cli.add_command(_command)
cli.add_command(local)


@cli.command()
@click.argument("url")
@click.option("--token", "login_token", required=True, help="Your API token.")
@click.option(
    "--ca",
    "login_ca",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    help="The pool's CA certificate (if the coordinator's is not publicly trusted).",
)
@click.option("--no-check", is_flag=True, help="Save without contacting the coordinator.")
@pass_settings
def login(
    settings: Settings, url: str, login_token: str, login_ca: Path | None, no_check: bool
) -> None:
    """Save the coordinator URL, your token and the pool's CA in the client config.

    \b
    Example:
      vsdk login https://pool.example.org:8443 --token abc123 --ca pool-ca.pem
    """
    if not url.startswith(("https://", "http://")):
        raise click.BadParameter("must start with https:// (or http://)", param_hint="URL")
    cfg = clientconfig.ClientConfig(url=url.rstrip("/"), token=login_token, ca=login_ca)
    if not no_check:
        from vpool.sdk.client import Client

        with Client(cfg.url, cfg.token, ca=cfg.ca) as client:
            user = client.whoami()
        note(settings, f"logged in to {cfg.url} as {user.name}")
    path = clientconfig.save(cfg, settings.config)
    note(settings, f"client config written to {path}")


@cli.command()
@json_option
@pass_settings
def info(settings: Settings, as_json: bool) -> None:
    """Show the pool you are using and who you are there.

    \b
    Example:
      vsdk info
    """
    with settings.client() as client:
        pool, user = client.pool_info(), client.whoami()
        url = client.url
    if as_json:
        print_json({"url": url, "pool": pool, "user": user})
    else:
        click.echo(f"pool {pool.name!r} at {url} (vpool {pool.version}, API v{pool.api_version})")
        click.echo(f"user {user.name}")


@cli.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option(
    "-n", "-np", "ranks", type=click.IntRange(min=1), required=True, help="Number of ranks."
)
@click.option(
    "--stdin",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    help="A file fed to rank 0's stdin.",
)
@click.option(
    "--on-failure",
    type=click.Choice(FAILURE_MODES),
    default="transparent",
    show_default=True,
    help="What a rank killed by a signal means: abort (the job ends; transparent is the same "
    "here, with no relays to replay from) or ulfm, blank, shrink, rebuild (it is declared "
    "failed, the other ranks get MPI.ERR_PROC_FAILED and recover as the mode says; the job's "
    "code is the survivors').",
)
@click.option(
    "--universe",
    "-usize",
    type=click.IntRange(min=0),
    default=0,
    help="MPI.UNIVERSE_SIZE, the processes the job expects to have (as mpiexec -usize; a "
    "hint: MPI.Comm.Spawn starts every process it asks for). Default: the ranks plus this "
    "machine's CPUs.",
)
@click.argument("argv", nargs=-1, required=True, type=click.UNPROCESSED)
def mpiexec(
    ranks: int, stdin: Path | None, on_failure: str, universe: int, argv: tuple[str, ...]
) -> None:
    """Run a program like `mpiexec -n N`, on this machine, without any MPI installed.

    ARGV is the program and its arguments (a leading `python` is optional). The ranks log
    their determinants as on a pool (not with any --on-failure but transparent, as on a pool);
    VPOOL_FT=0 in the environment turns that off, like `vsdk submit --no-fault-tolerance`.
    Processes the ranks spawn (MPI.Comm.Spawn) run here too, up to 1024 over the job's run.

    \b
    Example:
      vsdk mpiexec -n 4 python examples/pi.py 1000000
      vsdk mpiexec -n 8 -- examples/ring.py
      vsdk mpiexec -n 4 --on-failure ulfm -- examples/ulfm_shrink.py 100000 20 --die 2:5
    """
    try:
        from vpool.sdk import mpiexec as mpiexec_mod
    except ImportError as exc:
        raise VsdkError(f"vsdk mpiexec is not available: {exc}") from exc
    # `python app.py`, `python script` (any name) and `app.py` all run under vpool's
    # interpreter (``mpiexec.rank_command``); rank 0 reads the --stdin file.
    if stdin is None:
        code = mpiexec_mod.run(ranks, list(argv), on_failure=on_failure, universe=universe)
        exit_with(int(code or 0))
    with open(stdin, "rb") as feed:
        code = mpiexec_mod.run(
            ranks, list(argv), stdin=feed, on_failure=on_failure, universe=universe
        )
        exit_with(int(code or 0))


@cli.command()
@click.option(
    "--show-token", is_flag=True, help="Print the token itself (to sign in to the web portal)."
)
@click.pass_context
def config(ctx: click.Context, show_token: bool) -> None:
    """Show the client config in use (the token only with --show-token).

    The web portal is at the coordinator's URL; sign in there with the token.

    \b
    Example:
      vsdk config
      vsdk config --show-token
    """
    settings: Settings = ctx.ensure_object(Settings)
    path = settings.config
    cfg = clientconfig.load(path)
    token = (cfg.token or "missing") if show_token else ("set" if cfg.token else "missing")
    print_json(
        {
            "file": str(path or paths.client_config_file()),
            "url": cfg.url,
            "ca": str(cfg.ca) if cfg.ca else None,
            "token": token,
        }
    )


quiet_everywhere(cli)


def main() -> None:
    cli.main(prog_name="vsdk")


if __name__ == "__main__":
    main()
