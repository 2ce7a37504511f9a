"""The agent's unix socket: rank processes connect here and their MPI traffic is proxied.

One listening socket (``work_dir/agent.sock``, mode 0600). A rank opens with ``RankHello``
carrying the secret the agent gave it (in a file its runtime reads and deletes); the agent
answers ``RankWelcome`` or an ``Error`` and closes. Then, per connection, a reader forwards the
rank's ``Data`` frames, unchanged, to the home relay of each destination, and its ``Det`` frames
to its own home relay; a writer drains the rank's outbox (pushed ``Data``, ``Det``, ``Ack``,
``DetAck``, ``Stop``) into the socket and credits the relays for what was written.

Checkpoints: a rank whose runtime takes checkpoints opens a second connection,
``RankHello(control=True)``, answered by the same ``RankWelcome``; on it the rank sends
``CkptForked`` (handed to the rank's checkpoint task through ``LocalRank.control_recv``). A
restored process says which image it came from (``RankHello.checkpoint``), which must be the one
the agent restored.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import socket as stdlib_socket
import stat
import struct
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
import trio

from vpool.framestream import FrameStream, send_frames
from vpool.protocol.api import SpawnAnswer, SpawnAsk
from vpool.protocol.errors import ErrorCode, ProtocolError
from vpool.protocol.framing import Buffer, encode_frame
from vpool.protocol.messages import (
    PROTOCOL_VERSION,
    Abort,
    CkptForked,
    Data,
    Delivered,
    Det,
    Error,
    Finalize,
    RankHello,
    RankWelcome,
    Spawned,
    SpawnRequest,
)
from vpool.protocol.sealing import TAG_SIZE
from vpool.protocol.session import Session
from vpool.worker_agent.errors import CoordinatorRejected, RankSocketError, RelayLinkError
from vpool.worker_agent.local_ranks import LocalRank, LocalRanks
from vpool.worker_agent.relay_link import Connection, RelayLink

Spawner = Callable[[SpawnAsk], Awaitable[SpawnAnswer]]

log = logging.getLogger("vpool.agent")

HELLO_TIMEOUT = 10.0
# Connections that have not said hello yet, per sandbox (PID namespace) of the process that
# made them and in all: past either, a new one is closed at once. Every rank reaches the
# socket, so one that floods it (58,000 idle connections ran the agent out of descriptors)
# would otherwise starve the agent and its other ranks.
MAX_UNGREETED_PER_PEER = 8
MAX_UNGREETED = 256
# Reports of orphaned checkpoint clones one rank may have open at once.
MAX_ORPHAN_REPORTS = 4
RANK_SOCKET_BUFFER = 4 * 1024 * 1024
# Longest unix socket path (sun_path is 108 bytes on Linux, including the NUL).
_MAX_SOCKET_PATH = 107


def choose_socket_path(work_dir: Path, name: str = "agent.sock", *, make: bool = True) -> Path:
    """``work_dir/name``, unless that is too long for a unix socket address (108 bytes).

    Then a short path in a private per-user directory (``$XDG_RUNTIME_DIR`` or the temp
    directory), named after ``work_dir`` so each agent of this user keeps its own socket; that
    directory is made unless ``make`` is false (who only looks for an agent's socket).
    """
    preferred = work_dir / name
    if len(os.fsencode(preferred)) <= _MAX_SOCKET_PATH:
        return preferred
    digest = hashlib.sha256(os.fsencode(work_dir.absolute())).hexdigest()[:16]
    for base in (os.environ.get("XDG_RUNTIME_DIR"), tempfile.gettempdir()):
        if not base:
            continue
        directory = Path(base) / f"vpool-{os.getuid()}"
        path = directory / f"{Path(name).stem}-{digest}.sock"
        if len(os.fsencode(path)) <= _MAX_SOCKET_PATH:
            if not make:
                return path
            _private_dir(directory)
            log.info("socket path %s is too long; using %s", preferred, path)
            return path
    raise RankSocketError(
        f"socket path {preferred} is longer than {_MAX_SOCKET_PATH} bytes; use a shorter work_dir"
    )


def _private_dir(directory: Path) -> None:
    """Create ``directory`` (0700) or accept it only if it is ours and private: in a shared
    temp directory, someone else could have made it first to watch our socket."""
    directory.mkdir(mode=0o700, exist_ok=True)
    st = directory.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise RankSocketError(f"{directory} is not a private directory of this user")


def bind_rank_socket(path: Path) -> trio.SocketListener:
    """Listen on ``path`` with mode 0600, replacing a stale socket left by a dead agent."""
    if len(os.fsencode(path)) > _MAX_SOCKET_PATH:
        raise RankSocketError(
            f"socket path {path} is longer than {_MAX_SOCKET_PATH} bytes; use a shorter work_dir"
        )
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if path.exists():
        probe = stdlib_socket.socket(stdlib_socket.AF_UNIX)
        try:
            probe.connect(os.fspath(path))
        except OSError:
            path.unlink()  # nobody listens: a leftover of an agent that died
        else:
            raise RankSocketError(f"another agent is already serving {path}")
        finally:
            probe.close()
    sock = stdlib_socket.socket(stdlib_socket.AF_UNIX, stdlib_socket.SOCK_STREAM)
    try:
        # Created under a tight umask so there is no moment when others could connect.
        old = os.umask(0o177)
        try:
            sock.bind(os.fspath(path))
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise RankSocketError(f"another agent is already serving {path}") from exc
        raise RankSocketError(f"cannot listen on {path}: {exc}") from exc
    return trio.SocketListener(trio.socket.from_stdlib_socket(sock))


class RankProxy:
    """Serves rank connections on the agent's socket."""

    def __init__(
        self,
        ranks: LocalRanks,
        *,
        processor: str,
        max_payload: int,
        local_delivery: bool = True,
        spawner: Spawner | None = None,
    ) -> None:
        self.ranks = ranks
        self.processor = processor
        self.max_payload = max_payload
        self.local_delivery = local_delivery
        # Asks the coordinator for a rank's MPI.Comm.Spawn (None: spawning is refused).
        self.spawner = spawner
        self._ungreeted: dict[str, int] = {}  # per peer (its PID namespace)
        self._refused_connections = 0

    async def serve(
        self, path: Path, *, task_status: trio.TaskStatus[Path] = trio.TASK_STATUS_IGNORED
    ) -> None:
        listener = bind_rank_socket(path)
        try:
            async with trio.open_nursery() as nursery:
                task_status.started(path)
                await trio.serve_listeners(self.handle, [listener], handler_nursery=nursery)
        finally:
            _unlink(path)

    async def handle(self, stream: trio.SocketStream) -> None:
        for opt in (stdlib_socket.SO_SNDBUF, stdlib_socket.SO_RCVBUF):
            try:
                # As large as the rank's own (mpi/transport.py): a 200 KiB default makes
                # a pushed 16 MiB payload take a hundred wake-ups of both processes.
                stream.setsockopt(stdlib_socket.SOL_SOCKET, opt, RANK_SOCKET_BUFFER)
            except OSError:
                pass  # a smaller buffer only costs throughput
        async with stream:
            peer = _peer_namespace(stream)
            if (
                self._ungreeted.get(peer, 0) >= MAX_UNGREETED_PER_PEER
                or sum(self._ungreeted.values()) >= MAX_UNGREETED
            ):
                self._refused_connections += 1
                if self._refused_connections in (1, 10, 100, 1000) or not (
                    self._refused_connections % 10000
                ):
                    log.warning(
                        "closed %d rank connections at once: too many not greeted yet "
                        "(the latest from %s)",
                        self._refused_connections,
                        peer,
                    )
                return
            reader = FrameStream(stream, max_payload=self.max_payload)
            session = Session("rank", "server")
            self._ungreeted[peer] = self._ungreeted.get(peer, 0) + 1
            try:
                greeted = await self._greet(stream, reader, session)
            except ProtocolError as exc:
                with trio.move_on_after(1):
                    await _refuse(stream, exc.code, exc.message)
                return
            except (trio.BrokenResourceError, trio.TooSlowError) as exc:
                log.debug("rank connection dropped before its hello: %s", exc)
                return
            finally:
                left = self._ungreeted[peer] - 1
                if left:
                    self._ungreeted[peer] = left
                else:
                    del self._ungreeted[peer]
            if greeted is None:
                return
            rank, orphan = greeted
            if rank.control is stream:
                await self._control_loop(reader, rank, stream)
                return
            if rank.max_payload and rank.max_payload < self.max_payload:
                # A rank cannot have a message larger than its memory limit in its memory:
                # one announced larger is refused at its prefix, before the agent holds any
                # of it (a rank held to 256 MiB sent a 700 MiB frame: the agent peaked at
                # 3.5 GiB).
                reader.scanner.set_limits(
                    max_header=reader.scanner.max_header, max_payload=rank.max_payload
                )
            if orphan:
                if rank.orphan_reports >= MAX_ORPHAN_REPORTS:
                    await _refuse(
                        stream,
                        ErrorCode.ALREADY_CONNECTED,
                        f"{rank.label} has {MAX_ORPHAN_REPORTS} clone reports open already",
                    )
                    return
                rank.orphan_reports += 1
                try:
                    await self._orphan_report(reader, rank, stream)
                finally:
                    rank.orphan_reports -= 1
                return
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._write_loop, stream, rank)
                    if await self._read_loop(reader, session, rank, nursery):
                        # The rank closed its end: nothing written now could be read.
                        nursery.cancel_scope.cancel()
                    else:
                        # Give the writer a moment to deliver the Error that explains why.
                        nursery.cancel_scope.deadline = trio.current_time() + 2
            finally:
                rank.conn_done.set()

    async def _greet(
        self, stream: trio.SocketStream, reader: FrameStream, session: Session
    ) -> tuple[LocalRank, bool] | None:
        """The rank that said hello, and whether the hello came from an orphaned clone."""
        with trio.fail_after(HELLO_TIMEOUT):
            frame = await reader.receive()
        if frame is None:
            return None
        hello = frame.message
        session.receive(hello)
        assert isinstance(hello, RankHello)
        if hello.version != PROTOCOL_VERSION:
            await _refuse(
                stream,
                ErrorCode.BAD_VERSION,
                f"agent speaks protocol {PROTOCOL_VERSION}, the rank {hello.version}",
            )
            return None
        rank = self.ranks.by_secret.get(hello.secret)
        if rank is None or rank.ended:
            await _refuse(stream, ErrorCode.UNKNOWN_SECRET, "no rank of this agent has that secret")
            return None
        if hello.orphan:
            pass  # a clone's own report (handle), not the rank's control connection
        elif hello.control:
            if rank.control is not None:
                await _refuse(
                    stream,
                    ErrorCode.ALREADY_CONNECTED,
                    f"{rank.label} has a control connection already",
                )
                return None
            rank.control = stream
            rank.control_opened.set()
        else:
            if rank.hello_seen:
                await _refuse(
                    stream, ErrorCode.ALREADY_CONNECTED, f"{rank.label} is already connected"
                )
                return None
            if hello.checkpoint != rank.restored_from:
                what = (
                    f"was restored from checkpoint {rank.restored_from}"
                    if rank.restored_from >= 0
                    else "was not restored from a checkpoint"
                )
                await _refuse(
                    stream,
                    ErrorCode.WRONG_CHECKPOINT,
                    f"{rank.label} {what}, the process says {hello.checkpoint}",
                )
                return None
            rank.hello_seen = True
        lease = rank.lease
        welcome = RankWelcome(
            job=lease.job,
            rank=lease.rank,
            size=lease.size,
            incarnation=lease.incarnation,
            processor=self.processor,
            replay_dets=rank.replay_dets,
            replay_sent=rank.replay_sent,
            on_failure=lease.on_failure,
            world=lease.world,
            parent=lease.parent,
            parent_ctx=lease.parent_ctx,
            universe=lease.universe,
        )
        session.send(welcome)
        try:
            await stream.send_all(encode_frame(welcome))
        except BaseException:
            if rank.control is stream:
                rank.control = None
            raise
        if rank.state == "starting" and not hello.control and not hello.orphan:
            rank.state = "running"
        return rank, hello.orphan

    async def _orphan_report(
        self, reader: FrameStream, rank: LocalRank, stream: trio.SocketStream
    ) -> None:
        """The ``CkptForked`` of a clone whose rank died before saying it forked, handed on
        once the clone closed the connection (CRIU cannot dump a process holding a socket to
        the agent)."""
        forked: CkptForked | None = None
        try:
            with trio.move_on_after(HELLO_TIMEOUT):
                while (frame := await reader.receive()) is not None:
                    msg = frame.message
                    if forked is not None or not isinstance(msg, CkptForked) or msg.pid <= 0:
                        raise ProtocolError(
                            f"{type(msg).__name__} from an orphaned clone of {rank.label}",
                            code=ErrorCode.UNEXPECTED_MESSAGE,
                        )
                    forked = msg
                if forked is not None:
                    # The pid as this agent sees it (the clone may name itself in the PID
                    # namespace of a restored rank), from the kernel, not from the clone.
                    peer = _peer_pid(stream)
                    if peer is None:
                        raise ProtocolError(
                            "no peer credentials", code=ErrorCode.UNEXPECTED_MESSAGE
                        )
                    forked = msgspec.structs.replace(forked, pid=peer, orphan=True)
                    rank.control_send.send_nowait(forked)
        except ProtocolError as exc:
            log.warning("an orphaned clone of %s broke the protocol: %s", rank.label, exc)
            with trio.move_on_after(1):
                await _refuse(stream, exc.code, exc.message)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except trio.WouldBlock:
            log.warning("%s: dropped %s (nobody takes them)", rank.label, forked)

    async def _control_loop(
        self, reader: FrameStream, rank: LocalRank, stream: trio.SocketStream
    ) -> None:
        """Hand the rank's checkpoint frames to its checkpoint task until the rank closes."""
        try:
            while True:
                frame = await reader.receive()
                if frame is None:
                    return
                msg = frame.message
                if not isinstance(msg, CkptForked):
                    raise ProtocolError(
                        f"{type(msg).__name__} on the checkpoint control connection of "
                        f"{rank.label}",
                        code=ErrorCode.UNEXPECTED_MESSAGE,
                    )
                try:
                    rank.control_send.send_nowait(msg)
                except trio.WouldBlock:
                    log.warning("%s: dropped %s (nobody takes them)", rank.label, msg)
        except ProtocolError as exc:
            log.warning("%s broke the control protocol: %s", rank.label, exc)
            with trio.move_on_after(1):
                await _refuse(stream, exc.code, exc.message)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            if rank.control is stream:
                rank.control = None

    async def _read_loop(
        self,
        reader: FrameStream,
        session: Session,
        rank: LocalRank,
        nursery: trio.Nursery,
    ) -> bool:
        """Forward the rank's frames; True at end of stream, False after refusing a frame."""
        job, me, size = rank.lease.job, rank.lease.rank, rank.lease.size
        route = rank.route
        local = self.local_delivery
        # The agent holds a rank's frames until its relays log them: past the rank's budget
        # it reads no more of them (the rank's sends block, as on a full socket), and a large
        # frame waits at its prefix for room before a buffer is taken for it.
        reader.admit = rank.room_for
        try:
            while True:
                if rank.full():  # checked first: no coroutine per frame on the way out
                    await rank.room_for(0)
                frame = await reader.receive()
                if frame is None:
                    return True
                msg = frame.message
                session.receive(msg)
                if isinstance(msg, Data):
                    if msg.job != job or msg.src != me or not 0 <= msg.dst < len(route):
                        raise ProtocolError(
                            f"Data from job {msg.job} rank {msg.src} to {msg.dst} on the "
                            f"connection of {rank.label} (size {size}, "
                            f"{len(rank.links)} relays)",
                            code=ErrorCode.NOT_YOURS,
                        )
                    if msg.sealed:
                        raise ProtocolError(
                            f"{rank.label} sent a sealed Data frame: ranks send plaintext",
                            code=ErrorCode.UNEXPECTED_MESSAGE,
                        )
                    _check_seq(rank, msg)
                    link = route[msg.dst]
                    if frame.payload_len + TAG_SIZE > link.max_payload:
                        raise ProtocolError(
                            f"a message of {frame.payload_len} bytes is larger than the "
                            f"{link.max_payload} bytes {link.where} accepts",
                            code=ErrorCode.FRAME_TOO_LARGE,
                        )
                    if rank.stop_reason is not None:
                        continue  # being stopped (maybe replaced): it must deposit no more
                    # Before ``deposited`` counts it: a checkpoint would take a message counted
                    # there, but not yet in the link's books, as acknowledged (and local
                    # delivery may wait long for room).
                    notice = (
                        await _deliver_locally(link, msg, frame.parts, frame.size)
                        if local
                        else None
                    )
                    rank.deposited[msg.dst] = msg.seq
                    parts = frame.parts
                    if rank.seal:
                        assert rank.sealer is not None
                        parts = [rank.sealer.seal(msg, frame.frame, frame.header_len)]
                    try:
                        await link.send_data(msg, parts, notice)
                    except RelayLinkError:
                        # Already reported as a RankProblem by the link; the coordinator will
                        # stop this rank. Dropping here keeps the socket drained meanwhile.
                        pass
                elif isinstance(msg, Det):
                    if msg.job != job or msg.rank != me or not route:
                        raise ProtocolError(
                            f"Det of job {msg.job} rank {msg.rank} on the connection of "
                            f"{rank.label}" + ("" if route else ", which has no relays"),
                            code=ErrorCode.NOT_YOURS,
                        )
                    _check_det(rank, msg)
                    if rank.stop_reason is not None:
                        continue
                    try:
                        await route[me].send_det(msg, frame.parts)
                    except RelayLinkError:
                        pass  # as for Data
                elif isinstance(msg, SpawnRequest):
                    nursery.start_soon(self._spawn, rank, msg)
                elif isinstance(msg, Abort):
                    rank.abort = msg
                elif isinstance(msg, Finalize):
                    rank.finalized = True
        except ProtocolError as exc:
            log.warning("%s broke the rank protocol: %s", rank.label, exc)
            rank.outbox.push_control(encode_frame(Error(code=exc.code, message=exc.message)))
            rank.outbox.close()
            return False
        except trio.BrokenResourceError:
            return True

    async def _spawn(self, rank: LocalRank, req: SpawnRequest) -> None:
        """Ask the coordinator for the rank's spawn; answer the rank (``Spawned``)."""
        lease = rank.lease
        if self.spawner is None:
            answer = SpawnAnswer(error="this agent cannot ask its coordinator to spawn")
        else:
            ask = SpawnAsk(
                job=lease.job,
                rank=lease.rank,
                incarnation=lease.incarnation,
                seq=req.seq,
                command=req.command,
                maxprocs=req.maxprocs,
                least=req.least,
                parent=req.parent,
                ctx=req.ctx,
                reported=req.reported,
            )
            try:
                answer = await self.spawner(ask)
            except CoordinatorRejected as exc:
                answer = SpawnAnswer(error=f"the coordinator refused: {exc}")
        log.info(
            "%s spawn %d: %s",
            rank.label,
            req.seq,
            answer.error or f"ranks {answer.ranks[0]} to {answer.ranks[-1]}"
            if answer.ranks
            else "nothing",
        )
        reply = Spawned(seq=req.seq, ranks=answer.ranks, error=answer.error)
        rank.outbox.push_control(encode_frame(reply))

    async def _write_loop(self, stream: trio.SocketStream, rank: LocalRank) -> None:
        job, me = rank.lease.job, rank.lease.rank
        outbox = rank.outbox

        def written(link: Connection, nbytes: int) -> None:
            due = outbox.credit_due(link, nbytes)
            if due:
                link.credit_nowait(job, me, due)

        sock = getattr(stream, "socket", None)
        if sock is not None:
            outbox.set_socket(sock.fileno(), written)
        try:
            while True:
                batch, credits = await outbox.take()
                try:
                    await send_frames(stream, [p for parts in batch for p in parts])
                finally:
                    outbox.busy = False
                for link, nbytes in credits.items():
                    due = outbox.credit_due(link, nbytes)
                    if not due:
                        continue
                    try:
                        await link.credit(job, me, due)
                    except RelayLinkError:
                        pass  # reported by the link
        except trio.EndOfChannel:
            pass
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            # The rank went away with frames unwritten: nobody is left to read them.
            pass
        finally:
            # The descriptor is closed once this connection ends and may be reused.
            outbox.set_socket(-1, written)


async def _deliver_locally(
    link: RelayLink, msg: Data, parts: list[Buffer], size: int
) -> Delivered | None:
    """Agent-local delivery (docs/internals.md): when the receiver of ``msg`` is a rank of this
    agent home-attached on ``link`` (the link the message is deposited on) and this is the
    next message of the channel for it, the frame goes into its outbox, once that has room
    (the sender waits meanwhile, as on a full socket); the ``Delivered`` to send behind the
    deposit is returned. None: the relay pushes it."""
    key = (msg.job, msg.dst)
    peer = link.home_of(key)
    if peer is None or peer.stop_reason is not None:
        return None
    if not peer.outbox.has_room():
        await peer.outbox.wait_room()
        if link.home_of(key) is not peer or peer.stop_reason is not None:
            return None
        if not peer.outbox.has_room():
            return None  # closed
    if not peer.delivery.local(msg.src, msg.seq):
        return None
    peer.outbox.push_data(parts, size, None)
    return Delivered(
        job=msg.job, rank=msg.dst, incarnation=peer.lease.incarnation, src=msg.src, seq=msg.seq
    )


def _check_seq(rank: LocalRank, msg: Data) -> None:
    """A rank's ``Data`` continues its channel as the relay will accept it: seq 1 up to one
    past the highest the relays held (``replay_sent``, a replaying rank re-sends) or the rank
    sent, so that a gap is this rank's error here and never reaches the relay, which would
    close the connection every rank of this agent shares."""
    last = max(rank.sent_seq.get(msg.dst, 0), rank.replay_sent.get(msg.dst, 0))
    if not 1 <= msg.seq <= last + 1:
        raise ProtocolError(
            f"{rank.label} sent message {msg.seq} to rank {msg.dst} after {last}: a gap in "
            "its channel",
            code=ErrorCode.SEQ_GAP,
        )
    if msg.seq > rank.sent_seq.get(msg.dst, 0):
        rank.sent_seq[msg.dst] = msg.seq


def _check_det(rank: LocalRank, msg: Det) -> None:
    """A rank's determinant follows those its home relay holds (``replay_dets``) or it sent,
    as ``_check_seq`` does for messages."""
    limit = max(rank.sent_dets, rank.replay_dets)
    if not 0 <= msg.index <= limit:
        raise ProtocolError(
            f"{rank.label} sent determinant {msg.index}, the next is {limit}: a gap in its "
            "determinant log",
            code=ErrorCode.DET_GAP,
        )
    rank.sent_dets = max(rank.sent_dets, msg.index + 1)


def _unlink(path: Path) -> None:
    path.unlink(missing_ok=True)


async def _refuse(stream: trio.SocketStream, code: str, message: str) -> None:
    log.warning("refused a rank connection: %s", message)
    try:
        await stream.send_all(encode_frame(Error(code=code, message=message)))
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass  # the rank is gone already; nobody to explain it to


def _peer_namespace(stream: trio.SocketStream) -> str:
    """Who made a connection: the PID namespace of its process, a sandboxed rank's sandbox
    (which it cannot leave); the process itself when it shares the agent's namespace."""
    pid = _peer_pid(stream)
    if pid is None:
        return "unknown"
    try:
        namespace = os.readlink(f"/proc/{pid}/ns/pid")
        if namespace != os.readlink("/proc/self/ns/pid"):
            return namespace
    except OSError:
        pass
    return f"pid {pid}"  # an unsandboxed rank: each process counts on its own


def _peer_pid(stream: trio.SocketStream) -> int | None:
    """The pid of the process at the other end of a unix connection (SO_PEERCRED)."""
    try:
        cred = stream.socket.getsockopt(
            stdlib_socket.SOL_SOCKET, stdlib_socket.SO_PEERCRED, struct.calcsize("3i")
        )
    except OSError:
        return None
    pid = struct.unpack("3i", cred)[0]
    return pid if pid > 0 else None
