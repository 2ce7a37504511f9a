"""``vsdk mpiexec -n N app.py args``: run an MPI program's ranks on this machine, as mpiexec does.

No coordinator, relays or TLS: an in-process trio router plays the agent and relay for every rank.
It listens on a unix socket in a private temporary directory, admits each rank by its secret,
forwards every ``Data`` frame verbatim to the destination rank's connection (per-destination
FIFO: one writer at a time per connection, frames of one source in order) and acknowledges
deposits at once, since nothing here outlives the job anyway.

Like mpiexec: ranks inherit stdout/stderr; stdin goes to rank 0 only; the first rank to exit
non-zero (or to call ``MPI.Abort(code)``) ends the job, the other ranks are terminated and its code
is returned. Environment of the ranks as in docs/internals.md ("Rank <-> agent").

    python -m vpool.sdk.mpiexec -n 4 app.py args
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import signal
import socket
import struct
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

import trio

from vpool.protocol.errors import RemoteProtocolError
from vpool.protocol.framing import DEFAULT_MAX_HEADER, DEFAULT_MAX_PAYLOAD, PREFIX
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
    decode,
    encode,
)

SHIM_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mpi", "shim")
JOB = 0
READ_BUFFER = 1024 * 1024
SMALL_RUN = 64 * 1024  # frames up to this size are copied to go out in one write with acks
SOCKET_BUFFER = 4 * 1024 * 1024
KILL_GRACE = 2.0  # seconds between SIGTERM and SIGKILL for ranks being stopped
# Acks wait this long for a data frame to the same rank to ride along with (one write, one
# wake-up of the rank instead of two); only Finalize waits for them.
ACK_DELAY = 0.001

_unpack_prefix = struct.Struct("!II").unpack_from


def _frame(msg: Message) -> bytes:
    header = encode(msg)
    return PREFIX.pack(len(header), 0) + header


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
    base: Mapping[str, str], rank: int, size: int, sock_path: str, secret: str
) -> dict[str, str]:
    env = dict(base)
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


class _Router:
    def __init__(self, size: int, err: Any) -> None:
        self.size = size
        self.ranks = [_Rank(i) for i in range(size)]
        self.by_secret = {r.secret: r for r in self.ranks}
        self.exit_code: int | None = None
        self.all_exited = trio.Event()
        self.nursery: trio.Nursery | None = None
        self.err = err

    def say(self, text: str) -> None:
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
        try:
            rank = await self._hello(sock)
            if rank is not None:
                await self._pump(rank, sock)
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

    async def _hello(self, sock: socket.socket) -> _Rank | None:
        prefix = await _read_exact(sock, 8)
        hlen, plen = _unpack_prefix(prefix, 0)
        if hlen == 0 or hlen > DEFAULT_MAX_HEADER or plen:
            raise RemoteProtocolError("malformed hello")
        msg = decode(await _read_exact(sock, hlen))
        if not isinstance(msg, RankHello):
            raise RemoteProtocolError(f"expected RankHello, got {type(msg).__name__}")
        rank = self.by_secret.get(msg.secret)
        if msg.version != PROTOCOL_VERSION or rank is None or rank.sock is not None:
            await _write(sock, _frame(Error("bad_hello", "unknown secret or version")))
            return None
        await _write(sock, self._welcome(rank))
        rank.sock, rank.open = sock, True
        rank.ready.set()
        self._connected(rank, sock)
        return rank

    async def _pump(self, rank: _Rank, sock: socket.socket) -> None:
        """Read the rank's frames and route them, until it hangs up."""
        buf = bytearray(READ_BUFFER)
        view = memoryview(buf)
        start = end = 0
        acks = rank.acks
        eager = 0  # reads in a row that found data without waiting
        while True:
            # Route every complete frame; consecutive frames to one destination go in one write.
            run_dst, run_start, run_end = -1, 0, 0
            while end - start >= 8:
                hlen, plen = _unpack_prefix(buf, start)
                if hlen == 0 or hlen > DEFAULT_MAX_HEADER or plen > DEFAULT_MAX_PAYLOAD:
                    raise RemoteProtocolError("malformed frame prefix")
                body = start + 8 + hlen
                if body > end:
                    break
                fend = body + plen
                if fend > end and 8 + hlen + plen <= READ_BUFFER // 2:
                    break  # wait for the rest of a small frame
                msg = decode(view[start + 8 : body])
                if type(msg) is Data:
                    self._check(rank, msg)
                    acks[msg.dst] = msg.seq
                    if fend > end:
                        # Too large to buffer: stream it through, holding the destination.
                        await self._flush_run(run_dst, view[run_start:run_end])
                        run_dst = -1
                        await self._stream(sock, msg.dst, view[start:end], fend - end, buf)
                        start = end = 0
                        break
                    if msg.dst != run_dst:
                        await self._flush_run(run_dst, view[run_start:run_end])
                        run_dst, run_start = msg.dst, start
                    run_end = fend
                elif plen:
                    raise RemoteProtocolError(f"{type(msg).__name__} frame with a payload")
                elif type(msg) is Det:
                    await self._flush_run(run_dst, view[run_start:run_end])
                    run_dst = -1
                    await self.on_det(rank, sock, msg)
                else:
                    await self._flush_run(run_dst, view[run_start:run_end])
                    run_dst = -1
                    self._control(rank, msg)
                start = fend
            await self._flush_run(run_dst, view[run_start:run_end])
            if start == end:
                start = end = 0
            elif start and READ_BUFFER - end < READ_BUFFER // 2:
                buf[: end - start] = view[start:end]
                start, end = 0, end - start
            if acks:
                rank.ack_wanted.set()
            try:
                n = sock.recv_into(view[end:])
                eager += 1
                if eager >= 16:
                    eager = 0
                    await trio.lowlevel.checkpoint()  # let the other ranks' readers run
            except BlockingIOError:
                eager = 0
                n = await _read(sock, view[end:])
            if n == 0:
                return
            end += n

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

    async def _flush_run(self, dst: int, frames: memoryview) -> None:
        if dst < 0 or not frames.nbytes:
            return
        target = self.ranks[dst]
        if not target.ready.is_set():
            await target.ready.wait()
        await _acquire(target.lock)
        try:
            if target.open:
                acks = _take_acks(target)
                try:
                    if acks and frames.nbytes <= SMALL_RUN:
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
        self, sock: socket.socket, dst: int, head: memoryview, remaining: int, buf: bytearray
    ) -> None:
        target = self.ranks[dst]
        if not target.ready.is_set():
            await target.ready.wait()
        view = memoryview(buf)
        await _acquire(target.lock)
        try:
            chunk = head
            while True:
                if target.open and chunk.nbytes:
                    try:
                        await _write(target.sock, chunk)
                    except _GONE:
                        target.open = False
                if not remaining:
                    return
                # ``head`` may alias ``buf``: it was written out above, the buffer is free.
                n = await _read(sock, view[: min(remaining, len(buf))])
                if n == 0:
                    raise trio.BrokenResourceError("rank hung up mid-frame")
                remaining -= n
                chunk = view[:n]
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


# A peer that went away, seen from either direction.
_GONE = (OSError, trio.BrokenResourceError, trio.ClosedResourceError)


async def _acquire(lock: trio.Lock) -> None:
    try:
        lock.acquire_nowait()
    except trio.WouldBlock:
        await lock.acquire()


async def _write(sock: Any, data: Any) -> None:
    view = memoryview(data)
    while view.nbytes:
        try:
            n = sock.send(view)
        except BlockingIOError:
            await trio.lowlevel.wait_writable(sock)
            continue
        view = view[n:]


async def _read(sock: Any, view: memoryview) -> int:
    while True:
        try:
            return int(sock.recv_into(view))
        except BlockingIOError:
            await trio.lowlevel.wait_readable(sock)


async def _read_exact(sock: Any, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = await _read(sock, view[got:])
        if not k:
            raise trio.BrokenResourceError("connection closed")
        got += k
    return bytes(buf)


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


async def run_async(
    n: int,
    argv: Sequence[str],
    *,
    stdin: Any = None,
    env: Mapping[str, str] | None = None,
    stdout: Any = None,
    stderr: Any = None,
) -> int:
    """Run ``n`` ranks of ``argv``; the job's exit code.

    ``stdin``: None (rank 0 reads this process's stdin), bytes (fed to rank 0), or a file/fd.
    ``env``: extra environment variables for the ranks, over this process's environment.
    ``stdout``/``stderr``: None to inherit, else a file/fd shared by all ranks.
    """
    if n < 1:
        raise ValueError("need at least one rank")
    kill = (env or {}).get("VPOOL_MPIEXEC_KILL") or os.environ.get("VPOOL_MPIEXEC_KILL")
    ckpt = (env or {}).get("VPOOL_MPIEXEC_CKPT") or os.environ.get("VPOOL_MPIEXEC_CKPT")
    if kill or ckpt:
        # Test bench: kill a rank and restart it with replay, or from a checkpoint
        # (``mpiexec_replay``).
        from vpool.sdk import mpiexec_replay

        return await mpiexec_replay.run_async(
            n,
            argv,
            kill=mpiexec_replay.parse_kill(kill) if kill else None,
            ckpt=mpiexec_replay.parse_ckpt(ckpt) if ckpt else None,
            env=env,
            stdout=stdout if isinstance(stdout, int) else (stdout.fileno() if stdout else 1),
            stderr=stderr if isinstance(stderr, int) else (stderr.fileno() if stderr else 2),
        )
    command = rank_command(argv)
    err_fd = stderr if isinstance(stderr, int) else (stderr.fileno() if stderr else 2)
    router = _Router(n, err_fd)
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
                nursery.start_soon(router.accept, listener)
                nursery.start_soon(router.forward_signals)
                for rank in router.ranks:
                    rank_stdin = subprocess.DEVNULL
                    if rank.index == 0:
                        rank_stdin = subprocess.PIPE if isinstance(stdin, bytes) else stdin
                    rank.proc = await trio.lowlevel.open_process(
                        command,
                        stdin=rank_stdin,
                        stdout=stdout,
                        stderr=stderr,
                        env=rank_environment(base, rank.index, n, path, rank.secret),
                    )
                    nursery.start_soon(router.watch, rank)
                first = router.ranks[0].proc
                if isinstance(stdin, bytes) and first is not None and first.stdin is not None:
                    nursery.start_soon(_feed, first.stdin, stdin)
                await router.all_exited.wait()
                nursery.cancel_scope.cancel()
        finally:
            for rank in router.ranks:
                if rank.proc is not None and rank.proc.returncode is None:
                    rank.proc.kill()
            trio.lowlevel.notify_closing(listener)
            listener.close()
    return router.exit_code or 0


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
) -> int:
    """Run ``n`` ranks of ``argv`` (``app.py args``) on this machine; the job's exit code."""

    async def main() -> int:
        return await run_async(n, argv, stdin=stdin, env=env)

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
    parser.add_argument("program", nargs=argparse.REMAINDER, help="app.py and its arguments")
    ns = parser.parse_args(args)
    program = list(ns.program)
    if program and program[0] == "--":
        program = program[1:]
    if not program:
        parser.error("no program given")
    return run(ns.n, program)


if __name__ == "__main__":
    sys.exit(main())
