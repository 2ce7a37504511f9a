"""Lost agents and relays fail their jobs with a reason naming the rank, machine and cause."""

from __future__ import annotations

from functools import partial

import msgspec
import trio
from coord_helpers import RELAY_SECRET, Agent, Pool

from vpool.coordinator import scheduler
from vpool.protocol import api


async def _running(pool: Pool, ranks: int = 2) -> tuple[api.JobInfo, Agent, list[api.Lease]]:
    await pool.register_relay("relay-0")
    job = await pool.submit(ranks)
    agent = await pool.enroll("agent-1", slots=ranks)
    leases = await pool.lease(agent)
    await pool.heartbeat(agent, leases)
    return job, agent, leases


async def test_agent_heartbeat_timeout_fails_job(pool: Pool) -> None:
    job, agent, leases = await _running(pool)
    pool.clock.advance(5)
    await pool.relay_heartbeat("relay-0")
    await pool.core.check_timeouts()
    assert (await pool.job(job.id)).job.state == "running"

    pool.clock.advance(6)  # 11 s since the agent's last call, 6 since the relay's
    await pool.core.check_timeouts()
    detail = await pool.job(job.id)
    assert detail.job.state == "failed" and detail.job.exit_code is None
    assert detail.job.reason == "rank 0 lost: agent agent-1 stopped heartbeating"
    assert [x.state for x in detail.ranks] == ["lost", "killed"]
    assert any(e.kind == "rank_lost" and e.rank == 0 for e in detail.events)

    # The agent comes back: it is told to stop what it still runs, and is alive again.
    hb = await pool.heartbeat(agent, leases)
    assert len(hb.stop) == 2
    assert all(s.reason.startswith("job failed: rank 0 lost") for s in hb.stop)
    agents = pool.core.store.list_agents()
    assert agents[0]["state"] == "alive"


async def test_lost_agent_gets_no_new_work(pool: Pool) -> None:
    await pool.register_relay("relay-0")
    agent = await pool.enroll("agent-1", slots=1)
    pool.clock.advance(11)
    await pool.relay_heartbeat("relay-0")
    await pool.core.check_timeouts()
    job = await pool.submit(1)
    assert (await pool.job(job.id)).job.state == "queued"
    # Its next call revives it, and the job is placed.
    assert len(await pool.lease(agent)) == 1


async def test_relay_heartbeat_timeout_fails_job(pool: Pool) -> None:
    job, agent, leases = await _running(pool)
    pool.clock.advance(11)
    await pool.heartbeat(agent, leases)
    await pool.core.check_timeouts()
    detail = await pool.job(job.id)
    assert detail.job.state == "failed"
    assert detail.job.reason == "relay relay-0 stopped heartbeating"
    # No live relay: new jobs wait.
    job2 = await pool.submit(1)
    assert await pool.lease(agent) == []
    assert (await pool.job(job2.id)).job.state == "queued"
    await pool.relay_heartbeat("relay-0")
    assert len(await pool.lease(agent, free=2)) == 1


async def test_relay_lost_report_fails_job(pool: Pool) -> None:
    job, _, leases = await _running(pool)
    report = api.RelayLost(
        name="relay-0",
        lost=[
            api.RankLost(
                job=job.id, rank=1, incarnation=leases[1].incarnation, reason="connection dropped"
            )
        ],
    )
    r = await pool.client.post(
        "/api/v1/relays/lost",
        content=msgspec.json.encode(report),
        headers={"Authorization": f"Bearer {RELAY_SECRET}"},
    )
    assert r.status_code == 200
    detail = await pool.job(job.id)
    assert detail.job.state == "failed" and detail.job.exit_code is None
    assert detail.job.reason == (
        "rank 1 (on agent agent-1) lost: relay relay-0 reported: connection dropped"
    )


async def test_stale_relay_lost_report_is_ignored(pool: Pool) -> None:
    job, _, _ = await _running(pool)
    report = api.RelayLost(
        name="relay-0", lost=[api.RankLost(job=job.id, rank=1, incarnation=99, reason="old")]
    )
    await pool.client.post(
        "/api/v1/relays/lost",
        content=msgspec.json.encode(report),
        headers={"Authorization": f"Bearer {RELAY_SECRET}"},
    )
    assert (await pool.job(job.id)).job.state == "running"


async def test_rank_problem_fails_job(pool: Pool) -> None:
    job, agent, _ = await _running(pool)
    problem = api.RankProblem(job=job.id, rank=0, incarnation=1, message="relay unreachable")
    r = await pool.client.post(
        "/api/v1/agents/problem", content=msgspec.json.encode(problem), headers=agent.headers
    )
    assert r.status_code == 200
    detail = await pool.job(job.id)
    assert detail.job.reason == "rank 0 lost: agent agent-1 reported: relay unreachable"


async def test_expired_agent_token_is_refused(pool: Pool) -> None:
    _, agent, _ = await _running(pool, 1)
    pool.clock.advance(2 * 24 * 3600)
    r = await pool.client.post(
        "/api/v1/agents/lease", content=b'{"free_slots": 1, "wait": 0}', headers=agent.headers
    )
    assert r.status_code == 401 and r.json()["error"]["code"] == "expired_token"


async def test_rank_missing_from_heartbeats_is_lost(pool: Pool) -> None:
    job, agent, leases = await _running(pool)
    pool.clock.advance(5)
    hb = await pool.heartbeat(agent, leases[:1])  # within grace: a report may lag the lease
    assert hb.stop == [] and (await pool.job(job.id)).job.state == "running"
    pool.clock.advance(6)
    await pool.heartbeat(agent, leases[:1])
    detail = await pool.job(job.id)
    assert detail.job.state == "failed"
    assert detail.job.reason == "rank 1 lost: agent agent-1 no longer runs it"


async def test_monitor_loop_runs_the_checks(pool: Pool) -> None:
    job, _, _ = await _running(pool)
    pool.clock.advance(11)
    changed = pool.core.changes.current()
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(scheduler.monitor, pool.core, period=0.01))
            await changed.wait()
            nursery.cancel_scope.cancel()
    assert (await pool.job(job.id)).job.state == "failed"
