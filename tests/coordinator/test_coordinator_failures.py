"""Lost agents, relays and ranks: lost incarnations are replaced (events name the rank, machine
and cause); relays that stay down too long fail their jobs."""

from __future__ import annotations

from functools import partial

import msgspec
import trio
from coord_helpers import Agent, Pool, relay_headers

from vpool.coordinator import scheduler
from vpool.protocol import api
from vpool.protocol.tokens import RankClaims, verify_token


async def _running(
    pool: Pool, ranks: int = 2, slots: int | None = None
) -> tuple[api.JobInfo, Agent, list[api.Lease]]:
    await pool.register_relay("relay-0")
    job = await pool.submit(ranks)
    agent = await pool.enroll("agent-1", slots=slots or ranks)
    leases = await pool.lease(agent)
    await pool.heartbeat(agent, leases)
    return job, agent, leases


async def test_agent_heartbeat_timeout_replaces_its_ranks_elsewhere(pool: Pool) -> None:
    job, agent, leases = await _running(pool)
    other = await pool.enroll("agent-2", slots=2)
    pool.clock.advance(5)
    await pool.relay_heartbeat("relay-0")
    await pool.heartbeat(other, [])
    await pool.core.check_timeouts()
    assert (await pool.job(job.id)).job.state == "running"

    pool.clock.advance(6)  # 11 s since agent-1's last call, 6 since the others'
    await pool.core.check_timeouts()
    detail = await pool.job(job.id)
    assert detail.job.state == "running"
    assert [(x.incarnation, x.state) for x in detail.ranks] == [(2, "leased"), (2, "leased")]
    lost = [e for e in detail.events if e.kind == "rank_lost"]
    assert [e.message for e in lost] == [
        "rank 0 lost: agent agent-1 stopped heartbeating",
        "rank 1 lost: agent agent-1 stopped heartbeating",
    ]
    restarted = [e.message for e in detail.events if e.kind == "rank_restarted"]
    assert restarted == [
        "rank 0 incarnation 2 on agent agent-2",
        "rank 1 incarnation 2 on agent agent-2",
    ]
    fresh = await pool.lease(other)
    assert [(x.rank, x.incarnation) for x in fresh] == [(0, 2), (1, 2)]
    assert [x.homes for x in fresh] == [leases[0].homes, leases[1].homes]
    claims = verify_token(
        fresh[1].token, pool.core.key.public_key(), now=pool.clock(), kind=RankClaims
    )
    assert (claims.rank, claims.incarnation, claims.agent) == (1, 2, other.id)

    # agent-1 comes back: it is told to stop the replaced incarnations, and is alive again.
    hb = await pool.heartbeat(agent, leases)
    assert [s.reason for s in hb.stop] == ["incarnation 1 was replaced by incarnation 2"] * 2
    assert pool.core.store.list_agents()[0]["state"] == "alive"
    assert (await pool.job(job.id)).job.state == "running"


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


async def test_relay_heartbeat_timeout_is_not_a_job_failure(pool: Pool) -> None:
    job, agent, leases = await _running(pool, slots=3)
    pool.clock.advance(11)
    await pool.heartbeat(agent, leases)
    await pool.core.check_timeouts()
    detail = await pool.job(job.id)
    assert detail.job.state == "running"
    assert [e.message for e in detail.events if e.kind == "relay_down"] == [
        "relay relay-0 stopped heartbeating; the job waits up to 300 s for it to come back"
    ]
    # No live relay: new jobs wait.
    job2 = await pool.submit(1)
    assert await pool.lease(agent) == []
    assert (await pool.job(job2.id)).job.state == "queued"
    # The relay comes back (restarted on its disk: it registers again): the job goes on, new
    # jobs are placed.
    await pool.register_relay("relay-0")
    await pool.relay_heartbeat("relay-0")
    ups = [e.message for e in (await pool.job(job.id)).events if e.kind == "relay_up"]
    assert ups == ["relay relay-0 is back"]
    assert len(await pool.lease(agent, free=2)) == 1


async def test_relay_down_for_too_long_fails_its_jobs(pool: Pool) -> None:
    job, agent, leases = await _running(pool)
    for _ in range(30):  # 300 s of agent heartbeats, no relay heartbeat
        pool.clock.advance(10)
        await pool.heartbeat(agent, leases)
        await pool.core.check_timeouts()
    assert (await pool.job(job.id)).job.state == "running"
    pool.clock.advance(1)
    await pool.heartbeat(agent, leases)
    await pool.core.check_timeouts()
    detail = await pool.job(job.id)
    assert detail.job.state == "failed" and detail.job.exit_code is None
    assert detail.job.reason == (
        "relay relay-0 stopped heartbeating and did not come back within 300 s"
    )


async def _relay_lost(pool: Pool, job: int, rank: int, incarnation: int) -> None:
    report = api.RelayLost(
        name="relay-0",
        lost=[
            api.RankLost(job=job, rank=rank, incarnation=incarnation, reason="connection dropped")
        ],
    )
    r = await pool.client.post(
        "/api/v1/relays/lost",
        content=msgspec.json.encode(report),
        headers=relay_headers(),
    )
    assert r.status_code == 200, r.text


async def test_relay_lost_report_replaces_the_rank_on_another_agent(pool: Pool) -> None:
    job, agent, leases = await _running(pool)
    other = await pool.enroll("agent-2", slots=1)
    await _relay_lost(pool, job.id, 1, leases[1].incarnation)
    detail = await pool.job(job.id)
    assert detail.job.state == "running"
    lost = [e for e in detail.events if e.kind == "rank_lost"]
    assert [(e.rank, e.message) for e in lost] == [
        (1, "rank 1 (on agent agent-1) lost: relay relay-0 reported: connection dropped")
    ]
    # agent-1 has a free slot again (per its report), but it is suspect: agent-2 gets it.
    assert await pool.lease(agent, free=1) == []
    assert [(x.rank, x.incarnation) for x in await pool.lease(other)] == [(1, 2)]
    assert detail.ranks[1].incarnation == 2


async def test_relay_lost_report_may_reuse_the_same_agent_if_alone(pool: Pool) -> None:
    await pool.register_relay("relay-0")
    job = await pool.submit(2)
    agent = await pool.enroll("agent-1", slots=3)
    leases = await pool.lease(agent)
    await pool.heartbeat(agent, leases)
    await _relay_lost(pool, job.id, 0, 1)
    again = await pool.lease(agent)
    assert [(x.rank, x.incarnation) for x in again] == [(0, 2)]


async def test_stale_relay_lost_report_is_ignored(pool: Pool) -> None:
    job, _, _ = await _running(pool)
    report = api.RelayLost(
        name="relay-0", lost=[api.RankLost(job=job.id, rank=1, incarnation=99, reason="old")]
    )
    await pool.client.post(
        "/api/v1/relays/lost",
        content=msgspec.json.encode(report),
        headers=relay_headers(),
    )
    assert (await pool.job(job.id)).job.state == "running"


async def test_rank_problem_replaces_the_rank(pool: Pool) -> None:
    job, agent, _ = await _running(pool)
    problem = api.RankProblem(job=job.id, rank=0, incarnation=1, message="relay unreachable")
    r = await pool.client.post(
        "/api/v1/agents/problem", content=msgspec.json.encode(problem), headers=agent.headers
    )
    assert r.status_code == 200
    detail = await pool.job(job.id)
    assert detail.job.state == "running"
    lost = [e.message for e in detail.events if e.kind == "rank_lost"]
    assert lost == ["rank 0 lost: agent agent-1 reported: relay unreachable"]
    # The only agent with a free slot is the suspect one: better there than nowhere.
    assert (detail.ranks[0].incarnation, detail.ranks[0].state) == (2, "leased")
    restarted = [e.message for e in detail.events if e.kind == "rank_restarted"]
    assert restarted == ["rank 0 incarnation 2 on agent agent-1"]


async def test_expired_agent_token_is_refused(pool: Pool) -> None:
    _, agent, _ = await _running(pool, 1)
    pool.clock.advance(2 * 24 * 3600)
    r = await pool.client.post(
        "/api/v1/agents/lease", content=b'{"free_slots": 1, "wait": 0}', headers=agent.headers
    )
    assert r.status_code == 401 and r.json()["error"]["code"] == "expired_token"


async def test_rank_missing_from_heartbeats_is_replaced(pool: Pool) -> None:
    job, agent, leases = await _running(pool)
    pool.clock.advance(5)
    hb = await pool.heartbeat(agent, leases[:1])  # within grace: a report may lag the lease
    assert hb.stop == [] and (await pool.job(job.id)).job.state == "running"
    pool.clock.advance(6)
    await pool.heartbeat(agent, leases[:1], free=1)
    detail = await pool.job(job.id)
    assert detail.job.state == "running"
    lost = [e.message for e in detail.events if e.kind == "rank_lost"]
    assert lost == ["rank 1 lost: agent agent-1 no longer runs it"]
    # Only the process is gone, not the agent: the same agent may run the next incarnation.
    assert [(x.rank, x.incarnation) for x in await pool.lease(agent, free=1)] == [(1, 2)]


async def test_monitor_loop_runs_the_checks(pool: Pool) -> None:
    job, _, _ = await _running(pool)
    pool.clock.advance(11)
    changed = pool.core.changes.current()
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(scheduler.monitor, pool.core, period=0.01))
            await changed.wait()
            nursery.cancel_scope.cancel()
    detail = await pool.job(job.id)
    assert [x.state for x in detail.ranks] == ["pending", "pending"]
    assert sum(e.kind == "rank_lost" for e in detail.events) == 2


async def test_a_lease_its_agent_never_heard_of_is_offered_again_once(pool: Pool) -> None:
    """The answer carrying a lease can be lost on its way (an agent reports a rank from the
    moment it gets one): past the grace, a rank still 'leased' that its agent does not report
    is handed out again to the same agent, once, before it counts as lost."""
    await pool.register_relay()
    agent = await pool.enroll(slots=1)
    job = await pool.submit(1)
    [lost_on_the_way] = await pool.lease(agent)
    pool.clock.advance(11)
    await pool.heartbeat(agent, [], free=1)  # never heard of it
    detail = await pool.job(job.id)
    assert [e.kind for e in detail.events if e.kind in ("rank_lost", "lease_offered_again")] == [
        "lease_offered_again"
    ]
    assert (detail.ranks[0].incarnation, detail.ranks[0].state) == (1, "leased")
    [again] = await pool.lease(agent)
    assert again == lost_on_the_way  # the same lease, token and all
    pool.clock.advance(11)
    await pool.heartbeat(agent, [], free=1)  # lost again: now the rank is
    detail = await pool.job(job.id)
    lost = [e.message for e in detail.events if e.kind == "rank_lost"]
    assert lost == ["rank 0 lost: agent agent-1 no longer runs it"]
    [(rank, incarnation)] = [(x.rank, x.incarnation) for x in await pool.lease(agent)]
    assert (rank, incarnation) == (0, 2)


async def test_a_long_poll_whose_agent_went_away_takes_no_lease(pool: Pool) -> None:
    """An agent restarted while its lease long-poll waited: the leases placed meanwhile go to
    its next poll, not to the connection nobody reads (``Coordinator.lease(gone=...)``)."""
    await pool.register_relay()
    agent = await pool.enroll(slots=1)
    job = await pool.submit(1)

    async def gone() -> bool:
        return True

    answer = await pool.core.lease(agent.id, api.LeaseRequest(free_slots=1, wait=0), gone=gone)
    assert answer.leases == []
    [lease] = await pool.lease(agent)
    assert (lease.job, lease.rank, lease.incarnation) == (job.id, 0, 1)
