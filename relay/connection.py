"""One agent connection: handshake, deposits, credits and attachments in; acks and pushes out.

Two tasks per connection. The reader parses every frame that arrived in one read, checks it
against the session table and the rank's attachment, stages the Data and Det frames and commits
them to the logs in one group write (``Hub.commit``) before reading more, which is the
connection's back-pressure. The writer owns the stream's send side: each round it sends the
queued control messages (``Welcome``, ``Attached`` and the replayed ``Det``s, ``DetAck``,
``Stop``, per-rank ``Error``), the coalesced ``Ack``s, then frames pushed from the home mailboxes
of this connection's ranks, round robin, within their windows.

Re-sent messages (a reconnecting agent, a restarted rank replaying) are dropped, after their
content was compared with the logged copy; a rank whose token says it is ``validating`` (a
re-execution that checks the original run) may only re-send, and its ``Detach`` settles its
verdict. What each message does is decided by the relay's core (``protocol.relay_core``); this
is its shell for one connection.

Write-through: when a small batch is written inline and its receivers' writers are idle, the
depositing reader pushes the new frames itself (``push_now``), saving the writer's task switch,
which is a large part of a small message's cost. The push is shielded: abandoned half way it
would corrupt the receiver's TLS stream.

Checkpoint store connections open with a preamble and never get here (``server``,
``ckptstore``); a ``Hello(role="store")`` here is refused.

Anything the agent gets wrong ends in ``Refused``: the writer sends the ``Error``, the relay
ends its side and drains what the agent still sends for a moment (so the error is not lost to a
TCP reset), and only this connection closes.

Liveness (``protocol.liveness``): a ``Ping`` is answered ``Pong`` at once. An agent that pings
(``Hello.pings``) sends something at least every few seconds while it is alive, so a connection
that brings nothing at all for ``agent_idle_timeout`` is dead (a middlebox dropped it without a
reset): a third task closes it, and its ranks get ``lost_grace`` to reattach, as after any drop.
The socket also has TCP keepalive (``vpool.sockopts``).
"""

from __future__ import annotations

import logging

import trio

from vpool.framestream import FrameStream, RawFrame, send_frames
from vpool.protocol.errors import ErrorCode, RemoteProtocolError, TokenError, ends_connection
from vpool.protocol.framing import DEFAULT_MAX_HEADER, PREFIX_SIZE, encode_frame
from vpool.protocol.liveness import Liveness, Silent
from vpool.protocol.messages import (
    PROTOCOL_VERSION,
    Ack,
    Attach,
    Attached,
    Credit,
    Data,
    Delivered,
    Det,
    Detach,
    Error,
    Hello,
    Message,
    Ping,
    Pong,
    Welcome,
    decode,
)
from vpool.protocol.relay_core import Refused
from vpool.protocol.session import Session, State
from vpool.protocol.tokens import AgentClaims, RankClaims, verify_token
from vpool.relay.hub import Batch, Hub, now
from vpool.sockopts import set_keepalive

logger = logging.getLogger(__name__)

# Bytes of pushed frames gathered into one round of the writer.
PUSH_ROUND = 512 * 1024
# How long a rejected agent gets to read its Error before the connection is torn down.
ERROR_LINGER = 2.0
# A Hello is a version, a role and a token of a few hundred bytes.
PRE_AUTH_MAX_HEADER = 8 * 1024
# Batches written by worker threads while the connection reads on; more waits (back-pressure).
WRITES_IN_FLIGHT = 4
# How long acks may wait for other frames to travel with. A rank needs its acks only to finish
# (MPI_Finalize), while a frame of its own per ack costs a write here, a read and a forward in the
# agent, and a wake-up of the rank: a third of all the frames of a ping-pong.
ACK_DELAY = 0.005
# A receiver pushed to more recently than this is streaming: its writer batches better than
# pushing each deposit through at once would, so write-through is left out.
STREAMING_GAP = 0.0002


def rejection(exc: RemoteProtocolError | TokenError, *, job: int = -1, rank: int = -1) -> Refused:
    """The one place protocol-core errors become a connection's ``Error``."""
    rej = Refused(exc.code, exc.message, job=job, rank=rank)
    rej.__cause__ = exc
    return rej


class Connection:
    def __init__(self, hub: Hub, stream: trio.abc.Stream, *, peer: str = "") -> None:
        self.hub = hub
        self.core = hub.core
        self.stream = stream
        self.peer = peer
        self.session = Session("relay", "server")
        self.agent = ""
        self.cached = 0  # bytes of frames it deposited that the hub keeps in memory (``stage``)
        # The core's view of this connection: its attachments, fenced ranks, home boxes.
        self.link = hub.core.link(self)
        self._control: list[bytes] = []
        self._acks: dict[tuple[int, int, int], int] = {}
        self._acks_since = 0.0
        self._wake = trio.Event()
        self._final: bytes | None = None
        self._writer_done = trio.Event()
        # Some task is writing to the stream (the writer, or a depositing reader pushing).
        self._sending = False
        self._push_done = trio.Event()
        self._last_push = -1.0
        self._write_slots = trio.Semaphore(WRITES_IN_FLIGHT)
        self._nursery: trio.Nursery | None = None
        self._round = 0
        # (job, rank) told on this connection that their job may log nothing more here.
        self._refusals_told: set[tuple[int, int]] = set()
        self.reason = "the agent closed the connection"

    def __repr__(self) -> str:
        return f"<Connection agent={self.agent or '?'} peer={self.peer}>"

    # -- outbound queue ---------------------------------------------------------------------

    def wake(self) -> None:
        self._wake.set()

    def send(self, msg: Message) -> None:
        """Queue a control message (checked against the session table now)."""
        if self._final is not None:
            return
        self.session.send(msg)
        self._control.append(encode_frame(msg))
        self._wake.set()

    def queue_ack(self, job: int, src: int, dst: int, seq: int) -> None:
        key = (job, src, dst)
        if seq > self._acks.get(key, 0):
            if not self._acks:
                # The first ack of a round arms the writer's ACK_DELAY timer; later ones wait
                # with it (they are cumulative) unless something else goes out first.
                self._acks_since = trio.current_time()
                self._wake.set()
            self._acks[key] = seq

    def _fail(self, rej: Refused) -> None:
        if self._final is not None:
            return
        err = Error(code=rej.code, message=rej.message, job=rej.job, rank=rej.rank)
        if self.session.state is not State.CLOSED:
            self.session.send(err)
        self._final = encode_frame(err)
        self.reason = f"rejected ({rej.code}): {rej.message}"
        self._wake.set()

    # -- lifecycle --------------------------------------------------------------------------

    async def run(self) -> None:
        hub = self.hub
        hub.connections.add(self)
        stream = self.stream
        raw = stream.transport_stream if isinstance(stream, trio.SSLStream) else stream
        if isinstance(raw, trio.SocketStream):
            set_keepalive(raw.socket)
        # No payloads before the agent is authenticated: a stranger must not make the relay
        # allocate a max_payload buffer by sending one frame prefix.
        reader = FrameStream(self.stream, max_header=PRE_AUTH_MAX_HEADER, max_payload=0)
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._write_loop, nursery.cancel_scope)
                try:
                    await self._read_loop(reader)
                except Refused as rej:
                    logger.info("%r: %s", self, rej.message)
                    self._fail(rej)
                    with trio.move_on_after(ERROR_LINGER):
                        await self._writer_done.wait()
                        await self._linger()
                nursery.cancel_scope.cancel()
        finally:
            hub.connection_closed(
                self, f"connection of agent {self.agent or '?'} to relay {hub.name}: {self.reason}"
            )
            with trio.move_on_after(1, shield=True):
                await trio.aclose_forcefully(self.stream)

    async def _linger(self) -> None:
        # The Error is out: end our side (TCP FIN) and read on, below TLS, until the agent
        # hangs up. Closing while the agent's bytes are still arriving would send a reset,
        # which can throw away the Error before the agent has read it.
        stream = self.stream
        try:
            raw = stream.transport_stream if isinstance(stream, trio.SSLStream) else stream
            if isinstance(raw, trio.SocketStream):
                await raw.send_eof()
                while await raw.receive_some(65536):
                    pass
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError):
            pass

    async def _read_loop(self, reader: FrameStream) -> None:
        try:
            await self._handshake(reader)
            while True:
                frames = await reader.receive_frames()
                if not frames:
                    return
                await self._handle(frames)
        except RemoteProtocolError as exc:
            raise rejection(exc) from exc
        except TokenError as exc:
            raise rejection(exc) from exc
        except trio.BrokenResourceError:
            self.reason = "the connection broke"
        except trio.ClosedResourceError:
            pass

    async def _handshake(self, reader: FrameStream) -> None:
        settings = self.hub.settings
        frames: list[RawFrame] = []
        with trio.move_on_after(settings.handshake_timeout):
            if isinstance(self.stream, trio.SSLStream):
                await self.stream.do_handshake()
            frames = await reader.receive_frames()
        if not frames:
            raise Refused(ErrorCode.TIMEOUT, "no Hello in time")
        header_len, frame = frames[0]
        msg = self._decode(header_len, frame)
        self._receive(msg)
        assert isinstance(msg, Hello)  # the session table admits nothing else first
        if msg.version != PROTOCOL_VERSION:
            raise Refused(
                ErrorCode.BAD_VERSION,
                f"protocol version {msg.version}; this relay speaks {PROTOCOL_VERSION}",
            )
        if msg.role == "store":
            raise Refused(
                ErrorCode.UNEXPECTED_MESSAGE, "store connections start with the store preamble"
            )
        if msg.role != "agent":
            raise Refused(ErrorCode.BAD_ROLE, f"role {msg.role!r}; only agents connect to relays")
        with trio.move_on_after(settings.handshake_timeout):
            await self.hub.key_ready.wait()
        key = self.hub.signing_key
        if key is None:
            raise Refused(
                ErrorCode.NOT_READY, "the relay is not registered with the coordinator yet"
            )
        claims = verify_token(msg.token, key, now=now(), kind=AgentClaims)
        self.agent = claims.agent
        reader.scanner.set_limits(max_header=DEFAULT_MAX_HEADER, max_payload=settings.max_payload)
        self.send(
            Welcome(
                version=PROTOCOL_VERSION,
                relay=self.hub.name,
                max_payload=settings.max_payload,
                push_window=settings.push_window,
                pings=True,
            )
        )
        if msg.pings and settings.agent_idle_timeout > 0:
            assert self._nursery is not None
            self._nursery.start_soon(self._watch, reader, self._nursery.cancel_scope)
        if len(frames) > 1:
            await self._handle(frames[1:])

    async def _watch(self, reader: FrameStream, scope: trio.CancelScope) -> None:
        """Close the connection (cancel ``scope``) once the agent sent nothing for
        ``agent_idle_timeout``."""
        live = Liveness(
            ping_interval=0,
            dead_after=self.hub.settings.agent_idle_timeout,
            now=trio.current_time(),
        )
        while True:
            await trio.sleep_until(live.next_timer())
            live.heard(reader.last_read)
            out = live.handle_timer(trio.current_time())
            if isinstance(out, Silent):
                self.reason = f"nothing from the agent for {out.seconds:.1f} s: taken for dead"
                logger.info("%r: %s", self, self.reason)
                scope.cancel()
                return

    def _receive(self, msg: Message) -> None:
        """``msg`` checked against the session table. An agent sends a relay no ``Error``: the
        table would take one as the end of the session (of every message after it, of this
        side's too: a DetAck or an Ack then due could not be sent) with the connection left
        open, so it is refused here, before the table sees it."""
        if type(msg) is Error:
            raise RemoteProtocolError(
                f"an agent sends a relay no Error (got {msg.code!r}: {msg.message[:200]!r})",
                code=ErrorCode.UNEXPECTED_MESSAGE,
            )
        self.session.receive(msg)

    @staticmethod
    def _decode(header_len: int, frame: bytes | bytearray) -> Message:
        msg = decode(frame[PREFIX_SIZE : PREFIX_SIZE + header_len])
        if len(frame) != PREFIX_SIZE + header_len and type(msg) is not Data:
            raise RemoteProtocolError(f"{type(msg).__name__} frame must not carry a payload")
        return msg

    async def _handle(self, frames: list[RawFrame]) -> None:
        """Every frame of one read: the core decides, new deposits are staged for one group
        write."""
        batch = Batch()
        relay = self.core
        quotas = self.hub.quotas
        images = self.hub.store.job_nbytes
        try:
            for header_len, frame in frames:
                msg = self._decode(header_len, frame)
                self._receive(msg)
                if type(msg) is Data:
                    if msg.job in quotas.refused:
                        self._refuse_job(msg.job, msg.src, quotas.refused[msg.job])
                        continue
                    try:
                        box = relay.deposit(self, msg.job, msg.src, msg.dst, msg.seq, frame)
                    except RemoteProtocolError as exc:
                        raise rejection(exc, job=msg.job, rank=msg.src) from exc
                    if box is not None:
                        if why := quotas.admit(msg.job, len(frame), images[msg.job]):
                            self._refuse_job(msg.job, msg.src, why)
                        else:
                            self.hub.stage(batch, box, msg.src, msg.seq, frame, self)
                elif type(msg) is Credit:
                    try:
                        relay.credit(self, msg.job, msg.rank, msg.nbytes, trio.current_time())
                    except RemoteProtocolError as exc:
                        raise rejection(exc, job=msg.job, rank=msg.rank) from exc
                elif type(msg) is Delivered:
                    entry = relay.delivered(
                        self, msg.job, msg.rank, msg.incarnation, msg.src, msg.seq
                    )
                    if entry is not None:
                        self.hub.pushed(entry)  # its copy in memory is needed no more
                elif type(msg) is Det:
                    if msg.job in quotas.refused:
                        self._refuse_job(msg.job, msg.rank, quotas.refused[msg.job])
                        continue
                    try:
                        box = relay.det(self, msg.job, msg.rank, msg.index)
                    except RemoteProtocolError as exc:
                        raise rejection(exc, job=msg.job, rank=msg.rank) from exc
                    if box is not None:
                        if why := quotas.admit(msg.job, len(frame), images[msg.job]):
                            self._refuse_job(msg.job, msg.rank, why)
                        else:
                            self.hub.stage_det(batch, box, msg, frame)
                elif type(msg) is Attach:
                    claims = self._claims(msg)
                    box = self.hub.boxes.get((claims.job, claims.rank)) if msg.home else None
                    if box is not None and box.dets.durable < len(box.dets):
                        # Determinants of the rank are being written: the new attachment may
                        # be told (and obey) only durable ones, so wait for them, writing
                        # what this read staged first.
                        await self._flush(batch)
                        batch = Batch()
                        await self.hub.dets_settled(box)
                    self._attach(msg, claims)
                elif type(msg) is Detach:
                    relay.detach(self, msg.job, msg.rank)
                elif type(msg) is Ping:
                    self.send(Pong(nonce=msg.nonce))
        finally:
            # Frames staged before a bad one still have their place reserved in the log: they
            # must be written, or the log would keep a hole.
            await self._flush(batch)

    def _refuse_job(self, job: int, rank: int, why: tuple[ErrorCode, str]) -> None:
        """The job may log nothing more here (``relay.quotas``): its frame is dropped, and the
        rank told why once on this connection (the coordinator ends the job)."""
        if (job, rank) in self._refusals_told:
            return
        self._refusals_told.add((job, rank))
        code, message = why
        self.hub.send(self, Error(code=code, message=message, job=job, rank=rank))

    def _claims(self, msg: Attach) -> RankClaims:
        """The checked claims of an Attach's token."""
        hub = self.hub
        assert hub.signing_key is not None
        try:
            claims = verify_token(msg.token, hub.signing_key, now=now(), kind=RankClaims)
        except TokenError as exc:
            raise Refused(exc.code, f"rank token refused: {exc.message}") from exc
        job, rank = claims.job, claims.rank
        if claims.agent != self.agent:
            raise Refused(
                ErrorCode.WRONG_TOKEN,
                f"the token of job {job} rank {rank} was issued to agent {claims.agent!r}, "
                f"not to {self.agent!r}",
                job=job,
                rank=rank,
            )
        if not 0 <= rank < claims.size:
            raise Refused(
                ErrorCode.BAD_RANK,
                f"rank {rank} outside a job of {claims.size}",
                job=job,
                rank=rank,
            )
        return claims

    def _attach(self, msg: Attach, claims: RankClaims) -> None:
        relay = self.core
        job, rank = claims.job, claims.rank
        try:
            att = relay.attach(
                self,
                job=job,
                rank=rank,
                incarnation=claims.incarnation,
                size=claims.size,
                home=msg.home,
                received=msg.received,
                dets_from=msg.dets_from,
                validating=claims.validating,
            )
        except Refused as rej:
            if ends_connection(rej.code, rank):
                raise
            # A stale incarnation, or one asking for what a checkpoint let the log drop:
            # refused, but the agent's other ranks go on on this connection; late frames of
            # this one are dropped.
            logger.info("%r: %s", self, rej.message)
            relay.refused(self, job, rank)
            self.send(Error(code=rej.code, message=rej.message, job=job, rank=rank))
            return
        if att is None:
            return  # the job is over: the rank got a Stop
        count, replay = relay.replay_dets(job, rank, msg.dets_from) if msg.home else (0, [])
        self.send(
            Attached(
                job=job,
                rank=rank,
                incarnation=claims.incarnation,
                stored=relay.stored_from(job, rank),
                dets=count,
            )
        )
        # Before any push: the writer sends queued control frames first.
        for det in replay:
            self.send(det)

    async def _flush(self, batch: Batch) -> None:
        if batch:
            if self.hub.commit_inline(batch, wake=False):
                await self._push_through(batch)
                if batch.undigested:
                    assert self._nursery is not None
                    self._nursery.start_soon(self.hub.digest_later, batch.undigested)
            else:
                with trio.CancelScope(shield=True):
                    await self._write_slots.acquire()
                assert self._nursery is not None
                self._nursery.start_soon(self._commit, batch)

    async def _push_through(self, batch: Batch) -> None:
        receivers: dict[Connection, None] = {}
        for box, _, _ in batch.items:
            rc = box.receiver
            if rc is not None:
                receivers[rc] = None
        for rc in receivers:
            await rc.push_now()

    async def _commit(self, batch: Batch) -> None:
        try:
            await self.hub.commit(batch)
        finally:
            self._write_slots.release()
        if batch.undigested:
            await self.hub.digest_later(batch.undigested)

    # -- outbound ---------------------------------------------------------------------------

    def _take_control(self) -> list[bytes | bytearray | memoryview]:
        parts: list[bytes | bytearray | memoryview] = []
        if self._control:
            parts.extend(self._control)
            self._control.clear()
        if self._acks:
            session = self.session
            for (job, src, dst), seq in self._acks.items():
                ack = Ack(job=job, src=src, dst=dst, seq=seq)
                session.send(ack)
                parts.append(encode_frame(ack))
            self._acks.clear()
        return parts

    async def _push_round(self, parts: list[bytes | bytearray | memoryview]) -> None:
        boxes = list(self.link.home_boxes)
        if not boxes:
            return
        hub = self.hub
        nbytes = 0
        self._round += 1
        first = self._round % len(boxes)
        for box in boxes[first:] + boxes[:first] if len(boxes) > 1 else boxes:
            mailbox = box.mailbox
            while nbytes < PUSH_ROUND:
                # The push window's round trips start here (``protocol.window``).
                entry = mailbox.next_push(trio.current_time())
                if entry is None:
                    break
                frame = entry.ref.frame
                if frame is None:
                    frame = await hub.read_frame(box, entry)
                    if frame is None:
                        continue
                hub.pushed(entry)
                hub.pushed_to[box.job, box.dst] += 1
                parts.append(frame)
                nbytes += entry.size
        if nbytes:
            self._last_push = trio.current_time()

    async def push_now(self) -> None:
        """Push what can be pushed from the calling task if the writer is idle (see the
        module docstring); otherwise wake the writer to do it."""
        now = trio.current_time()
        if self._sending or self._final is not None or now - self._last_push < STREAMING_GAP:
            self._wake.set()
            return
        self._sending = True
        try:
            parts = self._take_control()
            with trio.CancelScope(shield=True):
                await self._push_round(parts)
                if parts:
                    await send_frames(self.stream, parts)
            if self._control or self._can_push():
                self._wake.set()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            # The receiver's own tasks see the broken stream and end that connection.
            self._wake.set()
        finally:
            self._sending = False
            self._push_done.set()

    async def _write_loop(self, scope: trio.CancelScope) -> None:
        stream = self.stream
        try:
            while True:
                if self._sending:
                    # A depositing reader is pushing: the stream is its until it is done.
                    self._push_done = trio.Event()
                    await self._push_done.wait()
                    continue
                if self._final is not None:
                    await stream.send_all(self._final)
                    return
                if self._acks and not self._control and not self._can_push():
                    # Only acks to send: they leave with the next other frame, or after
                    # ACK_DELAY (they are cumulative, so any number of them make one round).
                    due = self._acks_since + ACK_DELAY
                    if trio.current_time() < due:
                        with trio.move_on_at(due):
                            await self._wake.wait()
                        self._wake = trio.Event()
                        continue
                self._sending = True
                try:
                    parts = self._take_control()
                    await self._push_round(parts)
                    if parts:
                        await send_frames(stream, parts)
                        continue
                finally:
                    self._sending = False
                await self._wake.wait()
                self._wake = trio.Event()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.reason = "the connection broke"
            scope.cancel()
        finally:
            self._writer_done.set()

    def _can_push(self) -> bool:
        return any(box.mailbox.can_push() for box in self.link.home_boxes)
