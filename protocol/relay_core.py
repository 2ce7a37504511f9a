"""The relay's rules, as a sans-IO core: MPICH-V's channel memory for the ranks of many jobs.

The relay process (``vpool.relay``) is a shell around one ``RelayCore``: it reads frames and
calls the core's event methods, writes what the core says is new to the log files, reports to
the coordinator and sends what the core asks, on the connection it names. The core does no I/O
and reads no clock: time comes in as ``now`` (seconds on the shell's monotonic clock) and the
shell asks ``next_timer()`` when to call ``handle_timer(now)``, as in aioquic. The model test
(tests/protocol/ftmodel*) drives this same class.

Connections are the shell's objects (any hashable); the core keeps, per connection, the ranks
attached on it (``Link``). Instructions go to the shell through the ``Shell`` protocol it
implements: queue an ``Ack`` (coalesced), send a control message, fence a rank out with a
``Stop``, wake a connection's pusher, record an incarnation on disk, report a lost or diverged
rank or the verdict on a validating one. Errors that refuse what an agent asked are raised
(``Refused``) with their ``ErrorCode``; whether the connection survives is
``protocol.errors.ends_connection``.

**A rank at this relay** (``RankState``; ``RANK_TRANSITIONS`` is every rule, as data):

- ``NONE``: no attachment (never attached, or detached).
- ``ATTACHED``: its newest incarnation is attached on a connection.
- ``GRACE``: that connection dropped; the rank has ``lost_grace`` seconds to attach again
  before the relay reports it lost (a reconnecting agent is not a lost rank).
- ``LOST``: reported lost; a later incarnation (or the same one, late) may still attach.
- ``FINISHED``: its job is over: every attachment gets a ``Stop``, the logs go.

Attachments carry the incarnation of their signed token. An incarnation older than the newest
one seen (``fence``) is refused ``fenced`` (its frames, still on the wire, are dropped); a newer
one takes over, and the previous one gets a ``Stop``. The same incarnation on a new connection
(its agent reconnected) just moves.

**Deposits** (``deposit``): a ``Data`` frame of an attached rank is offered to the destination's
``Mailbox``: new ones are the shell's to write (it calls ``written`` once they are); a copy of a
logged one (a reconnecting agent resending, a restarted rank replaying) is dropped after its
digest is compared with the logged one's: a difference means the program is not deterministic,
which is reported (``Error(not_deterministic)`` to the rank, ``RelayDiverged`` to the
coordinator, once per incarnation) and the rank's further deposits are dropped. Acks are
cumulative per channel, go to the sender's current attachment, and never claim more than that
attachment deposited or re-sent itself (``Attachment.offered``): a replaying incarnation is not
told about messages it has not re-sent yet. Determinants (``det``) are logged the same way,
acknowledged by count (``DetAck``) the moment they are durable, and replayed to a home
attachment before anything else.

**Validating attachments** (``RankClaims.validating``): once every rank of a job exited, the
coordinator may re-execute a rank from the beginning, as a new incarnation on another volunteer,
to check the original run (validation by replay). Such an attachment may add nothing to the
logs: each message it sends must be a copy of a logged one with the logged content, and a seq
the log does not have (``Offer.NEW``: the original never sent it) is refused like a copy that
differs, as is a determinant the original never made. The first difference is the
incarnation's verdict: ``Error(not_deterministic)`` to the rank, its further deposits dropped,
and ``RelayValidated(agreed=False)`` to the coordinator (instead of ``RelayDiverged``). When it
detaches (its rank ended; a closed connection is the grace path as for any rank) it must have
re-sent everything the original sent to the ranks whose logs are here, or that shortfall is
the verdict; otherwise it is ``RelayValidated(agreed=True)``, given only once no copy of it
still waits for a logged frame's digest (``digested``). One verdict per incarnation, kept
across its reconnections (``Validation``).

**Trimming** (``trim``): once a checkpoint of a rank is committed, its messages and determinants
below the image's counters are dropped; a home attachment asking for them is refused
``trimmed``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from vpool.protocol.api import RankLost, RelayDiverged, RelayValidated
from vpool.protocol.detlog import DetLog, DetOffer
from vpool.protocol.errors import ErrorCode, LocalProtocolError, divergence_message
from vpool.protocol.mailbox import Entry, Mailbox, Offer
from vpool.protocol.messages import Det, DetAck, Error, Stop

C = TypeVar("C", bound=Hashable)  # the shell's connection
R = TypeVar("R")  # where the shell keeps a logged frame

Key = tuple[int, int]  # (job, rank)


class Refused(Exception):
    """What an agent asked is refused: ``Error(code, message, job, rank)`` goes back."""

    def __init__(self, code: ErrorCode, message: str, *, job: int = -1, rank: int = -1) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.job = job
        self.rank = rank


# -- a rank's life at this relay ------------------------------------------------------------


class RankState(enum.Enum):
    NONE = "none"
    ATTACHED = "attached"
    GRACE = "grace"
    LOST = "lost"
    FINISHED = "finished"


class RankEvent(enum.Enum):
    ATTACH_NEWER = "attach_newer"  # an incarnation above the newest seen
    ATTACH_CURRENT = "attach_current"  # the newest incarnation (again, maybe elsewhere)
    ATTACH_STALE = "attach_stale"  # an incarnation below the newest seen
    DETACH = "detach"
    CLOSED = "closed"  # the connection of the current attachment ended
    GRACE_OVER = "grace_over"  # lost_grace passed without a new attachment
    JOB_FINISHED = "job_finished"
    DECLARED_FAILED = "declared_failed"  # the coordinator declared the rank failed (ULFM)


class Act(enum.Enum):
    BIND = "bind"  # the attachment becomes the rank's current one
    STOP_PREVIOUS = "stop_previous"  # the replaced incarnation's attachment gets a Stop
    MOVE = "move"  # the same incarnation leaves its previous connection (no Stop)
    REFUSE_FENCED = "refuse_fenced"
    UNBIND = "unbind"
    START_GRACE = "start_grace"
    END_GRACE = "end_grace"
    REPORT_LOST = "report_lost"
    STOP_FINISHED = "stop_finished"  # a Stop saying the job is over
    STOP_FAILED = "stop_failed"  # a Stop saying the rank was declared failed


_S, _E, _A = RankState, RankEvent, Act
_ATTACHES = (_E.ATTACH_NEWER, _E.ATTACH_CURRENT)

# (state, event) -> (next state, what is done, in order). A pair not in the table cannot
# happen (``LocalProtocolError`` says the shell broke the core's contract).
RANK_TRANSITIONS: dict[tuple[RankState, RankEvent], tuple[RankState, tuple[Act, ...]]] = {
    **{(_S.NONE, e): (_S.ATTACHED, (_A.BIND,)) for e in _ATTACHES},
    (_S.NONE, _E.ATTACH_STALE): (_S.NONE, (_A.REFUSE_FENCED,)),
    (_S.NONE, _E.DETACH): (_S.NONE, ()),
    (_S.NONE, _E.JOB_FINISHED): (_S.FINISHED, ()),
    (_S.ATTACHED, _E.ATTACH_NEWER): (_S.ATTACHED, (_A.STOP_PREVIOUS, _A.BIND)),
    (_S.ATTACHED, _E.ATTACH_CURRENT): (_S.ATTACHED, (_A.MOVE, _A.BIND)),
    (_S.ATTACHED, _E.ATTACH_STALE): (_S.ATTACHED, (_A.REFUSE_FENCED,)),
    (_S.ATTACHED, _E.DETACH): (_S.NONE, (_A.UNBIND,)),
    (_S.ATTACHED, _E.CLOSED): (_S.GRACE, (_A.UNBIND, _A.START_GRACE)),
    (_S.ATTACHED, _E.JOB_FINISHED): (_S.FINISHED, (_A.UNBIND, _A.STOP_FINISHED)),
    **{(_S.GRACE, e): (_S.ATTACHED, (_A.END_GRACE, _A.BIND)) for e in _ATTACHES},
    (_S.GRACE, _E.ATTACH_STALE): (_S.GRACE, (_A.REFUSE_FENCED,)),
    (_S.GRACE, _E.DETACH): (_S.GRACE, ()),
    (_S.GRACE, _E.GRACE_OVER): (_S.LOST, (_A.REPORT_LOST,)),
    (_S.GRACE, _E.JOB_FINISHED): (_S.FINISHED, (_A.END_GRACE,)),
    **{(_S.LOST, e): (_S.ATTACHED, (_A.BIND,)) for e in _ATTACHES},
    (_S.LOST, _E.ATTACH_STALE): (_S.LOST, (_A.REFUSE_FENCED,)),
    (_S.LOST, _E.DETACH): (_S.LOST, ()),
    (_S.LOST, _E.JOB_FINISHED): (_S.FINISHED, ()),
    **{(_S.FINISHED, e): (_S.FINISHED, (_A.STOP_FINISHED,)) for e in (*_ATTACHES, _E.ATTACH_STALE)},
    (_S.FINISHED, _E.DETACH): (_S.FINISHED, ()),
    (_S.FINISHED, _E.JOB_FINISHED): (_S.FINISHED, ()),
    # Declared failed: whatever it was doing here ends, and its fence (``fence``) now refuses
    # that incarnation and every older one.
    (_S.NONE, _E.DECLARED_FAILED): (_S.NONE, ()),
    (_S.ATTACHED, _E.DECLARED_FAILED): (_S.NONE, (_A.UNBIND, _A.STOP_FAILED)),
    (_S.GRACE, _E.DECLARED_FAILED): (_S.NONE, (_A.END_GRACE,)),
    (_S.LOST, _E.DECLARED_FAILED): (_S.NONE, ()),
    (_S.FINISHED, _E.DECLARED_FAILED): (_S.FINISHED, ()),
}


def may_read_image(reader: int, image: int) -> bool:
    """An incarnation restores from images of its own or of earlier incarnations, never from a
    newer one's (that one replaced it)."""
    return reader >= image


# -- state ----------------------------------------------------------------------------------


@dataclass
class TrimPoint:
    """Per source the highest seq dropped, and the first determinant kept."""

    received: dict[int, int] = field(default_factory=dict)
    dets: int = 0

    def __bool__(self) -> bool:
        return self.dets > 0 or any(seq > 0 for seq in self.received.values())

    def merged(self, received: Mapping[int, int], dets: int) -> TrimPoint:
        """This point moved forward to (``received``, ``dets``), never back."""
        out = dict(self.received)
        for src, seq in received.items():
            if seq > out.get(src, 0):
                out[src] = seq
        return TrimPoint(out, max(self.dets, dets))


class Validation:
    """What a validating incarnation did at this relay, across its attachments (an agent that
    reconnects attaches it again with nothing offered yet). ``sent[dst]``: the highest seq it
    sent to ``dst``. ``waiting``: its copies whose logged frame's digest is still being
    computed. ``detached``: its rank ended, so the verdict is due once ``waiting`` is 0.
    ``verdict``: None until reported, then whether it agreed."""

    __slots__ = ("detached", "sent", "verdict", "waiting")

    def __init__(self) -> None:
        self.sent: dict[int, int] = {}
        self.waiting = 0
        self.detached = False
        self.verdict: bool | None = None


class Attachment(Generic[C]):
    """A rank's incarnation attached on one connection. ``offered[dst]``: the highest seq it
    deposited (or re-sent) to ``dst``. ``diverged``: it re-sent a message that differs from
    the logged one (or, validating, sent one the log does not have); its deposits are dropped.
    ``validation``: the incarnation's record when it re-executes the rank for validation."""

    __slots__ = (
        "conn",
        "diverged",
        "home",
        "incarnation",
        "job",
        "offered",
        "rank",
        "size",
        "validation",
    )

    def __init__(
        self,
        job: int,
        rank: int,
        incarnation: int,
        size: int,
        home: bool,
        conn: C,
        validation: Validation | None = None,
    ):
        self.job = job
        self.rank = rank
        self.incarnation = incarnation
        self.size = size
        self.home = home
        self.conn = conn
        self.offered: dict[int, int] = {}
        self.diverged = False
        self.validation = validation

    @property
    def validating(self) -> bool:
        """Its token says it re-executes the rank to check the original run."""
        return self.validation is not None


class Box(Generic[C, R]):
    """One destination rank's message log and determinant log, and who receives its pushes.
    ``io`` is the shell's (its files, its events)."""

    __slots__ = ("dead", "dets", "dst", "io", "job", "mailbox", "receiver", "trim")

    def __init__(self, job: int, dst: int, mailbox: Mailbox[R]) -> None:
        self.job = job
        self.dst = dst
        self.mailbox = mailbox
        self.dets: DetLog[Det] = DetLog()
        self.receiver: C | None = None
        self.dead = False
        self.trim = TrimPoint()
        self.io: Any = None


class Link(Generic[C, R]):
    """The core's view of one connection: the ranks attached on it, those fenced or stopped
    there (their late frames are dropped quietly), and the boxes it receives pushes for."""

    __slots__ = ("attached", "fenced", "home_boxes")

    def __init__(self) -> None:
        self.attached: dict[Key, Attachment[C]] = {}
        self.fenced: set[Key] = set()
        self.home_boxes: list[Box[C, R]] = []


class Shell(Protocol[C]):
    """What the core asks of its shell (every call returns at once; the shell acts later)."""

    def open_box(self, box: Box[C, Any]) -> None:
        """A new box: its files (``box.io``)."""

    def queue_ack(self, conn: C, job: int, src: int, dst: int, seq: int) -> None: ...

    def send(self, conn: C, msg: Error | DetAck | Det) -> None: ...

    def stop(self, conn: C, stop: Stop) -> None: ...

    def wake(self, conn: C) -> None: ...

    def record_incarnation(self, job: int, rank: int, incarnation: int) -> None: ...

    def report_lost(self, report: RankLost) -> None: ...

    def report_diverged(self, report: RelayDiverged) -> None: ...

    def report_validated(self, report: RelayValidated) -> None: ...


def validation_message_new(src: int, dst: int, seq: int) -> str:
    return (
        f"rank {src} re-executed for validation sent message seq {seq} to rank {dst}, which "
        "the original run never sent"
    )


def validation_message_differs(src: int, dst: int, seq: int) -> str:
    return (
        f"rank {src} re-executed for validation sent message seq {seq} to rank {dst} with "
        "content other than the original run's"
    )


def validation_message_short(src: int, dst: int, sent: int, original: int) -> str:
    return (
        f"rank {src} re-executed for validation sent {sent} messages to rank {dst}; the "
        f"original sent {original}"
    )


def _in_job(att: Attachment[Any], peer: int, what: str) -> None:
    """``peer`` is a rank of ``att``'s job; else ``bad_dst`` (rank scope)."""
    if not 0 <= peer < att.size:
        raise Refused(
            ErrorCode.BAD_DST,
            f"{what} {peer} outside job {att.job} of {att.size} ranks",
            job=att.job,
            rank=att.rank,
        )


# -- the core -------------------------------------------------------------------------------


class RelayCore(Generic[C, R]):
    def __init__(
        self,
        shell: Shell[C],
        *,
        name: str,
        window: int,
        window_max: int | None = None,
        lost_grace: float,
        digest: Callable[[bytes | bytearray | memoryview], bytes],
    ) -> None:
        self.shell = shell
        self.name = name
        self.window = window
        self.window_max = window_max
        self.lost_grace = lost_grace
        self.digest = digest
        self.boxes: dict[Key, Box[C, R]] = {}
        self.jobs: dict[int, dict[int, Box[C, R]]] = {}
        self.links: dict[C, Link[C, R]] = {}
        self.attachments: dict[Key, Attachment[C]] = {}
        self.fence: dict[Key, int] = {}
        self.finished: set[int] = set()
        # (job, rank) -> (incarnation, deadline, reason) of ranks in GRACE.
        self.grace: dict[Key, tuple[int, float, str]] = {}
        self.lost: set[Key] = set()
        # (job, rank, incarnation) reported diverged: each incarnation once, however often
        # its agent reconnects and re-sends.
        self.diverged_reported: set[tuple[int, int, int]] = set()
        # (job, rank, incarnation) -> the record of a validating incarnation.
        self.validations: dict[tuple[int, int, int], Validation] = {}
        # Re-sent copies waiting for their logged entry's digest (computed late for big frames).
        self.waiting: dict[Entry[R], list[tuple[Attachment[C], int, bytes]]] = {}

    # -- boxes ------------------------------------------------------------------------------

    def new_mailbox(self) -> Mailbox[R]:
        return Mailbox(window=self.window, window_max=self.window_max)

    def add_box(self, box: Box[C, R]) -> None:
        """A box rebuilt from disk by the shell (``load``), or made by ``box``."""
        self.boxes[(box.job, box.dst)] = box
        self.jobs.setdefault(box.job, {})[box.dst] = box

    def box(self, job: int, dst: int) -> Box[C, R]:
        box = self.boxes.get((job, dst))
        if box is None:
            box = Box(job, dst, self.new_mailbox())
            self.shell.open_box(box)
            self.add_box(box)
        return box

    def stored_from(self, job: int, src: int) -> dict[int, int]:
        """Per destination, the highest durable seq from ``src`` (for ``Attached``)."""
        out: dict[int, int] = {}
        for dst, box in self.jobs.get(job, {}).items():
            seq = box.mailbox.acked(src)
            if seq:
                out[dst] = seq
        return out

    # -- the rank table ---------------------------------------------------------------------

    def rank_state(self, key: Key) -> RankState:
        if key[0] in self.finished:
            return RankState.FINISHED
        if key in self.attachments:
            return RankState.ATTACHED
        if key in self.grace:
            return RankState.GRACE
        if key in self.lost:
            return RankState.LOST
        return RankState.NONE

    def _step(self, key: Key, event: RankEvent) -> tuple[Act, ...]:
        state = self.rank_state(key)
        rule = RANK_TRANSITIONS.get((state, event))
        if rule is None:
            raise LocalProtocolError(f"{event.value} of job {key[0]} rank {key[1]} in {state}")
        return rule[1]

    # -- connections ------------------------------------------------------------------------

    def link(self, conn: C) -> Link[C, R]:
        link = self.links.get(conn)
        if link is None:
            link = self.links[conn] = Link()
        return link

    def attach(
        self,
        conn: C,
        *,
        job: int,
        rank: int,
        incarnation: int,
        size: int,
        home: bool,
        received: Mapping[int, int],
        dets_from: int = 0,
        validating: bool = False,
    ) -> Attachment[C] | None:
        """An ``Attach`` with a verified token. The attachment, or None when the job is over
        (the rank got a ``Stop``). Raises ``Refused`` (fenced, trimmed): rank scope.
        ``validating``: the token's ``validating`` claim (module docstring)."""
        key = (job, rank)
        top = self.fence.get(key, 0)
        if incarnation < top:
            event = RankEvent.ATTACH_STALE
        elif incarnation > top:
            event = RankEvent.ATTACH_NEWER
        else:
            event = RankEvent.ATTACH_CURRENT
        acts = self._step(key, event)
        link = self.link(conn)
        if Act.STOP_FINISHED in acts:
            link.fenced.add(key)
            self.shell.stop(
                conn, Stop(job=job, rank=rank, incarnation=incarnation, reason="job finished")
            )
            return None
        if Act.REFUSE_FENCED in acts:
            raise Refused(
                ErrorCode.FENCED,
                f"incarnation {incarnation} of rank {rank} of job {job} was replaced by "
                f"incarnation {top}",
                job=job,
                rank=rank,
            )
        if home:
            self._check_trim(self.boxes.get(key), job, rank, received, dets_from)
        if incarnation > top:
            self.fence[key] = incarnation
            if incarnation > 1:
                self.shell.record_incarnation(job, rank, incarnation)
        old = self.attachments.get(key)
        if old is not None:
            self._unbind(key, old)
            if Act.STOP_PREVIOUS in acts:
                self._fence_out(
                    old.conn,
                    key,
                    Stop(
                        job=job,
                        rank=rank,
                        incarnation=old.incarnation,
                        reason=f"replaced by incarnation {incarnation}",
                    ),
                )
        stale = link.attached.get(key)
        if stale is not None and stale is not old:
            self._unbind(key, stale)
        if Act.END_GRACE in acts:
            del self.grace[key]
        self.lost.discard(key)
        validation = None
        if validating:
            validation = self.validations.setdefault((job, rank, incarnation), Validation())
        att = Attachment(job, rank, incarnation, size, home, conn, validation)
        self.attachments[key] = att
        link.attached[key] = att
        link.fenced.discard(key)
        if home:
            box = self.box(job, rank)
            box.mailbox.attach(received)
            box.receiver = conn
            link.home_boxes.append(box)
            self.shell.wake(conn)
        return att

    def replay_dets(self, job: int, rank: int, dets_from: int) -> tuple[int, list[Det]]:
        """For a home attachment: the count of determinants logged, and those from
        ``dets_from`` on, which it gets before any message."""
        box = self.boxes[(job, rank)]
        count = len(box.dets)
        if dets_from >= count:
            return count, []
        return count, box.dets.replay(max(dets_from, box.dets.first))

    def _check_trim(
        self,
        box: Box[C, R] | None,
        job: int,
        rank: int,
        received: Mapping[int, int],
        dets_from: int,
    ) -> None:
        if box is None or not box.trim:
            return
        point = box.trim
        for src, seq in sorted(point.received.items()):
            if received.get(src, 0) < seq:
                raise Refused(
                    ErrorCode.TRIMMED,
                    f"the log of rank {rank} of job {job} no longer holds messages <= {seq} "
                    f"from rank {src} (asked from {received.get(src, 0) + 1}): restore from "
                    "a checkpoint",
                    job=job,
                    rank=rank,
                )
        if dets_from < point.dets:
            raise Refused(
                ErrorCode.TRIMMED,
                f"the log of rank {rank} of job {job} no longer holds determinants below "
                f"{point.dets} (asked from {dets_from}): restore from a checkpoint",
                job=job,
                rank=rank,
            )

    def image_replaced(self, key: Key, incarnation: int, images: list[int]) -> int | None:
        """The incarnation that replaced ``incarnation`` of rank ``key``: the newest attached
        here, or one whose image the store holds (``images``); None while it is the newest.
        An image of a replaced incarnation is refused ``fenced``."""
        top = max([self.fence.get(key, 0), *images])
        return top if incarnation < top else None

    def refused(self, conn: C, job: int, rank: int) -> None:
        """The shell refused an attachment of this rank (rank scope): its late frames on this
        connection are dropped quietly."""
        self.link(conn).fenced.add((job, rank))

    def _stop_current(self, key: Key, reason: str) -> None:
        """The rank's current attachment ends here: unbound, told ``Stop(reason)``, and its
        late frames on that connection dropped."""
        att = self.attachments.get(key)
        if att is not None:
            self._unbind(key, att)
            stop = Stop(job=key[0], rank=key[1], incarnation=att.incarnation, reason=reason)
            self._fence_out(att.conn, key, stop)

    def _fence_out(self, conn: C, key: Key, stop: Stop) -> None:
        self.link(conn).fenced.add(key)
        self.shell.stop(conn, stop)

    def _unbind(self, key: Key, att: Attachment[C]) -> None:
        """Remove an attachment from the tables and its connection."""
        if self.attachments.get(key) is att:
            del self.attachments[key]
        link = self.links.get(att.conn)
        if link is None:
            return
        if link.attached.get(key) is att:
            del link.attached[key]
        if att.home:
            box = self.boxes.get(key)
            if box is not None and box.receiver == att.conn:
                box.mailbox.detach()
                box.receiver = None
                link.home_boxes.remove(box)

    def detach(self, conn: C, job: int, rank: int) -> None:
        """A ``Detach``: the rank ended. A validating one gets its verdict (``_validated``)."""
        key = (job, rank)
        link = self.links.get(conn)
        att = link.attached.get(key) if link is not None else None
        if att is None:
            return
        if self.attachments.get(key) is att:
            self._step(key, RankEvent.DETACH)
        self._unbind(key, att)
        if att.validation is not None:
            self._validated(att, att.validation)

    def closed(self, conn: C, reason: str, now: float) -> None:
        """The connection ended: the ranks whose current attachment it held get
        ``lost_grace`` seconds to attach again (``handle_timer``)."""
        link = self.links.get(conn)
        if link is None:
            return
        deadline = now + self.lost_grace
        for key, att in list(link.attached.items()):
            current = self.attachments.get(key) is att
            acts = self._step(key, RankEvent.CLOSED) if current else ()
            self._unbind(key, att)
            if Act.START_GRACE in acts:
                self.grace[key] = (att.incarnation, deadline, reason)
        del self.links[conn]

    def next_timer(self) -> float | None:
        """When ``handle_timer`` has something to do (None: nothing pending)."""
        return min((t for _, t, _ in self.grace.values()), default=None)

    def handle_timer(self, now: float) -> None:
        """Ranks whose grace is over are reported lost."""
        for key, (inc, deadline, reason) in list(self.grace.items()):
            if deadline > now:
                continue
            acts = self._step(key, RankEvent.GRACE_OVER)
            del self.grace[key]
            if Act.REPORT_LOST in acts:
                self.lost.add(key)
                self.shell.report_lost(
                    RankLost(job=key[0], rank=key[1], incarnation=inc, reason=reason)
                )

    # -- deposits ---------------------------------------------------------------------------

    def deposit(
        self, conn: C, job: int, src: int, dst: int, seq: int, frame: bytes | bytearray
    ) -> Box[C, R] | None:
        """A ``Data`` frame. The box to append it to when it is new (the shell appends it,
        writes it and calls ``written``); None when it is dropped."""
        link = self.links.get(conn)
        att = link.attached.get((job, src)) if link is not None else None
        if att is None:
            if (link is not None and (job, src) in link.fenced) or job in self.finished:
                return None
            raise Refused(
                ErrorCode.NOT_ATTACHED,
                f"rank {src} of job {job} is not attached on this connection",
                job=job,
                rank=src,
            )
        if att.diverged:
            return None
        _in_job(att, dst, "destination")
        validation = att.validation
        box = self.boxes.get((job, dst))
        if box is None:
            if validation is not None:
                # No log of ``dst`` here: the original sent it nothing through this relay.
                self._disagree(att, validation_message_new(src, dst, seq))
                return None
            box = self.box(job, dst)
        mailbox = box.mailbox
        offer = mailbox.offer(src, seq)
        offered = att.offered
        if seq > offered.get(dst, 0):
            offered[dst] = seq
        if offer is Offer.NEW:
            if validation is None:
                return box
            self._disagree(att, validation_message_new(src, dst, seq))
            return None
        if validation is not None and seq > validation.sent.get(dst, 0):
            validation.sent[dst] = seq
        # A copy of a logged message: dropped, if it has the logged content.
        entry = mailbox.entry(src, seq)
        if entry is not None and not self._same(att, entry, dst, frame):
            return None
        if offer is Offer.DUPLICATE:
            self.shell.queue_ack(conn, job, src, dst, self.ackable(att, dst, mailbox.acked(src)))
        return None

    def ackable(self, att: Attachment[C], dst: int, seq: int) -> int:
        """What an ``Ack`` of ``seq`` on channel (att.rank, dst) may say to ``att``: never more
        than it deposited or re-sent itself. A dead incarnation's message, written after its
        successor attached, must not acknowledge the successor's message of that seq unseen:
        the successor would never re-send it, and a difference would go unnoticed."""
        return min(seq, att.offered.get(dst, 0))

    def _same(
        self, att: Attachment[C], entry: Entry[R], dst: int, frame: bytes | bytearray
    ) -> bool:
        if entry.digest:
            if entry.digest == self.digest(frame):
                return True
            self._diverge(att, dst, entry.seq)
            return False
        # The logged frame's digest is still being computed (``digested``).
        self.waiting.setdefault(entry, []).append((att, dst, self.digest(frame)))
        if att.validation is not None:
            att.validation.waiting += 1
        return True

    def digested(self, entry: Entry[R]) -> None:
        """``entry.digest`` is known now: settle the copies that waited for it (and give the
        verdict of a validating incarnation that detached meanwhile, once none of its copies
        waits any more)."""
        copies = self.waiting.pop(entry, None)
        if copies is None:
            return
        for att, dst, mine in copies:
            if mine != entry.digest and not att.diverged:
                self._diverge(att, dst, entry.seq)
            validation = att.validation
            if validation is not None:
                validation.waiting -= 1
                if validation.detached:
                    self._validated(att, validation)

    def _diverge(self, att: Attachment[C], dst: int, seq: int) -> None:
        job, src = att.job, att.rank
        if att.validation is not None:
            self._disagree(att, validation_message_differs(src, dst, seq))
            return
        message = divergence_message(src, dst, seq)
        att.diverged = True
        self.shell.send(
            att.conn, Error(code=ErrorCode.NOT_DETERMINISTIC, message=message, job=job, rank=src)
        )
        key = (job, src, att.incarnation)
        if key in self.diverged_reported:
            return
        self.diverged_reported.add(key)
        self.shell.report_diverged(
            RelayDiverged(
                name=self.name, job=job, rank=src, incarnation=att.incarnation, message=message
            )
        )

    # -- validation -------------------------------------------------------------------------

    def _disagree(self, att: Attachment[C], message: str, *, tell: bool = True) -> None:
        """A validating incarnation did something the original did not: its deposits are
        dropped from now on, the rank is told (``tell``: it is still there) and the verdict
        reported, unless the incarnation has one already."""
        validation = att.validation
        assert validation is not None
        att.diverged = True
        if tell:
            self.shell.send(
                att.conn,
                Error(
                    code=ErrorCode.NOT_DETERMINISTIC, message=message, job=att.job, rank=att.rank
                ),
            )
        self._verdict(att, validation, False, message)

    def _validated(self, att: Attachment[C], validation: Validation) -> None:
        """A validating incarnation detached: what the original sent to the ranks whose logs
        are here and it did not is a disagreement; else it agreed, once no copy of it waits
        for a digest (a late one may still differ)."""
        validation.detached = True
        if validation.verdict is not None:
            return
        short: list[str] = []
        for dst, box in sorted(self.jobs.get(att.job, {}).items()):
            original = box.mailbox.stored(att.rank)
            sent = validation.sent.get(dst, 0)
            if original > sent:
                short.append(validation_message_short(att.rank, dst, sent, original))
        if short:
            self._disagree(att, "; ".join(short), tell=False)
        elif validation.waiting == 0:
            self._verdict(att, validation, True, "")

    def _verdict(
        self, att: Attachment[C], validation: Validation, agreed: bool, message: str
    ) -> None:
        if validation.verdict is not None:
            return
        validation.verdict = agreed
        self.shell.report_validated(
            RelayValidated(
                name=self.name,
                job=att.job,
                rank=att.rank,
                incarnation=att.incarnation,
                agreed=agreed,
                message=message,
            )
        )

    def written(self, box: Box[C, R], *, wake: bool = True) -> None:
        """Entries of ``box`` were written: what became durable is acknowledged (to each
        sender's current attachment, never past what it offered) and its receiver woken."""
        fresh = box.mailbox.advance()
        if not fresh:
            return
        # The receiver first: its push is what the message's latency is made of.
        if wake and box.receiver is not None:
            self.shell.wake(box.receiver)
        job, dst = box.job, box.dst
        if len(fresh) == 1:
            top = {fresh[0].src: fresh[0].seq}
        else:
            top = {}
            for e in fresh:
                top[e.src] = e.seq
        attachments = self.attachments
        for src, seq in top.items():
            att = attachments.get((job, src))
            if att is not None:
                seq = self.ackable(att, dst, seq)
                if seq > 0:
                    self.shell.queue_ack(att.conn, job, src, dst, seq)

    # -- determinants -----------------------------------------------------------------------

    def det(self, conn: C, job: int, rank: int, index: int) -> Box[C, R] | None:
        """A ``Det``. The box whose determinant log it is new to (the shell appends it,
        writes it and calls ``dets_written``); None when it is dropped."""
        key = (job, rank)
        link = self.links.get(conn)
        att = link.attached.get(key) if link is not None else None
        if att is None:
            if (link is not None and key in link.fenced) or job in self.finished:
                return None
            raise Refused(
                ErrorCode.NOT_ATTACHED,
                f"determinant of rank {rank} of job {job}, which is not attached on this "
                "connection",
                job=job,
                rank=rank,
            )
        if att.diverged:
            return None
        if not att.home:
            raise Refused(
                ErrorCode.NOT_HOME,
                f"determinant of rank {rank} of job {job} on an attachment without home: "
                "determinants go to the rank's home relay",
                job=job,
                rank=rank,
            )
        box = self.boxes.get(key) or self.box(job, rank)
        if box.dets.offer(index) is DetOffer.NEW:
            if att.validation is None:
                return box
            # Logging it would change what a later execution of the rank obeys.
            self._disagree(
                att,
                f"rank {rank} re-executed for validation made determinant {index}, which the "
                "original run never made",
            )
            return None
        if box.dets.durable:
            # Already logged: say again what is durable (if it is not yet, its DetAck follows).
            self.shell.send(conn, DetAck(job=job, rank=rank, count=box.dets.durable))
        return None

    def dets_written(self, box: Box[C, R]) -> int:
        """Determinants of ``box``'s rank were written: the new durable count goes to the
        rank's home attachment at once (its next deposit waits for it)."""
        count = box.dets.advance()
        att = self.attachments.get((box.job, box.dst))
        if att is not None and att.home and not box.dead:
            self.shell.send(att.conn, DetAck(job=box.job, rank=box.dst, count=count))
        return count

    # -- delivery ---------------------------------------------------------------------------

    def credit(self, conn: C, job: int, rank: int, nbytes: int, now: float | None) -> None:
        key = (job, rank)
        link = self.links.get(conn)
        att = link.attached.get(key) if link is not None else None
        if att is None or not att.home:
            return  # credit for pushes of an attachment that ended meanwhile
        box = self.boxes.get(key)
        if box is not None and box.receiver == conn:
            box.mailbox.credit(nbytes, now)
            if box.mailbox.can_push():
                self.shell.wake(conn)

    def delivered(
        self, conn: C, job: int, rank: int, incarnation: int, src: int, seq: int
    ) -> Entry[R] | None:
        """A ``Delivered``: the agent on ``conn`` gave the rank messages of ``src`` up to
        ``seq`` itself. Honoured only for the rank's current home attachment on this very
        connection and of that incarnation (the receiver's agent is the one that delivered);
        any other (a replaced incarnation's, one sent before the rank moved) is dropped: its
        pushes then go out as usual, and the agent drops what it has. Returns the logged entry
        it is about when there is one (the shell need not keep its bytes for a push)."""
        link = self.links.get(conn)
        att = link.attached.get((job, rank)) if link is not None else None
        if att is None or not att.home or att.incarnation != incarnation:
            return None
        _in_job(att, src, "source of a delivery")
        box = self.boxes.get((job, rank))
        if box is None or box.receiver != conn:
            return None
        return box.mailbox.delivered(src, seq)

    # -- jobs and checkpoints ---------------------------------------------------------------

    def declare_failed(self, job: int, rank: int, incarnation: int) -> None:
        """The coordinator declared incarnation ``incarnation`` of the rank failed (a job whose
        failure mode reports failures, ``api.RankFence``): from now on it and every older one
        are refused ``fenced``; its attachment gets a ``Stop`` and its late frames are dropped;
        a grace it was in ends without a report. A newer incarnation is left alone, and so is
        a fence already up (the coordinator repeats it until it hears it is up)."""
        key = (job, rank)
        if incarnation < self.fence.get(key, 0):
            return
        acts = self._step(key, RankEvent.DECLARED_FAILED)
        self.fence[key] = incarnation + 1
        self.shell.record_incarnation(job, rank, incarnation + 1)
        if Act.UNBIND in acts:
            self._stop_current(key, "declared failed: the other ranks carry on without it")
        if Act.END_GRACE in acts:
            del self.grace[key]
        self.lost.discard(key)

    def finish_jobs(self, jobs: list[int]) -> list[Box[C, R]]:
        """The coordinator says these jobs are over: their ranks get a ``Stop``; their boxes
        are dropped and returned (the shell deletes their logs)."""
        gone: list[Box[C, R]] = []
        for job in jobs:
            if job in self.finished:
                continue
            keys = {k for k in self.attachments if k[0] == job}
            keys |= {k for k in self.grace if k[0] == job}
            keys |= {k for k in self.lost if k[0] == job}
            for key in sorted(keys):
                acts = self._step(key, RankEvent.JOB_FINISHED)
                if Act.UNBIND in acts:
                    self._stop_current(key, "job finished")
                self.grace.pop(key, None)
                self.lost.discard(key)
            self.finished.add(job)
            for entry in [e for e, c in self.waiting.items() if c[0][0].job == job]:
                del self.waiting[entry]
            # A verdict still due no longer matters: the coordinator ended the job.
            for vkey in [k for k in self.validations if k[0] == job]:
                del self.validations[vkey]
            for box in self.jobs.pop(job, {}).values():
                del self.boxes[(job, box.dst)]
                box.dead = True
                gone.append(box)
        return gone

    def trim(self, box: Box[C, R], point: TrimPoint) -> list[Entry[R]]:
        """Drop what the checkpoint at ``point`` made unnecessary (the shell saved ``point``
        first); the dropped entries are returned (the shell frees their memory and files)."""
        box.trim = point
        dropped = box.mailbox.trim(point.received)
        box.dets = box.dets.trimmed(point.dets)
        return dropped
