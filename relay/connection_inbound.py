"""What each message from an agent does on its connection: deposits (``Data``), determinants
(``Det``), credits and attachments, checked against the rank's attachment and staged for the
hub's group write. The ``Connection``'s reader calls these for every frame it parsed.

Errors of the protocol core become the connection's ``Error`` in one place, ``rejection``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, cast

import trio

from vpool.protocol.detlog import DetOffer
from vpool.protocol.errors import ErrorCode, RemoteProtocolError, TokenError, ends_connection
from vpool.protocol.mailbox import Offer
from vpool.protocol.messages import Attach, Attached, Credit, Data, Det, DetAck, Error, Stop
from vpool.protocol.tokens import RankClaims, verify_token
from vpool.relay import trim
from vpool.relay.errors import Rejected
from vpool.relay.hub import Attachment, Batch, Hub, Key, now

if TYPE_CHECKING:
    from vpool.protocol.messages import Message
    from vpool.relay.connection import Connection

logger = logging.getLogger(__name__)


def rejection(exc: RemoteProtocolError | TokenError, *, job: int = -1, rank: int = -1) -> Rejected:
    """The one place protocol-core errors become a connection's ``Error``."""
    rej = Rejected(exc.code, exc.message, job=job, rank=rank)
    rej.__cause__ = exc
    return rej


class InboundMessages:
    """The handlers of a ``Connection`` (which holds the state below) for agents' messages."""

    hub: Hub
    agent: str
    attached: dict[Key, Attachment]
    fenced: set[Key]
    _wake: trio.Event

    if TYPE_CHECKING:

        def send(self, msg: Message) -> None: ...

        def queue_ack(self, job: int, src: int, dst: int, seq: int) -> None: ...

    def _deposit(self, msg: Data, frame: bytes | bytearray, batch: Batch) -> None:
        hub = self.hub
        job, src, dst, seq = msg.job, msg.src, msg.dst, msg.seq
        att = self.attached.get((job, src))
        if att is None:
            if (job, src) in self.fenced or job in hub.finished:
                return
            raise Rejected(
                ErrorCode.NOT_ATTACHED,
                f"rank {src} of job {job} is not attached on this connection",
                job=job,
                rank=src,
            )
        if att.diverged:
            return
        if not 0 <= dst < att.claims.size:
            raise Rejected(
                ErrorCode.BAD_DST,
                f"destination {dst} outside job {job} of {att.claims.size} ranks",
                job=job,
                rank=src,
            )
        box = hub.boxes.get((job, dst)) or hub.box(job, dst)
        mailbox = box.mailbox
        try:
            offer = mailbox.offer(src, seq)
        except RemoteProtocolError as exc:
            raise rejection(exc, job=job, rank=src) from exc
        offered = att.offered
        if seq > offered.get(dst, 0):
            offered[dst] = seq
        if offer is Offer.NEW:
            hub.stage(batch, box, src, seq, frame)
            return
        # A copy of a logged message: dropped, if it has the logged content.
        entry = mailbox.entry(src, seq)
        if entry is not None and not hub.determinism.check(att, entry, dst, frame):
            return
        if offer is Offer.DUPLICATE:
            self.queue_ack(job, src, dst, min(mailbox.acked(src), offered[dst]))

    def _det(self, msg: Det, frame: bytes | bytearray, batch: Batch) -> None:
        hub = self.hub
        job, rank = key = (msg.job, msg.rank)
        att = self.attached.get(key)
        if att is None:
            if key in self.fenced or job in hub.finished:
                return
            raise Rejected(
                ErrorCode.NOT_ATTACHED,
                f"determinant of rank {rank} of job {job}, which is not attached on this "
                "connection",
                job=job,
                rank=rank,
            )
        if att.diverged:
            return
        if not att.home:
            raise Rejected(
                ErrorCode.NOT_HOME,
                f"determinant of rank {rank} of job {job} on an attachment without home: "
                "determinants go to the rank's home relay",
                job=job,
                rank=rank,
            )
        box = hub.boxes.get(key) or hub.box(job, rank)
        dets = box.dets
        try:
            offer = dets.offer(msg.index)
        except RemoteProtocolError as exc:
            raise rejection(exc, job=job, rank=rank) from exc
        if offer is DetOffer.NEW:
            hub.stage_det(batch, box, msg, frame)
        elif dets.durable:
            # Already logged: drop it and say again what is durable (if it is not yet, its
            # DetAck follows when it is).
            self.send(DetAck(job=job, rank=rank, count=dets.durable))

    def _credit(self, msg: Credit) -> None:
        key = (msg.job, msg.rank)
        att = self.attached.get(key)
        if att is None or not att.home:
            return  # credit for pushes of an attachment that ended meanwhile
        box = self.hub.boxes.get(key)
        if box is not None and box.receiver is self:
            try:
                box.mailbox.credit(msg.nbytes)
            except RemoteProtocolError as exc:
                raise rejection(exc, job=msg.job, rank=msg.rank) from exc
            if box.mailbox.can_push():
                self._wake.set()

    def _claims(self, msg: Attach) -> RankClaims | None:
        """The checked claims of an Attach's token; None when the job is over."""
        hub = self.hub
        assert hub.signing_key is not None
        try:
            claims = verify_token(msg.token, hub.signing_key, now=now(), kind=RankClaims)
        except TokenError as exc:
            raise Rejected(exc.code, f"rank token refused: {exc.message}") from exc
        job, rank = claims.job, claims.rank
        if claims.agent != self.agent:
            raise Rejected(
                ErrorCode.WRONG_TOKEN,
                f"the token of job {job} rank {rank} was issued to agent {claims.agent!r}, "
                f"not to {self.agent!r}",
                job=job,
                rank=rank,
            )
        if not 0 <= rank < claims.size:
            raise Rejected(
                ErrorCode.BAD_RANK,
                f"rank {rank} outside a job of {claims.size}",
                job=job,
                rank=rank,
            )
        if job in hub.finished:
            self.fenced.add((job, rank))
            self.send(
                Stop(job=job, rank=rank, incarnation=claims.incarnation, reason="job finished")
            )
            return None
        return claims

    def _attach(self, msg: Attach, claims: RankClaims) -> None:
        hub = self.hub
        job, rank = claims.job, claims.rank
        try:
            if msg.home and claims.incarnation >= hub.fence.get((job, rank), 0):
                trim.check_attach(hub.boxes.get((job, rank)), msg, job, rank)
            hub.attach(cast("Connection", self), claims, msg.home, dict(msg.received))
        except Rejected as rej:
            if ends_connection(rej.code, rank):
                raise
            # A stale incarnation, or one asking for what a checkpoint let the log drop:
            # refused, but the agent's other ranks go on on this connection; late frames of
            # this one are dropped.
            logger.info("%r: %s", self, rej.message)
            self.fenced.add((job, rank))
            self.send(Error(code=rej.code, message=rej.message, job=job, rank=rank))
            return
        replay: list[Det] = []
        count = 0
        if msg.home:
            dets = hub.boxes[(job, rank)].dets
            count = len(dets)
            if msg.dets_from < count:
                replay = dets.replay(max(msg.dets_from, dets.first))
        self.send(
            Attached(
                job=job,
                rank=rank,
                incarnation=claims.incarnation,
                stored=hub.stored_from(job, rank),
                dets=count,
            )
        )
        # Before any push: the writer sends queued control frames first.
        for det in replay:
            self.send(det)
