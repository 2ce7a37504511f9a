"""What a relay sends this agent, routed to the ranks: the reader half of a ``RelayLink``.

``InboundRouting._read_loop`` takes every frame the relay sends on the link's current
connection: pushed ``Data`` and ``Det`` go into the destination rank's outbox, ``Ack``/``DetAck``
to the depositing rank (and its ``RankLink``), ``Attached``/``Error`` to whoever waits for
an attach, ``Stop`` to the rank's runner. An ``Error`` about one rank (``fenced``,
``not_deterministic``) leaves the connection up; any other ends it. A ``Ping`` is answered
``Pong`` at once; a ``Pong`` does nothing more than any frame does (the connection's liveness
watch counts every byte read, ``FrameStream.last_read``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import trio

from vpool.framestream import FrameStream, WireFrame
from vpool.protocol.errors import ErrorCode, ends_connection
from vpool.protocol.framing import encode_frame
from vpool.protocol.messages import Ack, Attached, Data, Det, DetAck, Error, Ping, Pong, Stop
from vpool.protocol.rank_link import RankLink, is_current
from vpool.protocol.sealing import SealError
from vpool.protocol.session import Session
from vpool.worker_agent.errors import RelayLinkError
from vpool.worker_agent.local_ranks import LocalRank, RankKey
from vpool.worker_agent.relay_writer import FrameWriter

if TYPE_CHECKING:
    from vpool.worker_agent.relay_link import Connection
    from vpool.worker_agent.relay_links import RelayLinks

log = logging.getLogger("vpool.agent")


class _PendingAttach:
    def __init__(self) -> None:
        self.done = trio.Event()
        self.result: Attached | str = "no answer"
        self.dropped = False  # the connection dropped before the answer: try again
        self.code = ""  # the relay's Error code, or "stopped"
        self.home = False  # asked as the rank's home attachment


class InboundRouting:
    """Routing of the frames a relay sends; ``RelayLink`` holds the state below."""

    name: str
    where: str
    current: Connection | None
    ranks: dict[RankKey, LocalRank]
    attached: dict[RankKey, bool]
    _owner: RelayLinks
    _session: Session
    _writer: FrameWriter | None
    _unacked: dict[RankKey, RankLink]
    _pending: dict[RankKey, _PendingAttach]

    async def _read_loop(self, reader: FrameStream) -> str:
        session = self._session
        ranks = self.ranks
        attached = self.attached
        unacked = self._unacked
        conn = self.current
        assert conn is not None
        while True:
            frame = await reader.receive()
            if frame is None:
                return "the relay closed the connection"
            msg = frame.message
            if type(msg) is Error and not ends_connection(msg.code, msg.rank):
                self._rank_error(msg)  # the connection, and every other rank here, goes on
                continue
            session.receive(msg)
            # Frames for a rank go to it only once the relay answered its attachment: until
            # then they are the previous attachment's of its key (an older incarnation's,
            # pushed before the relay read the new Attach; the relay sends ``Attached``
            # before any frame of the new one), and must not count as this one's.
            if isinstance(msg, Data):
                key = (msg.job, msg.dst)
                rank = ranks.get(key) if key in attached else None
                if rank is not None:
                    if rank.delivery.data(msg.src, msg.seq):
                        if msg.sealed:
                            self._push_opened(rank, msg, frame, conn)
                        else:
                            rank.outbox.push_data(frame.parts, frame.size, conn)
                    elif due := rank.outbox.credit_due(conn, frame.size):
                        # This agent delivered it already (its Delivered came after the
                        # push): dropped, and credited as if written.
                        conn.credit_nowait(msg.job, msg.dst, due)
            elif isinstance(msg, Ack):
                key = (msg.job, msg.src)
                if key not in attached:
                    continue
                store = unacked.get(key)
                if store is not None:
                    store.acked(msg.dst, msg.seq)
                rank = ranks.get(key)
                if rank is not None:
                    rank.outbox.push_ack(msg.dst, bytes(frame.frame))
            elif isinstance(msg, Det):
                key = (msg.job, msg.rank)
                rank = ranks.get(key) if key in attached else None
                # One the rank has is not given again (a resumed home attachment).
                if rank is not None and rank.delivery.det_in(msg.index):
                    rank.outbox.push_data(frame.parts, frame.size, None)
            elif isinstance(msg, DetAck):
                key = (msg.job, msg.rank)
                if key not in attached:
                    continue
                store = unacked.get(key)
                if store is not None:
                    store.dets_acked(msg.count)
                rank = ranks.get(key)
                if rank is not None:
                    rank.outbox.push_data(frame.parts, frame.size, None)
            elif isinstance(msg, Attached):
                self._resolve((msg.job, msg.rank), msg)
            elif isinstance(msg, Stop):
                self._stop(msg)
            elif isinstance(msg, Ping):
                writer = self._writer
                if writer is not None and not writer.closed:
                    pong = Pong(nonce=msg.nonce)
                    session.send(pong)
                    # Past the queue's bound, never waiting: the reader must not stall on it.
                    writer.put_nowait([encode_frame(pong)])
            elif isinstance(msg, Pong):
                pass
            elif isinstance(msg, Error):
                key = (msg.job, msg.rank)
                text = f"{self.where} refused {_label(key)}: {msg.code}: {msg.message}"
                # Every other Error ends the connection (the relay closes it); one naming a
                # rank says why that rank in particular was refused.
                if key in self._pending:
                    self._resolve(key, text, code=msg.code)
                elif (rank := ranks.get(key)) is not None:
                    self._forget(key)
                    self._owner.on_problem(rank, text, "")
                return f"{self.where} sent {msg.code}: {msg.message}"
            else:
                raise RelayLinkError(f"unexpected {type(msg).__name__} from {self.where}")

    def _push_opened(self, rank: LocalRank, msg: Data, frame: WireFrame, conn: Connection) -> None:
        """Open a sealed ``Data`` and queue the plaintext for the rank; the relay is credited
        with the sealed size it pushed."""
        try:
            if rank.sealer is None:
                raise SealError(f"{rank.label} has no job key to open message {msg.seq} with")
            plain = rank.sealer.open(msg, frame.frame, frame.header_len)
        except SealError as exc:
            # Changed on its way: the rank cannot go on without it. A restart fetches it again;
            # the coordinator counts it against the relay and this agent.
            self._owner.on_problem(
                rank, f"{self.where}: {exc}", "", failure=str(exc), unopened_from=self.name
            )
            if due := rank.outbox.credit_due(conn, frame.size):
                conn.credit_nowait(msg.job, msg.dst, due)
            return
        rank.outbox.push_data([plain], len(plain), conn, frame.size)

    def _rank_error(self, msg: Error) -> None:
        """An Error about one rank that leaves the connection up (``protocol.errors.SCOPES``):
        the answer to an attachment (``fenced``, ``trimmed``), ``fenced`` later (a newer
        incarnation holds the rank) or ``not_deterministic`` (the relay drops the rank's
        further deposits and tells the coordinator, which ends the job)."""
        key = (msg.job, msg.rank)
        text = f"{self.where} refused {_label(key)}: {msg.code}: {msg.message}"
        if key in self._pending:
            self._resolve(key, text, code=msg.code)
            return
        log.warning("%s", text)
        if msg.code == ErrorCode.FENCED and (rank := self.ranks.get(key)) is not None:
            self._forget(key)
            rank.request_stop(text)

    def _forget(self, key: RankKey) -> None:
        """The relay refused the rank: route nothing more for it, send nothing more of it."""
        self.ranks.pop(key, None)
        self.attached.pop(key, None)
        self._unacked.pop(key, None)

    def _stop(self, msg: Stop) -> None:
        key = (msg.job, msg.rank)
        rank = self.ranks.get(key)
        if rank is None or not is_current(rank.lease.incarnation, msg.incarnation):
            return  # an older incarnation, replaced here already
        self.attached.pop(key, None)
        text = f"{self.where} stopped it: {msg.reason}"
        if key in self._pending:
            self._resolve(key, text, code=ErrorCode.STOPPED)
        rank.request_stop(text)

    def _resolve(
        self, key: RankKey, result: Attached | str, *, dropped: bool = False, code: str = ""
    ) -> None:
        pending = self._pending.pop(key, None)
        if pending is not None:
            if isinstance(result, Attached):
                # Now, before the frames that follow it are read (``attach`` wakes later).
                self.attached[key] = pending.home
            pending.result = result
            pending.dropped = dropped
            pending.code = code
            pending.done.set()


def _label(key: RankKey) -> str:
    return f"rank {key[1]} of job {key[0]}" if key[0] >= 0 else "this agent"
