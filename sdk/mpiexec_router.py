"""The in-process router of ``vsdk mpiexec``: it plays the agent and the relay for every rank.

It admits each rank by its secret and runs the relay's own core (``protocol.relay_core``) in
memory: every rank is attached at home here, its ``Data`` frames are deposited in the
destination's mailbox and pushed, verbatim and in each channel's order, to the destination's
connection (one writer at a time per connection); determinants are logged and acknowledged at
once, acks are cumulative per channel, exactly as a relay does (nothing is written to disk:
nothing here outlives the job, and a mailbox drops what it pushed). It keeps the job's fate
(``on_failure``, the job's failure mode, which each rank's welcome carries too):

- "abort" and "transparent" (here the same: no relay keeps logs a replacement could replay):
  the first rank to exit non-zero, or to call ``MPI.Abort(code)``, ends the job, the other ranks
  are terminated and its code is the job's;
- "ulfm", "blank", "shrink", "rebuild" (``api.REPORTING_MODES``: here they differ only inside
  the ranks' runtime): a rank killed by a signal (the local likeness of a lost machine) is
  declared failed: every other rank is sent ``Failed`` (the ranks declared so far) and the job
  goes on; what it sent and was not pushed yet, and whatever is sent to it, is dropped with its
  mailbox. A rank that exits non-zero by itself, or calls ``MPI.Abort``, still ends the job (a
  program's error is not a lost process). The job's code is then the survivors' (0 when they
  all exit 0), or the first failure's when every rank failed.

It also plays the pool for ``MPI.Comm.Spawn``: a rank's ``SpawnRequest`` starts every process
it asks for (``launch``, given by ``mpiexec``) as ranks after the highest so far, welcomed with
their world, parents and parent context, and is answered ``Spawned``. A process of a reported
spawn killed by a signal is declared failed, whatever the mode.

The test bench ``tests/mpi/bench/replay_router.ReplayRouter`` extends it.

Frames are pushed by the task that deposited them when the destination's connection is free
(one write per destination and read, the acks for that rank riding along), else by the
destination's own pusher task.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import secrets
import signal
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from vpool.protocol.api import (
    FAILURE_MODES,
    REPORTING_MODES,
    RankLost,
    RelayDiverged,
    RelayValidated,
)
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
    Failed,
    Finalize,
    Message,
    RankHello,
    RankWelcome,
    Spawned,
    SpawnRequest,
    Stop,
)
from vpool.protocol.relay_core import Box, RelayCore, TrimPoint
from vpool.sdk.mpiexec_wire import _GONE, SocketFrames, _acquire, _frame, _write

JOB = 0
READ_BUFFER = 1024 * 1024
# Bytes of frames gathered into one write to a rank; frames above JOIN_MAX go out alone.
PUSH_ROUND = 1024 * 1024
JOIN_MAX = 64 * 1024
# A mailbox drops what it pushed once it holds this many entries (nothing is ever re-pushed).
TRIM_AT = 4096
SOCKET_BUFFER = 4 * 1024 * 1024
KILL_GRACE = 2.0  # seconds between SIGTERM and SIGKILL for ranks being stopped
# Acks wait this long for a data frame to the same rank to ride along with (one write, one
# wake-up of the rank instead of two); only Finalize waits for them, so a rank's end may wait
# this long once. (1 ms made a write of its own for most acks: mpi4py's suite's vector
# collectives at 4 ranks took 83 s, against 75 s at 20 ms.)
ACK_DELAY = 0.02


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
        self.failed = False  # declared failed (``REPORTING_MODES``, a reported spawn)
        # Control frames the core asked to send it (DetAck), and its pusher's wake-up.
        self.control: list[bytes] = []
        self.push_wanted = trio.Event()
        self.delivered: dict[int, int] = {}  # per source, the highest seq pushed to it
        # What its welcome says beyond its number (``RankWelcome``): its COMM_WORLD, and for a
        # spawned process its parents and their intercommunicator's context.
        self.world: list[int] = []
        self.parent: list[int] = []
        self.parent_ctx = 0
        self.reported = False  # of a spawn whose lost processes are declared failed


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


async def read_hello(frames: SocketFrames) -> RankHello | None:
    """A rank's first frame, which must be its hello; None when it hung up first."""
    msg = await frames.message()
    if msg is not None and not isinstance(msg, RankHello):
        raise RemoteProtocolError(f"expected RankHello, got {type(msg).__name__}")
    return msg


Launcher = Callable[[_Rank, list[str]], Awaitable[None]]
"""Starts a spawned process (``mpiexec``): its rank, and Python's arguments after the
interpreter."""


def python_arguments(command: list[str]) -> list[str] | None:
    """What a spawned process runs, as Python's arguments after the interpreter (the pool's
    rule, ``coordinator.sqlite_spawn.python_arguments``): a command naming a Python
    interpreter runs its arguments under this one, a ``.py`` program runs as a script; None:
    not a Python program."""
    if not command:
        return None
    first = command[0].rsplit("/", 1)[-1]
    if re.fullmatch(r"python[0-9.]*", first):
        return command[1:] or None
    if first.endswith(".py"):
        return list(command)
    return None


class _Router:
    def __init__(
        self,
        size: int,
        err: Any,
        on_failure: str = "transparent",
        *,
        space: int = 0,
        universe: int = 0,
    ) -> None:
        if on_failure not in FAILURE_MODES:
            raise ValueError(f"unknown failure mode {on_failure!r}")
        self.on_failure = on_failure
        self.failed: list[int] = []  # ranks declared failed, in order (``REPORTING_MODES``)
        self.first_failure = 0  # the exit status of the first of them
        # ``size``: the job's rank numbers (``space``: the first ranks and those they may
        # spawn), which every rank's arrays cover; ``ranks``: the processes so far.
        self.size = max(space, size)
        self.universe = universe
        self.ranks = [_Rank(i) for i in range(size)]
        if self.size > size:
            for rank in self.ranks:
                rank.world = list(range(size))
        self.by_secret = {r.secret: r for r in self.ranks}
        self.first = size
        self.launch: Launcher | None = None  # None: spawning is refused
        self.answers: dict[tuple[int, int], Spawned] = {}  # (root, seq) -> its answer
        self.exit_code: int | None = None
        self.all_exited = trio.Event()
        self.nursery: trio.Nursery | None = None
        self.err = err
        # While the ranks' output is read through pipes (``mpiexec._Lines``), what we say is
        # held until it is all shown: a rank's traceback comes before "rank 1 called
        # MPI.Abort(1)", as with mpiexec.
        self.held: list[str] | None = None
        # The relay's core, in memory. Pushed frames are credited at once (the socket is the
        # flow control), so the window never holds anything back.
        self.core: RelayCore[_Rank, Any] = RelayCore(
            self, name="vsdk mpiexec", window=PUSH_ROUND, lost_grace=math.inf, digest=_digest
        )
        self._kicked: dict[_Rank, None] = {}  # ranks with something to push

    # ---- what the core asks (``relay_core.Shell``) ----------------------------------------

    def open_box(self, box: Box[_Rank, Any]) -> None:
        box.io = None  # in memory only

    def queue_ack(self, conn: _Rank, job: int, src: int, dst: int, seq: int) -> None:
        if seq > conn.acks.get(dst, 0):
            conn.acks[dst] = seq

    def send(self, conn: _Rank, msg: Error | DetAck | Det) -> None:
        conn.control.append(_frame(msg))
        self._kicked[conn] = None

    def stop(self, conn: _Rank, stop: Stop) -> None:
        pass  # one incarnation per rank: nothing replaces one

    def wake(self, conn: _Rank) -> None:
        self._kicked[conn] = None

    def record_incarnation(self, job: int, rank: int, incarnation: int) -> None:
        pass

    def report_lost(self, report: RankLost) -> None:
        pass  # a rank's process is watched (``watch``), not its connection

    def report_diverged(self, report: RelayDiverged) -> None:
        self.fail(1, report.message)

    def report_validated(self, report: RelayValidated) -> None:
        pass  # its ranks are never re-executed for validation (no token says validating)

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
        """The rank's (last) process ended with ``code``: the job's fate, as mpiexec's (see
        the module docstring for the failure modes)."""
        if code != 0 and self.exit_code is None:
            reports = self.on_failure in REPORTING_MODES
            ends = "" if reports else f": the job ends (--on-failure {self.on_failure})"
            if code < 0:
                name = _signal_name(-code)
                if reports or rank.reported:
                    self.declare_failed(rank, 128 - code, f"was killed by signal {name}")
                else:
                    self.fail(128 - code, f"rank {rank.index} was killed by signal {name}{ends}")
            else:
                self.fail(code, f"rank {rank.index} exited with code {code}{ends}")
        if all(r.exited for r in self.ranks):
            if self.exit_code is None and all(r.failed for r in self.ranks):
                self.exit_code = self.first_failure
                self.say("every rank failed")
            self.all_exited.set()

    def declare_failed(self, rank: _Rank, status: int, how: str) -> None:
        """``REPORTING_MODES`` (or a reported spawn): ``rank`` is gone for good; the others are
        told and go on."""
        rank.failed = True
        if not self.failed:
            self.first_failure = status
        self.failed.append(rank.index)
        reports = self.on_failure in REPORTING_MODES
        why = f"--on-failure {self.on_failure}" if reports else "a reported spawn"
        self.say(f"rank {rank.index} {how}: declared failed, the other ranks go on ({why})")
        for other in self.ranks:
            if not other.failed and not other.exited:
                self._tell_failed(other)

    def _tell_failed(self, rank: _Rank) -> None:
        if rank.open:
            rank.control.append(_frame(Failed(ranks=list(self.failed))))
            rank.push_wanted.set()

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
        return _frame(
            RankWelcome(
                JOB,
                rank.index,
                self.size,
                1,
                socket.gethostname(),
                on_failure=self.on_failure,
                world=rank.world,
                parent=rank.parent,
                parent_ctx=rank.parent_ctx,
                universe=self.universe,
            )
        )

    def _connected(self, rank: _Rank, sock: socket.socket) -> None:
        """Start serving a rank that just said hello: attached at home in the core."""
        assert self.nursery is not None
        self.core.attach(
            rank, job=JOB, rank=rank.index, incarnation=1, size=self.size, home=True, received={}
        )
        self.nursery.start_soon(self.send_acks, rank)
        self.nursery.start_soon(self._pusher, rank)
        if self.failed:
            self._tell_failed(rank)  # ranks declared failed before this one said hello

    async def _hello(self, frames: SocketFrames) -> _Rank | None:
        sock = frames.sock
        msg = await read_hello(frames)
        if msg is None:
            return None
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
        """Read the rank's frames and hand them to the core, until it hangs up; what they
        make pushable goes out after each read."""
        scanner = frames.scanner
        core = self.core
        while True:
            event = scanner.next_event()
            if event is None:
                await self._push_kicked()
                if rank.acks:
                    rank.ack_wanted.set()
                if not await frames.receive():
                    return
                continue
            if type(event) is Large:  # kept whole: it is logged and pushed verbatim
                scanner.claim(bytearray(event.head.nbytes + event.payload_len), whole=True)
                continue
            if type(event) is Small:
                msg = decode_head(event.frame, event.header_len, event.payload_len)
                frame: bytes | bytearray | memoryview = event.frame
            else:
                frame = event.target
                msg = decode_head(frame, event.header_len, event.payload_len)
            if type(msg) is Data:
                self._check(rank, msg)
                box = core.deposit(rank, JOB, msg.src, msg.dst, msg.seq, frame)
                if box is not None:
                    # A small frame is a view of the scanner's buffer: copied; a large one was
                    # received into its own buffer: kept as it is.
                    ref = frame if type(frame) is bytearray else bytes(frame)
                    entry = box.mailbox.append(msg.src, msg.seq, len(frame), ref)
                    entry.written = True
                    core.written(box)
            elif type(msg) is Det:
                box = core.det(rank, JOB, rank.index, msg.index)
                if box is not None:
                    box.dets.append(msg.index, msg)
                    box.dets.written(msg.index)
                    core.dets_written(box)
            else:
                self._control(rank, msg)

    async def _push_kicked(self) -> None:
        """Push to every rank the core woke, from this task when its connection is free."""
        while self._kicked:
            rank = next(iter(self._kicked))
            del self._kicked[rank]
            if rank.lock.locked():
                rank.push_wanted.set()
            else:
                await self._push(rank)

    async def _pusher(self, rank: _Rank) -> None:
        while rank.open:
            await rank.push_wanted.wait()
            rank.push_wanted = trio.Event()
            await self._push(rank)

    async def _push(self, rank: _Rank) -> None:
        """One write to the rank: control frames, its acks, then what its mailbox holds."""
        box = self.core.boxes.get((JOB, rank.index))
        await _acquire(rank.lock)
        try:
            parts: list[Any] = rank.control
            rank.control = []
            acks = _take_acks(rank)
            if acks:
                parts.append(acks)
            nbytes = 0
            if box is not None:
                mailbox = box.mailbox
                delivered = rank.delivered
                while nbytes < PUSH_ROUND and (entry := mailbox.next_push()) is not None:
                    parts.append(entry.ref)
                    entry.ref = None  # pushed: nothing here pushes it again
                    delivered[entry.src] = entry.seq
                    nbytes += entry.size
                    mailbox.credit(entry.size)
                if len(mailbox) > TRIM_AT:
                    self.core.trim(box, TrimPoint(dict(delivered), box.trim.dets))
            if not parts or not rank.open:
                return
            try:
                await _write_parts(rank.sock, parts)
            except _GONE:
                rank.open = False
                return
            if box is not None and box.mailbox.can_push():
                rank.push_wanted.set()
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
        elif isinstance(msg, SpawnRequest):
            assert self.nursery is not None
            self.nursery.start_soon(self._spawn, rank, msg)
        else:
            raise RemoteProtocolError(f"unexpected {type(msg).__name__} from a rank")

    # ---- spawning (``MPI.Comm.Spawn``) -------------------------------------------------------

    async def _spawn(self, root: _Rank, req: SpawnRequest) -> None:
        """Start every process a rank's spawn asks for (here there is no pool to wait for:
        ``least`` does not matter, nor does the universe, a hint as with MPICH's hydra), as
        ranks after the highest so far; answer ``Spawned`` (the same answer to the same
        question again)."""
        key = (root.index, req.seq)
        answer = self.answers.get(key)
        if answer is None:
            error = self._refusal(root, req)
            ranks: list[int] = []
            if not error:
                ranks = list(range(len(self.ranks), len(self.ranks) + req.maxprocs))
                world = list(ranks)
                for number in ranks:
                    rank = _Rank(number)
                    rank.world, rank.parent, rank.parent_ctx = world, list(req.parent), req.ctx
                    rank.reported = req.reported
                    self.ranks.append(rank)
                    self.by_secret[rank.secret] = rank
            answer = self.answers[key] = Spawned(seq=req.seq, ranks=ranks, error=error)
            what = " ".join(req.command)[:200]
            if error:
                self.say(f"rank {root.index} cannot spawn {what}: {error}")
            args = python_arguments(req.command) or []
            for number in ranks:
                rank = self.ranks[number]
                if self.exit_code is not None or self.launch is None:
                    rank.exited = True  # the job ended meanwhile: never started
                    rank.ready.set()
                    continue
                await self.launch(rank, args)
        if root.open:
            root.control.append(_frame(answer))
            root.push_wanted.set()

    def _refusal(self, root: _Rank, req: SpawnRequest) -> str:
        """Why a spawn cannot be done ("" when it can), in the pool's words."""
        if self.launch is None or self.exit_code is not None:
            return "this job cannot spawn processes"
        if not 1 <= req.maxprocs or not 0 <= req.least <= req.maxprocs:
            return f"cannot start {req.least} to {req.maxprocs} processes"
        if root.index not in req.parent or len(set(req.parent)) != len(req.parent):
            return "the spawning group must hold the root once"
        if any(not 0 <= p < len(self.ranks) for p in req.parent):
            return "the spawning group names ranks the job does not have"
        if python_arguments(req.command) is None:
            return (
                f"{req.command[0] if req.command else 'an empty command'!r} is not a Python "
                "program: vpool spawns Python interpreters and .py programs"
            )
        if len(self.ranks) + req.maxprocs > self.size:
            return (
                f"the job may have {self.size} rank numbers over its run (its first ranks and "
                f"{self.size - self.first} spawned) and has used {len(self.ranks)}"
            )
        return ""

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


async def _write_parts(sock: Any, parts: list[Any]) -> None:
    """Write frames: small ones joined into one write, a large one on its own (no copy)."""
    small: list[Any] = []
    for part in parts:
        if len(part) > JOIN_MAX:
            if small:
                await _write(sock, small[0] if len(small) == 1 else b"".join(small))
                small = []
            await _write(sock, part)
        else:
            small.append(part)
    if small:
        await _write(sock, small[0] if len(small) == 1 else b"".join(small))


def _digest(frame: bytes | bytearray | memoryview) -> bytes:
    """A frame's digest, for the core's check of re-sent copies (the test bench replays)."""
    return hashlib.blake2b(frame, digest_size=16).digest()


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
