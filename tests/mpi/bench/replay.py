"""The replay bench: ``vsdk mpiexec`` with a rank killed and restarted with replay, or
checkpointed and restored, to test the runtime's fault tolerance (``vpool.protocol.rank_ft``) and
checkpoints (``vpool.mpi.checkpoint``) without the pool. A test tool, not part of vpool:

    python -m tests.mpi.bench.replay [--kill RANK:N] [--ckpt RANK:N:M[:orphan]] -n N app.py args

run from the repository root (``tests`` must be importable); ``run_async`` is the same in-process.

``--kill RANK:N`` (``run_async(kill=(RANK, N))``): once rank RANK's first incarnation deposited N
messages, the router kills it (SIGKILL) and starts incarnation 2, which replays: it gets its
determinants (``RankWelcome.replay_dets``), every message delivered to the rank so far again
from the start, and ``replay_sent`` (what it sent before). Re-sent messages are compared byte
for byte with the ones already delivered and dropped; a difference fails the job with "program
is not deterministic: ...", as the relays do.

``--ckpt RANK:N:M`` (``run_async(ckpt=...)``): the runtime's checkpoints without CRIU. Once rank
RANK's incarnation 1 (2 when ``--kill`` names the same rank) deposited N messages, the router
requests a checkpoint 1 (``CheckpointRequest`` + the signal; the rank's output is not read
meanwhile), takes ``CkptForked``, waits until every frame it counts as sent is in, and after M
more deposits kills the rank; the forked clone, reparented by that kill, finds
``.vpool-restore.json`` in its rank directory and becomes the next incarnation, replaying from
its counters. With a fourth field ``orphan`` no restore file is written: the clone must exit by
itself and the rank restarts from the beginning.

This router keeps every frame (the relays' logs) and reads whole frames, so it is slower than
the plain one; output of the ranks goes through pipes and what an earlier incarnation already
showed (per rank and stream, by byte offset) is not shown again. The router is
``replay_router.ReplayRouter``, its checkpoint half ``ckpt.CheckpointBench``; both extend the
router of ``vsdk mpiexec`` (``vpool.sdk.mpiexec_router``).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
from collections.abc import Mapping, Sequence

import trio

from tests.mpi.bench.ckpt import ORPHAN_GRACE, _close_writers
from tests.mpi.bench.replay_router import ReplayRouter, _RRank
from vpool.sdk.mpiexec import rank_command


def parse_kill(spec: str) -> tuple[int, int]:
    """``"RANK:N"`` -> (RANK, N)."""
    try:
        rank, n = (int(x) for x in spec.split(":"))
    except ValueError:
        raise ValueError(f"--kill {spec!r}: expected RANK:MESSAGES") from None
    if rank < 0 or n < 0:
        raise ValueError(f"--kill {spec!r}: expected RANK:MESSAGES")
    return rank, n


def parse_ckpt(spec: str) -> tuple[int, int, int, bool]:
    """``"RANK:N:M"`` or ``"RANK:N:M:orphan"`` -> (RANK, N, M, orphan)."""
    fields = spec.split(":")
    orphan = len(fields) == 4 and fields[3] == "orphan"
    try:
        if len(fields) != 3 and not orphan:
            raise ValueError
        rank, n, m = (int(x) for x in fields[:3])
    except ValueError:
        raise ValueError(f"--ckpt {spec!r}: expected RANK:N:M[:orphan]") from None
    if rank < 0 or n < 1 or m < 0:
        raise ValueError(f"--ckpt {spec!r}: expected RANK:N:M[:orphan]")
    return rank, n, m, orphan


async def run_async(
    n: int,
    argv: Sequence[str],
    *,
    kill: tuple[int, int] | None = None,
    ckpt: tuple[int, int, int, bool] | None = None,
    env: Mapping[str, str] | None = None,
    stdout: int = 1,
    stderr: int = 2,
) -> int:
    """Run ``n`` ranks of ``argv`` with the replaying router; the job's exit code. ``kill``:
    (rank, messages) as ``--kill``; ``ckpt``: (rank, n, m, orphan) as ``--ckpt``.
    ``stdout``/``stderr``: file descriptors."""
    import tempfile

    if n < 1:
        raise ValueError("need at least one rank")
    if kill is not None and not 0 <= kill[0] < n:
        raise ValueError(f"cannot kill rank {kill[0]} of {n}")
    if ckpt is not None and not 0 <= ckpt[0] < n:
        raise ValueError(f"cannot checkpoint rank {ckpt[0]} of {n}")
    # Checkpoints of a pool job are its agent's business, not this bench's (as in mpiexec).
    hidden = ("VPOOL_CKPT_SIGNAL", "VPOOL_RANK_DIR")
    base = {k: v for k, v in {**os.environ, **(env or {})}.items() if k not in hidden}
    router = ReplayRouter(n, stderr, kill, rank_command(argv), base, ckpt)
    router.out_fds = (stdout, stderr)
    with tempfile.TemporaryDirectory(prefix="vpool-mpiexec-") as tmp:
        path = os.path.join(tmp, "ranks.sock")
        router.sock_path = path
        if ckpt is not None:
            for rank in router.ranks:
                assert isinstance(rank, _RRank)
                rank.rank_dir = os.path.join(tmp, f"rank-{rank.index}")
                os.mkdir(rank.rank_dir, 0o700)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(path)
            listener.listen(max(n, 16))
            listener.setblocking(False)
            async with trio.open_nursery() as nursery:
                router.nursery = nursery
                nursery.start_soon(router.accept, listener)
                nursery.start_soon(router.forward_signals)
                for rank in router.ranks:
                    assert isinstance(rank, _RRank)
                    nursery.start_soon(router.run_rank, rank)
                await router.all_exited.wait()
                for orphan in router.orphans:
                    with trio.move_on_after(ORPHAN_GRACE + 1):
                        await orphan.wait()
                nursery.cancel_scope.cancel()
        finally:
            for rank in router.ranks:
                if rank.proc is not None and rank.proc.returncode is None:
                    rank.proc.kill()
            router.kill_clones()
            for rank in router.ranks:
                assert isinstance(rank, _RRank)
                _close_writers(rank)
            trio.lowlevel.notify_closing(listener)
            listener.close()
    return router.exit_code or 0


def main(args: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.mpi.bench.replay",
        description="Run an mpi4py program's ranks on this machine with a rank killed and "
        "restarted with replay (--kill) or checkpointed and restored (--ckpt): a test bench.",
        epilog="example: python -m tests.mpi.bench.replay --kill 0:20 -n 3 app.py",
    )
    parser.add_argument("-n", "-np", dest="n", type=int, default=1, help="number of ranks")
    parser.add_argument(
        "--kill",
        metavar="RANK:N",
        help="kill rank RANK once it deposited N messages; it restarts with replay",
    )
    parser.add_argument(
        "--ckpt",
        metavar="RANK:N:M[:orphan]",
        help="checkpoint rank RANK after N messages, kill it M messages after the commit; "
        "its clone restores (orphan: no restore file, the clone exits)",
    )
    parser.add_argument("program", nargs=argparse.REMAINDER, help="app.py and its arguments")
    ns = parser.parse_args(args)
    program = list(ns.program)
    if program and program[0] == "--":
        program = program[1:]
    if not program:
        parser.error("no program given")
    try:
        kill = parse_kill(ns.kill) if ns.kill is not None else None
        ckpt = parse_ckpt(ns.ckpt) if ns.ckpt is not None else None
    except ValueError as exc:
        parser.error(str(exc))
    for name, spec in (("kill", kill), ("checkpoint", ckpt)):
        if spec is not None and not 0 <= spec[0] < ns.n:
            parser.error(f"cannot {name} rank {spec[0]} of {ns.n}")

    async def run() -> int:
        return await run_async(ns.n, program, kill=kill, ckpt=ckpt)

    try:
        return trio.run(run)
    except KeyboardInterrupt:
        return 128 + signal.SIGINT  # the ranks got the same SIGINT and are killed by now


if __name__ == "__main__":
    sys.exit(main())
