"""Held heartbeats: an agent's heartbeat waits (up to one heartbeat interval) for a stop order,
so when one rank fails the others are stopped at once, not at their agents' next heartbeat.

The tests run on trio's MockClock without autojump: trio time moves only when a test moves it, so
"the answer came at trio time 0" means it was woken by the event, not by the hold running out.
"""

from __future__ import annotations

import msgspec
import trio
import trio.testing
from coord_helpers import Agent, Pool

from vpool.protocol import api


async def _held_heartbeat(pool: Pool, agent: Agent, leases: list[api.Lease], wait: float):
    hb = api.AgentHeartbeat(
        ranks=[
            api.RankState(job=x.job, rank=x.rank, incarnation=x.incarnation, state="running")
            for x in leases
        ],
        free_slots=0,
        wait=wait,
    )
    r = await pool.post("/api/v1/agents/heartbeat", hb, agent.headers)
    assert r.status_code == 200, r.text
    return msgspec.json.decode(r.content, type=api.AgentHeartbeatResponse)


async def _until_held(pool: Pool) -> None:
    """Until a heartbeat waits on the coordinator's ``ended`` signal (the store runs in threads,
    so "all tasks blocked" alone may come before the heartbeat got there)."""
    for _ in range(100_000):
        if pool.core.ended.current().statistics().tasks_waiting:
            return
        await trio.testing.wait_all_tasks_blocked()
    raise AssertionError("no heartbeat is held")


async def test_held_heartbeat_returns_stop_orders_as_soon_as_a_rank_fails(
    pool: Pool, mock_clock: trio.testing.MockClock
) -> None:
    job, agent, leases = await pool.running_job(3)
    got: list[api.AgentHeartbeatResponse] = []

    async def beat() -> None:
        got.append(await _held_heartbeat(pool, agent, [leases[0], leases[2]], wait=30.0))

    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(beat)
        await _until_held(pool)
        assert not got
        await pool.exit(agent, leases[1], 3)
    assert trio.current_time() == start  # woken by the failure, not by the hold's end
    assert sorted(s.rank for s in got[0].stop) == [0, 2]
    assert all("rank 1 exited with code 3" in s.reason for s in got[0].stop)
    assert (await pool.job(job.id)).job.state == "failed"


async def test_held_heartbeat_ends_after_at_most_one_interval(
    pool: Pool, mock_clock: trio.testing.MockClock
) -> None:
    await pool.register_relay()
    await pool.submit(1)
    agent = await pool.enroll(slots=1)
    leases = await pool.lease(agent)
    got: list[api.AgentHeartbeatResponse] = []

    async def beat() -> None:
        got.append(await _held_heartbeat(pool, agent, leases, wait=30.0))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(beat)
        await _until_held(pool)
        # Another job's output or a rank exiting cleanly wakes it, but it has nothing to say.
        pool.core.ended.fire()
        await _until_held(pool)
        assert not got
        mock_clock.jump(pool.core.settings.heartbeat_interval)  # 1 s, not the 30 asked for
    assert got[0].stop == []


async def test_heartbeat_without_ranks_or_wait_is_not_held(
    pool: Pool, mock_clock: trio.testing.MockClock
) -> None:
    await pool.register_relay()
    await pool.submit(1)
    agent = await pool.enroll(slots=1)
    leases = await pool.lease(agent)
    start = trio.current_time()
    assert (await _held_heartbeat(pool, agent, [], wait=30.0)).stop == []
    assert (await _held_heartbeat(pool, agent, leases, wait=0.0)).stop == []
    assert trio.current_time() == start
