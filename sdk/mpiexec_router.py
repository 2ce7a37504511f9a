"""The in-process router of ``vsdk mpiexec``: it plays the agent and the relay for every rank.

It admits each rank by its secret, forwards every ``Data`` frame verbatim to the destination
rank's connection (per-destination FIFO: one writer at a time per connection, frames of one
source in order), acknowledges deposits at once (nothing here outlives the job anyway) and keeps
the job's fate: the first rank to exit non-zero, or to call ``MPI.Abort(code)``, ends the job and
the other ranks are terminated. The test bench ``tests/mpi/bench/replay_router.ReplayRouter``
extends it.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
from typing import Any

import trio

from vpool.protocol.errors import ErrorCode, RemoteProtocolError
from vpool.protocol.framing import Large, Small, decode_head
from vpool.protocol.messages import (
    PROTOCOL_VERSION,
    Abort,
    Ack,
    Data,
    Det,
    DetAck,
    Error,
    Finalize,
    Message,
    RankHello,
    RankWelcome,
)
from vpool.sdk.mpiexec_wire import _GONE, SocketFrames, _acquire, _frame, _read, _write

JOB = 0
READ_BUFFER = 1024 * 1024
SMALL_RUN = 64 * 1024  # frames up to this size are copied to go out in one write with acks
SOCKET_BUFFER = 4 * 1024 * 1024
KILL_GRACE = 2.0  # seconds between SIGTERM and SIGKILL for ranks being stopped
# Acks wait this long for a data frame to the same rank to ride along with (one write, one
# wake-up of the rank instead of two); only Finalize waits for them.
ACK_DELAY = 0.001


class _Rank:
    def __init__(self, index: int) -> None:
        self.index = index
        self.secret = secrets.token_hex(16)
        self.proc: trio.Process | None = None
        self.sock: Any = None  # its connection, once it said hello
        self.open = False  # the connection can still be written to
        self.lock = trio.Lock()  # one writer at a time: frames are never interleaved
        # Set once the rank connected, or can never connect (its process is gone).
        self.ready = trio.Event()
        self.acks: dict[int, int] = {}  # destination -> highest seq deposited, not yet acked
        self.ack_wanted = trio.Event()
        self.hung_up = trio.Event()  # its connection ended (or never began: process gone)
        self.exited = False
        self.finalized = False
        self.dets: list[bytes] = []  # its determinants (Det.data by index), acked at once


def hello_refusal(msg: RankHello, *, known: bool, connected: bool) -> Error | None:
    """Why a rank's hello is refused, as the agent would say it; None when it is welcome."""
    if msg.version != PROTOCOL_VERSION:
        return Error(
            ErrorCode.BAD_VERSION,
            f"this speaks protocol {PROTOCOL_VERSION}, the rank {msg.version}",
        )
    if not known:
        return Error(ErrorCode.UNKNOWN_SECRET, "no rank of this job has that secret")
    if connected:
        return Error(ErrorCode.ALREADY_CONNECTED, "this rank is already connected")
    return None


class _Router:
    def __init__(self, size: int, err: Any) -> None:
        self.size = size
        self.ranks = [_Rank(i) for i in range(size)]
        self.by_secret = {r.secret: r for r in self.ranks}
        self.exit_code: int | None = None
        self.all_exited = trio.Event()
        self.nursery: trio.Nursery | None = None
        self.err = err
        # While the ranks' output is read through pipes (``mpiexec._Lines``), what we say is
        # held until it is all shown: a rank's traceback comes before "rank 1 called
        # MPI.Abort(1)", as with mpiexec.
        self.held: list[str] | None = None

    def say(self, text: str) -> None:
        if self.held is not None:
            self.held.append(text)
            return
        try:
            os.write(self.err, f"vsdk mpiexec: {text}\n".encode())
        except OSError:
            pass

    # ---- the job's fate ------------------------------------------------------------------

    def fail(self, code: int, reason: str) -> None:
        if self.exit_code is not None:
            return
        self.exit_code = code
        self.say(reason)
        for rank in self.ranks:
            if rank.proc is not None and rank.proc.returncode is None:
                rank.proc.terminate()
        assert self.nursery is not None
        self.nursery.start_soon(self._kill_stragglers)

    async def _kill_stragglers(self) -> None:
        await trio.sleep(KILL_GRACE)
        for rank in self.ranks:
            if rank.proc is not None and rank.proc.returncode is None:
                rank.proc.kill()

    async def watch(self, rank: _Rank) -> None:
        assert rank.proc is not None
        code = await rank.proc.wait()
        rank.exited = True
        rank.ready.set()
        if rank.sock is not None:
            # Read what it sent before dying (an Abort says why) before judging the exit.
            with trio.move_on_after(KILL_GRACE):
                await rank.hung_up.wait()
        self.exited(rank, code)

    def exited(self, rank: _Rank, code: int) -> None:
        """The rank's (last) process ended with ``code``: the job's fate, as mpiexec's."""
        if code != 0 and self.exit_code is None:
            if code < 0:
                name = _signal_name(-code)
                self.fail(128 - code, f"rank {rank.index} was killed by signal {name}")
            else:
                self.fail(code, f"rank {rank.index} exited with code {code}")
        if all(r.exited for r in self.ranks):
            self.all_exited.set()

    async def forward_signals(self) -> None:
        """SIGTERM/SIGHUP to mpiexec stop the ranks too, rather than orphaning them."""
        try:
            receiver = trio.open_signal_receiver(signal.SIGTERM, signal.SIGHUP)
        except RuntimeError:
            return  # not the main thread: signals are someone else's business
        with receiver as signals:
            async for signum in signals:
                self.fail(128 + signum, f"stopping the ranks on {signal.Signals(signum).name}")

    # ---- connections ---------------------------------------------------------------------
    # Plain non-blocking sockets; trio only waits for readiness. Trying the system call first
    # and waiting only when it would block saves a trip through the scheduler per frame.

    async def accept(self, listener: socket.socket) -> None:
        assert self.nursery is not None
        while True:
            await trio.lowlevel.wait_readable(listener)
            try:
                sock, _ = listener.accept()
            except BlockingIOError:
                continue
            sock.setblocking(False)
            self.nursery.start_soon(self.serve, sock)

    async def serve(self, sock: socket.socket) -> None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
        except OSError:
            pass
        rank = None
        frames = SocketFrames(sock, buffer_size=READ_BUFFER, large=READ_BUFFER // 4)
        try:
            rank = await self._hello(frames)
            if rank is not None:
                await self._pump(rank, frames)
        except _GONE:
            pass
        except RemoteProtocolError as exc:
            who = f"rank {rank.index}" if rank is not None else "a rank"
            self.say(f"protocol error from {who}: {exc}")
            try:
                await _write(sock, _frame(Error(exc.code, str(exc))))
            except _GONE:
                pass
        finally:
            if rank is not None:
                rank.open = False
                rank.hung_up.set()
            trio.lowlevel.notify_closing(sock)
            sock.close()

    def _welcome(self, rank: _Rank) -> bytes:
        """What a rank gets right after its hello (the replay router adds its determinants)."""
        return _frame(RankWelcome(JOB, rank.index, self.size, 1, socket.gethostname()))

    def _connected(self, rank: _Rank, sock: socket.socket) -> None:
        """Start serving a rank that just said hello."""
        assert self.nursery is not None
        self.nursery.start_soon(self.send_acks, rank)

    async def _hello(self, frames: SocketFrames) -> _Rank | None:
        sock = frames.sock
        msg = await frames.message()
        if msg is None:
            return None
        if not isinstance(msg, RankHello):
            raise RemoteProtocolError(f"expected RankHello, got {type(msg).__name__}")
        rank = self.by_secret.get(msg.secret)
        refusal = hello_refusal(
            msg, known=rank is not None, connected=rank is not None and rank.sock is not None
        )
        if refusal is not None:
            await _write(sock, _frame(refusal))
            return None
        await _write(sock, self._welcome(rank))
        rank.sock, rank.open = sock, True
        rank.ready.set()
        self._connected(rank, sock)
        return rank

    async def _pump(self, rank: _Rank, frames: SocketFrames) -> None:
        """Read the rank's frames and route them, until it hangs up. Consecutive frames to one
        destination go out in one write; a large one streams through as it arrives."""
        sock = frames.sock
        scanner = frames.scanner
        acks = rank.acks
        run_dst = -1
        run: list[memoryview] = []
        while True:
            event = scanner.next_event()
            if event is None:
                # The run's views are of the scanner's buffer: out before the next read.
                await self._flush_run(run_dst, run)
                run_dst, run = -1, []
                if acks:
                    rank.ack_wanted.set()
                if not await frames.receive():
                    return
                continue
            if type(event) is Small:
                msg = decode_head(event.frame, event.header_len, event.payload_len)
                if type(msg) is Data:
                    self._check(rank, msg)
                    acks[msg.dst] = msg.seq
                    if msg.dst != run_dst:
                        await self._flush_run(run_dst, run)
                        run_dst, run = msg.dst, []
                    run.append(event.frame)
                    continue
                await self._flush_run(run_dst, run)
                run_dst, run = -1, []
                if type(msg) is Det:
                    await self.on_det(rank, sock, msg)
                else:
                    self._control(rank, msg)
                continue
            assert type(event) is Large
            msg = decode_head(event.head, event.header_len, event.payload_len)
            if type(msg) is not Data:
                raise RemoteProtocolError(f"{type(msg).__name__} frame with a payload")
            self._check(rank, msg)
            acks[msg.dst] = msg.seq
            await self._flush_run(run_dst, run)
            run_dst, run = -1, []
            # Too large to buffer: stream it through, holding the destination.
            head = bytes(event.head)
            have = scanner.take_payload()
            await self._stream(frames, msg.dst, [head, have], event.payload_len - have.nbytes)

    async def on_det(self, rank: _Rank, sock: socket.socket, msg: Det) -> None:
        """Log a determinant (in memory: nothing here outlives the job) and ack it at once."""
        if msg.job != JOB or msg.rank != rank.index:
            raise RemoteProtocolError(f"rank {rank.index} sent a determinant as {msg.rank}")
        if msg.index == len(rank.dets):
            rank.dets.append(msg.data)
        elif msg.index > len(rank.dets):
            raise RemoteProtocolError(f"determinant {msg.index} after {len(rank.dets) - 1}")
        await _acquire(rank.lock)
        try:
            await _write(sock, _frame(DetAck(JOB, rank.index, len(rank.dets))))
        except _GONE:
            pass
        finally:
            rank.lock.release()

    def _check(self, rank: _Rank, msg: Data) -> None:
        if msg.job != JOB or msg.src != rank.index:
            raise RemoteProtocolError(f"rank {rank.index} sent a message as {msg.src}")
        if not 0 <= msg.dst < self.size:
            raise RemoteProtocolError(f"message to rank {msg.dst} of {self.size}")

    def _control(self, rank: _Rank, msg: Message) -> None:
        if isinstance(msg, Finalize):
            rank.finalized = True
        elif isinstance(msg, Abort):
            self.fail(
                _exit_status(msg.code),
                f"rank {rank.index} called MPI.Abort({msg.code})"
                + (f": {msg.message}" if msg.message else ""),
            )
        else:
            raise RemoteProtocolError(f"unexpected {type(msg).__name__} from a rank")

    async def _flush_run(self, dst: int, run: list[memoryview]) -> None:
        if dst < 0 or not run:
            return
        frames = run[0] if len(run) == 1 else b"".join(run)
        target = self.ranks[dst]
        if not target.ready.is_set():
            await target.ready.wait()
        await _acquire(target.lock)
        try:
            if target.open:
                acks = _take_acks(target)
                try:
                    if acks and len(frames) <= SMALL_RUN:
                        await _write(target.sock, acks + frames)
                    else:
                        if acks:
                            await _write(target.sock, acks)
                        await _write(target.sock, frames)
                except _GONE:
                    target.open = False
        finally:
            target.lock.release()

    async def _stream(
        self, frames: SocketFrames, dst: int, head: list[Any], remaining: int
    ) -> None:
        """Write ``head`` (the frame's start), then the rest of its payload as it arrives."""
        target = self.ranks[dst]
        if not target.ready.is_set():
            await target.ready.wait()
        buf = bytearray(min(remaining, READ_BUFFER)) if remaining else bytearray()
        view = memoryview(buf)
        await _acquire(target.lock)
        try:
            chunks: list[Any] = head
            while True:
                for chunk in chunks:
                    if target.open and len(chunk):
                        try:
                            await _write(target.sock, chunk)
                        except _GONE:
                            target.open = False
                if not remaining:
                    return
                n = await _read(frames.sock, view[: min(remaining, len(buf))])
                if n == 0:
                    raise trio.BrokenResourceError("rank hung up mid-frame")
                remaining -= n
                chunks = [view[:n]]
        finally:
            target.lock.release()

    async def send_acks(self, rank: _Rank) -> None:
        """Acks nobody took along within ACK_DELAY go out on their own."""
        while True:
            await rank.ack_wanted.wait()
            rank.ack_wanted = trio.Event()
            await trio.sleep(ACK_DELAY)
            await _acquire(rank.lock)
            try:
                frames = _take_acks(rank)
                if frames and rank.open:
                    # A rank that is gone cannot take its acks, but what it sent last (an
                    # Abort) is still to be read: its reader carries on regardless.
                    try:
                        await _write(rank.sock, frames)
                    except _GONE:
                        rank.open = False
            finally:
                rank.lock.release()


def _take_acks(rank: _Rank) -> bytes:
    if not rank.acks:
        return b""
    frames = b"".join(_frame(Ack(JOB, rank.index, dst, seq)) for dst, seq in rank.acks.items())
    rank.acks.clear()
    return frames


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)


def _exit_status(code: int) -> int:
    """A process exit status for an MPI error code: nonzero codes never become 0."""
    status = code & 0xFF
    return status if status or not code else 1
