"""``vsdk mpiexec -n N app.py args``: run an MPI program's ranks on this machine, as mpiexec does.

No coordinator, relays or TLS: an in-process trio router plays the agent and relay for every rank.
It listens on a unix socket in a private temporary directory, admits each rank by its secret,
forwards every ``Data`` frame verbatim to the destination rank's connection (per-destination
FIFO: one writer at a time per connection, frames of one source in order) and acknowledges
deposits at once, since nothing here outlives the job anyway.

Like mpiexec: the ranks' stdout and stderr come out here as whole lines (a line of one rank is
never cut by another's: ``protocol.lines.LineAssembler`` over a pipe per rank and stream);
stdin goes to rank 0 only. What a failed rank means is the job's failure mode (``--on-failure``):

- ``abort``: the first rank to exit non-zero (or to call ``MPI.Abort(code)``) ends the job, the
  other ranks are terminated and its code is returned, with a line on stderr saying which rank;
- ``transparent`` (the default, as for pool jobs): the same as ``abort`` here. In a pool a lost
  rank is restarted and replays its logged messages; here no relay keeps logs to replay from;
- ``ulfm``, ``blank``, ``shrink``, ``rebuild``: a rank killed by a signal is declared failed and
  the job goes on: the other ranks are told (``MPI.ERR_PROC_FAILED``, then ULFM's calls,
  ``vpool.mpi.ulfm``, or FT-MPI's ``COMM_WORLD.Dup()``, ``vpool.mpi.ftmpi``), a line on stderr
  names it, and the job's code is the survivors' (0 when they all exit 0). A rank that exits
  non-zero by itself, or calls ``MPI.Abort``, still ends the job. A ``rebuild`` replacement is
  a spawned process (below).

Environment of the ranks as in docs/internals.md ("Rank <-> agent").

Spawning (``MPI.Comm.Spawn``): the router starts every process a spawn asks for, as ranks after
the highest so far, running this interpreter (``mpiexec_router.python_arguments``), with the
ranks' environment and output; they end the job as ranks do, except a reported spawn's (info
``vpool_reported``) killed by a signal, which is declared failed as in ``ulfm``. A job may spawn
``SPAWN_SPACE`` processes over its run; ``--universe N`` is ``MPI.UNIVERSE_SIZE``.

The router is ``mpiexec_router`` (its frames and socket I/O ``mpiexec_wire``).

    python -m vpool.sdk.mpiexec -n 4 app.py args
    python -m vpool.sdk.mpiexec -n 4 --on-failure ulfm -- app.py args
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

import trio

from vpool.protocol.lines import LineAssembler
from vpool.sdk.mpiexec_router import FAILURE_MODES, JOB, _Rank, _Router

# Rank numbers a job may spawn over its run, past its first ranks (every rank's arrays indexed
# by rank number cover them all); a spawn past them gets an error.
SPAWN_SPACE = 1024

SHIM_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "mpi", "shim")


def rank_command(argv: Sequence[str]) -> list[str]:
    """The command of a rank: ``app.py args`` and ``python app.py args`` both run under this
    interpreter (the one vpool is installed in); other executables run as given."""
    if not argv:
        raise ValueError("no program to run")
    first = argv[0]
    if first.endswith(".py") or first in ("-m", "-c"):
        return [sys.executable, *argv]
    if re.fullmatch(r"python[0-9.]*", os.path.basename(first)):
        return [sys.executable, *argv[1:]]
    return list(argv)


def rank_environment(
    base: Mapping[str, str],
    rank: int,
    size: int,
    sock_path: str,
    secret: str,
    on_failure: str = "transparent",
) -> dict[str, str]:
    env = dict(base)
    if on_failure != "transparent":
        env["VPOOL_FT"] = "0"  # as on a pool: nothing replays, so nothing is logged
    # Checkpoints are the pool agent's business (a rank of a pool job may run mpiexec itself).
    env.pop("VPOOL_CKPT_SIGNAL", None)
    env.pop("VPOOL_RANK_DIR", None)
    old = env.get("PYTHONPATH")
    env["PYTHONPATH"] = SHIM_DIR + (os.pathsep + old if old else "")
    env.update(
        PYTHONHASHSEED="0",
        PYTHONUNBUFFERED="1",
        VPOOL_AGENT_SOCKET=sock_path,
        VPOOL_RANK_SECRET=secret,
        VPOOL_JOB=str(JOB),
        VPOOL_RANK=str(rank),
        VPOOL_SIZE=str(size),
        VPOOL_INCARNATION="1",
    )
    return env


async def run_async(
    n: int,
    argv: Sequence[str],
    *,
    stdin: Any = None,
    env: Mapping[str, str] | None = None,
    stdout: Any = None,
    stderr: Any = None,
    on_failure: str = "transparent",
    universe: int = 0,
) -> int:
    """Run ``n`` ranks of ``argv``; the job's exit code.

    ``stdin``: None (rank 0 reads this process's stdin), bytes (fed to rank 0), or a file/fd.
    ``env``: extra environment variables for the ranks, over this process's environment.
    ``stdout``/``stderr``: None to inherit, else a file/fd shared by all ranks.
    ``on_failure``: the job's failure mode (module docstring).
    ``universe``: ``MPI.UNIVERSE_SIZE`` (0: ``n`` + the machine's CPUs).
    """
    if n < 1:
        raise ValueError("need at least one rank")
    command = rank_command(argv)
    err_fd = stderr if isinstance(stderr, int) else (stderr.fileno() if stderr else 2)
    # Inherited stdout/stderr are shown as whole lines, as mpiexec does; a file or fd given by
    # the caller gets the ranks' bytes directly.
    lines = _Lines() if stdout is None and stderr is None else None
    router = _Router(
        n,
        err_fd,
        on_failure,
        space=n + SPAWN_SPACE,
        universe=universe or n + (os.cpu_count() or 1),
    )
    if lines is not None:
        router.held = []
    base = {**os.environ, **(env or {})}
    with tempfile.TemporaryDirectory(prefix="vpool-mpiexec-") as tmp:
        path = os.path.join(tmp, "ranks.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(path)
            listener.listen(max(n, 16))
            listener.setblocking(False)
            async with trio.open_nursery() as nursery:
                router.nursery = nursery

                async def start(rank: _Rank, cmd: list[str], rank_stdin: Any) -> None:
                    """Start one rank's process; its output is shown like every rank's."""
                    env = rank_environment(
                        base, rank.index, router.size, path, rank.secret, on_failure
                    )
                    try:
                        rank.proc = await trio.lowlevel.open_process(
                            cmd,
                            stdin=rank_stdin,
                            stdout=subprocess.PIPE if lines is not None else stdout,
                            stderr=subprocess.PIPE if lines is not None else stderr,
                            env=env,
                        )
                    except OSError as exc:
                        router.say(f"cannot start rank {rank.index}: {exc}")
                        rank.exited = True
                        rank.ready.set()
                        router.exited(rank, 127)
                        return
                    nursery.start_soon(router.watch, rank)
                    if lines is not None:
                        for name, pipe in (
                            ("stdout", rank.proc.stdout),
                            ("stderr", rank.proc.stderr),
                        ):
                            assert pipe is not None
                            lines.start(nursery, rank.index, name, pipe)

                async def launch(rank: _Rank, args: list[str]) -> None:
                    # A spawned process: Python's arguments under this interpreter.
                    await start(rank, [sys.executable, *args], subprocess.DEVNULL)

                router.launch = launch
                nursery.start_soon(router.accept, listener)
                nursery.start_soon(router.forward_signals)
                for rank in list(router.ranks):
                    rank_stdin = subprocess.DEVNULL
                    if rank.index == 0:
                        rank_stdin = subprocess.PIPE if isinstance(stdin, bytes) else stdin
                    await start(rank, command, rank_stdin)
                first = router.ranks[0].proc
                if isinstance(stdin, bytes) and first is not None and first.stdin is not None:
                    nursery.start_soon(_feed, first.stdin, stdin)
                await router.all_exited.wait()
                if lines is not None:
                    # What the ranks wrote last is still in the pipes: read it to the end
                    # (a child a rank left behind may hold a pipe open: not for long).
                    with trio.move_on_after(DRAIN_TIMEOUT):
                        await lines.drained()
                    lines.flush()
                    held, router.held = router.held or [], None
                    for text in held:
                        router.say(text)
                nursery.cancel_scope.cancel()
        finally:
            for rank in router.ranks:
                if rank.proc is not None and rank.proc.returncode is None:
                    rank.proc.kill()
            held, router.held = router.held or [], None  # not shown yet (interrupted)
            for text in held:
                router.say(text)
            trio.lowlevel.notify_closing(listener)
            listener.close()
    return router.exit_code or 0


DRAIN_TIMEOUT = 5.0  # seconds to read what the ranks left in their pipes after they exited


class _Lines:
    """The ranks' stdout and stderr pipes, shown on ours as whole lines."""

    def __init__(self) -> None:
        self.assembler = LineAssembler()
        self.open = 0
        self.done = trio.Event()

    def start(
        self, nursery: trio.Nursery, rank: int, stream: str, pipe: trio.abc.ReceiveStream
    ) -> None:
        self.open += 1  # counted now: ``drained`` must wait for a pump not running yet
        nursery.start_soon(self.pump, rank, stream, pipe)

    async def pump(self, rank: int, stream: str, pipe: trio.abc.ReceiveStream) -> None:
        try:
            async with pipe:
                while chunk := await pipe.receive_some(65536):
                    _show(self.assembler.feed(rank, stream, chunk))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            self.open -= 1
            if not self.open:
                self.done.set()

    async def drained(self) -> None:
        if self.open:
            await self.done.wait()

    def flush(self) -> None:
        _show(self.assembler.flush())


def _show(lines: list[tuple[int, str, bytes]]) -> None:
    for _rank, stream, data in lines:
        fd = 2 if stream == "stderr" else 1
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]


async def _feed(pipe: Any, data: bytes) -> None:
    try:
        await pipe.send_all(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    finally:
        await pipe.aclose()


def run(
    n: int,
    argv: list[str],
    *,
    stdin: Any = None,
    env: Mapping[str, str] | None = None,
    on_failure: str = "transparent",
    universe: int = 0,
) -> int:
    """Run ``n`` ranks of ``argv`` (``app.py args``) on this machine; the job's exit code."""

    async def main() -> int:
        return await run_async(
            n, argv, stdin=stdin, env=env, on_failure=on_failure, universe=universe
        )

    try:
        return trio.run(main)
    except KeyboardInterrupt:
        return 128 + signal.SIGINT  # the ranks got the same SIGINT and are killed by now


def main(args: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vpool.sdk.mpiexec",
        description="Run an mpi4py program's ranks on this machine.",
        epilog="example: python -m vpool.sdk.mpiexec -n 4 app.py --steps 10",
    )
    parser.add_argument("-n", "-np", dest="n", type=int, default=1, help="number of ranks")
    parser.add_argument(
        "--on-failure",
        choices=FAILURE_MODES,
        default="transparent",
        help="what a rank killed by a signal means: abort (the job ends; transparent is the "
        "same here, with no relays to replay from) or ulfm, blank, shrink, rebuild (it is "
        "declared failed, the others are told and recover as the mode says; the job's code is "
        "the survivors')",
    )
    parser.add_argument(
        "--universe",
        "-usize",
        type=int,
        default=0,
        metavar="N",
        help="MPI.UNIVERSE_SIZE, the processes the job expects to have (a hint: a spawn starts "
        "every process it asks for); default: the ranks plus this machine's CPUs",
    )
    parser.add_argument("program", nargs=argparse.REMAINDER, help="app.py and its arguments")
    ns = parser.parse_args(args)
    program = list(ns.program)
    if program and program[0] == "--":
        program = program[1:]
    if not program:
        parser.error("no program given")
    if ns.universe < 0:
        parser.error("--universe must be at least 0")
    return run(ns.n, program, on_failure=ns.on_failure, universe=ns.universe)


if __name__ == "__main__":
    sys.exit(main())
