"""What a worker agent keeps for its ranks towards the relays, as sans-IO cores.

The agent (``vpool.worker_agent``) forwards every frame of a rank verbatim: ``Data`` to the home
relay of its destination, ``Det`` to the rank's own home relay; and what the home relay pushes
(``Data``, replayed ``Det``) to the rank. A relay connection may drop at any time (the relay
restarts, a middlebox forgets the connection): the agent reconnects, attaches each rank again and
resends what the relay never acknowledged, and the rank notices nothing. Two cores hold the
rules; the agent's ``relay_link`` and ``relay_inbound`` are their shell.

``RankLink``, one per (rank, relay link): every ``Data`` and ``Det`` the rank deposited there that
the relay has not acknowledged, as references to the very buffers forwarded (no copy), dropped
as ``Ack``s (cumulative per channel) and ``DetAck``s (cumulative count) come in, so the
fault-free path pays one append and one pop per frame. After a re-attachment
(``resend(attached)``) every unacknowledged frame goes again, determinants first, even the
messages the relay says it holds: the relay compares a re-sent message with its logged copy, and
that check is what catches a replaying incarnation that diverged under a seq its predecessor
logged (found by tests/protocol/test_ft_model.py). A checkpoint waits until the relays hold what
the image says was sent (``holds_data``, ``holds_dets``). What a rank's ``RankLink``s hold, in
bytes, is counted in one ``Held`` per rank: the agent stops reading the rank while that is over
its budget (``worker_agent.local_ranks.LocalRank.room_for``).

``Delivery``, one per rank: what was delivered to it, so a re-attachment resumes after it
(``Attach.received``, ``Attach.dets_from``): per source the highest ``Data`` seq given to the
rank, by its home relay or by the agent itself (agent-local delivery: a message between two
ranks of one agent goes straight to the receiver, in channel order, and is still deposited at
the receiver's home relay, which is told with ``Delivered`` not to push it back), and the
count of determinants it has, those replayed to it and those it made, so a re-attachment never
gets the rank's own determinants pushed back. A restored rank starts from its image's counters.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Mapping

from vpool.protocol.framing import Buffer

Frame = tuple[int, list[Buffer]]  # (seq or index, the frame's parts)


FIRST_INCARNATION = 1


def is_current(held: int, named: int) -> bool:
    """A message that names incarnation ``named`` (a relay's ``Stop``, a coordinator's order)
    concerns the local incarnation ``held`` only when they are the same: an older one's is
    about a process replaced here already."""
    return held == named


def replaces(new: int, old: int) -> bool:
    """A lease of incarnation ``new`` replaces a local rank of incarnation ``old`` (a repeated
    or older lease does not)."""
    return new > old


def restarted(incarnation: int) -> bool:
    """Whether this start of a rank follows an earlier one."""
    return incarnation > FIRST_INCARNATION


def frame_bytes(parts: list[Buffer]) -> int:
    return sum(len(p) for p in parts)


class Held:
    """The bytes of one rank's frames its ``RankLink``s keep, over all its relay links;
    ``released`` is called whenever some go (the agent wakes a rank waiting for room)."""

    __slots__ = ("bytes", "released")

    def __init__(self, released: Callable[[], None] | None = None) -> None:
        self.bytes = 0
        self.released = released

    def add(self, n: int) -> None:
        self.bytes += n

    def release(self, n: int) -> None:
        if n:
            self.bytes -= n
            if self.released is not None:
                self.released()


class RankLink:
    """Unacknowledged ``Data`` per destination and ``Det``s of one rank on one relay link."""

    __slots__ = ("data", "dets", "held", "home", "local")

    def __init__(self, *, home: bool, held: Held | None = None) -> None:
        self.home = home  # the rank's home relay: its determinants go here
        self.data: dict[int, deque[Frame]] = {}
        self.dets: deque[Frame] = deque()
        # Per destination, the highest seq the agent also delivered to it itself.
        self.local: dict[int, int] = {}
        # The rank's count, shared by its links (None: nothing counted; the parts need not
        # be buffers then, as in the model of tests/protocol/test_ft_model.py).
        self.held = held

    def _kept(self, parts: list[Buffer]) -> None:
        if self.held is not None:
            self.held.add(frame_bytes(parts))

    def _drop_through(self, queue: deque[Frame], last: int) -> None:
        """Drop the frames of ``queue`` numbered up to ``last``, counting their bytes out."""
        gone = 0
        while queue and queue[0][0] <= last:
            parts = queue.popleft()[1]
            if self.held is not None:
                gone += frame_bytes(parts)
        if self.held is not None:
            self.held.release(gone)

    @property
    def nbytes(self) -> int:
        """The bytes of the frames this link keeps (its part of ``held``)."""
        return sum(frame_bytes(p) for q in (*self.data.values(), self.dets) for _, p in q)

    def clear(self) -> None:
        """The link lets go of everything (the rank detached, or the link failed)."""
        for queue in (*self.data.values(), self.dets):
            self._drop_through(queue, queue[-1][0] if queue else 0)

    # -- out: what the rank deposits ---------------------------------------------------------

    def deposited(self, dst: int, seq: int, parts: list[Buffer], *, local: bool = False) -> None:
        """The rank sent message ``seq`` to ``dst`` through this link; ``local``: its
        receiver, a rank of this agent, has it already (agent-local delivery)."""
        queue = self.data.get(dst)
        if queue is None:
            queue = self.data[dst] = deque()
        queue.append((seq, parts))
        self._kept(parts)
        if local:
            self.local[dst] = seq

    def unlogged_local(self) -> list[int]:
        """The receivers that were handed a message of this rank that the relay has not
        acknowledged yet. While the sender lives, it is resent until it is; a sender that
        ended leaves them holding a message that may never be logged, and only a logged one
        is checked against what the sender's next incarnation sends (the determinism
        check): they must wait for it, or be restarted."""
        return [dst for dst, seq in self.local.items() if not self.holds_data(dst, seq)]

    def det_sent(self, index: int, parts: list[Buffer]) -> None:
        self.dets.append((index, parts))
        self._kept(parts)

    # -- in: what the relay acknowledges -------------------------------------------------------

    def acked(self, dst: int, seq: int) -> None:
        """Everything of channel (this rank, ``dst``) up to ``seq`` is in the relay's log."""
        queue = self.data.get(dst)
        if queue:
            self._drop_through(queue, seq)

    def dets_acked(self, count: int) -> None:
        """Determinants ``0 .. count-1`` are durable at the home relay."""
        self._drop_through(self.dets, count - 1)

    # -- a re-attachment ------------------------------------------------------------------

    def resend(self, dets_logged: int) -> list[list[Buffer]]:
        """What to send again once the relay answered ``Attached`` (``dets_logged``: its
        ``dets``, the determinants it holds), in deposit order, the determinants first.
        Determinants the relay holds are dropped (an index identifies one); every
        unacknowledged ``Data`` goes again (see the module docstring)."""
        if self.home:
            self.dets_acked(dets_logged)
        frames = [parts for _, parts in self.dets]
        for queue in self.data.values():
            frames.extend(parts for _, parts in queue)
        return frames

    # -- a checkpoint ----------------------------------------------------------------------

    def holds_data(self, dst: int, seq: int) -> bool:
        """The relay acknowledged every message to ``dst`` up to ``seq``."""
        queue = self.data.get(dst)
        return not queue or queue[0][0] > seq

    def holds_dets(self, count: int) -> bool:
        """The relay acknowledged determinants ``0 .. count-1``."""
        return not self.dets or self.dets[0][0] >= count

    def __len__(self) -> int:
        return len(self.dets) + sum(map(len, self.data.values()))


class Via(enum.Enum):
    RELAY = "relay"  # its home relay pushed it
    LOCAL = "local"  # a rank of the same agent sent it (agent-local delivery)


class Place(enum.Enum):
    """Where a message's seq is against what the rank has of its channel."""

    HAD = "had"  # seq <= received: the rank has it
    NEXT = "next"  # seq == received + 1
    AHEAD = "ahead"  # seq > received + 1: earlier ones are still to come


class Take(enum.Enum):
    GIVE = "give"  # it goes to the rank, and counts as received
    DROP = "drop"  # the rank has it: dropped (a push is still credited)
    RELAY = "relay"  # not handed over here: it goes the relay's way


# (how it came, where its seq is) -> what the agent does with a message for its rank. A relay
# pushes each channel in order from what the attachment said the rank had, so it sends no
# AHEAD one (what it sends is passed on as it comes). Locally only the next message is handed
# over: one ahead would overtake one the relay still has to push, and one the rank had comes
# from a replaying sender, whose copy the relay must compare with the logged one.
DELIVERY_RULES: dict[tuple[Via, Place], Take] = {
    (Via.RELAY, Place.HAD): Take.DROP,
    (Via.RELAY, Place.NEXT): Take.GIVE,
    (Via.RELAY, Place.AHEAD): Take.GIVE,
    (Via.LOCAL, Place.HAD): Take.RELAY,
    (Via.LOCAL, Place.NEXT): Take.GIVE,
    (Via.LOCAL, Place.AHEAD): Take.RELAY,
}


class Delivery:
    """What a rank's home relay delivered to it (see the module docstring)."""

    __slots__ = ("dets", "received")

    def __init__(self, received: Mapping[int, int] | None = None, dets: int = 0) -> None:
        self.received: dict[int, int] = {s: q for s, q in (received or {}).items() if q > 0}
        self.dets = dets

    def take(self, via: Via, src: int, seq: int) -> Take:
        """Message ``seq`` of ``src`` for the rank came ``via``: what to do with it
        (``DELIVERY_RULES``); given, it counts as received."""
        had = self.received.get(src, 0)
        place = Place.HAD if seq <= had else Place.NEXT if seq == had + 1 else Place.AHEAD
        take = DELIVERY_RULES[via, place]
        if take is Take.GIVE:
            self.received[src] = seq
        return take

    def data(self, src: int, seq: int) -> bool:
        """The relay pushed message ``seq`` of ``src``: whether it goes to the rank (not when
        the agent delivered it locally already: its ``Delivered`` came too late to stop the
        push)."""
        return self.take(Via.RELAY, src, seq) is Take.GIVE

    def local(self, src: int, seq: int) -> bool:
        """A rank of this agent sends message ``seq`` of channel (``src``, this rank): whether
        the agent may hand it over itself (agent-local delivery)."""
        return self.take(Via.LOCAL, src, seq) is Take.GIVE

    def det_in(self, index: int) -> bool:
        """The relay pushed determinant ``index``: whether the rank gets it (one it has is not
        given again: a home attachment resumed after a reconnection)."""
        if index < self.dets:
            return False
        self.dets = index + 1
        return True

    def det_out(self, index: int) -> None:
        """The rank made determinant ``index``."""
        if index >= self.dets:
            self.dets = index + 1

    def resume(self, *, home: bool) -> tuple[dict[int, int], int]:
        """``Attach.received`` and ``Attach.dets_from`` of an attachment to this relay."""
        return (dict(self.received), self.dets) if home else ({}, 0)
