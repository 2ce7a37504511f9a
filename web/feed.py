"""Live pages, cheaply: one feed per watched job, shared by every tab that watches it.

A job page follows its job through server-sent events (``portal.live``). Whatever the number of
open tabs, each job has one ``JobFeed``: when the coordinator's ``changes`` signal fires (new
output, a rank state, an event) or, while the job runs, every ``TICK`` seconds (the timeline
grows with time), *one* subscriber takes the feed's lock and reads the job once: its detail
and the output records since the feed's ``head``. It renders the live panel (state, ranks,
timeline, events) once and keeps the records in a ring (bounded in records and bytes); every
subscriber takes what it has not seen from there. So the database work grows with the number
of watched jobs, not of tabs.

A subscriber that starts (or reconnects, with ``Last-Event-ID``) behind the ring's ``floor``
reads the missing records itself, once, in pages, then joins the ring. There is no background
task: the feed lives while it has subscribers and goes with the last one.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import trio

from vpool.protocol import api

TICK = 2.0  # seconds between re-renders of a running job's panel
RING = 5000  # output records a feed keeps for its subscribers, at most
RING_BYTES = 8 << 20  # and at most this many bytes of them
PAGE = 1000  # output records read at once

DetailReader = Callable[[int], Awaitable[api.JobDetail | None]]
OutputReader = Callable[[int, int, int], Awaitable[tuple[list[api.OutputRecord], bool]]]
Renderer = Callable[[api.JobDetail], str]


@dataclass
class Update:
    """What a subscriber has not seen yet: output records (in id order), the live panel if it
    changed, and ``done`` once the job ended and every record was given."""

    records: list[api.OutputRecord]
    panel: str | None = None
    state: str = ""
    done: bool = False


@dataclass
class Sources:
    """Where feeds read from and how they render; ``changes`` is the coordinator's signal."""

    detail: DetailReader
    output: OutputReader
    render: Renderer
    changes: Callable[[], trio.Event]
    tick: float = TICK
    # Whether an ended job's output is complete (every stopped rank reported its exit);
    # until then the feed keeps reading.
    settled: Callable[[api.JobInfo], Awaitable[bool]] | None = None


@dataclass
class JobFeed:
    job: int
    sources: Sources
    floor: int  # the ring holds every record with id > floor (up to head)
    head: int = 0  # the last record id read
    ids: deque[int] = field(default_factory=deque)
    records: deque[api.OutputRecord] = field(default_factory=deque)
    nbytes: int = 0  # of the records' data
    panel: str = ""
    state: str = ""
    version: int = 0  # of the panel
    terminal: bool = False
    subscribers: int = 0
    lock: trio.Lock = field(default_factory=trio.Lock)
    seen: trio.Event | None = None  # the ``changes`` event current at the last read
    rendered_at: float = -math.inf
    reads: int = 0  # database reads of this feed (tests check they do not grow with tabs)

    def __post_init__(self) -> None:
        self.head = self.floor

    async def refresh(self) -> bool:
        """Read the job if something changed (or a running job's panel is a tick old). Only
        one subscriber at a time; the others find it done. False if nothing was read."""
        async with self.lock:
            changed = self.sources.changes()
            age = trio.current_time() - self.rendered_at
            stale = not self.terminal and age >= self.sources.tick
            if changed is self.seen and not stale:
                return False
            self.seen = changed
            self.reads += 1
            # The state before the output, as ``Coordinator.output`` does: once terminal,
            # every exited rank's output is already stored, so the reads below hold it.
            detail = await self.sources.detail(self.job)
            if detail is None:  # the job is gone (cannot happen today): end the feed
                self.terminal = True
                return True
            more = True
            while more:
                records, more = await self.sources.output(self.job, self.head, PAGE)
                for record in records:
                    self.ids.append(record.id)
                    self.records.append(record)
                    self.nbytes += len(record.data)
                if records:
                    self.head = records[-1].id
            while len(self.records) > RING or (self.nbytes > RING_BYTES and self.records):
                self.nbytes -= len(self.records.popleft().data)
                self.floor = self.ids.popleft()
            self.panel = self.sources.render(detail)
            self.state = detail.job.state
            self.version += 1
            ended = detail.job.state in api.TERMINAL_STATES
            settled = self.sources.settled
            self.terminal = ended and (settled is None or await settled(detail.job))
            self.rendered_at = trio.current_time()
            return True

    def since(self, cursor: int, rank: int | None) -> list[api.OutputRecord]:
        start = bisect.bisect_right(self.ids, cursor)
        records = [self.records[i] for i in range(start, len(self.records))]
        return records if rank is None else [r for r in records if r.rank == rank]

    async def follow(self, after: int, rank: int | None = None) -> AsyncGenerator[Update, None]:
        """Updates for a subscriber that has seen the records up to ``after``."""
        cursor, version = after, -1
        while True:
            if cursor < self.floor:
                # Behind the ring: catch up from the database, this subscriber alone.
                records, _ = await self.sources.output(self.job, cursor, PAGE)
                records = [r for r in records if r.id <= self.floor]
                cursor = records[-1].id if records else self.floor
                wanted = [r for r in records if rank is None or r.rank == rank]
                if wanted:
                    yield Update(wanted)
                continue
            records = self.since(cursor, rank)
            if self.head > cursor:
                cursor = self.head
            fresh = self.version != version and self.version > 0
            if records or fresh:
                version = self.version
                yield Update(records, self.panel if fresh else None, self.state)
                continue
            if self.terminal and cursor >= self.head:
                yield Update([], None, self.state, done=True)
                return
            changed = self.sources.changes()
            await self.refresh()  # by this subscriber, or found done by another
            if self.head > cursor or (self.version > 0 and self.version != version):
                continue
            if self.terminal:
                continue
            with trio.move_on_after(self.sources.tick):
                await changed.wait()


class Feeds:
    """The feeds of the watched jobs."""

    def __init__(self, sources: Sources) -> None:
        self.sources = sources
        self.feeds: dict[int, JobFeed] = {}

    @asynccontextmanager
    async def watch(self, job: int, after: int) -> AsyncIterator[JobFeed]:
        feed = self.feeds.get(job)
        if feed is None:
            feed = self.feeds[job] = JobFeed(job, self.sources, floor=after)
        feed.subscribers += 1
        try:
            yield feed
        finally:
            feed.subscribers -= 1
            if not feed.subscribers and self.feeds.get(job) is feed:
                del self.feeds[job]
