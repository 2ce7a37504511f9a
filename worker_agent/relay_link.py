"""Connections from this agent to relays: one TLS link per relay, shared by all ranks.

``relay_links.RelayLinks.get`` opens a relay's link the first time a rank needs it (``Hello`` ->
``Welcome``). Each connection runs two tasks: a reader (``relay_inbound.InboundRouting``) that
routes what the relay sends (pushed ``Data`` and ``Det`` into the destination rank's outbox,
``Ack``/``DetAck`` to the depositing rank, ``Attached``/``Error`` to whoever waits for an attach,
``Stop`` to the rank's runner) and a writer (``relay_writer.FrameWriter``) that drains one
bounded queue.

Reconnection (docs/internals.md, "Fault tolerance"): every ``Data`` and ``Det`` deposited is
kept (``protocol.rank_link.RankLink``) until the relay acknowledges it. When the connection
drops while ranks are attached, the link reconnects with backoff for up to ``relay_reconnect``
seconds, re-attaches each rank (a home attachment resuming after what the rank already has) and
resends every frame the relay has not acknowledged, before any new frame: senders wait
meanwhile (back-pressure, the ranks keep running). Only when the window passes is every rank
still attached reported through ``on_problem``, and the coordinator decides what becomes of the
job.

Liveness (``protocol.liveness``): a connection whose relay answers pings (``Welcome.pings``) is
watched by a third task. After ``ping_interval`` s without a byte from the relay it sends a
``Ping``; after ``dead_after`` s the connection is declared dead (a middlebox that forgot it
drops everything without a reset): its writer is closed at once, so nothing more is written
to it, the socket is closed, and the link reconnects as after any drop.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Protocol

import trio

from vpool.framestream import FrameStream
from vpool.protocol.api import RelayInfo
from vpool.protocol.errors import ErrorCode, ProtocolError
from vpool.protocol.framing import Buffer, encode_frame
from vpool.protocol.liveness import Liveness, Silent
from vpool.protocol.messages import (
    Attach,
    Attached,
    Credit,
    Data,
    Delivered,
    Det,
    Detach,
    DetAck,
    Message,
    Ping,
    Welcome,
)
from vpool.protocol.rank_link import RankLink
from vpool.protocol.session import Session
from vpool.reasons import describe
from vpool.worker_agent.errors import RelayLinkError
from vpool.worker_agent.local_ranks import LocalRank, RankKey
from vpool.worker_agent.relay_handshake import handshake
from vpool.worker_agent.relay_inbound import InboundRouting, _label, _PendingAttach
from vpool.worker_agent.relay_writer import Dropped, FrameWriter

if TYPE_CHECKING:
    from vpool.worker_agent.relay_links import RelayLinks

log = logging.getLogger("vpool.agent")

CONNECT_TIMEOUT = 15.0
ATTACH_TIMEOUT = 30.0
# An ended rank's detach waits this long for the relay to log what this agent delivered from
# it to its other ranks (``_settle_local``), looking every _SETTLE_POLL seconds.
LOCAL_SETTLE = 2.0
_SETTLE_POLL = 0.005
_RECONNECT_FIRST = 0.1  # s before the first reconnection attempt, doubled up to _RECONNECT_MAX
_RECONNECT_MAX = 2.0


class ProblemCallback(Protocol):
    """(rank, message, relay): ``relay`` names the relay that could not be reached ("" when
    the problem is another one), ``failure`` and ``unopened_from`` as ``RankProblem`` has
    them: how it failed in words every agent would use, the relay whose sealed message did not
    open here."""

    def __call__(
        self,
        rank: LocalRank,
        message: str,
        relay: str,
        *,
        failure: str = "",
        unopened_from: str = "",
    ) -> None: ...


class Connection:
    """One connection of a link, as the outbox of a rank sees it: pushed frames are credited
    on the connection that pushed them. Credit for an earlier connection of the link is dropped
    (the relay's push window starts afresh with each attachment)."""

    __slots__ = ("credit_batch", "link")

    def __init__(self, link: RelayLink, credit_batch: int) -> None:
        self.link = link
        # Bytes of Credit an agent may hold back per rank (0: credit every write).
        self.credit_batch = credit_batch

    def credit_nowait(self, job: int, rank: int, nbytes: int) -> None:
        if self.link.current is self:
            self.link.credit_nowait(job, rank, nbytes)

    async def credit(self, job: int, rank: int, nbytes: int) -> None:
        link = self.link
        if link.current is self:
            msg = Credit(job=job, rank=rank, nbytes=nbytes)
            try:
                await link._enqueue(msg, [encode_frame(msg)], gated=False)
            except Dropped:
                pass  # a new connection brings a new window


class RelayLink(InboundRouting):
    """The agent's link to one relay, across reconnections."""

    def __init__(self, info: RelayInfo, *, owner: RelayLinks) -> None:
        self.info = info
        self.name = info.name or f"{info.host}:{info.port}"
        self.where = f"relay {self.name} ({info.host}:{info.port})"
        self._owner = owner
        # The current connection's sending half (None while there is no connection).
        self._writer: FrameWriter | None = None
        self._session = Session("relay", "client")
        self._lock = trio.Lock()
        # Ready: connected and every attached rank re-attached, so ranks may send.
        self._ready = False
        self._ready_event = trio.Event()
        self.current: Connection | None = None
        self.welcome: Welcome | None = None
        # Largest payload the relay takes: a bigger one is refused to its rank alone, before
        # the relay would close the connection every rank here shares.
        self.max_payload = owner.max_payload
        self.broken: str | None = None
        # Ranks whose frames this link routes; ``attached``: those the relay has attached
        # (value: home), re-attached after a reconnection.
        self.ranks: dict[RankKey, LocalRank] = {}
        self.attached: dict[RankKey, bool] = {}
        self._unacked: dict[RankKey, RankLink] = {}
        self._pending: dict[RankKey, _PendingAttach] = {}

    def __repr__(self) -> str:
        return f"<RelayLink {self.where}{' broken' if self.broken else ''}>"

    # -- opening ----------------------------------------------------------------------------

    async def ensure_open(self) -> None:
        async with self._lock:
            if self.broken is not None:
                raise RelayLinkError(f"connection to {self.where} is broken: {self.broken}")
            if self.welcome is None:
                try:
                    stream, reader, session, welcome = await self._connect(CONNECT_TIMEOUT)
                except RelayLinkError as exc:
                    self.broken = str(exc)
                    raise
                self._adopt(stream, session, welcome)
                self._owner.nursery.start_soon(self._run, stream, reader)
                log.info("connected to %s", self.where)

    async def _connect(
        self, seconds: float
    ) -> tuple[trio.SSLStream[trio.SocketStream], FrameStream, Session, Welcome]:
        owner = self._owner
        return await handshake(
            self.info,
            self.where,
            ssl_context=owner.ssl_context,
            token=owner.token(),
            max_payload=owner.max_payload,
            seconds=seconds,
            pings=owner.ping_interval > 0,
        )

    def _adopt(
        self, stream: trio.SSLStream[trio.SocketStream], session: Session, welcome: Welcome
    ) -> None:
        """Make a fresh connection the link's current one (not yet ready)."""
        self._session = session
        self._writer = FrameWriter(stream, self.where)
        self.welcome = welcome
        # Credit is gathered up to a quarter of the relay's push window: the relay still has
        # three quarters to push into meanwhile, so this never stalls delivery, and one Credit
        # frame then covers many pushed frames instead of one each. ``Welcome.push_window`` is
        # the window each attachment starts with and never goes below (it grows with the
        # link's bandwidth-delay product, protocol/window.py), so a quarter of it stays at
        # most a quarter of the window in force.
        self.current = Connection(self, max(0, welcome.push_window // 4))
        self.max_payload = self._owner.max_payload
        if welcome.max_payload > 0:
            self.max_payload = min(self.max_payload, welcome.max_payload)

    # -- running ----------------------------------------------------------------------------

    async def _run(self, stream: trio.SSLStream[trio.SocketStream], reader: FrameStream) -> None:
        """Serve the connection; reconnect when it drops, within the window; fail for good
        when the window passes (or at once when no rank needs the link)."""
        reason = "closed"
        resync = False
        deadline: float | None = None
        try:
            while True:
                reason = await self._serve(stream, reader, resync=resync)
                if self._ready:
                    deadline = None  # it was fully back: a new drop gets a whole new window
                keep = bool(self.attached) or bool(self._pending)
                self._drop(reason)
                if not keep:
                    self._fail(reason)
                    return
                if deadline is None:
                    deadline = trio.current_time() + self._owner.reconnect
                    log.warning(
                        "lost %s with %d ranks attached (%s); reconnecting for up to %g s",
                        self.where,
                        len(self.attached),
                        reason,
                        self._owner.reconnect,
                    )
                got = await self._reconnect(deadline)
                if got is None:
                    self._fail(f"{reason}; not back within {self._owner.reconnect:g} s")
                    return
                stream, reader, session, welcome = got
                self._adopt(stream, session, welcome)
                resync = True
        finally:
            if self.broken is None:
                # Cancelled means the agent itself is stopping: each rank's runner tells the
                # coordinator why, so this link must not blame the relay for it.
                shutting_down = trio.current_effective_deadline() == -math.inf
                self._fail(reason, report=not shutting_down)

    async def _serve(
        self, stream: trio.SSLStream[trio.SocketStream], reader: FrameStream, *, resync: bool
    ) -> str:
        reason = "closed"
        writer = self._writer
        assert writer is not None
        try:
            async with trio.open_nursery() as nursery:
                writer.scope = nursery.cancel_scope

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
                        reason = describe(exc)
                    nursery.cancel_scope.cancel()

                async def write() -> None:
                    nonlocal reason
                    try:
                        await writer.run()
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                        reason = describe(exc)
                    if writer.error:
                        reason = writer.error
                    nursery.cancel_scope.cancel()

                async def resync_ranks() -> None:
                    nonlocal reason
                    try:
                        await self._resync()
                    except RelayLinkError as exc:
                        reason = str(exc)
                        nursery.cancel_scope.cancel()
                        return
                    log.info("reconnected to %s", self.where)
                    self._set_ready()

                async def watch() -> None:
                    nonlocal reason
                    silent = await self._watch(reader, writer)
                    reason = f"nothing from the relay for {silent.seconds:.1f} s: dead"
                    nursery.cancel_scope.cancel()

                nursery.start_soon(read)
                nursery.start_soon(write)
                assert self.welcome is not None
                if self.welcome.pings and self._owner.ping_interval > 0:
                    nursery.start_soon(watch)
                if resync:
                    nursery.start_soon(resync_ranks)
                else:
                    self._set_ready()
        finally:
            # No TLS goodbye: the relay treats any end as a drop, and a broken peer could
            # make a graceful close raise or hang.
            await trio.aclose_forcefully(stream)
        return reason

    async def _watch(self, reader: FrameStream, writer: FrameWriter) -> Silent:
        """Ping the relay when it is quiet; return once it was silent for ``dead_after``,
        with the writer closed (``protocol.liveness``)."""
        owner = self._owner
        live = Liveness(
            ping_interval=owner.ping_interval,
            dead_after=owner.dead_after,
            now=trio.current_time(),
        )
        while True:
            await trio.sleep_until(live.next_timer())
            live.heard(reader.last_read)
            out = live.handle_timer(trio.current_time())
            if isinstance(out, Ping) and self._session.is_open and not writer.closed:
                # Never waits: a writer stuck on a full socket must not hold the watch up.
                self._session.send(out)
                writer.put_nowait([encode_frame(out)])
            elif isinstance(out, Silent):
                writer.close()
                return out

    async def _reconnect(
        self, deadline: float
    ) -> tuple[trio.SSLStream[trio.SocketStream], FrameStream, Session, Welcome] | None:
        delay = _RECONNECT_FIRST
        while True:
            left = deadline - trio.current_time()
            if left <= 0:
                return None
            await trio.sleep(min(delay, left))
            left = deadline - trio.current_time()
            if left <= 0:
                return None
            try:
                return await self._connect(min(CONNECT_TIMEOUT, left))
            except RelayLinkError as exc:
                log.info("reconnecting to %s: %s", self.where, describe(exc))
            delay = min(delay * 2, _RECONNECT_MAX)

    async def _resync(self) -> None:
        """Re-attach every rank attached before the drop, then resend every frame the relay
        has not acknowledged (``RankLink.resend``)."""
        for key, home in list(self.attached.items()):
            rank = self.ranks.get(key)
            if rank is None or rank.ended or rank.stop_reason is not None:
                self.attached.pop(key, None)
                continue
            pending = await self._attach_once(
                rank,
                home=home,
                resume=rank.delivery.resume(home=home),
                gated=False,
            )
            result = pending.result
            if pending.dropped:
                raise Dropped(f"connection to {self.where} dropped while re-attaching")
            if not isinstance(result, Attached):
                self._forget(key)
                self._refused(rank, pending)
                continue
            store = self._unacked.get(key)
            if store is None:
                continue
            if home and result.dets:
                # The relay holds these determinants (durable: an attach waits for them) and
                # they are not resent, so no DetAck would come for one whose DetAck was lost
                # with the connection: the rank is told here (else its next deposit would
                # wait forever; found by tests/protocol/test_ft_model.py).
                det_ack = DetAck(job=rank.lease.job, rank=rank.lease.rank, count=result.dets)
                rank.outbox.push_control(encode_frame(det_ack))
            frames = store.resend(result.dets)
            if frames:
                log.info("resending %d frames of %s to %s", len(frames), rank.label, self.where)
            for parts in frames:
                await self._enqueue(None, parts, gated=False)

    def _refused(self, rank: LocalRank, pending: _PendingAttach) -> None:
        """A re-attachment the relay answered with an Error or a Stop."""
        if pending.code == ErrorCode.STOPPED:
            return  # the rank's runner is stopping it
        self._owner.on_problem(rank, str(pending.result), "")
        if pending.code == ErrorCode.FENCED:
            rank.request_stop(str(pending.result))

    def _set_ready(self) -> None:
        self._ready = True
        self._ready_event.set()

    def _drop(self, reason: str) -> None:
        """The current connection is gone: wake everyone who waits on it."""
        self.current = None
        if self._writer is not None:
            self._writer.close()  # Data and Det are kept in ``_unacked``; the rest is moot now
            self._writer = None
        if self._ready:
            self._ready = False
            self._ready_event = trio.Event()
        for key in list(self._pending):
            self._resolve(key, f"connection to {self.where} dropped: {reason}", dropped=True)

    def _fail(self, reason: str, *, report: bool = True) -> None:
        """The link is gone for good."""
        if self.broken is None:
            self.broken = reason
        self._drop(reason)
        self._ready_event.set()  # senders waiting for a reconnection find the link broken
        victims = [r for r in self.ranks.values() if not r.ended and not r.finalized]
        self.ranks.clear()
        self.attached.clear()
        for store in self._unacked.values():
            store.clear()  # its ranks' budgets are free again (``LocalRank.room_for``)
        self._unacked.clear()
        self._owner.forget(self)
        if not report:
            return
        if victims:
            log.warning("lost %s with %d ranks attached: %s", self.where, len(victims), reason)
        for rank in victims:
            self._owner.on_problem(rank, f"connection to {self.where} dropped: {reason}", self.name)

    # -- used by ranks ----------------------------------------------------------------------

    async def _wait_ready(self) -> None:
        while not self._ready:
            if self.broken is not None:
                raise RelayLinkError(f"connection to {self.where} is broken: {self.broken}")
            await self._ready_event.wait()

    async def _send_msg(self, msg: Message, *, gated: bool = True) -> None:
        await self._enqueue(msg, [encode_frame(msg)], gated=gated)

    async def _enqueue(
        self, msg: Message | None, parts: list[Buffer], *, gated: bool, lazy: bool = False
    ) -> None:
        """Write or queue one frame on the current connection. ``gated``: wait until the link
        is ready (after a reconnection: once the resend is out). ``msg`` None: a resent frame,
        checked by the session when it was first sent."""
        if gated and not self._ready:
            await self._wait_ready()
        if self.broken is not None:
            raise RelayLinkError(f"connection to {self.where} is broken: {self.broken}")
        writer = self._writer
        if writer is None or writer.closed:
            raise Dropped(f"connection to {self.where} dropped")
        if msg is not None:
            self._session.send(msg)
        if lazy:
            await writer.put_lazy(parts)
        else:
            await writer.put(parts)

    def credit_nowait(self, job: int, rank: int, nbytes: int) -> None:
        """Queue a ``Credit`` for the writer task without waiting (credits are few and small,
        so they may overrun the queue's bound)."""
        writer = self._writer
        if self.broken is not None or writer is None or writer.closed:
            return
        msg = Credit(job=job, rank=rank, nbytes=nbytes)
        self._session.send(msg)
        writer.put_nowait([encode_frame(msg)])

    async def _attach_once(
        self,
        rank: LocalRank,
        *,
        home: bool,
        resume: tuple[dict[int, int], int],
        gated: bool,
    ) -> _PendingAttach:
        key = rank.key
        pending = self._pending[key] = _PendingAttach()
        pending.home = home
        try:
            received, dets_from = resume
            msg = Attach(token=rank.lease.token, home=home, received=received, dets_from=dets_from)
            await self._send_msg(msg, gated=gated)
            with trio.move_on_after(ATTACH_TIMEOUT):
                await pending.done.wait()
        except Dropped as exc:
            pending.result, pending.dropped = str(exc), True
        finally:
            if self._pending.get(key) is pending:
                del self._pending[key]
        return pending

    def _forget_unacked(self, key: RankKey) -> None:
        store = self._unacked.pop(key, None)
        if store is not None:
            store.clear()

    async def attach(self, rank: LocalRank, *, home: bool) -> Attached:
        """Bind ``rank`` to this link and wait for the relay's ``Attached``; retried on the next
        connection if this one drops meanwhile. A home attachment resumes after
        ``rank.delivery`` (empty for a fresh incarnation, the image's
        counters for a restored one)."""
        key = rank.key
        if self.ranks.get(key) is not rank:
            self._forget_unacked(key)
            # An older incarnation's are not ours; what the rank's links hold counts against
            # its budget (``LocalRank.room_for``).
            self._unacked[key] = RankLink(home=home, held=rank.held)
            # Nor are the frames the relay still sends to the older one until it reads this
            # Attach: routed again once it answers (``_resolve``).
            self.attached.pop(key, None)
        self.ranks[key] = rank
        while True:
            try:
                # A fresh incarnation has nothing yet; a restored one what its image holds.
                pending = await self._attach_once(
                    rank,
                    home=home,
                    resume=rank.delivery.resume(home=home),
                    gated=True,
                )
            except RelayLinkError:
                pending = _PendingAttach()
                pending.result = f"connection to {self.where} is broken: {self.broken}"
            result = pending.result
            if isinstance(result, Attached):
                self.attached[key] = home
                return result
            if pending.dropped and self.broken is None:
                continue  # reconnecting: attach on the next connection
            if self.ranks.get(key) is rank:
                del self.ranks[key]
                self._forget_unacked(key)
            raise RelayLinkError(
                f"cannot attach {rank.label} to {self.where}: {result}"
                if result != "no answer"
                else f"{self.where} did not answer Attach for {rank.label} in {ATTACH_TIMEOUT} s"
            )

    def home_of(self, key: RankKey) -> LocalRank | None:
        """The rank of this agent home-attached on this link under ``key``, if any: where
        agent-local delivery may go (the relay honours its ``Delivered`` only there)."""
        if self.attached.get(key) is not True or not self._ready:
            return None
        return self.ranks.get(key)

    async def _settle_local(self, rank: LocalRank) -> None:
        """Before an ended rank detaches: wait until the relay holds the messages this agent
        delivered from it to its other ranks (``RankLink.unlogged_local``). If it cannot (the
        connection dropped: an ended rank's frames are not resent), those receivers are
        restarted, so that they take the message from the log, as sent by the rank's next
        incarnation: consuming one the log never had would keep a program that is not
        deterministic from being caught."""
        store = self._unacked.get(rank.key)
        if store is None or not store.local or rank.stop_reason is not None:
            return  # (a rank stopped by the agent: its job is over, or it was replaced)
        with trio.move_on_after(LOCAL_SETTLE):
            # Polled: acknowledgements land in the link's books, which signal nobody.
            while store.unlogged_local() and self.broken is None and self._ready:  # noqa: ASYNC110
                await trio.sleep(_SETTLE_POLL)
        job = rank.lease.job
        for dst in store.unlogged_local():
            peer = self.ranks.get((job, dst))
            if peer is not None and not peer.ended and peer.stop_reason is None:
                peer.request_stop(
                    f"it was given messages of {rank.label}, which ended before "
                    f"{self.where} logged them: restarted to take them from the log",
                    lost=True,
                )

    def unacked(self, key: RankKey) -> RankLink | None:
        """What rank ``key`` deposited through this link that is not acknowledged yet (None:
        the link does not carry the rank); a checkpoint waits on it."""
        return self._unacked.get(key)

    async def send_data(
        self, msg: Data, parts: list[Buffer], delivered: Delivered | None = None
    ) -> None:
        """Forward one of a rank's ``Data`` frames, bytes unchanged, keeping it until acked;
        with ``delivered``, the agent handed it to its receiver itself: the notice goes right
        behind it (in the same write: the relay reads it before it could push), and both may
        wait a little to go out with others (``FrameWriter.put_lazy``)."""
        if not self._ready:
            await self._wait_ready()
        store = self._unacked.get((msg.job, msg.src))
        if store is None:
            raise RelayLinkError(f"rank {msg.src} of job {msg.job} is not attached to {self.where}")
        store.deposited(msg.dst, msg.seq, parts, local=delivered is not None)
        try:
            if delivered is None:
                await self._enqueue(msg, parts, gated=False)
            else:
                self._session.send(msg)
                await self._enqueue(
                    delivered, [*parts, encode_frame(delivered)], gated=False, lazy=True
                )
        except Dropped:
            if self.broken is not None:
                raise
            # Kept above: resent once the link is back.

    async def send_det(self, msg: Det, parts: list[Buffer]) -> None:
        """Forward one of a rank's determinants to its home relay, keeping it until acked."""
        if not self._ready:
            await self._wait_ready()
        store = self._unacked.get((msg.job, msg.rank))
        if store is None:
            raise RelayLinkError(f"{_label((msg.job, msg.rank))} is not attached to {self.where}")
        store.det_sent(msg.index, parts)
        rank = self.ranks.get((msg.job, msg.rank))
        if rank is not None:
            rank.delivery.det_out(msg.index)
        try:
            await self._enqueue(msg, parts, gated=False)
        except Dropped:
            if self.broken is not None:
                raise

    async def detach(self, rank: LocalRank) -> None:
        key = rank.key
        if self.ranks.get(key) is not rank:
            return  # never attached, or a newer incarnation took its place (the relay knows)
        await self._settle_local(rank)
        if self.ranks.get(key) is not rank:
            return  # the link failed meanwhile (``_fail`` let go of every rank)
        del self.ranks[key]
        self.attached.pop(key, None)
        self._forget_unacked(key)
        if self.broken is not None or not self._ready:
            return
        try:
            await self._send_msg(Detach(job=rank.lease.job, rank=rank.lease.rank), gated=False)
        except RelayLinkError:
            pass  # the drop is handled by the link itself
