"""``vsdk mpiexec`` with a rank killed and restarted with replay: a test bench for the runtime's
fault tolerance (``vpool.sdk.mpi.ft``) without the pool.

Hidden switch: ``VPOOL_MPIEXEC_KILL="RANK:N"`` in the environment of ``vsdk mpiexec`` (or
``run_async(kill=(RANK, N))``): once rank RANK's first incarnation deposited N messages, the
router kills it (SIGKILL) and starts incarnation 2, which replays: it gets its determinants
(``RankWelcome.replay_dets``), every message delivered to the rank so far again from the start,
and ``replay_sent`` (what it sent before). Re-sent messages are compared byte for byte with the
ones already delivered and dropped; a difference fails the job with "program is not
deterministic: ...", as the relays do.

This router keeps every frame (the relays' logs) and reads whole frames, so it is slower than
the plain one; output of the ranks goes through pipes and what an earlier incarnation already
showed (per rank and stream, by byte offset) is not shown again.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
from collections.abc import Mapping, Sequence
from typing import Any

import trio

from vpool.protocol.errors import RemoteProtocolError
from vpool.protocol.framing import DEFAULT_MAX_HEADER, DEFAULT_MAX_PAYLOAD
from vpool.protocol.messages import Ack, Data, Det, Message, RankWelcome, decode
from vpool.sdk.mpiexec import (
    _GONE,
    JOB,
    KILL_GRACE,
    READ_BUFFER,
    _acquire,
    _frame,
    _Rank,
    _read,
    _Router,
    _signal_name,
    _unpack_prefix,
    _write,
    rank_command,
    rank_environment,
)


def parse_kill(spec: str) -> tuple[int, int]:
    """``"RANK:N"`` -> (RANK, N)."""
    try:
        rank, n = (int(x) for x in spec.split(":"))
    except ValueError:
        raise ValueError(f"VPOOL_MPIEXEC_KILL={spec!r}: expected RANK:MESSAGES") from None
    if rank < 0 or n < 0:
        raise ValueError(f"VPOOL_MPIEXEC_KILL={spec!r}: expected RANK:MESSAGES")
    return rank, n


class _RRank(_Rank):
    def __init__(self, index: int) -> None:
        super().__init__(index)
        self.incarnation = 1
        self.log: list[bytes] = []  # Data frames delivered to this rank, in delivery order
        self.grew = trio.Event()
        self.sent: dict[int, list[bytes]] = {}  # destination -> frames from this rank, by seq
        self.deposits = 0  # Data frames deposited by the current incarnation
        self.restarting = False
        self.shown = [0, 0]  # bytes of stdout/stderr already shown (over all incarnations)


class ReplayRouter(_Router):
    def __init__(
        self, size: int, err: Any, kill: tuple[int, int] | None, command: list[str], env: Any
    ) -> None:
        super().__init__(size, err)
        self.ranks = [_RRank(i) for i in range(size)]
        self.by_secret = {r.secret: r for r in self.ranks}
        self.kill = kill
        self.command = command
        self.env = env
        self.sock_path = ""
        self.out_fds = (1, 2)
        self.restarts = 0

    # ---- processes -------------------------------------------------------------------------

    async def run_rank(self, rank: _RRank) -> None:
        """Run the rank's incarnations until one ends without being killed by the router."""
        while True:
            env = rank_environment(self.env, rank.index, self.size, self.sock_path, rank.secret)
            env["VPOOL_INCARNATION"] = str(rank.incarnation)
            proc = await trio.lowlevel.open_process(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
            )
            rank.proc = proc
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._copy, rank, proc.stdout, 0)
                nursery.start_soon(self._copy, rank, proc.stderr, 1)
                code = await proc.wait()
            if rank.sock is not None:
                with trio.move_on_after(KILL_GRACE):
                    await rank.hung_up.wait()
            if rank.restarting and self.exit_code is None:
                self._new_incarnation(rank)
                continue
            break
        rank.exited = True
        rank.ready.set()
        if code != 0 and self.exit_code is None:
            if code < 0:
                name = _signal_name(-code)
                self.fail(128 - code, f"rank {rank.index} was killed by signal {name}")
            else:
                self.fail(code, f"rank {rank.index} exited with code {code}")
        if all(r.exited for r in self.ranks):
            self.all_exited.set()

    def _new_incarnation(self, rank: _RRank) -> None:
        del self.by_secret[rank.secret]
        rank.secret = secrets.token_hex(16)
        self.by_secret[rank.secret] = rank
        rank.incarnation += 1
        rank.restarting = False
        rank.deposits = 0
        rank.sock = None
        rank.open = False
        rank.hung_up = trio.Event()
        rank.finalized = False
        self.restarts += 1
        self.say(f"restarting rank {rank.index} (incarnation {rank.incarnation}) with replay")

    async def _copy(self, rank: _RRank, pipe: Any, stream: int) -> None:
        """Show what this incarnation writes beyond what earlier ones already showed."""
        offset = 0
        fd = self.out_fds[stream]
        while True:
            data = await pipe.receive_some(65536)
            if not data:
                return
            start, offset = offset, offset + len(data)
            if offset > rank.shown[stream]:
                new = data[max(0, rank.shown[stream] - start) :]
                rank.shown[stream] = offset
                try:
                    os.write(fd, new)
                except OSError:
                    pass

    # ---- connections -------------------------------------------------------------------------

    def _welcome(self, rank: _Rank) -> bytes:
        assert isinstance(rank, _RRank)
        welcome = RankWelcome(
            JOB,
            rank.index,
            self.size,
            rank.incarnation,
            socket.gethostname(),
            replay_dets=len(rank.dets),
            replay_sent={d: len(frames) for d, frames in rank.sent.items() if frames},
        )
        return _frame(welcome) + b"".join(
            _frame(Det(JOB, rank.index, i, data)) for i, data in enumerate(rank.dets)
        )

    def _connected(self, rank: _Rank, sock: socket.socket) -> None:
        assert isinstance(rank, _RRank) and self.nursery is not None
        self.nursery.start_soon(self._deliver, rank, sock)

    async def _deliver(self, rank: _RRank, sock: socket.socket) -> None:
        """Push the rank's log to this connection, from the start (a new incarnation replays)."""
        pos = 0
        while rank.sock is sock:
            if pos < len(rank.log):
                frames = rank.log[pos:]
                pos += len(frames)
                await _acquire(rank.lock)
                try:
                    await _write(sock, b"".join(frames))
                except _GONE:
                    return
                finally:
                    rank.lock.release()
                continue
            await rank.grew.wait()

    async def _pump(self, rank: _Rank, sock: socket.socket) -> None:
        assert isinstance(rank, _RRank)
        buf = bytearray()
        chunk = bytearray(READ_BUFFER)
        view = memoryview(chunk)
        while True:
            n = await _read(sock, view)
            if n == 0:
                return
            buf += view[:n]
            start = 0
            while len(buf) - start >= 8:
                hlen, plen = _unpack_prefix(buf, start)
                if hlen == 0 or hlen > DEFAULT_MAX_HEADER or plen > DEFAULT_MAX_PAYLOAD:
                    raise RemoteProtocolError("malformed frame prefix")
                end = start + 8 + hlen + plen
                if end > len(buf):
                    break
                msg = decode(bytes(buf[start + 8 : start + 8 + hlen]))
                frame = bytes(buf[start:end])
                start = end
                await self._handle(rank, sock, msg, frame, plen)
            del buf[:start]

    async def _handle(
        self, rank: _RRank, sock: socket.socket, msg: Message, frame: bytes, plen: int
    ) -> None:
        if type(msg) is Data:
            self._check(rank, msg)
            await self._deposit(rank, sock, msg, frame)
        elif plen:
            raise RemoteProtocolError(f"{type(msg).__name__} frame with a payload")
        elif type(msg) is Det:
            await self.on_det(rank, sock, msg)
        else:
            self._control(rank, msg)

    async def _deposit(self, rank: _RRank, sock: socket.socket, msg: Data, frame: bytes) -> None:
        chan = rank.sent.setdefault(msg.dst, [])
        if msg.seq <= len(chan):
            if chan[msg.seq - 1] != frame:
                self.fail(
                    1,
                    f"program is not deterministic: rank {rank.index} re-sent message "
                    f"{msg.seq} to rank {msg.dst} (channel {rank.index}->{msg.dst}) with "
                    "different content",
                )
                return
        elif msg.seq == len(chan) + 1:
            chan.append(frame)
            target = self.ranks[msg.dst]
            assert isinstance(target, _RRank)
            target.log.append(frame)
            target.grew.set()
            target.grew = trio.Event()
        else:
            raise RemoteProtocolError(f"message {msg.seq} after {len(chan)} on a channel")
        await _acquire(rank.lock)
        try:
            await _write(sock, _frame(Ack(JOB, rank.index, msg.dst, msg.seq)))
        except _GONE:
            pass
        finally:
            rank.lock.release()
        rank.deposits += 1
        kill = self.kill
        if (
            kill is not None
            and kill[0] == rank.index
            and rank.incarnation == 1
            and rank.deposits == kill[1]
            and rank.proc is not None
            and rank.proc.returncode is None
        ):
            rank.restarting = True
            rank.proc.kill()


async def run_async(
    n: int,
    argv: Sequence[str],
    *,
    kill: tuple[int, int] | None = None,
    env: Mapping[str, str] | None = None,
    stdout: int = 1,
    stderr: int = 2,
) -> int:
    """Run ``n`` ranks of ``argv`` with the replaying router; the job's exit code. ``kill``:
    (rank, messages) as ``VPOOL_MPIEXEC_KILL``. ``stdout``/``stderr``: file descriptors."""
    import tempfile

    if n < 1:
        raise ValueError("need at least one rank")
    if kill is not None and not 0 <= kill[0] < n:
        raise ValueError(f"cannot kill rank {kill[0]} of {n}")
    base = {k: v for k, v in {**os.environ, **(env or {})}.items() if k != "VPOOL_MPIEXEC_KILL"}
    router = ReplayRouter(n, stderr, kill, rank_command(argv), base)
    router.out_fds = (stdout, stderr)
    with tempfile.TemporaryDirectory(prefix="vpool-mpiexec-") as tmp:
        path = os.path.join(tmp, "ranks.sock")
        router.sock_path = path
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
                nursery.cancel_scope.cancel()
        finally:
            for rank in router.ranks:
                if rank.proc is not None and rank.proc.returncode is None:
                    rank.proc.kill()
            trio.lowlevel.notify_closing(listener)
            listener.close()
    return router.exit_code or 0
