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
import shutil
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from vpool.protocol.api import RankLost, RelayLoad
from vpool.protocol.detlog import DetLog
from vpool.protocol.errors import ErrorCode
from vpool.protocol.mailbox import Entry, Mailbox
from vpool.protocol.messages import Det, DetAck, Stop
from vpool.protocol.tokens import RankClaims
from vpool.relay import log as logfiles
from vpool.relay import trim
from vpool.relay.determinism import Determinism
from vpool.relay.errors import Rejected
from vpool.relay.log import Buffer, ChannelLog, Location, digest
from vpool.relay.settings import RelaySettings

if TYPE_CHECKING:
    from vpool.relay.connection import Connection

logger = logging.getLogger(__name__)

# Batches smaller than this are written inline: a thread hop costs more than the write.
THREAD_WRITE_MIN = 256 * 1024
THREAD_READ_MIN = 256 * 1024
# Frames up to this size get their digest at once; bigger ones in a worker thread once they are
# written and pushed, off the message's path.
DIGEST_INLINE_MAX = 32 * 1024

Key = tuple[int, int]  # (job, rank)


class Box:
    """Log and delivery state of one destination rank of one job, and the rank's determinant
    log (its entries are the ``Det`` messages themselves: they are small)."""

    __slots__ = ("dead", "dets", "dst", "job", "log", "mailbox", "receiver", "settled", "trim")

    def __init__(self, job: int, dst: int, mailbox: Mailbox[Location], chan: ChannelLog):
        self.job = job
        self.dst = dst
        self.mailbox = mailbox
        self.log = chan
        self.dets: DetLog[Det] = DetLog()
        # Set once every logged determinant is durable, for a home Attach waiting for that.
        self.settled: trio.Event | None = None
        self.receiver: Connection | None = None
        self.dead = False
        # What a checkpoint made unnecessary and was dropped (``relay.trim``).
        self.trim = trim.TrimPoint()


class Attachment:
    """A rank attached on one connection. ``offered[dst]`` is the highest seq this attachment
    deposited (or re-sent) to ``dst``: acks never claim more than that, so a replaying
    incarnation is not told about messages it has not re-sent yet. ``diverged``: the rank
    re-sent a message that differs from the logged one; its deposits are dropped."""

    __slots__ = ("claims", "conn", "diverged", "home", "offered")

    def __init__(self, claims: RankClaims, home: bool, conn: Connection) -> None:
        self.claims = claims
        self.home = home
        self.conn = conn
        self.offered: dict[int, int] = {}
        self.diverged = False


class Batch:
    """New frames of one read, in arrival order, waiting to be written: messages (``items``)
    and determinants (``dets``: box, index, place in the determinant log, frame).
    ``undigested``: big messages whose digest is computed after the write."""

    __slots__ = ("dets", "items", "nbytes", "undigested")

    def __init__(self) -> None:
        self.items: list[tuple[Box, Entry[Location], Buffer]] = []
        self.dets: list[tuple[Box, int, Location, Buffer]] = []
        self.undigested: list[tuple[Entry[Location], Buffer]] = []
        self.nbytes = 0

    def __bool__(self) -> bool:
        return bool(self.items or self.dets)

    def runs(self) -> list[logfiles.Run]:
        """The writes of the batch, merged into contiguous runs."""
        places = [(e.ref, frame) for _, e, frame in self.items]
        places.extend((loc, frame) for _, _, loc, frame in self.dets)
        return logfiles.group_runs(places)


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
        self.hash_limiter = trio.CapacityLimiter(max(1, settings.write_threads))
        self.determinism = Determinism(name)
        from vpool.relay.ckptstore import CheckpointStore

        self.store = CheckpointStore(self)

    def set_signing_key(self, key: Ed25519PublicKey) -> None:
        self.signing_key = key
        self.key_ready.set()

    # -- boxes ------------------------------------------------------------------------------

    def load(self) -> None:
        """Rebuild every box from the logs on disk (blocking; run it in a thread)."""
        s = self.settings
        self.fence.update(logfiles.recorded_incarnations(self.data_dir))
        for job, dst, directory in logfiles.existing_boxes(self.data_dir):
            point = trim.read_point(directory)
            chan, records = logfiles.open_log(
                directory,
                job,
                dst,
                segment_size=s.segment_size,
                fsync=s.fsync,
                floor=point.received,
            )
            mailbox = self._mailbox()
            mailbox.seed(point.received)
            for rec in records:
                entry = mailbox.append(rec.src, rec.seq, rec.size, rec.location, rec.digest)
                mailbox.written(entry)
            mailbox.advance()
            box = Box(job, dst, mailbox, chan)
            box.trim = point
            box.dets = DetLog(first=point.dets)
            for det in logfiles.open_dets(chan, job, dst, first=point.dets):
                box.dets.append(det.index, det)
                box.dets.written(det.index)
            box.dets.advance()
            if point:
                trim.rewrite_dets(box)  # a kill may have come between saving and rewriting
            self._add_box(box)
            self.messages_stored += len(records)
            self.bytes_stored += mailbox.nbytes
            logger.info(
                "job %d rank %d: %d messages and %d determinants in the log",
                job,
                dst,
                len(records),
                len(box.dets),
            )
        self.store.load()

    def _mailbox(self) -> trim.TrimmableMailbox[Location]:
        """A rank's mailbox: its push window starts at ``push_window`` and grows up to
        ``push_window_max`` as the round trips it measures on this relay's clock allow."""
        s = self.settings
        return trim.TrimmableMailbox(
            window=s.push_window, window_max=s.push_window_max, clock=trio.current_time
        )

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
            box = Box(job, dst, self._mailbox(), chan)
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
                ErrorCode.FENCED,
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
        if size <= DIGEST_INLINE_MAX:
            entry = box.mailbox.append(src, seq, size, loc, digest(frame))
        else:
            entry = box.mailbox.append(src, seq, size, loc)
            batch.undigested.append((entry, frame))
        batch.items.append((box, entry, frame))
        batch.nbytes += size

    def stage_det(self, batch: Batch, box: Box, det: Det, frame: Buffer) -> None:
        """Append a NEW determinant to the rank's log and reserve its place in the file."""
        box.dets.append(det.index, det)
        batch.dets.append((box, det.index, box.log.reserve_det(len(frame)), frame))
        batch.nbytes += len(frame)

    async def digest_later(self, pending: list[tuple[Entry[Location], Buffer]]) -> None:
        """Compute the digests of big frames in a worker thread (see ``DIGEST_INLINE_MAX``).
        Shielded: a re-sent copy may be waiting for them."""
        with trio.CancelScope(shield=True):
            digests = await trio.to_thread.run_sync(
                lambda: [digest(frame) for _, frame in pending], limiter=self.hash_limiter
            )
        determinism = self.determinism
        for (entry, _), d in zip(pending, digests, strict=True):
            entry.digest = d
            if determinism.waiting:
                determinism.digested(entry)

    def commit_inline(self, batch: Batch, *, wake: bool = True) -> bool:
        """Write a small batch right here (a thread hop costs more than such a write) and
        finish it; False when the batch must go through ``commit`` instead. With
        ``wake=False`` the receivers' writers are not woken: the caller pushes itself."""
        if batch.nbytes >= THREAD_WRITE_MIN or self.settings.fsync:
            return False
        items = batch.items
        if len(items) == 1 and not batch.dets:
            _, entry, frame = items[0]
            logfiles.write_runs([(entry.ref.segment, entry.ref.offset, [frame])], fsync=False)
        else:
            logfiles.write_runs(batch.runs(), fsync=False)
        self._finish(batch, wake)
        return True

    async def commit(self, batch: Batch) -> None:
        """Write a batch in a worker thread, then finish it. Shielded: a write that never
        happens would leave a hole in the log that no later write fills, and the mailbox
        would stop advancing."""
        runs = batch.runs()
        fsync = self.settings.fsync
        logs = {box.log: None for box, _, _ in batch.items}
        logs.update((box.log, None) for box, _, _, _ in batch.dets)
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
        if batch.dets:
            self._dets_durable(batch)
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

    def _dets_durable(self, batch: Batch) -> None:
        """Determinants are written: tell their ranks at once (``DetAck`` is not delayed like
        acks, the rank's next deposit waits for it)."""
        touched: dict[Box, None] = {}
        for box, index, _, _ in batch.dets:
            box.dets.written(index)
            touched[box] = None
        for box in touched:
            count = box.dets.advance()
            if box.settled is not None and count == len(box.dets):
                box.settled.set()
                box.settled = None
            att = self.attachments.get((box.job, box.dst))
            if att is not None and att.home and not box.dead:
                att.conn.send(DetAck(job=box.job, rank=box.dst, count=count))

    async def dets_settled(self, box: Box) -> None:
        """Wait until every determinant logged for ``box``'s rank is durable."""
        while box.dets.durable < len(box.dets) and not box.dead:
            if box.settled is None:
                box.settled = trio.Event()
            await box.settled.wait()

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
            self.determinism.forget_job(job)
            self.store.forget_job(job)
            for box in self.jobs.pop(job, {}).values():
                del self.boxes[(job, box.dst)]
                box.dead = True
                if box.settled is not None:
                    box.settled.set()
                for e in box.mailbox.entries():
                    self.pushed(e)
                self.messages_stored -= box.mailbox.durable_count
                self.bytes_stored -= box.mailbox.nbytes
                box.log.close()
            await trio.to_thread.run_sync(
                logfiles.delete_job, self.data_dir, job, limiter=self.io_limiter
            )
            logger.info("job %d finished: its logs and checkpoint images are deleted", job)

    def load_report(self) -> RelayLoad:
        return RelayLoad(
            connections=len(self.connections),
            ranks=len(self.attachments),
            messages_stored=self.messages_stored,
            # The log's frames and the checkpoint images: what this relay's disk holds.
            bytes_stored=self.bytes_stored + self.store.nbytes,
            disk_free=_disk_free(self.data_dir),
        )


def _disk_free(path: Path) -> int:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 0


def now() -> float:
    """Wall-clock time for token expiry checks."""
    return time.time()
