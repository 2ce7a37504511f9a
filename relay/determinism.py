"""Is the program deterministic? Re-sent messages compared with the logged ones.

A restarted rank re-executes from the beginning and re-sends every message it sent before; the
relay drops those copies (they are in the log). Channels are deterministic (docs/internals.md,
"Fault tolerance"), so each copy must equal the logged frame byte for byte. ``Determinism``
compares the copy's digest with the logged entry's (``Entry.digest``). When they differ the
program is not deterministic: the sender gets ``Error(not_deterministic)`` on its connection
(which stays up; the rank's further deposits there are dropped) and the coordinator gets one
``RelayDiverged`` per (job, rank), which fails the job.

The digest of a large frame is computed in a worker thread after the frame was written and
pushed (it is off the message's path); a copy that arrives before that waits in ``waiting``
until ``digested`` is called for its entry.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import trio

from vpool.protocol.api import RelayDiverged
from vpool.protocol.errors import ErrorCode, divergence_message
from vpool.protocol.mailbox import Entry
from vpool.protocol.messages import Error
from vpool.relay.log import Buffer, Location, digest

if TYPE_CHECKING:
    from vpool.relay.hub import Attachment

logger = logging.getLogger(__name__)

Key = tuple[int, int]
# A re-sent copy waiting for its entry's digest: who sent it, to whom, and its own digest.
Copy = tuple["Attachment", int, bytes]


class Determinism:
    def __init__(self, relay: str) -> None:
        self.relay = relay
        self.reported: set[Key] = set()
        self.reports: list[RelayDiverged] = []
        self.ready = trio.Event()
        self.waiting: dict[Entry[Location], list[Copy]] = {}

    def check(self, att: Attachment, entry: Entry[Location], dst: int, frame: Buffer) -> bool:
        """Compare a re-sent frame with the logged ``entry``; False when they differ (the
        rank has diverged)."""
        if entry.digest:
            if entry.digest == digest(frame):
                return True
            self.diverge(att, dst, entry.seq)
            return False
        # The logged frame's digest is still being computed.
        self.waiting.setdefault(entry, []).append((att, dst, digest(frame)))
        return True

    def digested(self, entry: Entry[Location]) -> None:
        """``entry.digest`` is known now: settle the copies that waited for it."""
        copies = self.waiting.pop(entry, None)
        if copies is None:
            return
        for att, dst, mine in copies:
            if mine != entry.digest and not att.diverged:
                self.diverge(att, dst, entry.seq)

    def diverge(self, att: Attachment, dst: int, seq: int) -> None:
        claims = att.claims
        job, src = claims.job, claims.rank
        message = divergence_message(src, dst, seq)
        att.diverged = True
        logger.warning("job %d: %s", job, message)
        conn = att.conn
        if conn.session.is_open:
            conn.send(Error(code=ErrorCode.NOT_DETERMINISTIC, message=message, job=job, rank=src))
        key = (job, src)
        if key in self.reported:
            return
        self.reported.add(key)
        self.reports.append(
            RelayDiverged(
                name=self.relay,
                job=job,
                rank=src,
                incarnation=claims.incarnation,
                message=message,
            )
        )
        self.ready.set()

    def take(self) -> list[RelayDiverged]:
        """The reports not yet handed to the coordinator client."""
        out, self.reports = self.reports, []
        self.ready = trio.Event()
        return out

    def forget_job(self, job: int) -> None:
        for entry in [e for e, copies in self.waiting.items() if copies[0][0].claims.job == job]:
            del self.waiting[entry]
