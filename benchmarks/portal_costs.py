"""What the web portal costs: a big job page, and many tabs following one job.

    .venv/bin/python benchmarks/portal_costs.py [--ranks 64] [--lines 10000] [--events 400]
        [--repeat 9] [--tabs 100] [--changes 200] [--json FILE]

Both parts run an in-process coordinator (its SQLite store in a temporary directory, the app
driven through httpx's ASGI transport, no network) and print each figure next to a baseline
measured in the same invocation (issue 17):

1. the job page: ``GET /jobs/N`` of a job with ``--ranks`` ranks, ``--lines`` lines of output
   spread over them and ``--events`` events (restarts and checkpoints), from the request to the
   last byte (database reads, the timeline, the template), ``--repeat`` times (median); the
   baseline is the page of a 1-rank job with no output and no event. The goal: under 1 s.
2. watching: ``--tabs`` subscribers follow one job's live feed (what each open job page's
   event stream reads from) while ``--changes`` output chunks arrive, one change each; the
   figure is the database reads of the job per change, against one subscriber alone. The
   goal: the same (one read of the job per change, whatever the tabs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from contextlib import aclosing
from pathlib import Path

import httpx
import trio

from vpool.coordinator import keys
from vpool.coordinator.app import create_app
from vpool.coordinator.service import Coordinator, Signal
from vpool.coordinator.settings import CoordinatorSettings
from vpool.protocol import api
from vpool.web import feed, portal


def _coordinator(state: Path) -> Coordinator:
    return Coordinator(CoordinatorSettings(state_dir=str(state), max_ranks=4096))


def _job(core: Coordinator, ranks: int, lines: int, events: int) -> int:
    """A running job with ``lines`` lines of output and ``events`` events, written straight
    to the store (as agents and relays would have)."""
    store, now = core.store, core.clock()
    store.add_blob("0" * 64, 0, now, "alice")  # the bundle, as uploaded (never read here)
    sub = api.JobSubmit(ranks=ranks, bundle="0" * 64, entry="app.py", name=f"{ranks} ranks")
    job = store.create_job("alice", sub, now - 600)
    db = store.db  # type: ignore[attr-defined]
    with db.atomic():
        db.execute(
            "UPDATE jobs SET state = 'running', started = ? WHERE id = ?", [now - 590, job.id]
        )
        db.execute("UPDATE ranks SET state = 'running', incarnation = 1 WHERE job = ?", [job.id])
        rows = []
        for n in range(lines):
            rank = n % ranks
            text = f"step {n // ranks:6d} of rank {rank}: residual 1.234567e-03\n".encode()
            rows.append([job.id, rank, "stdout", (n // ranks) * len(text), text])
        db.conn.executemany(
            "INSERT INTO output (job, rank, stream, offset, data) VALUES (?, ?, ?, ?, ?)", rows
        )
        kinds = ("rank_lost", "rank_restarted", "rank_replaying", "rank_running", "checkpoint")
        for n in range(events):
            kind, rank = kinds[n % len(kinds)], (n // len(kinds)) % ranks
            db.execute(
                "INSERT INTO events (job, time, kind, rank, message) VALUES (?, ?, ?, ?, ?)",
                [job.id, now - 590 + n, kind, rank, f"rank {rank}: {kind} number {n}"],
            )
    return job.id


async def page_times(ranks: int, lines: int, events: int, repeat: int) -> tuple[float, float]:
    """Median seconds of the baseline page and of the big one."""
    with tempfile.TemporaryDirectory() as tmp:
        core = _coordinator(Path(tmp))
        token, token_hash = keys.new_api_token()
        core.store.add_user("alice", token_hash, core.clock())
        small = _job(core, 1, 0, 0)
        big = _job(core, ranks, lines, events)
        app = create_app(core.settings, coordinator=core)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="https://c") as client:
            cookie, _, _ = await core.sign_in(token)
            client.cookies.set("vpool_session", cookie)
            times: dict[int, list[float]] = {small: [], big: []}
            for _ in range(repeat):
                for job in (small, big):  # alternating, so drift hits both
                    start = time.perf_counter()
                    r = await client.get(f"/jobs/{job}")
                    times[job].append(time.perf_counter() - start)
                    assert r.status_code == 200, r.text[:300]
            lines_shown = r.text.count('<span class="ln')
            assert lines_shown == lines, (lines_shown, lines)
        core.close()
    return statistics.median(times[small]), statistics.median(times[big])


async def reads_per_change(tabs: int, changes: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        core = _coordinator(Path(tmp))
        job = _job(core, 4, 0, 0)
        reads = 0

        async def detail(job_id: int) -> api.JobDetail | None:
            nonlocal reads
            reads += 1
            return await core.db.call(core.store.job_detail, job_id)

        async def output(
            job_id: int, after: int, limit: int
        ) -> tuple[list[api.OutputRecord], bool]:
            return await core.db.call(core.store.output_page, job_id, after, None, limit)

        sources = feed.Sources(
            detail=detail,
            output=output,
            render=lambda d: portal.live_panel(d, core.clock()),
            changes=core.changes.current,
            tick=float("inf"),
        )
        feeds = feed.Feeds(sources)
        received = [0] * tabs
        panels = [0] * tabs
        progress = Signal()

        async def tab(i: int) -> None:
            async with feeds.watch(job, 0) as f, aclosing(f.follow(0)) as updates:
                async for update in updates:
                    received[i] += len(update.records)
                    panels[i] += update.panel is not None
                    progress.fire()
                    if update.done:
                        return

        async with trio.open_nursery() as nursery:
            for i in range(tabs):
                nursery.start_soon(tab, i)
            while True:  # every tab has its first panel: the feed's first read is done
                woken = progress.current()
                if min(panels) > 0:
                    break
                await woken.wait()
            start = reads
            db = core.store.db  # type: ignore[attr-defined]
            for n in range(changes):
                await core.db.call(
                    db.execute,
                    "INSERT INTO output (job, rank, stream, offset, data) "
                    "VALUES (?, 0, 'stdout', ?, ?)",
                    [job, n * 8, b"line %03d\n" % (n % 1000)],
                )
                core.changes.fire()
                while True:  # every tab has the new line
                    woken = progress.current()
                    if min(received) > n:
                        break
                    await woken.wait()
            per_change = (reads - start) / changes
            await core.db.call(
                db.execute, "UPDATE jobs SET state = 'succeeded' WHERE id = ?", [job]
            )
            core.changes.fire()
        assert received == [changes] * tabs, received[:5]
        core.close()
    return per_change


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--lines", type=int, default=10_000)
    ap.add_argument("--events", type=int, default=400)
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--tabs", type=int, default=100)
    ap.add_argument("--changes", type=int, default=200)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()

    base, big = trio.run(page_times, a.ranks, a.lines, a.events, a.repeat)
    print(f"job page, 1 rank, no output:                         {base * 1000:8.1f} ms")
    print(
        f"job page, {a.ranks} ranks, {a.lines} lines, {a.events} events: {big * 1000:8.1f} ms"
        f"   ratio {big / base:.1f}   (goal: under 1000 ms)"
    )
    one = trio.run(reads_per_change, 1, a.changes)
    many = trio.run(reads_per_change, a.tabs, a.changes)
    print(f"reads of the job per change, 1 tab:      {one:.2f}")
    print(
        f"reads of the job per change, {a.tabs} tabs:  {many:.2f}   ratio {many / one:.2f}"
        "   (goal: 1.00)"
    )
    if a.json:
        a.json.write_text(
            json.dumps(
                {
                    "page_baseline_s": base,
                    "page_big_s": big,
                    "reads_per_change_1": one,
                    f"reads_per_change_{a.tabs}": many,
                },
                indent=1,
            )
        )
    sys.exit(0 if big < 1.0 and many <= one else 1)


if __name__ == "__main__":
    main()
