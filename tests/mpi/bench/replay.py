"""``vsdk mpiexec`` with a rank killed and restarted with replay: a test bench for the runtime's
fault tolerance (``vpool.mpi.ft``) without the pool.

Hidden switch: ``VPOOL_MPIEXEC_KILL="RANK:N"`` in the environment of ``vsdk mpiexec`` (or
``run_async(kill=(RANK, N))``): once rank RANK's first incarnation deposited N messages, the
router kills it (SIGKILL) and starts incarnation 2, which replays: it gets its determinants
(``RankWelcome.replay_dets``), every message delivered to the rank so far again from the start,
and ``replay_sent`` (what it sent before). Re-sent messages are compared byte for byte with the
ones already delivered and dropped; a difference fails the job with "program is not
deterministic: ...", as the relays do.

Hidden switch ``VPOOL_MPIEXEC_CKPT="RANK:N:M"`` (``run_async(ckpt=...)``): a test bench for the
runtime's checkpoints (``vpool.mpi.checkpoint``) without CRIU. Once rank RANK's incarnation 1
(2 when ``VPOOL_MPIEXEC_KILL`` names the same rank) deposited N messages, the router requests a
checkpoint 1 (``CheckpointRequest`` + the signal; the rank's output is not read meanwhile),
takes ``CkptForked``, waits until every frame it counts as sent is in, and after M more
deposits kills the rank; the forked
clone, reparented by that kill, finds ``.vpool-restore.json`` in its rank directory and becomes
the next incarnation, replaying from its counters. With a fourth field ``orphan`` no restore file
is written: the clone must exit by itself and the rank restarts from the beginning.

This router keeps every frame (the relays' logs) and reads whole frames, so it is slower than
the plain one; output of the ranks goes through pipes and what an earlier incarnation already
showed (per rank and stream, by byte offset) is not shown again. The router is
``mpiexec_replay_router.ReplayRouter``, its checkpoint half ``mpiexec_ckpt.CheckpointBench``.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence

import trio

from vpool.sdk.mpiexec import rank_command
from vpool.sdk.mpiexec_ckpt import ORPHAN_GRACE, _close_writers
from vpool.sdk.mpiexec_replay_router import ReplayRouter, _RRank


def parse_kill(spec: str) -> tuple[int, int]:
    """``"RANK:N"`` -> (RANK, N)."""
    try:
        rank, n = (int(x) for x in spec.split(":"))
    except ValueError:
        raise ValueError(f"VPOOL_MPIEXEC_KILL={spec!r}: expected RANK:MESSAGES") from None
    if rank < 0 or n < 0:
        raise ValueError(f"VPOOL_MPIEXEC_KILL={spec!r}: expected RANK:MESSAGES")
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
        raise ValueError(f"VPOOL_MPIEXEC_CKPT={spec!r}: expected RANK:N:M[:orphan]") from None
    if rank < 0 or n < 1 or m < 0:
        raise ValueError(f"VPOOL_MPIEXEC_CKPT={spec!r}: expected RANK:N:M[:orphan]")
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
    (rank, messages) as ``VPOOL_MPIEXEC_KILL``; ``ckpt``: as ``VPOOL_MPIEXEC_CKPT``.
    ``stdout``/``stderr``: file descriptors."""
    import tempfile

    if n < 1:
        raise ValueError("need at least one rank")
    if kill is not None and not 0 <= kill[0] < n:
        raise ValueError(f"cannot kill rank {kill[0]} of {n}")
    if ckpt is not None and not 0 <= ckpt[0] < n:
        raise ValueError(f"cannot checkpoint rank {ckpt[0]} of {n}")
    hidden = ("VPOOL_MPIEXEC_KILL", "VPOOL_MPIEXEC_CKPT", "VPOOL_CKPT_SIGNAL", "VPOOL_RANK_DIR")
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
