"""The relay's shared state: the I/O shell around ``protocol.relay_core.RelayCore``.

One ``Hub`` per relay process, used by every agent connection (``connection``) and by the
coordinator client (``registry``). The rules (attachments, fencing by incarnation, acks,
determinism and validation by replay, lost ranks, trimming, finished jobs) are the core's; the
hub gives it what it asks for (``Shell``: acks and messages on connections, incarnations on
disk, reports to the coordinator) and keeps the files: a ``Box`` is one destination rank's
``Mailbox`` and determinant log (the core's) plus its ``ChannelLog`` on disk (``box.io``).

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
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from vpool.protocol import relay_core as core
from vpool.protocol.api import (
    MAX_HELD_JOBS,
    RankFence,
    RankLost,
    RelayDiverged,
    RelayLoad,
    RelayValidated,
)
from vpool.protocol.detlog import DetLog
from vpool.protocol.mailbox import Entry
from vpool.protocol.messages import Det, DetAck, Error, Stop
from vpool.relay import log as logfiles
from vpool.relay import trim
from vpool.relay.determinism import Determinism
from vpool.relay.log import Buffer, ChannelLog, Location, digest
from vpool.relay.quotas import Quotas, disk_free
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


class BoxIO:
    """The files of one box, and the event a home ``Attach`` waits on until every logged
    determinant of the rank is durable."""

    __slots__ = ("log", "settled")

    def __init__(self, log: ChannelLog) -> None:
        self.log = log
        self.settled: trio.Event | None = None


Box = core.Box["Connection", Location]
Attachment = core.Attachment["Connection"]


class Cached(Protocol):
    """Who deposited frames kept in memory (a connection): ``cached`` bytes of them."""

    cached: int


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
        self.core: core.RelayCore[Connection, Location] = core.RelayCore(
            self,
            name=name,
            window=settings.push_window,
            window_max=settings.push_window_max,
            lost_grace=settings.lost_grace,
            digest=digest,
        )
        self.connections: set[Connection] = set()
        self.lost_reports: list[RankLost] = []
        self.lost_ready = trio.Event()
        self._timer_wake = trio.Event()
        self.memory_used = 0
        # Data frames pushed to each (job, receiving rank) since the start.
        self.pushed_to: Counter[tuple[int, int]] = Counter()
        self.messages_stored = 0
        self.bytes_stored = 0
        self.io_limiter = trio.CapacityLimiter(max(1, settings.write_threads))
        self.hash_limiter = trio.CapacityLimiter(max(1, settings.write_threads))
        self.determinism = Determinism()
        self.quotas = Quotas(name, data_dir, settings.job_log_quota, settings.disk_reserve)
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
            mailbox = self.core.new_mailbox()
            mailbox.seed(point.received)
            for rec in records:
                entry = mailbox.append(rec.src, rec.seq, rec.size, rec.location, rec.digest)
                mailbox.written(entry)
            mailbox.advance()
            box = core.Box(job, dst, mailbox)
            box.io = BoxIO(chan)
            box.trim = point
            box.dets = DetLog(first=point.dets)
            for det in logfiles.open_dets(chan, job, dst, first=point.dets):
                box.dets.append(det.index, det)
                box.dets.written(det.index)
            box.dets.advance()
            if point:
                trim.rewrite_dets(box)  # a kill may have come between saving and rewriting
            self.core.add_box(box)
            self.messages_stored += len(records)
            self.bytes_stored += mailbox.nbytes
            self.quotas.loaded(job, mailbox.nbytes)
            logger.info(
                "job %d rank %d: %d messages and %d determinants in the log",
                job,
                dst,
                len(records),
                len(box.dets),
            )
        self.store.load()

    # The core's state, as the rest of the relay reads it.

    @property
    def boxes(self) -> dict[Key, Box]:
        return self.core.boxes

    @property
    def jobs(self) -> dict[int, dict[int, Box]]:
        return self.core.jobs

    @property
    def attachments(self) -> dict[Key, Attachment]:
        return self.core.attachments

    @property
    def fence(self) -> dict[Key, int]:
        return self.core.fence

    @property
    def finished(self) -> set[int]:
        return self.core.finished

    def box(self, job: int, dst: int) -> Box:
        return self.core.box(job, dst)

    def stored_from(self, job: int, src: int) -> dict[int, int]:
        return self.core.stored_from(job, src)

    # -- what the core asks (``protocol.relay_core.Shell``) --------------------------------

    def open_box(self, box: Box) -> None:
        s = self.settings
        box.io = BoxIO(
            logfiles.create_log(
                logfiles.box_dir(self.data_dir, box.job, box.dst),
                segment_size=s.segment_size,
                fsync=s.fsync,
            )
        )

    def queue_ack(self, conn: Connection, job: int, src: int, dst: int, seq: int) -> None:
        conn.queue_ack(job, src, dst, seq)

    def send(self, conn: Connection, msg: Error | DetAck | Det) -> None:
        if conn.session.is_open:
            conn.send(msg)

    def stop(self, conn: Connection, stop: Stop) -> None:
        if conn.session.is_open:
            conn.send(stop)

    def wake(self, conn: Connection) -> None:
        conn.wake()

    def record_incarnation(self, job: int, rank: int, incarnation: int) -> None:
        logfiles.record_incarnation(self.data_dir, job, rank, incarnation)

    def report_lost(self, report: RankLost) -> None:
        logger.warning(
            "job %d rank %d incarnation %d lost: %s",
            report.job,
            report.rank,
            report.incarnation,
            report.reason,
        )
        self.lost_reports.append(report)
        self.lost_ready.set()

    def report_diverged(self, report: RelayDiverged) -> None:
        logger.warning("job %d: %s", report.job, report.message)
        self.determinism.add(report)

    def report_validated(self, report: RelayValidated) -> None:
        if report.agreed:
            logger.info(
                "job %d rank %d incarnation %d re-executed for validation: agreed",
                report.job,
                report.rank,
                report.incarnation,
            )
        else:
            logger.warning("job %d: %s", report.job, report.message)
        self.determinism.add(report)

    # -- connections and time -----------------------------------------------------------------

    def connection_closed(self, conn: Connection, reason: str) -> None:
        self.connections.discard(conn)
        self.core.closed(conn, reason, trio.current_time())
        self._timer_wake.set()

    async def watch_lost(self) -> None:
        """Run the core's timers: ranks that did not reattach within ``lost_grace`` are
        reported lost (runs for ever)."""
        while True:
            self.core.handle_timer(trio.current_time())
            nxt = self.core.next_timer()
            with trio.move_on_at(math.inf if nxt is None else nxt):
                await self._timer_wake.wait()
            self._timer_wake = trio.Event()

    def take_lost(self) -> list[RankLost]:
        out, self.lost_reports = self.lost_reports, []
        self.lost_ready = trio.Event()
        return out

    # -- deposits ---------------------------------------------------------------------------

    def stage(
        self, batch: Batch, box: Box, src: int, seq: int, frame: Buffer, owner: Cached
    ) -> None:
        """Append a NEW frame to its mailbox and reserve its place in the log. Its bytes stay
        in memory until pushed while the relay's ``memory_budget`` and the depositing
        connection's share of it (``connection_memory``) allow; else its push reads them back
        from the log. One agent sending what nobody receives fills only its own share."""
        size = len(frame)
        keep = (
            self.memory_used + size <= self.settings.memory_budget
            and owner.cached + size <= self.settings.connection_memory
        )
        if keep:
            self.memory_used += size
            owner.cached += size
        loc = box.io.log.reserve(size, frame if keep else None)
        if keep:
            loc.owner = owner
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
        batch.dets.append((box, det.index, box.io.log.reserve_det(len(frame)), frame))
        batch.nbytes += len(frame)

    async def digest_later(self, pending: list[tuple[Entry[Location], Buffer]]) -> None:
        """Compute the digests of big frames in a worker thread (see ``DIGEST_INLINE_MAX``).
        Shielded: a re-sent copy may be waiting for them."""
        with trio.CancelScope(shield=True):
            digests = await trio.to_thread.run_sync(
                lambda: [digest(frame) for _, frame in pending], limiter=self.hash_limiter
            )
        relay = self.core
        for (entry, _), d in zip(pending, digests, strict=True):
            entry.digest = d
            if relay.waiting:
                relay.digested(entry)

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
        logs = {box.io.log: None for box, _, _ in batch.items}
        logs.update((box.io.log, None) for box, _, _, _ in batch.dets)
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
        """The batch is in the log files: the core acknowledges and wakes the receivers."""
        if batch.dets:
            self._dets_durable(batch)
        items = batch.items
        self.messages_stored += len(items)
        self.bytes_stored += batch.nbytes
        relay = self.core
        if len(items) == 1:
            box, entry, _ = items[0]
            entry.written = True
            relay.written(box, wake=wake)
            return
        touched: dict[Box, None] = {}
        for box, entry, _ in items:
            entry.written = True
            touched[box] = None
        for box in touched:
            relay.written(box, wake=wake)

    def _dets_durable(self, batch: Batch) -> None:
        """Determinants are written: the core tells their ranks at once (``DetAck`` is not
        delayed like acks, the rank's next deposit waits for it)."""
        touched: dict[Box, None] = {}
        for box, index, _, _ in batch.dets:
            box.dets.written(index)
            touched[box] = None
        for box in touched:
            count = self.core.dets_written(box)
            io = box.io
            if io.settled is not None and count == len(box.dets):
                io.settled.set()
                io.settled = None

    async def dets_settled(self, box: Box) -> None:
        """Wait until every determinant logged for ``box``'s rank is durable."""
        while box.dets.durable < len(box.dets) and not box.dead:
            if box.io.settled is None:
                box.io.settled = trio.Event()
            await box.io.settled.wait()

    def pushed(self, entry: Entry[Location]) -> None:
        """A frame went out, or its receiver has it already (agent-local delivery): its
        in-memory copy is no longer needed (the log has it)."""
        loc = entry.ref
        if loc.frame is not None:
            loc.frame = None
            self.memory_used -= entry.size
            if loc.owner is not None:
                loc.owner.cached -= entry.size
                loc.owner = None

    async def read_frame(self, box: Box, entry: Entry[Location]) -> Buffer | None:
        """The bytes of a logged frame (from memory, else from disk); None if the job's log
        was deleted meanwhile."""
        loc = entry.ref
        frame = loc.frame
        if frame is not None:
            return frame
        if box.dead:
            return None
        chan = box.io.log
        if entry.size < THREAD_READ_MIN:
            return chan.read(loc, entry.size)
        chan.acquire()
        try:
            data = await trio.to_thread.run_sync(
                chan.read, loc, entry.size, limiter=self.io_limiter
            )
        finally:
            chan.release()
        return None if box.dead else data

    # -- jobs -------------------------------------------------------------------------------

    async def finish_jobs(self, jobs: Iterable[int]) -> None:
        """The coordinator says these jobs are over: the core stops their ranks and drops
        their state; their logs and images are deleted."""
        for job in jobs:
            if job in self.finished:
                continue
            self.store.forget_job(job)
            self.quotas.forget(job)
            for box in self.core.finish_jobs([job]):
                io = box.io
                if io.settled is not None:
                    io.settled.set()
                for e in box.mailbox.entries():
                    self.pushed(e)
                self.messages_stored -= box.mailbox.durable_count
                self.bytes_stored -= box.mailbox.nbytes
                io.log.close()
            await trio.to_thread.run_sync(
                logfiles.delete_job, self.data_dir, job, limiter=self.io_limiter
            )
            logger.info("job %d finished: its logs and checkpoint images are deleted", job)

    def declare_failed(self, fences: Iterable[RankFence]) -> list[RankFence]:
        """The coordinator declared these ranks failed: the core fences them out for good
        (``RelayCore.declare_failed``). Returns the fences now up, to confirm."""
        up: list[RankFence] = []
        for f in fences:
            if f.job not in self.finished:
                self.core.declare_failed(f.job, f.rank, f.incarnation)
                logger.info(
                    "job %d rank %d incarnation %d declared failed: fenced out",
                    f.job,
                    f.rank,
                    f.incarnation,
                )
            up.append(f)
        return up

    def load_report(self) -> RelayLoad:
        return RelayLoad(
            connections=len(self.connections),
            ranks=len(self.attachments),
            messages_stored=self.messages_stored,
            # The log's frames and the checkpoint images: what this relay's disk holds.
            bytes_stored=self.bytes_stored + self.store.nbytes,
            disk_free=disk_free(self.data_dir),
        )

    def held_jobs(self) -> list[int]:
        """The jobs whose logs or images are here (at most ``MAX_HELD_JOBS``, oldest first)."""
        jobs = {job for job, _ in self.core.boxes} | {job for job, _ in self.store.images}
        return sorted(jobs - self.finished)[:MAX_HELD_JOBS]


def now() -> float:
    """Wall-clock time for token expiry checks."""
    return time.time()
