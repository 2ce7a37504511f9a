"""One feed per watched job: however many tabs follow a job, the job is read once per change.

The sources here are in memory (a list of records, a job state, a change signal), so the test
counts reads exactly; ``test_portal.py`` follows a real job through the event stream.
"""

from __future__ import annotations

import math
from contextlib import aclosing

import pytest
import trio
import trio.testing

from vpool.coordinator.service import Signal
from vpool.protocol import api
from vpool.web import feed


class FakeJob:
    def __init__(self) -> None:
        self.state: api.JobState = "running"
        self.records: list[api.OutputRecord] = []
        self.changes = Signal()
        self.detail_reads = 0
        self.output_reads = 0

    def add(self, rank: int, text: str) -> None:
        record = api.OutputRecord(
            id=len(self.records) + 1, rank=rank, stream="stdout", data=text.encode()
        )
        self.records.append(record)
        self.changes.fire()

    def end(self) -> None:
        self.state = "succeeded"
        self.changes.fire()

    def sources(self) -> feed.Sources:
        async def detail(job: int) -> api.JobDetail:
            self.detail_reads += 1
            info = api.JobInfo(
                id=job,
                name="j",
                user="u",
                state=self.state,
                ranks=2,
                exit_code=None,
                reason="",
                created=0.0,
                started=0.0,
                finished=None,
            )
            return api.JobDetail(job=info, ranks=[], events=[])

        async def output(job: int, after: int, limit: int) -> tuple[list[api.OutputRecord], bool]:
            self.output_reads += 1
            later = [r for r in self.records if r.id > after]
            return later[:limit], len(later) > limit

        return feed.Sources(
            detail=detail,
            output=output,
            render=lambda d: f"panel:{d.job.state}",
            changes=self.changes.current,
            tick=math.inf,  # no periodic re-render: every read below is for a change
        )


async def _follow(
    feeds: feed.Feeds, got: list[api.OutputRecord], panels: list[str], rank: int | None = None
) -> None:
    async with feeds.watch(1, 0) as f, aclosing(f.follow(0, rank)) as updates:
        async for update in updates:
            got += update.records
            if update.panel is not None:
                panels.append(update.panel)
            if update.done:
                return


async def _run(tabs: int, changes: int) -> tuple[FakeJob, list[list[api.OutputRecord]]]:
    job = FakeJob()
    feeds = feed.Feeds(job.sources())
    seen: list[list[api.OutputRecord]] = [[] for _ in range(tabs)]
    panels: list[list[str]] = [[] for _ in range(tabs)]
    async with trio.open_nursery() as nursery:
        for i in range(tabs):
            nursery.start_soon(_follow, feeds, seen[i], panels[i])
        await trio.testing.wait_all_tasks_blocked()
        for n in range(changes):
            job.add(n % 2, f"line {n}\n")
            await trio.testing.wait_all_tasks_blocked()
        job.end()
    assert feeds.feeds == {}  # the feed went with its last subscriber
    for p in panels:
        assert p[0] == "panel:running" and p[-1] == "panel:succeeded"
    return job, seen


async def test_many_tabs_cost_what_one_tab_costs() -> None:
    one, _ = await _run(tabs=1, changes=20)
    many, seen = await _run(tabs=25, changes=20)
    # One read of the job per change (and one to start), however many tabs watch.
    assert one.detail_reads == many.detail_reads == 20 + 2
    assert many.output_reads <= one.output_reads
    for records in seen:
        assert [r.data for r in records] == [f"line {n}\n".encode() for n in range(20)]


async def test_a_late_tab_behind_the_ring_catches_up_alone() -> None:
    job = FakeJob()
    for n in range(30):
        job.add(0, f"early {n}\n")
    feeds = feed.Feeds(job.sources())
    early: list[api.OutputRecord] = []
    late: list[api.OutputRecord] = []
    rank1: list[api.OutputRecord] = []
    async with trio.open_nursery() as nursery:
        # The first tab loaded the page with 30 records: the feed starts at 30.
        async def first() -> None:
            async with feeds.watch(1, 30) as f, aclosing(f.follow(30)) as updates:
                async for update in updates:
                    early.extend(update.records)
                    if update.done:
                        return

        nursery.start_soon(first)
        await trio.testing.wait_all_tasks_blocked()
        job.add(1, "new 1\n")
        await trio.testing.wait_all_tasks_blocked()
        # A tab with nothing yet (cursor 0, behind the feed's floor) and one for rank 1 only.
        nursery.start_soon(_follow, feeds, late, [])
        nursery.start_soon(_follow, feeds, rank1, [], 1)
        await trio.testing.wait_all_tasks_blocked()
        job.add(0, "new 2\n")
        await trio.testing.wait_all_tasks_blocked()
        job.end()
    assert [r.data for r in early] == [b"new 1\n", b"new 2\n"]
    assert [r.id for r in late] == list(range(1, 33))
    assert [r.data for r in rank1] == [b"new 1\n"]


async def test_the_ring_is_bounded_and_slow_tabs_catch_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(feed, "RING_BYTES", 100)  # a few records of ~10 bytes
    job = FakeJob()
    feeds = feed.Feeds(job.sources())
    got: list[api.OutputRecord] = []
    async with feeds.watch(1, 0) as f:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_follow, feeds, got, [])
            await trio.testing.wait_all_tasks_blocked()
            for n in range(50):  # bursts of 10 between reads: the ring drops the oldest
                for m in range(10):
                    job.add(0, f"l{n:02d}-{m}\n")
                await trio.testing.wait_all_tasks_blocked()
                assert f.nbytes <= 100 and len(f.records) <= 100
            # A tab that starts now, from the beginning, is far behind the ring.
            late: list[api.OutputRecord] = []
            nursery.start_soon(_follow, feeds, late, [])
            await trio.testing.wait_all_tasks_blocked()
            job.end()
    assert f.floor > 400  # the ring moved on
    assert [r.id for r in got] == list(range(1, 501))
    assert [r.id for r in late] == list(range(1, 501))
