"""The determinant log of one rank at its home relay, as a sans-IO state machine.

Determinants are the non-deterministic outcomes of a rank (which source an ``ANY_SOURCE`` receive
matched, what a ``Test`` returned, what ``Wtime`` read, ...), numbered 0, 1, 2, ... by the rank.
The relay appends each one, makes it durable, and acknowledges with a cumulative count
(``DetAck``). A restarted incarnation gets them back, in order, before any message: it obeys
them instead of deciding again (docs/internals.md, "Fault tolerance").

    offer(index)            -> NEW | DUPLICATE, or RemoteProtocolError("det_gap")
    append(index, ref)         NEW only; ``ref`` is whatever the shell needs to find the bytes
    written(index)             that entry's bytes are written
    advance() -> int           the new durable count (entries become durable in index order)
    replay(start) -> [refs]    every logged entry from ``start``, durable or not yet
"""

from __future__ import annotations

import enum
from typing import Generic, TypeVar

from vpool.protocol.errors import ErrorCode, LocalProtocolError, RemoteProtocolError

R = TypeVar("R")


class DetOffer(enum.Enum):
    NEW = "new"
    DUPLICATE = "duplicate"  # already in the log (a resend after a reconnect): drop it


class DetLog(Generic[R]):
    __slots__ = ("_durable", "_refs", "_written", "first")

    def __init__(self, first: int = 0) -> None:
        # ``first``: index of the first entry kept (> 0 once older ones were dropped after a
        # checkpoint made them unnecessary).
        self.first = first
        self._refs: list[R] = []
        self._written: list[bool] = []
        self._durable = first

    def __len__(self) -> int:
        """The count of determinants logged (durable or not), as an index: the next one's."""
        return self.first + len(self._refs)

    @property
    def durable(self) -> int:
        """Determinants ``0 .. durable-1`` are durable (what ``DetAck`` says)."""
        return self._durable

    def offer(self, index: int) -> DetOffer:
        n = len(self)
        if index == n:
            return DetOffer.NEW
        if 0 <= index < n:
            return DetOffer.DUPLICATE
        raise RemoteProtocolError(
            f"determinant {index} after {n - 1}: a gap in the determinant log",
            code=ErrorCode.DET_GAP,
        )

    def append(self, index: int, ref: R) -> None:
        if index != len(self):
            raise LocalProtocolError(f"append of determinant {index}, expected {len(self)}")
        self._refs.append(ref)
        self._written.append(False)

    def written(self, index: int) -> None:
        self._written[index - self.first] = True

    def advance(self) -> int:
        k = self._durable - self.first
        written = self._written
        while k < len(written) and written[k]:
            k += 1
        self._durable = self.first + k
        return self._durable

    def replay(self, start: int) -> list[R]:
        """The refs of determinants ``start ..`` (a restarted rank's replay)."""
        if start < self.first:
            raise LocalProtocolError(
                f"determinants before {self.first} are gone (asked from {start})"
            )
        return self._refs[start - self.first :]

    def trimmed(self, first: int) -> DetLog[R]:
        """This log without the entries below ``first`` (a committed checkpoint made them
        unnecessary), with the same written and durable state."""
        if first <= self.first:
            return self
        out: DetLog[R] = DetLog(first=first)
        end = len(self)
        if first >= end:
            return out
        for index, ref in enumerate(self.replay(first), start=first):
            out.append(index, ref)
            if index < self._durable:
                out.written(index)
        out.advance()
        return out
