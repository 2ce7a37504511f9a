"""The relay's shared state: mailboxes with their logs, rank attachments, fencing, lost ranks.

One ``Hub`` per relay process, used by every agent connection (``connection``) and by the
coordinator client (``registry``). It is the I/O shell around ``protocol.mailbox``: a ``Box`` is
one destination rank's ``Mailbox`` plus its ``ChannelLog`` on disk and the connection its
frames are pushed to.

The write path is a group commit: a connection hands the hub every Data frame that arrived in
one read (``stage``), the hub writes them with one ``pwritev`` per contiguous run, then
acknowledges what became durable and wakes the receivers' connections. Small batches are written
inline (``commit_inline``); large or fsynced ones in a worker thread (``commit``), which the
connection runs in the background while it reads on, so reading, writing and pushing overlap.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from vpool.protocol.api import RankLost, RelayLoad
from vpool.protocol.mailbox import Entry, Mailbox
from vpool.protocol.messages import Stop
from vpool.protocol.tokens import RankClaims
from vpool.relay import log as logfiles
from vpool.relay.errors import Rejected
from vpool.relay.log import Buffer, ChannelLog, Location
from vpool.relay.settings import RelaySettings

if TYPE_CHECKING:
    from vpool.relay.connection import Connection

logger = logging.getLogger(__name__)

# Batches smaller than this are written inline: a thread hop costs more than the write.
THREAD_WRITE_MIN = 256 * 1024
THREAD_READ_MIN = 256 * 1024

Key = tuple[int, int]  # (job, rank)


class Box:
    """Log and delivery state of one destination rank of one job."""

    __slots__ = ("dead", "dst", "job", "log", "mailbox", "receiver")

    def __init__(self, job: int, dst: int, mailbox: Mailbox[Location], chan: ChannelLog):
        self.job = job
        self.dst = dst
        self.mailbox = mailbox
        self.log = chan
        self.receiver: Connection | None = None
        self.dead = False


class Attachment:
    """A rank attached on one connection. ``offered[dst]`` is the highest seq this attachment
    deposited (or re-sent) to ``dst``: acks never claim more than that, so a replaying
    incarnation is not told about messages it has not re-sent yet."""

    __slots__ = ("claims", "conn", "home", "offered")

    def __init__(self, claims: RankClaims, home: bool, conn: Connection) -> None:
        self.claims = claims
        self.home = home
        self.conn = conn
        self.offered: dict[int, int] = {}


class Batch:
    """New frames of one read, in arrival order, waiting to be written."""

    __slots__ = ("items", "nbytes")

    def __init__(self) -> None:
        self.items: list[tuple[Box, Entry[Location], Buffer]] = []
        self.nbytes = 0

    def __bool__(self) -> bool:
        return bool(self.items)


class Hub:
    def __init__(
        self,
        settings: RelaySettings,
        data_dir: Path,
        *,
        name: str = "",
        signing_key: Ed25519PublicKey | None = None,
    ) -> None:
        self.settings = settings
        self.data_dir = data_dir
        self.name = name
        self.signing_key = signing_key
        self.key_ready = trio.Event()
        if signing_key is not None:
            self.key_ready.set()
        self.boxes: dict[Key, Box] = {}
        self.jobs: dict[int, dict[int, Box]] = {}
        self.attachments: dict[Key, Attachment] = {}
        self.fence: dict[Key, int] = {}
        self.finished: set[int] = set()
        self.connections: set[Connection] = set()
        # (job, rank) -> (incarnation, deadline, reason) of ranks whose connection dropped.
        self.lost_pending: dict[Key, tuple[int, float, str]] = {}
        self.lost_reports: list[RankLost] = []
        self.lost_ready = trio.Event()
        self._lost_wake = trio.Event()
        self.memory_used = 0
        self.messages_stored = 0
        self.bytes_stored = 0
        self.io_limiter = trio.CapacityLimiter(max(1, settings.write_threads))

    def set_signing_key(self, key: Ed25519PublicKey) -> None:
        self.signing_key = key
        self.key_ready.set()

    # -- boxes ------------------------------------------------------------------------------

    def load(self) -> None:
        """Rebuild every box from the logs on disk (blocking; run it in a thread)."""
        s = self.settings
        self.fence.update(logfiles.recorded_incarnations(self.data_dir))
        for job, dst, directory in logfiles.existing_boxes(self.data_dir):
            chan, records = logfiles.open_log(
                directory, job, dst, segment_size=s.segment_size, fsync=s.fsync
            )
            mailbox: Mailbox[Location] = Mailbox(window=s.push_window)
            for rec in records:
                entry = mailbox.append(rec.src, rec.seq, rec.size, rec.location)
                mailbox.written(entry)
            mailbox.advance()
            self._add_box(Box(job, dst, mailbox, chan))
            self.messages_stored += len(records)
            self.bytes_stored += mailbox.nbytes
            logger.info("job %d rank %d: %d messages in the log", job, dst, len(records))

    def _add_box(self, box: Box) -> None:
        self.boxes[(box.job, box.dst)] = box
        self.jobs.setdefault(box.job, {})[box.dst] = box

    def box(self, job: int, dst: int) -> Box:
        box = self.boxes.get((job, dst))
        if box is None:
            s = self.settings
            chan = logfiles.create_log(
                logfiles.box_dir(self.data_dir, job, dst),
                segment_size=s.segment_size,
                fsync=s.fsync,
            )
            box = Box(job, dst, Mailbox(window=s.push_window), chan)
            self._add_box(box)
        return box

    def stored_from(self, job: int, src: int) -> dict[int, int]:
        """Per destination, the highest durable seq from ``src`` (for ``Attached``)."""
        out: dict[int, int] = {}
        for dst, box in self.jobs.get(job, {}).items():
            seq = box.mailbox.acked(src)
            if seq:
                out[dst] = seq
        return out

    # -- attachments ------------------------------------------------------------------------

    def attach(
        self, conn: Connection, claims: RankClaims, home: bool, received: dict[int, int]
    ) -> Attachment:
        key = (claims.job, claims.rank)
        inc = claims.incarnation
        top = self.fence.get(key, 0)
        if inc < top:
            raise Rejected(
                "fenced",
                f"incarnation {inc} of rank {claims.rank} of job {claims.job} was replaced by "
                f"incarnation {top}",
                job=claims.job,
                rank=claims.rank,
            )
        if inc > top:
            self.fence[key] = inc
            if inc > 1:
                logfiles.record_incarnation(self.data_dir, claims.job, claims.rank, inc)
        old = self.attachments.get(key)
        if old is not None:
            self._unbind(key, old)
            if old.claims.incarnation < inc:
                old.conn.fence_out(
                    key,
                    Stop(
                        job=claims.job,
                        rank=claims.rank,
                        incarnation=old.claims.incarnation,
                        reason=f"replaced by incarnation {inc}",
                    ),
                )
        stale = conn.attached.get(key)
        if stale is not None and stale is not old:
            self._unbind(key, stale)
        att = Attachment(claims, home, conn)
        self.attachments[key] = att
        conn.attached[key] = att
        conn.fenced.discard(key)
        pending = self.lost_pending.get(key)
        if pending is not None and pending[0] <= inc:
            del self.lost_pending[key]
        if home:
            box = self.box(claims.job, claims.rank)
            box.mailbox.attach(received)
            box.receiver = conn
            conn.home_boxes.append(box)
            conn.wake()
        return att

    def _unbind(self, key: Key, att: Attachment) -> None:
        """Remove an attachment from the tables and its connection."""
        if self.attachments.get(key) is att:
            del self.attachments[key]
        conn = att.conn
        if conn.attached.get(key) is att:
            del conn.attached[key]
        if att.home:
            box = self.boxes.get(key)
            if box is not None and box.receiver is conn:
                box.mailbox.detach()
                box.receiver = None
                conn.home_boxes.remove(box)

    def detach(self, conn: Connection, job: int, rank: int) -> None:
        att = conn.attached.get((job, rank))
        if att is not None:
            self._unbind((job, rank), att)

    def connection_closed(self, conn: Connection, reason: str) -> None:
        self.connections.discard(conn)
        deadline = trio.current_time() + self.settings.lost_grace
        for key, att in list(conn.attached.items()):
            current = self.attachments.get(key) is att
            self._unbind(key, att)
            if current and key[0] not in self.finished:
                self.lost_pending[key] = (att.claims.incarnation, deadline, reason)
        if self.lost_pending:
            self._lost_wake.set()

    async def watch_lost(self) -> None:
        """Report ranks that did not reattach within ``lost_grace`` (runs for ever)."""
        while True:
            now = trio.current_time()
            expired = [k for k, (_, t, _) in self.lost_pending.items() if t <= now]
            for key in expired:
                inc, _, reason = self.lost_pending.pop(key)
                if key[0] in self.finished or key in self.attachments:
                    continue
                logger.warning("job %d rank %d incarnation %d lost: %s", *key, inc, reason)
                self.lost_reports.append(
                    RankLost(job=key[0], rank=key[1], incarnation=inc, reason=reason)
                )
                self.lost_ready.set()
            nxt = min((t for _, t, _ in self.lost_pending.values()), default=math.inf)
            with trio.move_on_at(nxt):
                await self._lost_wake.wait()
            self._lost_wake = trio.Event()

    def take_lost(self) -> list[RankLost]:
        out, self.lost_reports = self.lost_reports, []
        self.lost_ready = trio.Event()
        return out

    # -- deposits ---------------------------------------------------------------------------

    def stage(self, batch: Batch, box: Box, src: int, seq: int, frame: Buffer) -> None:
        """Append a NEW frame to its mailbox and reserve its place in the log."""
        size = len(frame)
        keep = self.memory_used + size <= self.settings.memory_budget
        if keep:
            self.memory_used += size
        loc = box.log.reserve(size, frame if keep else None)
        entry = box.mailbox.append(src, seq, size, loc)
        batch.items.append((box, entry, frame))
        batch.nbytes += size

    def commit_inline(self, batch: Batch, *, wake: bool = True) -> bool:
        """Write a small batch right here (a thread hop costs more than such a write) and
        finish it; False when the batch must go through ``commit`` instead. With
        ``wake=False`` the receivers' writers are not woken: the caller pushes itself."""
        if batch.nbytes >= THREAD_WRITE_MIN or self.settings.fsync:
            return False
        items = batch.items
        if len(items) == 1:
            _, entry, frame = items[0]
            logfiles.write_runs([(entry.ref.segment, entry.ref.offset, [frame])], fsync=False)
        else:
            logfiles.write_runs(logfiles.group_runs([(e.ref, f) for _, e, f in items]), fsync=False)
        self._finish(batch, wake)
        return True

    async def commit(self, batch: Batch) -> None:
        """Write a batch in a worker thread, then finish it. Shielded: a write that never
        happens would leave a hole in the log that no later write fills, and the mailbox
        would stop advancing."""
        items = batch.items
        runs = logfiles.group_runs([(e.ref, frame) for _, e, frame in items])
        fsync = self.settings.fsync
        logs = {box.log: None for box, _, _ in items}
        for chan in logs:
            chan.acquire()
        try:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(
                    lambda: logfiles.write_runs(runs, fsync=fsync), limiter=self.io_limiter
                )
        finally:
            for chan in logs:
                chan.release()
        self._finish(batch)

    def _finish(self, batch: Batch, wake: bool = True) -> None:
        """The batch is in the log files: advance the mailboxes, ack, wake the receivers."""
        items = batch.items
        self.messages_stored += len(items)
        self.bytes_stored += batch.nbytes
        if len(items) == 1:
            box, entry, _ = items[0]
            entry.written = True
            self._durable(box, box.mailbox.advance(), wake)
            return
        touched: dict[Box, None] = {}
        for box, entry, _ in items:
            entry.written = True
            touched[box] = None
        for box in touched:
            self._durable(box, box.mailbox.advance(), wake)

    def _durable(self, box: Box, fresh: list[Entry[Location]], wake: bool = True) -> None:
        if not fresh:
            return
        # The receiver first: its push is what the message's latency is made of.
        if wake and box.receiver is not None:
            box.receiver.wake()
        job, dst = box.job, box.dst
        if len(fresh) == 1:
            top = {fresh[0].src: fresh[0].seq}
        else:
            top = {}
            for e in fresh:
                top[e.src] = e.seq
        for src, seq in top.items():
            att = self.attachments.get((job, src))
            if att is not None:
                seq = min(seq, att.offered.get(dst, 0))
                if seq > 0:
                    att.conn.queue_ack(job, src, dst, seq)

    def pushed(self, entry: Entry[Location]) -> None:
        """A frame went out: its in-memory copy is no longer needed (the log has it)."""
        loc = entry.ref
        if loc.frame is not None:
            loc.frame = None
            self.memory_used -= entry.size

    async def read_frame(self, box: Box, entry: Entry[Location]) -> Buffer | None:
        """The bytes of a logged frame (from memory, else from disk); None if the job's log
        was deleted meanwhile."""
        loc = entry.ref
        frame = loc.frame
        if frame is not None:
            return frame
        if box.dead:
            return None
        if entry.size < THREAD_READ_MIN:
            return box.log.read(loc, entry.size)
        box.log.acquire()
        try:
            data = await trio.to_thread.run_sync(
                box.log.read, loc, entry.size, limiter=self.io_limiter
            )
        finally:
            box.log.release()
        return None if box.dead else data

    # -- jobs -------------------------------------------------------------------------------

    async def finish_jobs(self, jobs: Iterable[int]) -> None:
        """The coordinator says these jobs are over: drop their state and delete their logs."""
        for job in jobs:
            if job in self.finished:
                continue
            self.finished.add(job)
            for key in [k for k in self.attachments if k[0] == job]:
                att = self.attachments[key]
                self._unbind(key, att)
                att.conn.fence_out(
                    key,
                    Stop(
                        job=job,
                        rank=key[1],
                        incarnation=att.claims.incarnation,
                        reason="job finished",
                    ),
                )
            for key in [k for k in self.lost_pending if k[0] == job]:
                del self.lost_pending[key]
            for box in self.jobs.pop(job, {}).values():
                del self.boxes[(job, box.dst)]
                box.dead = True
                for e in box.mailbox.entries():
                    self.pushed(e)
                self.messages_stored -= box.mailbox.durable_count
                self.bytes_stored -= box.mailbox.nbytes
                box.log.close()
            await trio.to_thread.run_sync(
                logfiles.delete_job, self.data_dir, job, limiter=self.io_limiter
            )
            logger.info("job %d finished: its logs are deleted", job)

    def load_report(self) -> RelayLoad:
        return RelayLoad(
            connections=len(self.connections),
            ranks=len(self.attachments),
            messages_stored=self.messages_stored,
            bytes_stored=self.bytes_stored,
        )


def now() -> float:
    """Wall-clock time for token expiry checks."""
    return time.time()
