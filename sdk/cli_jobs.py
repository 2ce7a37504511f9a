"""``vsdk`` commands about jobs: submit, status, logs, wait, cancel, checkpoint, jobs, results;
``status`` without a job shows the pool's agents."""

from __future__ import annotations

import io
import os
import stat
import sys
import time
from pathlib import Path
from typing import Any

import click

from vpool import requirements
from vpool.protocol.api import (
    FAILURE_MODES,
    MAX_JOB_MEMORY,
    MIN_JOB_MEMORY,
    REPORTING_MODES,
    TERMINAL_STATES,
    AgentInfo,
    FailureMode,
    JobDetail,
    JobInfo,
    OutputPage,
)
from vpool.sdk import bundle
from vpool.sdk.cli_common import Settings, exit_with, json_option, note, pass_settings, print_json
from vpool.sdk.errors import BundleError, WaitTimeout
from vpool.sdk.output import LineAssembler, LineWriter, job_exit_code
from vpool.sizes import format_size, parse_size

JOB = click.argument("job", type=int, metavar="JOB")
LABEL = click.option(
    "-l", "--label", is_flag=True, help="Prefix each output line with [rank], like mpiexec -l."
)


def _memory(ctx: click.Context, param: click.Parameter, value: str) -> int:
    """``--memory``: a size (``parse_size``) of 0 or within what the coordinator accepts."""
    try:
        n = parse_size(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None
    if n != 0 and not MIN_JOB_MEMORY <= n <= MAX_JOB_MEMORY:
        raise click.BadParameter(
            f"{value!r} is {format_size(n)}: give 0 (what each agent offers) or "
            f"{format_size(MIN_JOB_MEMORY)} to {format_size(MAX_JOB_MEMORY)}",
            ctx,
            param,
        )
    return n


def _when(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def _duration(job: JobInfo) -> str:
    if job.started is None:
        return ""
    end = job.finished if job.finished is not None else time.time()
    return f"{end - job.started:.1f} s"


def _summary(job: JobInfo) -> str:
    text = f"job {job.id} {job.state}"
    if job.exit_code is not None and job.state != "succeeded":
        text += f" with exit code {job.exit_code}"
    if job.reason and job.state != "succeeded":
        text += f": {job.reason}"
    return text


def finish(settings: Settings, job: JobInfo, *, as_json: bool = False) -> None:
    """Report an ended job and exit as ``vsdk`` promises: 0, the job's code, 3 or 4."""
    if as_json:
        print_json(job)
    if job.state == "succeeded":
        note(settings, f"job {job.id} succeeded ({_duration(job)})")
    else:
        # Failures are always said, even with --quiet: the exit code alone hides the reason.
        click.echo(f"vsdk: {_summary(job)}", err=True)
    exit_with(job_exit_code(job))


# state, queue reason, restarts, ranks running, what validation did
Progress = tuple[str, str, int, int, str]


def _progress(settings: Settings, job_id: int, page: OutputPage, last: Progress) -> Progress:
    """Say on stderr what changed since ``last`` (state, queue reason, restarts, ranks,
    validation)."""
    state, waiting, restarts, running, validation = last
    if page.state != state and page.state in ("queued", "running"):
        note(settings, f"job {job_id} {page.state}")
    if page.state == "running" and page.running != running and page.running:
        of = f" of {page.ranks}" if page.ranks else ""
        note(settings, f"job {job_id}: {page.running}{of} ranks running")
    if page.waiting and page.waiting != waiting:
        _say_waiting(settings, job_id, page.waiting, page.never_fits)
    if page.restarts > restarts:
        n = page.restarts
        note(
            settings,
            f"job {job_id}: a lost rank was restarted ({n} restart{'s' * (n != 1)} so far)",
        )
    if page.validation != validation and page.validation and page.state == "running":
        note(settings, f"job {job_id}: {page.validation}")
    return (
        page.state,
        page.waiting,
        max(restarts, page.restarts),
        page.running,
        page.validation,
    )


def stream_output(
    client: Any,
    settings: Settings,
    job_id: int,
    *,
    rank: int | None = None,
    label: bool = False,
    progress: bool = True,
) -> None:
    """Stream a job's output as whole lines per rank (stdout to stdout, stderr to stderr)
    until the job ended and all its output arrived."""
    assembler = LineAssembler(label=label)
    writer = LineWriter(sys.stdout.buffer, sys.stderr.buffer)
    last: Progress = ("", "", 0, 0, "")
    try:
        for page in client.follow_pages(job_id, rank):
            if progress:
                last = _progress(settings, job_id, page, last)
            writer.write(assembler.feed_records(page.records))
    except KeyboardInterrupt:
        writer.write(assembler.flush())
        click.echo(
            f"vsdk: stopped following job {job_id}; it keeps running "
            f"(`vsdk logs {job_id} --follow`, `vsdk cancel {job_id}`)",
            err=True,
        )
        exit_with(130)
    writer.write(assembler.flush())


@click.command(context_settings={"ignore_unknown_options": False})
@click.argument("program", type=click.Path(path_type=Path))
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.option(
    "-n",
    "--ranks",
    type=click.IntRange(min=1),
    required=True,
    help="Number of ranks (like mpiexec -n).",
)
@click.option(
    "-i",
    "--input",
    "inputs",
    multiple=True,
    type=click.Path(path_type=Path),
    help="A file or directory the program reads, at the path given when it is relative "
    "(data/x.csv stays data/x.csv), or SRC:DEST to put it at DEST (repeatable).",
)
@click.option(
    "--stdin",
    type=click.Path(path_type=Path, allow_dash=True),
    help="A file fed to rank 0's stdin ('-': vsdk's own stdin). With --wait, input piped to "
    "vsdk goes to rank 0 too, as with mpiexec.",
)
@click.option(
    "-m",
    "--module",
    metavar="MODULE",
    default="",
    help="Run the program as python -m MODULE PROGRAM ARGS, e.g. -m mpi4py.futures (as "
    "mpiexec -n 5 python -m mpi4py.futures app.py: rank 0 runs the program, the others serve "
    "its MPIPoolExecutor).",
)
@click.option("--name", help="A name for the job (default: the program's file name).")
@click.option(
    "--requirements",
    "requirements_file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="A requirements.txt of packages the program needs (from the package index); each "
    "agent installs them once and keeps them. A project directory's pyproject.toml "
    "dependencies count too.",
)
@click.option(
    "--entry",
    help="The program inside a .zip or a project directory (default: __main__.py).",
)
@click.option(
    "--fault-tolerance/--no-fault-tolerance",
    default=True,
    show_default=True,
    help="--no-fault-tolerance: no message logging (a little faster), but a lost rank "
    "(its machine gone, its process killed) fails the job instead of being restarted.",
)
@click.option(
    "--on-failure",
    type=click.Choice(FAILURE_MODES),
    default="transparent",
    show_default=True,
    help="What a lost rank means: transparent (it is restarted and replays, the program never "
    "notices), abort (the job fails; the same as --no-fault-tolerance), or, for programs that "
    "recover themselves, ulfm, blank, shrink or rebuild (it is declared failed and the other "
    "ranks get MPI.ERR_PROC_FAILED; they recover with Comm.Revoke/Agree/Shrink in ulfm, with "
    "MPI.COMM_WORLD.Dup() in blank (a hole at the lost rank), shrink (it is removed) and "
    "rebuild (a new process takes its place)).",
)
@click.option(
    "--universe",
    type=click.IntRange(min=0),
    default=0,
    metavar="N",
    help="The most processes the job may have at once, its ranks and those they spawn "
    "(MPI.Comm.Spawn, mpi4py.futures' MPIPoolExecutor), as mpiexec -usize (0: its ranks plus "
    "the pool's default).",
)
@click.option(
    "--checkpoint-every",
    type=click.FloatRange(min=0),
    default=0.0,
    metavar="SECONDS",
    help="Checkpoint every rank this often, so that a lost rank restarts from its last "
    "checkpoint instead of from the beginning (0: only on `vsdk checkpoint`).",
)
@click.option(
    "--memory",
    default="0",
    callback=_memory,
    metavar="SIZE",
    help="Memory each rank needs, e.g. 512M, 2G, 1.5GiB (powers of 1024) or bytes: ranks go "
    "only to agents that let a rank use that much, and are held to it there (default: "
    "whatever each agent offers).",
)
@click.option(
    "--allow-unsandboxed",
    is_flag=True,
    help="Also place ranks on agents that cannot sandbox them (their volunteers allowed "
    "that): there ranks run unconfined, as the volunteer's own user.",
)
@click.option(
    "--validate",
    is_flag=True,
    help="Validate the result by replay: once every rank exited, ranks are re-executed from "
    "their logged messages on other, unrelated volunteers and compared (messages sent, "
    "stdout, exit code); the output is shown once validated.",
)
@click.option(
    "-w", "--wait", is_flag=True, help="Stream the output and exit with the job's exit code."
)
@LABEL
@json_option
@pass_settings
def submit(
    settings: Settings,
    program: Path,
    args: tuple[str, ...],
    ranks: int,
    inputs: tuple[Path, ...],
    stdin: Path | None,
    name: str | None,
    requirements_file: Path | None,
    entry: str | None,
    fault_tolerance: bool,
    on_failure: FailureMode,
    universe: int,
    module: str,
    checkpoint_every: float,
    memory: int,
    allow_unsandboxed: bool,
    validate: bool,
    wait: bool,
    label: bool,
    as_json: bool,
) -> None:
    """Run PROGRAM (a .py file, a .zip or a project directory) on the pool with ARGS.

    \b
    Examples:
      vsdk submit examples/pi.py --ranks 8 --wait -- 1000000
      JOB=$(vsdk submit app.py -n 4 --input data.csv) && vsdk logs $JOB --follow
      vsdk submit myproject/ --entry main.py -n 8 --input data/ --wait
      vsdk submit sim.py -n 16 --memory 2G --wait
      vsdk submit trusted.py -n 4 --allow-unsandboxed
      vsdk submit pi.py -n 8 --validate --wait
      vsdk submit -m mpi4py.futures farm.py -n 5 --wait

    A .py program brings the modules next to it that it imports (vsdk says which); a project
    directory brings every file under it (not caches, .git or virtual environments), and
    --entry names the program in it. --input keeps relative paths: data/x.csv is data/x.csv
    in the job's directory, as next to the program here.

    Without --wait, prints the job id (or the job as JSON with --json) and returns at once.
    With --wait, stdout carries only the program's output (the ranks' stdout, whole lines,
    merged as mpiexec does), progress goes to stderr, and vsdk exits with the job's exit
    code: 3 if a rank was lost, 4 if the job was cancelled. --wait --json prints the ended
    job as JSON instead of its output.

    Ranks are fault tolerant by default: a rank whose machine or process is lost is restarted
    and replays its logged messages. --no-fault-tolerance skips the logging (the benchmark
    benchmarks/ft_overhead.py measures what it costs) and fails the job on the first loss
    (--on-failure abort says the same). --on-failure ulfm, blank, shrink and rebuild are for
    programs that handle failures themselves: a lost rank is declared failed, fenced so it can
    never come back, and the other ranks get MPI.ERR_PROC_FAILED; the job succeeds if the
    survivors exit 0. In ulfm they recover as MPI's ULFM says (Comm.Revoke, Agree, Shrink); in
    blank, shrink and rebuild as FT-MPI's modes say: MPI.COMM_WORLD.Dup() rebuilds the world
    with a hole at each lost rank, without them (renumbered), or with new processes of the
    program in their places (spawned: they count against the pool's spawn limit).
    --checkpoint-every 600 also saves each rank every 10 minutes on machines that can (CRIU),
    so a lost rank resumes from there; it needs fault tolerance.

    Ranks run in sandboxes, each with the limits its agent sets; `vsdk status` lists the
    agents and the memory each lets a rank use. --memory 2G places ranks only where a rank may
    use 2 GiB, and holds each to 2 GiB there. --allow-unsandboxed also accepts agents that
    cannot sandbox ranks: use it only for programs you would let run as the volunteer's own
    user.

    Volunteers are strangers: --validate re-executes the job's ranks (each alone, from its
    logged messages) on other volunteers, not admitted by the same join token, once they all
    exited, and compares what each sent, printed and returned; a disagreement is decided by a
    third execution. The job ends once validated, and its output is shown only then. Agents
    with a long record of agreeing are sampled less (`vsdk status JOB` says which ranks were
    re-executed, where, and what came of it). The program must be deterministic given its
    messages (no clock or unseeded random numbers in what it prints or sends).
    """
    if not fault_tolerance and on_failure == "transparent":
        on_failure = "abort"
    if on_failure != "transparent":
        if not fault_tolerance and on_failure != "abort":
            raise click.UsageError(f"--no-fault-tolerance is --on-failure abort, not {on_failure}")
        fault_tolerance = False
    if validate and not fault_tolerance:
        raise click.UsageError(
            "--validate replays the logs fault tolerance keeps (drop --no-fault-tolerance)"
        )
    if checkpoint_every > 0 and not fault_tolerance:
        raise click.UsageError(
            "--checkpoint-every needs fault tolerance (drop --no-fault-tolerance)"
        )
    feed: Path | bytes | None = stdin
    if stdin is not None and str(stdin) == "-":
        feed = sys.stdin.buffer.read()
    elif stdin is None and wait:
        feed = _piped_stdin()
        if feed is not None:
            note(settings, f"rank 0 gets the {len(feed)} bytes piped to vsdk as its stdin")
    built = bundle.build(program, list(inputs), entry=entry)
    needs = _requirements(program, requirements_file)
    if built.added:
        note(settings, f"packed the local modules {program.name} imports: {', '.join(built.added)}")
    with settings.client() as client:
        job = client.submit(
            program,
            ranks,
            built=built,
            requirements=needs,
            inputs=list(inputs),
            stdin=feed,
            args=list(args),
            name=name,
            entry=entry,
            fault_tolerance=fault_tolerance,
            on_failure=on_failure,
            universe=universe,
            module=module,
            checkpoint_every=checkpoint_every,
            memory=memory,
            unsandboxed=allow_unsandboxed,
            validate=validate,
        )
        what = f"{ranks} rank{'s' if ranks != 1 else ''}"
        if on_failure in REPORTING_MODES:
            what += f", failures reported to the program ({on_failure})"
        elif not fault_tolerance:
            what += ", fault tolerance off"
        if checkpoint_every > 0:
            what += f", a checkpoint every {checkpoint_every:g} s"
        if memory:
            what += f", {format_size(memory)} per rank"
        if allow_unsandboxed:
            what += ", unsandboxed agents allowed"
        if job.validate:
            what += ", validated by replay (output shown once validated)"
        if not wait:
            if as_json:
                print_json(job)
            else:
                click.echo(job.id)
            note(
                settings,
                f"job {job.id} submitted ({what}); `vsdk logs {job.id} --follow` shows its output",
            )
            _say_waiting(settings, job.id, job.waiting, job.never_fits)
            return
        note(settings, f"job {job.id} submitted ({what})")
        if as_json:
            finish(settings, client.wait(job.id), as_json=True)
        stream_output(client, settings, job.id, label=label)
        finish(settings, client.status(job.id).job)


def _requirements(program: Path, file: Path | None) -> list[str]:
    """What the job needs installed: --requirements, plus a project's pyproject.toml."""
    found = bundle.project_requirements(program)
    if file is not None:
        try:
            text = file.read_text()
        except OSError as exc:
            raise BundleError(f"cannot read {file}: {exc.strerror or exc}") from exc
        try:
            found = requirements.normalize([*found, *requirements.parse_lines(text, str(file))])
        except requirements.RequirementsError as exc:
            raise BundleError(str(exc)) from exc
    return found


def _piped_stdin() -> bytes | None:
    """What was piped (or redirected from a file) into vsdk, as mpiexec gives it to rank 0;
    None for a terminal, /dev/null, or no real stdin at all."""
    stream = sys.stdin.buffer
    try:
        mode = os.fstat(stream.fileno()).st_mode
    except (OSError, ValueError, io.UnsupportedOperation):
        return None
    if not (stat.S_ISFIFO(mode) or stat.S_ISREG(mode)):
        return None
    return stream.read()


def _say_waiting(settings: Settings, job_id: int, waiting: str, never: bool) -> None:
    """Why a job waits; said even with --quiet when the pool as it is can never run it (it
    would wait forever)."""
    if never:
        click.echo(
            f"vsdk: job {job_id} waits: {waiting} (the pool as it is can never run it)", err=True
        )
    elif waiting:
        note(settings, f"job {job_id} waits: {waiting}")


def _rank_table(detail: JobDetail) -> str:
    validated = detail.job.validate
    rows = [("RANK", "INC", "STATE", "EXIT", "AGENT", "RELAY", "RESTORED FROM")]
    if validated:
        rows[0] += ("VALIDATION",)
    for r in detail.ranks:
        row: tuple[str, ...] = (
            str(r.rank),
            str(r.incarnation),
            # Frozen on its volunteer's machine, which is in use (its events say why).
            r.state if r.suspended_since is None else f"{r.state} (suspended)",
            "-" if r.exit_code is None else str(r.exit_code),
            r.agent_name or r.agent or "-",  # by name, as the events name agents
            r.relay or "-",
            _image_name(r.restored_from),
        )
        if validated:
            by = f" by {r.validated_by}" if r.validated_by else ""
            row += (f"{r.validation}{by}" if r.validation else "-",)
        rows.append(row)
    return _table(rows)


def _image_name(ckpt: int) -> str:
    """A checkpoint id (wall-clock ms) as the local time it was taken, "-" for none."""
    if ckpt < 0:
        return "-"
    stamp = time.strftime("%H:%M:%S", time.localtime(ckpt / 1000))
    return f"image of {stamp}"


def _event_table(detail: JobDetail) -> str:
    """Time, kind, rank and message of each event; the message is the last column, so a long
    one (a failure reason) runs on without widening the others."""
    rows = [("TIME", "EVENT", "RANK", "MESSAGE")]
    for ev in detail.events:
        rank = "-" if ev.rank is None else str(ev.rank)
        rows.append((_clock(ev.time), ev.kind, rank, " ".join(ev.message.split()) or "-"))
    return _table(rows)


def _clock(t: float) -> str:
    """An event's local time to the millisecond: restarts come in quick succession."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) + f".{int(t * 1000) % 1000:03d}"


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def _agent_table(agents: list[AgentInfo]) -> str:
    """One agent a row: its state (alive, lost, gone: it left cleanly, banned), what its
    volunteer lets it do now (available, busy, suspended: why, leaving); why its isolation is
    not stronger is the last column."""
    rows: list[tuple[str, ...]] = [
        (
            "AGENT",
            "STATE",
            "RANKS",
            "SLOTS",
            "ACTIVITY",
            "ISOLATION",
            "RANK MEMORY",
            "LAST SEEN",
            "DETAIL",
        )
    ]
    for a in agents:
        if not a.isolation:
            memory = "-"
        else:
            memory = format_size(a.rank_memory) if a.rank_memory else "no limit"
        rows.append(
            (
                a.name,
                a.state,
                str(a.ranks),
                str(a.slots),
                " ".join(a.doing().split()),
                a.isolation or "not reported",
                memory,
                _when(a.last_seen),
                _agent_detail(a),
            )
        )
    return _table(rows)


def _agent_detail(a: AgentInfo) -> str:
    """Why its isolation is not stronger, and the sealed messages that did not open there (a
    sign of a bad relay, or of this agent's disk, memory or software)."""
    parts = [" ".join(a.isolation_detail.split())] if a.isolation_detail.strip() else []
    if a.integrity_failures:
        n = a.integrity_failures
        parts.append(f"{n} sealed message{'s' * (n != 1)} did not open here")
    return "; ".join(parts) or "-"


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'s' * (n != 1)}"


def _pool_status(settings: Settings, as_json: bool) -> None:
    with settings.client() as client:
        pool, agents = client.pool_info(), client.agents()
    if as_json:
        print_json({"pool": pool, "agents": agents})
        return
    click.echo(
        f"pool {pool.name!r} (vpool {pool.version}): {_count(pool.agents, 'agent')} and "
        f"{_count(pool.relays, 'relay')} alive"
    )
    if not agents:
        click.echo("no agent has enrolled yet", err=True)
        return
    click.echo("")
    click.echo(_agent_table(agents))
    levels = {a.isolation for a in agents}
    notes = []
    if "" in levels:
        notes.append("agents that have not reported their isolation get no ranks")
    if levels - {"", "sandbox", "sandbox-rlimits"}:
        notes.append(
            "agents that do not sandbox get only the ranks of jobs submitted with "
            "--allow-unsandboxed"
        )
    if any(a.state == "alive" and a.activity in ("suspended", "leaving") for a in agents):
        notes.append(
            "suspended and leaving agents get no new ranks: their volunteers use their "
            "machines now, or they are stopping"
        )
    if notes:
        click.echo("\n" + "\n".join(notes))


@click.command()
@click.argument("job", type=int, required=False, metavar="[JOB]")
@json_option
@pass_settings
def status(settings: Settings, job: int | None, as_json: bool) -> None:
    """Show a job: state, exit code, reason, its ranks and its events. Without JOB, show the
    pool: its agents, how each isolates ranks and the memory a rank may use there.

    \b
    Examples:
      vsdk status 12
      vsdk status 12 --json | jq .job.state
      vsdk status
      vsdk status --json | jq '.agents[] | {name, isolation, rank_memory}'
    """
    if job is None:
        _pool_status(settings, as_json)
        return
    with settings.client() as client:
        detail = client.status(job)
    if as_json:
        print_json(detail)
        return
    j = detail.job
    off = "" if j.fault_tolerance else "  (fault tolerance off)"
    if j.on_failure not in ("transparent", "abort"):
        off = f"  (on failure: {j.on_failure})"
    if j.spawned:
        off += f"  ({j.spawned} spawned, universe {j.universe})"
    if j.failed_ranks:
        off += f"  (failed: {', '.join(map(str, j.failed_ranks))})"
    if j.checkpoint_every > 0:
        off += f"  (a checkpoint every {j.checkpoint_every:g} s)"
    if j.memory:
        off += f"  ({format_size(j.memory)} per rank)"
    if j.unsandboxed:
        off += "  (unsandboxed agents allowed)"
    if j.validate:
        off += "  (validated by replay)"
    click.echo(f"job {j.id}  {j.name!r}  user {j.user}  {j.ranks} ranks{off}")
    line = f"state: {j.state}"
    if j.exit_code is not None:
        line += f"  exit code: {j.exit_code}"
    click.echo(line)
    if j.reason:
        click.echo(f"reason: {j.reason}")
    if j.waiting:
        never = "  (the pool as it is can never run it)" if j.never_fits else ""
        click.echo(f"waiting: {j.waiting}{never}")
    if j.restarts:
        click.echo(f"restarts: {j.restarts}")
    if j.validation:
        click.echo(f"validation: {j.validation}")
    if j.requirements:
        click.echo(f"packages: {', '.join(j.requirements)}")
    click.echo(
        f"created {_when(j.created)}  started {_when(j.started)}  "
        f"finished {_when(j.finished)}" + (f"  ({_duration(j)})" if j.started else "")
    )
    if detail.ranks:
        click.echo("")
        click.echo(_rank_table(detail))
    if detail.events:
        click.echo("\nevents:")
        click.echo(_event_table(detail))


@click.command()
@JOB
@click.option("-r", "--rank", type=click.IntRange(min=0), help="Only this rank's output.")
@click.option("-f", "--follow", is_flag=True, help="Keep streaming until the job ends.")
@LABEL
@pass_settings
def logs(settings: Settings, job: int, rank: int | None, follow: bool, label: bool) -> None:
    """Print a job's output so far (stdout to stdout, stderr to stderr).

    \b
    Examples:
      vsdk logs 12
      vsdk logs 12 --rank 3 --follow
    """
    with settings.client() as client:
        if follow:
            stream_output(client, settings, job, rank=rank, label=label, progress=False)
            return
        assembler = LineAssembler(label=label)
        writer = LineWriter(sys.stdout.buffer, sys.stderr.buffer)
        after = 0
        while True:
            page = client.output(job, after=after, rank=rank)
            writer.write(assembler.feed_records(page.records))
            if not page.records or page.complete:
                break
            after = page.next
        writer.write(assembler.flush())


@click.command()
@JOB
@click.option("--timeout", type=float, help="Give up after this many seconds (exit 1).")
@json_option
@pass_settings
def wait(settings: Settings, job: int, timeout: float | None, as_json: bool) -> None:
    """Wait for a job to end; exit with its exit code (3 rank lost, 4 cancelled).

    \b
    Example:
      vsdk wait 12 && echo "job 12 succeeded"
    """

    def progress(detail: JobDetail) -> None:
        if detail.job.state in TERMINAL_STATES:
            return  # finish() reports the end
        counts: dict[str, int] = {}
        for r in detail.ranks:
            counts[r.state] = counts.get(r.state, 0) + 1
        ranks = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
        note(settings, f"job {job} {detail.job.state}" + (f" (ranks: {ranks})" if ranks else ""))

    with settings.client() as client:
        try:
            ended = client.wait(job, timeout=timeout, on_change=progress)
        except WaitTimeout as exc:
            if as_json:  # the job as it is, for scripts: they get JSON either way
                print_json(exc.job)
            raise
        finish(settings, ended, as_json=as_json)


@click.command()
@JOB
@json_option
@pass_settings
def cancel(settings: Settings, job: int, as_json: bool) -> None:
    """Cancel a job: every rank is told to stop.

    \b
    Example:
      vsdk cancel 12
    """
    with settings.client() as client:
        info = client.cancel(job)
    if as_json:
        print_json(info)
    else:
        click.echo(f"job {info.id} {info.state}")


@click.command()
@JOB
@click.option(
    "-r", "--rank", type=click.IntRange(min=0), help="Only this rank (default: every rank)."
)
@json_option
@pass_settings
def checkpoint(settings: Settings, job: int, rank: int | None, as_json: bool) -> None:
    """Checkpoint a running job's ranks now (on machines that can: CRIU).

    A lost rank then restarts from its newest checkpoint instead of from the beginning. The
    images are made in the background; `vsdk status JOB` shows them as `checkpoint` events
    (or `checkpoint_failed`).

    \b
    Examples:
      vsdk checkpoint 12
      vsdk checkpoint 12 --rank 3
    """
    with settings.client() as client:
        asked = client.checkpoint(job, rank)
    if as_json:
        print_json(asked)
        return
    ranks = ", ".join(str(r) for r in asked.ranks)
    click.echo(f"job {asked.job}: asked rank{'s' * (len(asked.ranks) != 1)} {ranks} to checkpoint")


@click.command()
@json_option
@pass_settings
def jobs(settings: Settings, as_json: bool) -> None:
    """List your jobs.

    \b
    Example:
      vsdk jobs
      vsdk jobs --json | jq '.[] | select(.state == "running") | .id'
    """
    with settings.client() as client:
        items = client.jobs()
    if as_json:
        print_json(items)
        return
    if not items:
        click.echo("no jobs", err=True)
        return
    rows = [("ID", "NAME", "STATE", "RANKS", "EXIT", "CREATED")]
    for j in items:
        rows.append(
            (
                str(j.id),
                j.name,
                j.state,
                str(j.ranks),
                "-" if j.exit_code is None else str(j.exit_code),
                _when(j.created),
            )
        )
    click.echo(_table(rows))


@click.command()
@JOB
@click.argument("dest", type=click.Path(file_okay=False, path_type=Path))
@json_option
@pass_settings
def results(settings: Settings, job: int, dest: Path, as_json: bool) -> None:
    """Download a job's result files into the directory DEST.

    A job that has not ended yet gives what its ranks have sent so far (a rank's files come
    when it ends); vsdk says so.

    \b
    Example:
      vsdk results 12 out/
    """
    with settings.client() as client:
        state = client.status(job).job.state
        files = client.results(job, dest)
    if state not in TERMINAL_STATES:
        click.echo(
            f"vsdk: job {job} is {state}: these are its results so far (the files of ranks that "
            f"have not ended come when they end; `vsdk wait {job}` first for all of them)",
            err=True,
        )
    if as_json:
        print_json([str(f) for f in files])
    else:
        click.echo(f"{len(files)} file(s) extracted into {dest}")


COMMANDS = [submit, status, logs, wait, cancel, checkpoint, jobs, results]
