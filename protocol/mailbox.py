"""The message log of one receiving rank at its home relay, as a sans-IO state machine.

A ``Mailbox`` is MPICH-V's channel memory for one destination rank ``dst`` of one job: every
message any source sends to ``dst`` is appended to one log, in arrival order, and is pushed to
``dst`` from that log. It knows nothing about files or sockets; the relay's I/O shell feeds it
events and acts on what it returns.

Deposit side (per channel ``(src, dst)``, seq 1, 2, 3, ...)::

    offer(src, seq)          -> NEW | DUPLICATE | PENDING, or RemoteProtocolError("seq_gap")
    append(src, seq, size, ref)   NEW entries only; the shell reserves their place in the file
    written(entry)                the shell finished writing that entry's bytes
    advance() -> [entries]        entries that became durable, in log order (a prefix of the log)

Entries become durable strictly in log order even when their writes complete out of order, so
"durable" is always a prefix and a cumulative ``Ack`` per channel never covers a hole. ``acked``
gives, per source, the highest seq that is durable; ``DUPLICATE`` means the offered seq is already
durable (the shell re-acks it), ``PENDING`` that it is in the log but not yet durable (its ack
will follow when it is).

Delivery side (one receiver at a time, the rank's current home attachment)::

    attach(received)         resume after ``received[src]`` for every source
    delivered(src, seq)      the receiver got (src, ..seq) another way: do not push those
    credit(nbytes, now)      the receiver consumed that many pushed bytes
    next_push(now) -> entry  the next durable entry to push while the window allows, else None
    detach()

The window counts un-credited pushed bytes; a frame is pushed while fewer than ``window`` bytes
are outstanding, so one frame larger than the window still goes out (alone). With
``window_max`` above ``window`` the window grows with the bandwidth-delay product of the
receiver's link (``protocol.window``), from ``window`` up to ``window_max``, and each attach
starts again from ``window``; ``now`` (the shell's clock, in seconds) is what it measures
with. Without ``now`` (or without ``window_max``) the window stays as it is.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping
from typing import Generic, TypeVar

from vpool.protocol.errors import ErrorCode, LocalProtocolError, RemoteProtocolError
from vpool.protocol.window import PushWindow

R = TypeVar("R")


class Offer(enum.Enum):
    NEW = "new"  # seq == stored + 1: append it
    DUPLICATE = "duplicate"  # seq <= acked: drop it, ack again
    PENDING = "pending"  # acked < seq <= stored: drop it, its ack is on its way


class Entry(Generic[R]):
    """One message in the log. ``size`` is the whole frame (prefix, header, payload); ``ref`` is
    whatever the I/O shell needs to find the bytes (memory, file offset)."""

    __slots__ = ("digest", "ref", "seq", "size", "src", "written")

    def __init__(self, src: int, seq: int, size: int, ref: R, digest: bytes = b"") -> None:
        self.src = src
        self.seq = seq
        self.size = size
        self.ref = ref
        self.digest = digest
        self.written = False

    def __repr__(self) -> str:
        return f"Entry(src={self.src}, seq={self.seq}, size={self.size})"


class Mailbox(Generic[R]):
    """Log and delivery state of one destination rank (see the module docstring)."""

    def __init__(self, *, window: int, window_max: int | None = None) -> None:
        if window <= 0:
            raise ValueError("window must be positive")
        self.push_window = PushWindow(window, window_max)
        self._log: list[Entry[R]] = []
        self._durable = 0  # log[:_durable] is durable
        self._stored: dict[int, int] = {}  # src -> highest seq appended
        self._acked: dict[int, int] = {}  # src -> highest seq durable
        # src -> log index of each of its entries, in seq order, and the seq of the first one
        # (so resuming after received[src] finds its start without scanning the log).
        self._by_src: dict[int, list[int]] = {}
        self._first_seq: dict[int, int] = {}
        self._bytes = 0
        # Delivery.
        self._attached = False
        self._cursor = 0
        self._received: dict[int, int] = {}
        self.in_flight = 0

    # -- deposit side -----------------------------------------------------------------------

    def stored(self, src: int) -> int:
        """Highest seq from ``src`` in the log (durable or not); 0 when none."""
        return self._stored.get(src, 0)

    def acked(self, src: int) -> int:
        """Highest seq from ``src`` that is durable; 0 when none."""
        return self._acked.get(src, 0)

    def acked_counters(self) -> dict[int, int]:
        return dict(self._acked)

    def offer(self, src: int, seq: int) -> Offer:
        stored = self._stored.get(src, 0)
        if seq == stored + 1:
            return Offer.NEW
        if 1 <= seq <= stored:
            return Offer.DUPLICATE if seq <= self._acked.get(src, 0) else Offer.PENDING
        raise RemoteProtocolError(
            f"message {seq} from rank {src} after {stored}: a gap in the channel",
            code=ErrorCode.SEQ_GAP,
        )

    def append(self, src: int, seq: int, size: int, ref: R, digest: bytes = b"") -> Entry[R]:
        """Append a message ``offer`` called NEW. Starting a channel above seq 1 is allowed only
        for the first entry of a source (a log that was truncated after a checkpoint).
        ``digest`` identifies the frame's content, to check re-sent copies (``entry``)."""
        stored = self._stored.get(src)
        if stored is not None and seq != stored + 1:
            raise LocalProtocolError(f"append of seq {seq} from {src} after {stored}")
        entry = Entry(src, seq, size, ref, digest)
        index = len(self._log)
        self._log.append(entry)
        self._stored[src] = seq
        positions = self._by_src.get(src)
        if positions is None:
            self._by_src[src] = [index]
            self._first_seq[src] = seq
        else:
            positions.append(index)
        self._bytes += size
        return entry

    def entry(self, src: int, seq: int) -> Entry[R] | None:
        """The logged message (src, seq), or None when it is not (or no longer) in the log."""
        positions = self._by_src.get(src)
        if not positions:
            return None
        k = seq - self._first_seq[src]
        if not 0 <= k < len(positions):
            return None
        return self._log[positions[k]]

    def written(self, entry: Entry[R]) -> None:
        entry.written = True

    def advance(self) -> list[Entry[R]]:
        """Entries that became durable since the last call, in log order."""
        log, start = self._log, self._durable
        end = start
        n = len(log)
        while end < n and log[end].written:
            end += 1
        if end == start:
            return []
        self._durable = end
        fresh = log[start:end]
        acked = self._acked
        for e in fresh:
            acked[e.src] = e.seq
        return fresh

    # -- delivery side ----------------------------------------------------------------------

    @property
    def attached(self) -> bool:
        return self._attached

    @property
    def window(self) -> int:
        """Bytes that may be pushed and not credited, now."""
        return self.push_window.size

    def attach(self, received: Mapping[int, int]) -> None:
        """A (new) receiver: push everything after ``received[src]``, with an empty window of
        the initial size."""
        self._attached = True
        self._received = {src: seq for src, seq in received.items() if seq > 0}
        self.in_flight = 0
        self.push_window.reset()
        start = len(self._log)
        for src, positions in self._by_src.items():
            k = self._received.get(src, 0) + 1 - self._first_seq[src]
            k = max(k, 0)
            if k < len(positions) and positions[k] < start:
                start = positions[k]
        self._cursor = start

    def delivered(self, src: int, seq: int) -> Entry[R] | None:
        """The current receiver has every message of ``src`` up to ``seq`` already (its agent
        delivered them locally): they are not pushed to it. Logged and kept all the same (a
        later receiver, one restarted from an image, gets them pushed). Returns the entry of
        (``src``, ``seq``) when it is in the log (its copy in memory is not needed for a
        push)."""
        if not self._attached:
            return None
        if seq > self._received.get(src, 0):
            self._received[src] = seq
        return self.entry(src, seq)

    def detach(self) -> None:
        self._attached = False
        self.in_flight = 0
        self.push_window.reset()

    def credit(self, nbytes: int, now: float | None = None) -> None:
        """The receiver consumed ``nbytes`` pushed bytes (at ``now``). Never below zero:
        credits for pushes of a previous attachment may arrive after a re-attach reset the
        window."""
        if nbytes < 0:
            raise RemoteProtocolError(f"negative credit {nbytes}", code=ErrorCode.BAD_CREDIT)
        self.in_flight = max(0, self.in_flight - nbytes)
        self.push_window.credited(nbytes, now)

    def can_push(self) -> bool:
        return (
            self._attached
            and self.in_flight < self.push_window.size
            and self._cursor < self._durable
        )

    def next_push(self, now: float | None = None) -> Entry[R] | None:
        """The next entry to push (it counts as pushed at ``now``), or None."""
        if not self._attached:
            return None
        if self.in_flight >= self.push_window.size:
            if self._cursor < self._durable:
                self.push_window.limited()
            return None
        log, received = self._log, self._received
        cursor, durable = self._cursor, self._durable
        while cursor < durable:
            entry = log[cursor]
            cursor += 1
            if received and entry.seq <= received.get(entry.src, 0):
                continue
            self._cursor = cursor
            self.in_flight += entry.size
            self.push_window.pushed(entry.size, now)
            return entry
        self._cursor = cursor
        return None

    # -- trimming ---------------------------------------------------------------------------

    def seed(self, floor: Mapping[int, int]) -> None:
        """A rebuilt log of a trimmed rank: every source's channel continues after
        ``floor[src]``, which counts as stored and durable. Call before any ``append``."""
        for src, seq in floor.items():
            if seq > 0:
                self._stored[src] = seq
                self._acked[src] = seq

    def trim(self, floor: Mapping[int, int]) -> list[Entry[R]]:
        """Drop the durable entries with ``seq <= floor[src]`` (a committed checkpoint made
        them unnecessary); return them. The delivery cursor keeps its place among the entries
        kept."""
        log, durable, cursor = self._log, self._durable, self._cursor
        kept: list[Entry[R]] = []
        dropped: list[Entry[R]] = []
        new_durable = new_cursor = 0
        for i, e in enumerate(log):
            if i < durable and e.seq <= floor.get(e.src, 0):
                dropped.append(e)
                continue
            kept.append(e)
            if i < durable:
                new_durable += 1
            if i < cursor:
                new_cursor += 1
        if not dropped:
            return []
        self._log = kept
        self._durable = new_durable
        self._cursor = new_cursor
        self._by_src = {}
        self._first_seq = {}
        for i, e in enumerate(kept):
            positions = self._by_src.get(e.src)
            if positions is None:
                self._by_src[e.src] = [i]
                self._first_seq[e.src] = e.seq
            else:
                positions.append(i)
        self._bytes -= sum(e.size for e in dropped)
        return dropped

    # -- inspection -------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._log)

    @property
    def nbytes(self) -> int:
        """Bytes of all frames in the log."""
        return self._bytes

    @property
    def durable_count(self) -> int:
        return self._durable

    def entries(self) -> Iterator[Entry[R]]:
        return iter(self._log)
