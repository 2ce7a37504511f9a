"""``vpool-agent status``, ``pause`` and ``resume``: the owner of the machine asks the running
agent (``control.py``) what it does, and tells it to stop for a while."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import sys
import tomllib
from pathlib import Path
from typing import Any

import click
import tomli_w

from vpool.config import SettingsError
from vpool.sizes import format_duration, format_size, parse_duration, parse_size
from vpool.worker_agent import install
from vpool.worker_agent.control import SYSTEM_SOCKET, ControlError, request, socket_path
from vpool.worker_agent.settings import AgentSettings, load_agent_settings


def _socket(settings: AgentSettings | None, given: Path | None) -> Path:
    """The socket named on the command line; else the first that exists of: the settings'
    (--config), this user's agent installed by `vpool-agent join`, a system agent's."""
    if given is not None:
        return given
    candidates = []
    if settings is not None:
        candidates.append(socket_path(settings))
    joined = install.user_layout()
    if joined.settings_file.exists():
        with contextlib.suppress(SettingsError):
            candidates.append(socket_path(load_agent_settings(joined.settings_file)))
    candidates.append(SYSTEM_SOCKET)
    return next((c for c in candidates if c.exists()), candidates[0])


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
        + (
            f" (inhibitor lock held; logind waits {st['sleep_delay_max']:g} s at most)"
            if st["sleep_lock"]
            else " (no logind: no warning)"
        )
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
    st = _ask(ctx, socket, "status")["status"]
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
    st = _ask(ctx, socket, "pause", seconds)["status"]
    click.echo(f"paused: {st['reason']}")


@click.command()
@SOCKET_OPTION
@click.pass_context
def resume(ctx: click.Context, socket: Path | None) -> None:
    """End a pause: the ranks run again if the other preferences allow."""
    st = _ask(ctx, socket, "resume")["status"]
    what = "running" if st["activity"] == "available" else f"{st['activity']}: {st['reason']}"
    click.echo(f"resumed; now {what}")


# -- preferences ----------------------------------------------------------------------------

PREFS = (
    "slots",
    "memory",
    "run_when",
    "idle_after",
    "pause_on_battery",
    "evacuate_battery_below",
    "pause_while",
    "run_hours",
)


def _settings_file(ctx: click.Context) -> Path:
    """The settings file the agent starts from: --config, else the one `vpool-agent join`
    wrote (this user's, or the system's for root)."""
    given = ctx.meta.get("config")
    if given is not None:
        return Path(given)
    for layout in (install.user_layout(), install.SYSTEM_LAYOUT):
        if layout.settings_file.exists():
            return layout.settings_file
    raise click.UsageError("no settings file: give --config (vpool-agent join writes one)")


def _show_prefs(settings: AgentSettings) -> list[str]:
    p = settings.preferences()
    cores = settings.slots or f"every CPU ({settings.slot_count})"
    memory = (
        format_size(settings.memory)
        if settings.memory
        else (f"three quarters of this machine's ({format_size(settings.memory_offered)})")
    )
    when = (
        "always" if p.run_when == "always" else (f"when idle for {format_duration(p.idle_after)}")
    )
    return [
        f"cores:        {cores}",
        f"memory:       {memory}",
        f"runs:         {when}",
        f"hours:        {', '.join(str(w) for w in p.hours) or 'any'}",
        f"on battery:   {'suspended' if p.pause_on_battery else 'runs'}; every rank moves "
        f"away below {p.evacuate_battery_below:g}%",
        f"paused while: {', '.join(sorted(p.pause_while)) or 'nothing'} runs",
    ]


@click.command()
@click.option("--cores", type=click.IntRange(min=0), help="Ranks at once (0: every CPU).")
@click.option(
    "--memory",
    "memory_text",
    metavar="SIZE",
    help="Memory offered in all, e.g. 8G (0: 3/4 of the machine's).",
)
@click.option(
    "--run-when",
    type=click.Choice(["always", "idle"]),
    help="Run always, or only when the machine is idle.",
)
@click.option("--idle-after", metavar="DURATION", help="Idle this long before ranks run, e.g. 5m.")
@click.option(
    "--on-battery",
    type=click.Choice(["pause", "run"]),
    help="Suspend ranks on battery, or let them run.",
)
@click.option(
    "--evacuate-below",
    type=click.FloatRange(0, 100),
    metavar="PERCENT",
    help="Battery charge below which every rank moves away.",
)
@click.option(
    "--pause-while",
    metavar="NAMES",
    help="Comma-separated programs during which ranks are suspended ('' for none).",
)
@click.option(
    "--run-hours", metavar="HOURS", help="e.g. '22:00-07:00, 12:00-13:00' ('' for any time)."
)
@SOCKET_OPTION
@click.pass_context
def prefs(
    ctx: click.Context,
    cores: int | None,
    memory_text: str | None,
    run_when: str | None,
    idle_after: str | None,
    on_battery: str | None,
    evacuate_below: float | None,
    pause_while: str | None,
    run_hours: str | None,
    socket: Path | None,
) -> None:
    """Show the owner's preferences, or change them: the settings file is rewritten and a
    running agent applies them at once (cores included; memory from its next start)."""
    changes: dict[str, object] = {}
    try:
        if cores is not None:
            changes["slots"] = cores
        if memory_text is not None:
            changes["memory"] = 0 if memory_text.strip() == "0" else parse_size(memory_text)
        if run_when is not None:
            changes["run_when"] = run_when
        if idle_after is not None:
            changes["idle_after"] = parse_duration(idle_after)
        if on_battery is not None:
            changes["pause_on_battery"] = on_battery == "pause"
        if evacuate_below is not None:
            changes["evacuate_battery_below"] = evacuate_below
        if pause_while is not None:
            changes["pause_while"] = [n.strip() for n in pause_while.split(",") if n.strip()]
        if run_hours is not None:
            changes["run_hours"] = run_hours
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    path = _settings_file(ctx)
    if not changes:
        click.echo(f"{path}:")
        click.echo("\n".join(_show_prefs(load_agent_settings(path))))
        return
    try:
        data = tomllib.loads(path.read_text()) if path.exists() else {}
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise click.UsageError(f"cannot read {path}: {exc}") from exc
    data.update(changes)
    try:
        new = load_settings_text(data)  # checked before anything is written
    except SettingsError as exc:
        raise click.UsageError(str(exc)) from exc
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(tomli_w.dumps(data).encode())
    tmp.chmod(path.stat().st_mode & 0o777 if path.exists() else 0o600)
    tmp.replace(path)
    click.echo(f"{path}: {', '.join(f'{k} = {v!r}' for k, v in changes.items())}")
    click.echo("\n".join(_show_prefs(new)))
    where = _socket(ctx.obj, socket)
    try:
        answer = request(where, "reload")
    except ControlError as exc:
        click.echo(f"(not applied to a running agent: {exc}; it applies them when it starts)")
        return
    later = answer.get("later") or []
    click.echo(
        "the running agent applied them"
        + (f"; {', '.join(later)} from its next start" if later else "")
    )


def load_settings_text(data: dict[str, object]) -> AgentSettings:
    """Settings from a file's ``data`` as the agent would load them (every value checked)."""
    return load_agent_settings(None, {k: v for k, v in data.items() if v is not None})
