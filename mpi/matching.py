"""MPI message matching: the posted-receive queue and the unexpected-message queue.

Every matching decision of the runtime is made here, and only here: which posted receive an
arriving message completes, which queued message a new receive or probe takes. The decisions
that depend on timing are exactly those with ``ANY_SOURCE`` (which source's message came first);
a message-logging layer records and replays them by wrapping ``arrive``, ``post`` and ``probe``.
Everything else is fixed by MPI's rules, since each channel (source, destination) is FIFO:

- a message goes to the earliest posted receive it matches (context, source, tag);
- a receive takes the earliest arrived message it matches (non-overtaking per source).

Unexpected messages are queued per context id, so traffic of one communicator (or of the
collectives) never slows matching in another.

Revocation (``runtime``, transparent mode): a pill is an entry whose payload is ``PILL``, queued
in a revoked communicator's two contexts after everything its sender sent before. It matches
every tag and is never taken: each receive or probe that reaches it finds it again. ``on_miss``
(set once a failure is known) is told of every probe that found nothing, so that one waiting for
a failed rank can raise instead.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from vpool.mpi.constants import ANY_SOURCE, ANY_TAG
from vpool.protocol.messages import Data

Entry = tuple[Data, Any]  # (header, payload bytes) of an arrived, unmatched message


class _Pill:
    def __repr__(self) -> str:
        return "PILL"

    def __len__(self) -> int:
        return 0


PILL = _Pill()  # the payload of a revocation entry: "this sender's channel ended here"


class Pattern(Protocol):
    """What a receive or probe looks for; ``src`` is a world rank or ANY_SOURCE."""

    ctx: int
    src: int
    tag: int


class Matcher:
    __slots__ = ("on_miss", "pills", "posted", "unexpected")

    def __init__(self) -> None:
        self.posted: list[Any] = []
        self.unexpected: dict[int, deque[Entry]] = {}
        self.pills: set[tuple[int, int]] = set()  # (source, ctx) of the pills queued
        self.on_miss: Callable[[int, int], None] | None = None

    def arrive(self, msg: Data) -> Any:
        """The posted receive ``msg`` completes (removed from the queue), or None."""
        posted = self.posted
        if posted:
            ctx, src, tag = msg.ctx, msg.src, msg.tag
            for i, op in enumerate(posted):
                if (
                    op.ctx == ctx
                    and (op.src == src or op.src == ANY_SOURCE)
                    and (op.tag == tag or op.tag == ANY_TAG)
                ):
                    del posted[i]
                    return op
        return None

    def stash(self, msg: Data, payload: Any) -> None:
        """Queue a message no posted receive wanted (``arrive`` returned None)."""
        queue = self.unexpected.get(msg.ctx)
        if queue is None:
            queue = self.unexpected[msg.ctx] = deque()
        queue.append((msg, payload))

    def add_pill(self, *msgs: Data) -> None:
        """Queue pills (one per context of a revoked communicator), once per sender."""
        for msg in msgs:
            key = (msg.src, msg.ctx)
            if key not in self.pills:
                self.pills.add(key)
                self.stash(msg, PILL)

    def post(self, op: Any) -> Entry | None:
        """The queued message ``op`` takes (removed), or None after queueing ``op``."""
        entry = self.take(op.ctx, op.src, op.tag)
        if entry is None:
            self.posted.append(op)
        return entry

    def take(self, ctx: int, src: int, tag: int) -> Entry | None:
        """Remove and return the earliest queued message matching, if any (matched probe)."""
        queue = self.unexpected.get(ctx)
        if queue:
            i = self._find(queue, src, tag)
            if i >= 0:
                entry = queue[i]
                if entry[1] is not PILL:  # a pill stays: it ends its sender's channel
                    del queue[i]
                return entry
        return None

    def probe(self, ctx: int, src: int, tag: int) -> Entry | None:
        """The earliest queued message matching, left in the queue."""
        queue = self.unexpected.get(ctx)
        if queue:
            i = self._find(queue, src, tag)
            if i >= 0:
                return queue[i]
        if self.on_miss is not None:
            self.on_miss(ctx, src)
        return None

    @staticmethod
    def _find(queue: deque[Entry], src: int, tag: int) -> int:
        any_src = src == ANY_SOURCE
        any_tag = tag == ANY_TAG
        for i, (msg, payload) in enumerate(queue):
            if (any_src or msg.src == src) and (any_tag or msg.tag == tag or payload is PILL):
                return i
        return -1

    def remove(self, entry: Entry) -> None:
        """Take a probed message out of the queue (matched probe: ``Mprobe``)."""
        self.unexpected[entry[0].ctx].remove(entry)

    def cancel(self, op: Any) -> bool:
        """Withdraw a posted receive; False if it was already matched."""
        try:
            self.posted.remove(op)
        except ValueError:
            return False
        return True
