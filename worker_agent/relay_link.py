"""Connections from this agent to relays: one TLS connection per relay, shared by all ranks.

``RelayLinks.get`` opens a relay's connection the first time a rank needs it (``Hello`` ->
``Welcome``). Each open link runs two tasks: a reader that routes what the relay sends (pushed
``Data`` into the destination rank's outbox, ``Ack`` to the source rank, ``Attached``/``Error``
to whoever waits for an attach, ``Stop`` to the rank's runner) and a writer that drains one
bounded queue, gathering small frames into single writes.

Write-through: a sender that finds the queue empty and no write in progress writes its frame
itself instead of handing it to the writer task (a task switch per message is a large part of a
small message's cost). Such writes are shielded from cancellation: a write abandoned half way
would corrupt the TLS stream every rank of this agent shares. They still end when the link
closes the stream.

When a link drops, every rank still using it is reported through ``on_problem``: the
coordinator decides what becomes of the job. A later ``get`` opens a fresh connection.
"""

from __future__ import annotations

import logging
import math
import ssl
from collections import deque
from collections.abc import Callable

import trio

from vpool import __version__
from vpool.protocol.api import RelayInfo
from vpool.protocol.errors import ProtocolError
from vpool.protocol.messages import (
    PROTOCOL_VERSION,
    Ack,
    Attach,
    Attached,
    Credit,
    Data,
    Detach,
    Error,
    Hello,
    Message,
    Stop,
    Welcome,
)
from vpool.protocol.session import Session
from vpool.worker_agent.errors import RelayLinkError
from vpool.worker_agent.local_ranks import LocalRank, RankKey
from vpool.worker_agent.wire import Buffer, FrameReader, encode_small, send_parts

log = logging.getLogger("vpool.agent")

# Frames queued for one relay before senders wait: back-pressure from a slow relay.
_QUEUE = 512
_BATCH = 256 * 1024
CONNECT_TIMEOUT = 15.0
ATTACH_TIMEOUT = 30.0

ProblemCallback = Callable[[LocalRank, str], None]


class _PendingAttach:
    def __init__(self) -> None:
        self.done = trio.Event()
        self.result: Attached | str = "no answer"


class RelayLink:
    """One agent -> relay connection."""

    def __init__(self, info: RelayInfo, *, owner: RelayLinks) -> None:
        self.info = info
        self.name = info.name or f"{info.host}:{info.port}"
        self.where = f"relay {self.name} ({info.host}:{info.port})"
        self._owner = owner
        # Frames waiting for the writer task, oldest first; ``_busy`` while some task writes.
        self._out: deque[list[Buffer]] = deque()
        self._busy = False
        self._out_wake = trio.Event()
        self._space = trio.Event()
        self._stream: trio.SSLStream[trio.SocketStream] | None = None
        self._scope: trio.CancelScope | None = None
        self._closed = False
        self._write_error = ""
        self._session = Session("relay", "client")
        self._lock = trio.Lock()
        self.welcome: Welcome | None = None
        # Largest payload the relay takes: a bigger one is refused to its rank alone, before
        # the relay would close the connection every rank here shares.
        self.max_payload = owner.max_payload
        # Bytes of Credit an agent may hold back per rank (0: credit every write).
        self.credit_batch = 0
        self.broken: str | None = None
        self.ranks: dict[RankKey, LocalRank] = {}
        self._pending: dict[RankKey, _PendingAttach] = {}

    def __repr__(self) -> str:
        return f"<RelayLink {self.where}{' broken' if self.broken else ''}>"

    # -- opening ----------------------------------------------------------------------------

    async def ensure_open(self) -> None:
        async with self._lock:
            if self.broken is not None:
                raise RelayLinkError(f"connection to {self.where} is broken: {self.broken}")
            if self.welcome is None:
                await self._open()

    async def _open(self) -> None:
        info = self.info
        try:
            with trio.fail_after(CONNECT_TIMEOUT):
                tcp = await trio.open_tcp_stream(info.host, info.port)
                stream = trio.SSLStream(tcp, self._owner.ssl_context, server_hostname=info.host)
                try:
                    await stream.do_handshake()
                    reader = FrameReader(stream, max_payload=self._owner.max_payload)
                    hello = Hello(
                        version=PROTOCOL_VERSION,
                        role="agent",
                        token=self._owner.token(),
                        software=f"vpool-agent {__version__}",
                    )
                    self._session.send(hello)
                    await stream.send_all(encode_small(hello))
                    frame = await reader.receive()
                    if frame is None:
                        raise RelayLinkError(f"{self.where} closed the connection after Hello")
                    self._session.receive(frame.message)
                    if isinstance(frame.message, Error):
                        raise RelayLinkError(
                            f"{self.where} refused this agent: "
                            f"{frame.message.code}: {frame.message.message}"
                        )
                    assert isinstance(frame.message, Welcome)
                    if frame.message.version != PROTOCOL_VERSION:
                        raise RelayLinkError(
                            f"{self.where} speaks protocol {frame.message.version}, "
                            f"this agent {PROTOCOL_VERSION}"
                        )
                except BaseException:
                    await trio.aclose_forcefully(stream)
                    raise
        except trio.TooSlowError as exc:
            self.broken = "timed out while connecting"
            raise RelayLinkError(f"{self.where} did not answer within {CONNECT_TIMEOUT} s") from exc
        except (OSError, trio.BrokenResourceError, ssl.SSLError, ProtocolError) as exc:
            self.broken = str(exc)
            raise RelayLinkError(f"cannot connect to {self.where}: {exc}") from exc
        except RelayLinkError as exc:
            self.broken = str(exc)
            raise
        self.welcome = frame.message
        # Credit is gathered up to a quarter of the relay's push window: the relay still has
        # three quarters to push into meanwhile, so this never stalls delivery, and one Credit
        # frame then covers many pushed frames instead of one each.
        self.credit_batch = max(0, frame.message.push_window // 4)
        if frame.message.max_payload > 0:
            self.max_payload = min(self.max_payload, frame.message.max_payload)
        self._stream = stream
        self._owner.nursery.start_soon(self._run, stream, reader)
        log.info("connected to %s", self.where)

    # -- running ----------------------------------------------------------------------------

    async def _run(self, stream: trio.SSLStream[trio.SocketStream], reader: FrameReader) -> None:
        reason = "closed"
        try:
            async with trio.open_nursery() as nursery:
                self._scope = nursery.cancel_scope

                async def read() -> None:
                    nonlocal reason
                    try:
                        reason = await self._read_loop(reader)
                    except (
                        trio.BrokenResourceError,
                        ProtocolError,
                        RelayLinkError,
                        OSError,
                    ) as exc:
                        reason = f"{type(exc).__name__}: {exc}"
                    nursery.cancel_scope.cancel()

                async def write() -> None:
                    nonlocal reason
                    try:
                        await self._write_loop(stream)
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                        reason = f"{type(exc).__name__}: {exc}"
                    if self._write_error:
                        reason = self._write_error
                    nursery.cancel_scope.cancel()

                nursery.start_soon(read)
                nursery.start_soon(write)
        finally:
            # Cancelled means the agent itself is stopping: each rank's runner tells the
            # coordinator why, so this link must not blame the relay for it.
            shutting_down = trio.current_effective_deadline() == -math.inf
            self._fail(reason, report=not shutting_down)
            # No TLS goodbye: the relay treats any end as a drop, and a broken peer could
            # make a graceful close raise or hang.
            await trio.aclose_forcefully(stream)

    async def _read_loop(self, reader: FrameReader) -> str:
        session = self._session
        ranks = self.ranks
        while True:
            frame = await reader.receive()
            if frame is None:
                return "the relay closed the connection"
            msg = frame.message
            session.receive(msg)
            if isinstance(msg, Data):
                rank = ranks.get((msg.job, msg.dst))
                if rank is not None:
                    rank.outbox.push_data(frame.parts, frame.size, self)
            elif isinstance(msg, Ack):
                rank = ranks.get((msg.job, msg.src))
                if rank is not None:
                    rank.outbox.push_ack(msg.dst, bytes(frame.parts[0]))
            elif isinstance(msg, Attached):
                self._resolve((msg.job, msg.rank), msg)
            elif isinstance(msg, Stop):
                rank = ranks.get((msg.job, msg.rank))
                if rank is not None and rank.lease.incarnation == msg.incarnation:
                    rank.request_stop(f"{self.where} stopped it: {msg.reason}")
            elif isinstance(msg, Error):
                # Every Error ends the connection (the relay closes it); one naming a rank
                # says why that rank in particular was refused.
                key = (msg.job, msg.rank)
                text = f"{self.where} refused {_label(key)}: {msg.code}: {msg.message}"
                if key in self._pending:
                    self._resolve(key, text)
                elif (rank := ranks.pop(key, None)) is not None:
                    self._owner.on_problem(rank, text)
                return f"{self.where} sent {msg.code}: {msg.message}"
            else:
                raise RelayLinkError(f"unexpected {type(msg).__name__} from {self.where}")

    async def _write_loop(self, stream: trio.SSLStream[trio.SocketStream]) -> None:
        out = self._out
        while True:
            while not out or self._busy:
                if self._closed:
                    return
                self._out_wake = trio.Event()
                await self._out_wake.wait()
            batch = [out.popleft()]
            size = sum(map(len, batch[0]))
            while out and size < _BATCH:
                item = out.popleft()
                batch.append(item)
                size += sum(map(len, item))
            self._space.set()
            self._busy = True
            try:
                await send_parts(stream, batch)
            finally:
                self._busy = False

    def _resolve(self, key: RankKey, result: Attached | str) -> None:
        pending = self._pending.pop(key, None)
        if pending is not None:
            pending.result = result
            pending.done.set()

    def _fail(self, reason: str, *, report: bool = True) -> None:
        if self.broken is None:
            self.broken = reason
        self._closed = True
        self._out.clear()
        self._out_wake.set()
        self._space.set()
        for key in list(self._pending):
            self._resolve(key, f"connection to {self.where} dropped: {reason}")
        victims = [r for r in self.ranks.values() if not r.ended and not r.finalized]
        self.ranks.clear()
        self._owner.forget(self)
        if not report:
            return
        if victims:
            log.warning("lost %s with %d ranks attached: %s", self.where, len(victims), reason)
        for rank in victims:
            self._owner.on_problem(rank, f"connection to {self.where} dropped: {reason}")

    # -- used by ranks ----------------------------------------------------------------------

    async def _send_msg(self, msg: Message) -> None:
        await self._enqueue(msg, [encode_small(msg)])

    async def _enqueue(self, msg: Message, parts: list[Buffer]) -> None:
        if self.broken is not None or self._closed:
            raise RelayLinkError(f"connection to {self.where} is broken: {self.broken}")
        self._session.send(msg)
        stream = self._stream
        if not self._busy and not self._out and stream is not None:
            await self._write_through(stream, parts)
            return
        while len(self._out) >= _QUEUE:
            self._space = trio.Event()
            await self._space.wait()
            if self._closed:
                raise RelayLinkError(f"connection to {self.where} dropped")
        # Not yielding while there is room lets a sender hand over every frame it has
        # buffered before the writer runs, which then sends them all in one write.
        self._out.append(parts)
        self._out_wake.set()

    async def _write_through(
        self, stream: trio.SSLStream[trio.SocketStream], parts: list[Buffer]
    ) -> None:
        self._busy = True
        try:
            with trio.CancelScope(shield=True):
                await send_parts(stream, [parts])
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            if not self._write_error:
                self._write_error = f"{type(exc).__name__}: {exc}"
            if self._scope is not None:
                self._scope.cancel()
            raise RelayLinkError(f"connection to {self.where} dropped") from exc
        finally:
            self._busy = False
            if self._out:
                self._out_wake.set()

    def credit_nowait(self, job: int, rank: int, nbytes: int) -> None:
        """Queue a ``Credit`` for the writer task without waiting (credits are few and small,
        so they may overrun the queue's bound)."""
        if self.broken is not None or self._closed:
            return
        msg = Credit(job=job, rank=rank, nbytes=nbytes)
        self._session.send(msg)
        self._out.append([encode_small(msg)])
        self._out_wake.set()

    async def attach(self, rank: LocalRank, *, home: bool) -> Attached:
        """Bind ``rank`` to this connection and wait for the relay's ``Attached``."""
        key = rank.key
        pending = self._pending[key] = _PendingAttach()
        self.ranks[key] = rank
        try:
            await self._send_msg(Attach(token=rank.lease.token, home=home))
            with trio.move_on_after(ATTACH_TIMEOUT):
                await pending.done.wait()
        finally:
            self._pending.pop(key, None)
        result = pending.result
        if not isinstance(result, Attached):
            self.ranks.pop(key, None)
            raise RelayLinkError(
                f"cannot attach {rank.label} to {self.where}: {result}"
                if isinstance(result, str) and result != "no answer"
                else f"{self.where} did not answer Attach for {rank.label} in {ATTACH_TIMEOUT} s"
            )
        return result

    async def send_data(self, msg: Data, parts: list[Buffer]) -> None:
        """Forward one of a rank's ``Data`` frames, bytes unchanged."""
        await self._enqueue(msg, parts)

    async def credit(self, job: int, rank: int, nbytes: int) -> None:
        await self._send_msg(Credit(job=job, rank=rank, nbytes=nbytes))

    async def detach(self, rank: LocalRank) -> None:
        if self.ranks.pop(rank.key, None) is None or self.broken is not None:
            return
        try:
            await self._send_msg(Detach(job=rank.lease.job, rank=rank.lease.rank))
        except RelayLinkError:
            pass  # the drop is reported by the link itself


def _label(key: RankKey) -> str:
    return f"rank {key[1]} of job {key[0]}" if key[0] >= 0 else "this agent"


class RelayLinks:
    """The agent's relay connections, keyed by address and opened on first use."""

    def __init__(
        self,
        nursery: trio.Nursery,
        *,
        ssl_context: ssl.SSLContext,
        token: Callable[[], str],
        on_problem: ProblemCallback,
        max_payload: int,
    ) -> None:
        self.nursery = nursery
        self.ssl_context = ssl_context
        self.token = token
        self.on_problem = on_problem
        self.max_payload = max_payload
        self._links: dict[tuple[str, int], RelayLink] = {}

    async def get(self, info: RelayInfo) -> RelayLink:
        key = (info.host, info.port)
        link = self._links.get(key)
        if link is None or link.broken is not None:
            link = self._links[key] = RelayLink(info, owner=self)
        try:
            await link.ensure_open()
        except RelayLinkError:
            self.forget(link)
            raise
        return link

    def forget(self, link: RelayLink) -> None:
        key = (link.info.host, link.info.port)
        if self._links.get(key) is link:
            del self._links[key]

    def __len__(self) -> int:
        return len(self._links)
