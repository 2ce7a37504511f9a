"""``vpool-agent``: run the worker agent on a volunteer's machine until SIGTERM or Ctrl-C (the
first checkpoints its ranks before stopping them, a second stops at once).

Exit codes: 0 after a clean stop (signal), 1 when the agent cannot run (bad settings, socket in
use, enrollment refused), 2 for bad command-line usage (click).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import click
import trio

from vpool.config import SettingsError
from vpool.logsetup import quiet_routine_requests
from vpool.readyfile import Ready, ready_options
from vpool.worker_agent import cli_owner
from vpool.worker_agent.agent import AgentStarted, run_agent
from vpool.worker_agent.criu import criu_check
from vpool.worker_agent.errors import AgentError
from vpool.worker_agent.install import join_command, leave_command
from vpool.worker_agent.sandboxed import find_isolation, rank_limits
from vpool.worker_agent.selftest import SelfTest, run_selftest
from vpool.worker_agent.settings import AgentSettings, load_agent_settings

log = logging.getLogger("vpool.agent")

EPILOG = """\b
Example:
  vpool-agent join https://pool.example.org:8443 vpj_... --ca-sha256 3f1c...
      (once: enroll, write the settings, install and start the systemd service)
  vpool-agent --config ~/.config/vpool/agent.toml --slots 4
\b
  where agent.toml holds for instance:
    coordinator_url = "https://pool.example.org:8443"
    coordinator_ca = "/home/me/.config/vpool/ca.pem"
    join_token = "vpj_..."

Every setting can also come from the environment as VPOOL_AGENT_<NAME>.
"""


async def _watch_signals(
    cancel_scope: trio.CancelScope, leaving: trio.Event, grace: float, ready: trio.Event
) -> None:
    """The first SIGTERM or SIGINT checkpoints the ranks for at most ``grace`` s before they
    are stopped (``Agent.leave``); a second one, or the first with no grace or before the
    agent is ready (still enrolling: it runs no rank yet), stops at once."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            name = signal.Signals(signum).name
            if not ready.is_set():
                log.info("received %s before the agent was ready: exiting", name)
                cancel_scope.cancel()
                return
            if grace > 0 and not leaving.is_set():
                log.info(
                    "received %s: checkpointing ranks (at most %g s), then stopping them and "
                    "exiting; send it again to stop at once",
                    name,
                    grace,
                )
                leaving.set()
                continue
            log.info("received %s: stopping ranks and exiting", name)
            cancel_scope.cancel()
            return


async def _agent(
    settings: AgentSettings,
    reload: Callable[[], AgentSettings] | None,
    leaving: trio.Event,
    done: trio.CancelScope,
    task_status: trio.TaskStatus[AgentStarted] = trio.TASK_STATUS_IGNORED,
) -> None:
    try:
        await run_agent(settings, leaving=leaving, reload=reload, task_status=task_status)
    finally:
        done.cancel()  # it left: the signal watch ends too


async def serve(
    settings: AgentSettings,
    readiness: Ready,
    reload: Callable[[], AgentSettings] | None = None,
) -> None:
    leaving, ready = trio.Event(), trio.Event()
    async with trio.open_nursery() as nursery:
        grace = settings.leave_checkpoint_grace
        nursery.start_soon(_watch_signals, nursery.cancel_scope, leaving, grace, ready)
        started = await nursery.start(_agent, settings, reload, leaving, nursery.cancel_scope)
        ready.set()
        readiness.announce({"pid": started.pid, "agent_id": started.agent_id, "name": started.name})
        log.info("agent %s (%s) ready on %s", started.name, started.agent_id, started.socket_path)
        if not settings.seal_messages:
            log.warning("seal_messages is off: relays see the messages of ranks run here")


@click.group(
    invoke_without_command=True,
    epilog=EPILOG,
    context_settings={"help_option_names": ["-h", "--help"]},
)
@click.option(
    "--config",
    type=click.Path(dir_okay=False, path_type=Path),
    help="TOML settings file (see docs/configuration.md).",
)
@ready_options('{"pid", "agent_id", "name"} (once enrolled)')
@click.option("--slots", type=click.IntRange(min=1), help="Ranks to run at once.")
@click.option("--name", help="Name shown in the pool (default: hostname).")
@click.option("--work-dir", help="Directory for the socket, blob cache and rank directories.")
@click.option("--identity-dir", help="Directory of the agent's identity.key.")
@click.option("--coordinator-url", help="Base URL of the coordinator.")
@click.option("--coordinator-ca", help="PEM file of the pool CA.")
@click.option("-v", "--verbose", is_flag=True, help="Log debugging detail.")
@click.pass_context
def main(
    ctx: click.Context,
    config: Path | None,
    ready: Ready,
    slots: int | None,
    name: str | None,
    work_dir: str | None,
    identity_dir: str | None,
    coordinator_url: str | None,
    coordinator_ca: str | None,
    verbose: bool,
) -> None:
    """Run the vpool worker agent: lease MPI ranks from the coordinator and run them here.

    The agent only makes outbound connections (HTTPS to the coordinator, TLS to relays).
    SIGTERM or Ctrl-C first checkpoints the ranks it runs (where CRIU works and the job
    takes checkpoints; at most leave_checkpoint_grace s), then kills them and exits with
    status 0; a second signal stops at once.

    `vpool-agent selftest` shows what a rank can and cannot do on this machine.
    """
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    quiet_routine_requests(verbose=verbose)
    if config is not None and not config.exists():
        raise click.UsageError(f"config file {config} does not exist")
    overrides: dict[str, object] = {
        "slots": slots,
        "name": name,
        "work_dir": work_dir,
        "identity_dir": identity_dir,
        "coordinator_url": coordinator_url,
        "coordinator_ca": coordinator_ca,
    }
    try:
        settings = load_agent_settings(config, overrides)
    except SettingsError as exc:
        raise click.UsageError(str(exc)) from exc
    ctx.obj = settings
    ctx.meta["config"] = config
    if ctx.invoked_subcommand is not None:
        return
    try:
        reload = functools.partial(load_agent_settings, config, overrides) if config else None
        trio.run(serve, settings, ready, reload)
    except BaseException as exc:
        errors = _agent_errors(exc)
        if not errors:
            raise
        for error in errors:
            click.echo(f"vpool-agent: {error}", err=True)
        sys.exit(1)


SELFTEST_EPILOG = """\b
Example:
  vpool-agent --config ~/.config/vpool/agent.toml selftest
\b
Exit status: 0 when ranks run sandboxed (level "sandbox" or "sandbox-rlimits"), 1 when
they cannot be (level "none": the agent then refuses ranks unless sandbox = 'prefer').
"""


@main.command(epilog=SELFTEST_EPILOG)
@click.option("--json", "as_json", is_flag=True, help="Print the findings as JSON.")
@click.pass_obj
def selftest(settings: AgentSettings, as_json: bool) -> None:
    """Try, from inside a sandboxed test rank, what a hostile program would do here (read the
    agent's key, see or signal other processes, reach the network, write to the system, make
    namespaces, ptrace, mount...), read back the rank's limits, checkpoint and restore a
    sandboxed process, and print the isolation level and what each probe showed. The agent
    runs the same probes at start and reports the level to the coordinator."""
    found = trio.run(_selftest, settings)
    if as_json:
        click.echo(json.dumps(dataclasses.asdict(found), indent=2, default=str))
    else:
        click.echo("\n".join(found.lines()))
    sys.exit(0 if found.level != "none" else 1)


async def _selftest(settings: AgentSettings) -> SelfTest:
    iso = await trio.to_thread.run_sync(find_isolation, settings)
    criu_ok = bool(await criu_check(settings.criu))
    return await run_selftest(settings, iso, rank_limits(settings), criu_ok=criu_ok)


def _agent_errors(exc: BaseException) -> list[AgentError]:
    """The ``AgentError``s in ``exc``, looking inside exception groups; [] if anything else."""
    if isinstance(exc, AgentError):
        return [exc]
    if isinstance(exc, BaseExceptionGroup):
        found = [_agent_errors(e) for e in exc.exceptions]
        if all(found):
            return [e for group in found for e in group]
    return []


main.add_command(cli_owner.status)
main.add_command(cli_owner.pause)
main.add_command(cli_owner.resume)
main.add_command(cli_owner.prefs)


main.add_command(join_command, "join")
main.add_command(leave_command, "leave")


if __name__ == "__main__":
    main()
