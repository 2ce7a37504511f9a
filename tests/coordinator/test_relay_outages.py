"""Restarts that wait (issue 20): a rank lost because its agent cannot reach a relay of its job
is restarted with backoff, outside the job's restart budget, and its job waits out
``relay_down_timeout``; while a relay of a job is down, its lost ranks wait for it."""

from __future__ import annotations

from pathlib import Path

from coord_helpers import Agent, FakeClock, Pool, open_pool

from vpool.coordinator.sqlite_faults import RELAY_BACKOFF_MAX, relay_backoff
from vpool.protocol import api


async def _running(pool: Pool) -> tuple[Agent, list[api.Lease]]:
    await pool.register_relay("relay-0")
    await pool.submit(2)
    agent = await pool.enroll("agent-1", slots=4)
    leases = await pool.lease(agent)
    await pool.heartbeat(agent, leases)
    return agent, leases


async def _unreachable(pool: Pool, agent: Agent, lease: api.Lease, relay: str = "relay-0") -> None:
    problem = api.RankProblem(
        job=lease.job,
        rank=lease.rank,
        incarnation=lease.incarnation,
        message=f"cannot connect to relay {relay}: connection refused",
        relay=relay,
    )
    r = await pool.post("/api/v1/agents/problem", problem, agent.headers)
    assert r.status_code == 200, r.text


def test_backoff_doubles_up_to_its_cap() -> None:
    assert [relay_backoff(n) for n in (1, 2, 3, 4)] == [0.5, 1.0, 2.0, 4.0]
    assert relay_backoff(60) == RELAY_BACKOFF_MAX == 30.0


async def test_relay_losses_wait_a_backoff_and_spend_no_restart(tmp_path: Path) -> None:
    clock = FakeClock()
    async with open_pool(tmp_path, clock, max_restarts=1, relay_down_timeout=60.0) as pool:
        agent, leases = await _running(pool)
        job = leases[0].job
        lease = leases[0]
        for n in range(1, 6):  # far more losses than max_restarts allows
            await _unreachable(pool, agent, lease)
            wait = relay_backoff(n)
            clock.advance(wait * 0.9)
            await pool.core.schedule()
            assert await pool.lease(agent, free=1) == [], f"placed before {wait} s (loss {n})"
            clock.advance(wait * 0.2)
            await pool.core.schedule()
            [lease] = await pool.lease(agent, free=1)
            assert (lease.rank, lease.incarnation) == (0, n + 1)
        detail = await pool.job(job)
        assert detail.job.state == "running" and detail.job.restarts == 0
        lost = [e.message for e in detail.events if e.kind == "rank_lost"]
        assert lost[-1].endswith(
            "(relay relay-0 unreachable; restarting in 8 s, not counted as a restart)"
        )

        # Running again ends the streak: the next loss waits the first backoff again.
        await pool.heartbeat(agent, [lease, leases[1]])
        await _unreachable(pool, agent, lease)
        clock.advance(relay_backoff(1) + 0.01)
        await pool.core.schedule()
        [lease] = await pool.lease(agent, free=1)
        assert lease.incarnation == 7


async def test_a_relay_unreachable_past_relay_down_timeout_fails_the_job(tmp_path: Path) -> None:
    clock = FakeClock()
    async with open_pool(tmp_path, clock, relay_down_timeout=20.0) as pool:
        agent, leases = await _running(pool)
        job, lease = leases[0].job, leases[0]
        await _unreachable(pool, agent, lease)
        while (await pool.job(job)).job.state == "running":
            clock.advance(RELAY_BACKOFF_MAX)
            await pool.relay_heartbeat("relay-0")  # up for the coordinator, not for agents
            await pool.core.schedule()
            [lease] = await pool.lease(agent, free=1)
            await _unreachable(pool, agent, lease)
        detail = await pool.job(job)
        assert detail.job.state == "failed" and detail.job.restarts == 0
        assert detail.job.reason.startswith(
            "relay relay-0 has been unreachable for 30 s (relay_down_timeout is 20 s): rank 0 lost"
        )


async def test_an_agent_blaming_a_relay_of_another_job_spends_a_restart(pool: Pool) -> None:
    agent, leases = await _running(pool)
    await _unreachable(pool, agent, leases[0], relay="relay-7")
    await pool.core.schedule()
    [again] = await pool.lease(agent, free=1)  # no backoff: an ordinary loss
    assert again.incarnation == 2
    assert (await pool.job(leases[0].job)).job.restarts == 1


async def test_lost_ranks_wait_while_a_relay_of_their_job_is_down(tmp_path: Path) -> None:
    clock = FakeClock()
    async with open_pool(tmp_path, clock, relay_timeout=5.0) as pool:
        agent, leases = await _running(pool)
        job = leases[0].job
        clock.advance(6.0)  # relay-0 is silent past relay_timeout
        await pool.heartbeat(agent, leases)
        await pool.core.check_timeouts()
        ex = api.RankExit(job=job, rank=0, incarnation=1, code=-9, lost=True)
        assert (await pool.post("/api/v1/agents/exit", ex, agent.headers)).status_code == 200
        await pool.core.schedule()
        assert await pool.lease(agent, free=1) == []  # it could not attach anyway
        await pool.relay_heartbeat("relay-0")  # back
        await pool.core.schedule()
        [again] = await pool.lease(agent, free=1)
        assert again.incarnation == 2
        kinds = [e.kind for e in (await pool.job(job)).events]
        assert kinds.index("relay_down") < kinds.index("relay_up") < kinds.index("rank_restarted")
