"""``vpool-agent status``, ``pause`` and ``resume``: the owner of the machine asks the running
agent (``control.py``) what it does, and tells it to stop for a while."""

from __future__ import annotations

import datetime as dt
import json
import sys
from pathlib import Path
from typing import Any

import click

from vpool.sizes import format_duration, format_size, parse_duration
from vpool.worker_agent.control import SYSTEM_SOCKET, ControlError, request, socket_path
from vpool.worker_agent.settings import AgentSettings


def _socket(settings: AgentSettings | None, given: Path | None) -> Path:
    """The socket named on the command line, else the settings', else a system agent's."""
    if given is not None:
        return given
    own = socket_path(settings) if settings is not None else None
    if own is not None and (own.exists() or (settings is not None and settings.control_socket)):
        return own
    if SYSTEM_SOCKET.exists():
        return SYSTEM_SOCKET
    return own or SYSTEM_SOCKET


def _ask(ctx: click.Context, socket: Path | None, op: str, seconds: float | None = None) -> Any:
    path = _socket(ctx.obj, socket)
    try:
        return request(path, op, seconds)
    except ControlError as exc:
        click.echo(f"vpool-agent: {exc}", err=True)
        sys.exit(1)


SOCKET_OPTION = click.option(
    "--socket",
    type=click.Path(dir_okay=False, path_type=Path),
    help="The agent's control socket (default: its settings', or a system agent's "
    f"{SYSTEM_SOCKET}).",
)


def _when(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M")


def render(st: dict[str, Any]) -> list[str]:
    """The status as lines for people."""
    activity = st["activity"]
    if activity == "available":
        busy = st["limits"]["busy"]
        state = f"running {busy} rank(s)" if busy else "available, waiting for work"
    else:
        state = f"{activity}: {st['reason']}"
    lines = [
        f"agent {st['name']} ({st['agent_id']}), pool {st['coordinator']}, pid {st['pid']}",
        f"state:      {state}",
    ]
    idle = st.get("idle")
    if idle is not None:
        lines.append(f"idle:       {format_duration(idle)} (from {st['idle_source']})")
    elif st["preferences"]["run_when"] == "idle":
        lines.append("idle:       unknown (no logind, no terminal to look at)")
    bat = st.get("battery")
    if bat is not None:
        pct = f"{bat['percent']:.0f}%" if bat["percent"] is not None else "charge unknown"
        lines.append(f"battery:    {pct}, {'discharging' if bat['discharging'] else 'on mains'}")
    p = st["preferences"]
    rules = [
        "always" if p["run_when"] == "always" else f"after {format_duration(p['idle_after'])} idle"
    ]
    if p["run_hours"]:
        rules.append(f"hours {p['run_hours']}")
    if p["pause_on_battery"]:
        rules.append("not on battery")
    if p["pause_while"]:
        rules.append(f"not while {', '.join(p['pause_while'])} run(s)")
    lines.append(f"runs:       {'; '.join(rules)}")
    limit = st["suspend_limit"]
    lines.append(
        f"moves away: a rank suspended {format_duration(limit)}; every rank before sleep"
        + (" (inhibitor lock held)" if st["sleep_lock"] else " (no logind: no warning)")
    )
    lim = st["limits"]
    lines.append(
        f"limits:     {lim['slots']} slot(s), {format_size(lim['memory'])} offered "
        f"({format_size(lim['rank_memory'])} a rank), {lim['rank_processes']} processes "
        f"and {format_size(lim['rank_disk'])} of disk a rank"
    )
    iso = st["isolation"] + (f" ({st['isolation_detail']})" if st["isolation_detail"] else "")
    lines.append(f"isolation:  {iso}")
    ranks = st["ranks"]
    if ranks:
        lines.append("")
        lines.append(
            f"{'JOB':>5} {'RANK':>5} {'USER':<12} {'STATE':<22} {'SINCE':<16} "
            f"{'CPU':>9} {'MEMORY':>10}"
        )
        for r in ranks:
            state = r["state"]
            if state == "suspended":
                state = f"suspended {format_duration(r['suspended_for'])}"
            if r["evacuating"]:
                state = "moving away"
            lines.append(
                f"{r['job']:>5} {r['rank']:>5} {(r['user'] or '-')[:12]:<12} {state[:22]:<22} "
                f"{_when(r['since']):<16} {format_duration(r['cpu_seconds']):>9} "
                f"{format_size(r['memory']):>10}"
            )
    tot = st["totals"]
    lines.append("")
    lines.append(
        f"since {_when(tot['since'])}: {tot['ranks_done']} rank(s) run to their end here, "
        f"{format_duration(tot['cpu_seconds'])} of CPU given"
    )
    return lines


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
@SOCKET_OPTION
@click.pass_context
def status(ctx: click.Context, as_json: bool, socket: Path | None) -> None:
    """Show what the running agent does: running, suspended and why, or waiting for the
    machine to be idle; each rank (job, user, CPU, memory, since when); the limits, the
    isolation level and the totals. Needs no root."""
    st = _ask(ctx, socket, "status")
    click.echo(json.dumps(st, indent=2) if as_json else "\n".join(render(st)))


@click.command()
@click.option(
    "--for",
    "duration",
    metavar="DURATION",
    help="How long, e.g. 30m, 2h (default: until `vpool-agent resume`).",
)
@SOCKET_OPTION
@click.pass_context
def pause(ctx: click.Context, duration: str | None, socket: Path | None) -> None:
    """Suspend the agent's ranks (frozen, not killed) and take no new work, for a while or
    until resumed. A rank suspended past the pool's suspend_limit is moved elsewhere."""
    seconds = None
    if duration is not None:
        try:
            seconds = parse_duration(duration)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--for") from exc
    st = _ask(ctx, socket, "pause", seconds)
    click.echo(f"paused: {st['reason']}")


@click.command()
@SOCKET_OPTION
@click.pass_context
def resume(ctx: click.Context, socket: Path | None) -> None:
    """End a pause: the ranks run again if the other preferences allow."""
    st = _ask(ctx, socket, "resume")
    what = "running" if st["activity"] == "available" else f"{st['activity']}: {st['reason']}"
    click.echo(f"resumed; now {what}")
