"""Fault tolerance on the coordinator's side: replacement incarnations, stale incarnations,
output dedup across incarnations, divergence reports, replay events, restart caps, and a
coordinator restart over the same state directory."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import trio
from coord_helpers import (
    Agent,
    FakeClock,
    Pool,
    decode,
    make_zip,
    open_pool,
    relay_headers,
)

from vpool.config import SettingsError
from vpool.coordinator import scheduler, settings
from vpool.protocol import api

RELAY = relay_headers()


async def _running(pool: Pool, ranks: int = 2, slots: int = 3) -> tuple[Agent, list[api.Lease]]:
    await pool.register_relay("relay-0")
    await pool.submit(ranks)
    agent = await pool.enroll("agent-1", slots=slots)
    leases = await pool.lease(agent)
    await pool.heartbeat(agent, leases)
    return agent, leases


async def _lost_exit(pool: Pool, agent: Agent, lease: api.Lease, code: int = -9) -> None:
    ex = api.RankExit(
        job=lease.job, rank=lease.rank, incarnation=lease.incarnation, code=code, lost=True
    )
    r = await pool.post("/api/v1/agents/exit", ex, agent.headers)
    assert r.status_code == 200, r.text


def _events(detail: api.JobDetail, kind: str) -> list[str]:
    return [e.message for e in detail.events if e.kind == kind]


async def test_lost_process_is_restarted_and_wakes_the_lease_long_poll(pool: Pool) -> None:
    agent, leases = await _running(pool)
    got: list[list[api.Lease]] = []

    async def poll() -> None:
        got.append(await pool.lease(agent, free=1, wait=30.0))

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(poll)
            await trio.testing.wait_all_tasks_blocked()
            await _lost_exit(pool, agent, leases[1])
    assert [(x.rank, x.incarnation) for x in got[0]] == [(1, 2)]
    detail = await pool.job(leases[0].job)
    assert detail.job.state == "running"
    assert _events(detail, "rank_lost") == [
        "rank 1 lost: its process on agent agent-1 died (killed by signal 9)"
    ]
    assert _events(detail, "rank_restarted") == ["rank 1 incarnation 2 on agent agent-1"]


async def test_stale_incarnation_is_fenced_and_success_needs_the_current_ones(
    pool: Pool,
) -> None:
    agent, leases = await _running(pool)
    job = leases[0].job
    await _lost_exit(pool, agent, leases[0])
    (fresh,) = await pool.lease(agent, free=1)
    await pool.heartbeat(agent, [fresh, leases[1]])

    # A replaced incarnation's reports change nothing: not its exit, not its problems.
    stale = api.RankExit(job=job, rank=0, incarnation=1, code=3)
    assert (await pool.post("/api/v1/agents/exit", stale, agent.headers)).status_code == 200
    problem = api.RankProblem(job=job, rank=0, incarnation=1, message="late")
    assert (await pool.post("/api/v1/agents/problem", problem, agent.headers)).status_code == 200
    hb = await pool.heartbeat(agent, [leases[0], fresh, leases[1]])
    assert [(s.rank, s.incarnation) for s in hb.stop] == [(0, 1)]
    detail = await pool.job(job)
    assert detail.job.state == "running"
    # Its exit was already recorded (the lost one): the late duplicate is no event.
    assert _events(detail, "rank_fenced") == []

    await pool.exit(agent, leases[1], 0)
    await pool.exit(agent, fresh, 0)
    detail = await pool.job(job)
    assert detail.job.state == "succeeded"
    assert [(x.rank, x.incarnation, x.exit_code) for x in detail.ranks] == [(0, 2, 0), (1, 1, 0)]


async def test_exit_of_a_replaced_incarnation_is_a_fenced_event(pool: Pool) -> None:
    agent, leases = await _running(pool)
    other = await pool.enroll("agent-2", slots=2)
    job = leases[0].job
    report = api.RelayLost(
        name="relay-0", lost=[api.RankLost(job=job, rank=1, incarnation=1, reason="dropped")]
    )
    assert (await pool.post("/api/v1/relays/lost", report, RELAY)).status_code == 200
    (fresh,) = await pool.lease(other)
    assert (fresh.rank, fresh.incarnation) == (1, 2)
    # The old incarnation still runs on agent-1 and exits with an error after being stopped.
    await pool.exit(agent, leases[1], 143)
    await pool.exit(agent, leases[1], 143)  # repeated: one event
    detail = await pool.job(job)
    assert detail.job.state == "running"
    assert _events(detail, "rank_fenced") == [
        "rank 1 incarnation 1 on agent agent-1 exited with code 143 after it was replaced "
        "by incarnation 2; ignored"
    ]
    # Its results are not the job's; the current incarnation's are.
    stale_zip = make_zip({"out.txt": b"stale"})
    fresh_zip = make_zip({"out.txt": b"fresh"})
    for who, lease, data in ((agent, leases[1], stale_zip), (other, fresh, fresh_zip)):
        url = f"/api/v1/agents/results/{job}/1/{lease.incarnation}"
        r = await pool.client.put(url, content=data, headers=who.headers)
        assert r.status_code == 200, r.text
    blobs = pool.core.store.job_results(job)
    assert pool.core.blobs.path(blobs[1]).read_bytes() == fresh_zip


async def test_output_is_not_shown_twice_across_incarnations(pool: Pool) -> None:
    agent, leases = await _running(pool)
    job = leases[0].job
    await pool.output(agent, leases[0], "stdout", 0, b"hello\n")
    await pool.output(agent, leases[0], "stdout", 6, b"world\n")
    await pool.output(agent, leases[0], "stdout", 0, b"hello\n")  # re-sent: nothing new
    await _lost_exit(pool, agent, leases[0])
    (fresh,) = await pool.lease(agent, free=1)
    # The replaying incarnation prints everything again, then more.
    assert (await pool.output(agent, fresh, "stdout", 0, b"hello\nwo")).status_code == 200
    await pool.output(agent, fresh, "stdout", 8, b"rld\nmore\n")
    await pool.output(agent, fresh, "stderr", 0, b"warn\n")
    # The replaced incarnation's late output is dropped.
    assert (await pool.output(agent, leases[0], "stdout", 12, b"late\n")).status_code == 200
    r = await pool.client.get(f"/api/v1/jobs/{job}/output?after=0", headers=pool.user())
    page = decode(r, api.OutputPage)
    stdout = b"".join(x.data for x in page.records if x.stream == "stdout")
    assert stdout == b"hello\nworld\nmore\n"
    assert [x.data for x in page.records] == [b"hello\n", b"world\n", b"more\n", b"warn\n"]
    assert [x.id for x in page.records] == sorted(x.id for x in page.records)
    streams = pool.core.store.output_streams(job)
    assert streams[(0, "stdout")] == b"hello\nworld\nmore\n"


async def test_replacements_go_before_queued_jobs(pool: Pool) -> None:
    agent, leases = await _running(pool, ranks=2, slots=2)
    queued = await pool.submit(1)
    await _lost_exit(pool, agent, leases[0])
    got = await pool.lease(agent, free=1)
    assert [(x.job, x.rank, x.incarnation) for x in got] == [(leases[0].job, 0, 2)]
    assert (await pool.job(queued.id)).job.state == "queued"


async def test_max_restarts_fails_the_job(tmp_path: Path) -> None:
    async with open_pool(tmp_path, FakeClock(), max_restarts=1) as pool:
        agent, leases = await _running(pool)
        await _lost_exit(pool, agent, leases[0])
        (fresh,) = await pool.lease(agent, free=1)
        await _lost_exit(pool, agent, fresh)
        detail = await pool.job(leases[0].job)
        assert detail.job.state == "failed" and detail.job.exit_code is None
        assert detail.job.reason == (
            "rank 0 lost: its process on agent agent-1 died (killed by signal 9) "
            "(not restarted: the job had 1 restarts, max_restarts is 1)"
        )
        assert [x.state for x in detail.ranks] == ["lost", "killed"]
        assert await pool.lease(agent) == []


async def test_relay_diverged_fails_the_job_and_stops_every_rank(pool: Pool) -> None:
    agent, leases = await _running(pool)
    job = leases[0].job
    message = (
        "program is not deterministic: rank 1 re-sent message 5 to rank 0 (channel 1->0) "
        "with different content"
    )
    report = api.RelayDiverged(name="relay-0", job=job, rank=1, incarnation=2, message=message)
    assert (await pool.post("/api/v1/relays/diverged", report, {})).status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    assert (await pool.post("/api/v1/relays/diverged", report, wrong)).status_code == 401
    bad = await pool.client.post("/api/v1/relays/diverged", content=b"{}", headers=RELAY)
    assert bad.status_code == 422 and bad.json()["error"]["code"] == "bad_request"
    stranger = msgspec.structs.replace(report, name="relay-9")
    r = await pool.post("/api/v1/relays/diverged", stranger, relay_headers("relay-9"))
    assert r.status_code == 403 and r.json()["error"]["code"] == "not_your_job"
    r = await pool.post("/api/v1/relays/diverged", stranger, RELAY)  # relay-0 posing as relay-9
    assert r.status_code == 403 and r.json()["error"]["code"] == "not_your_name"
    r = await pool.post("/api/v1/relays/diverged", report, RELAY)
    assert r.status_code == 200, r.text
    detail = await pool.job(job)
    assert detail.job.state == "failed" and detail.job.reason == message
    assert _events(detail, "job_failed") == [f"relay relay-0, rank 1 incarnation 2: {message}"]
    hb = await pool.heartbeat(agent, leases)
    assert [s.reason for s in hb.stop] == [f"job failed: {message}"] * 2
    # Repeated or about an unknown job: accepted, nothing changes.
    assert (await pool.post("/api/v1/relays/diverged", report, RELAY)).status_code == 200
    unknown = msgspec.structs.replace(report, job=999)
    assert (await pool.post("/api/v1/relays/diverged", unknown, RELAY)).status_code == 200
    assert len(_events(await pool.job(job), "job_failed")) == 1


async def test_replaying_incarnation_is_an_event_once(pool: Pool) -> None:
    agent, leases = await _running(pool)
    await _lost_exit(pool, agent, leases[1])
    (fresh,) = await pool.lease(agent, free=1)
    states = [
        api.RankState(job=x.job, rank=x.rank, incarnation=x.incarnation, state="running")
        for x in leases[:1]
    ] + [
        api.RankState(job=fresh.job, rank=1, incarnation=2, state="running", replay_dets=7),
    ]
    hb = api.AgentHeartbeat(ranks=states, free_slots=1)
    for _ in range(2):
        assert (await pool.post("/api/v1/agents/heartbeat", hb, agent.headers)).status_code == 200
    detail = await pool.job(fresh.job)
    assert _events(detail, "rank_replaying") == [
        "rank 1 incarnation 2 replays its logged messages and 7 determinant frames"
    ]
    assert detail.ranks[1].state == "running"


async def test_coordinator_restart_keeps_jobs_and_gives_grace(tmp_path: Path) -> None:
    clock = FakeClock()
    async with open_pool(tmp_path, clock) as pool:
        agent, leases = await _running(pool)
        await _lost_exit(pool, agent, leases[1])
        (fresh,) = await pool.lease(agent, free=1)
        await pool.heartbeat(agent, [leases[0], fresh])
        job = leases[0].job
        before = await pool.job(job)
        user = pool.users["alice"]

    clock.advance(60)  # the coordinator was down for a minute
    async with open_pool(tmp_path, clock) as pool:
        pool.users["alice"] = user
        await pool.core.check_timeouts()
        detail = await pool.job(job)
        assert detail.job.state == "running"
        assert detail.ranks == before.ranks
        assert [(x.incarnation, x.state) for x in detail.ranks] == [(1, "running"), (2, "running")]
        hb = await pool.heartbeat(agent, [leases[0], fresh])
        assert hb.stop == [] and hb.agent_token
        await pool.relay_heartbeat("relay-0")
        clock.advance(9)
        await pool.core.check_timeouts()
        assert _events(await pool.job(job), "rank_lost") == _events(before, "rank_lost")
        # Grace is one timeout, not forever.
        clock.advance(2)
        await pool.relay_heartbeat("relay-0")
        await pool.core.check_timeouts()
        assert len(_events(await pool.job(job), "rank_lost")) == 3


def test_agent_timeout_is_at_most_15_seconds() -> None:
    assert settings.load(agent_timeout=15).agent_timeout == 15
    with pytest.raises(SettingsError, match=r"agent_timeout must be .* at most 15"):
        settings.load(agent_timeout=20)
    with pytest.raises(SettingsError, match="max_restarts"):
        settings.load(max_restarts=-1)


def test_pick_agent_prefers_another_agent_than_a_suspect_one() -> None:
    assert scheduler.pick_agent({"a": 3, "b": 1}, None) == "a"
    assert scheduler.pick_agent({"a": 3, "b": 1}, "a") == "b"
    assert scheduler.pick_agent({"a": 3, "b": 0}, "a") == "a"
    assert scheduler.pick_agent({"a": 0}, None) is None
