"""Restart storms (issue 34): a rank that fails the same way again and again must not burn its
job's restarts in seconds. Quick losses in a row back off (exponential, jittered, capped); the
same failure on two agents, or three times in a row, ends the job at once with that reason; a
sealed message that does not open is an integrity failure counted against its relay and agent,
not a lost rank."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from coord_helpers import Agent, FakeClock, Pool, open_pool

from vpool.coordinator import scheduler
from vpool.coordinator.scheduler import RestartPolicy, repeated_failure
from vpool.protocol import api

POLICY = RestartPolicy(backoff_first=1.0, backoff_max=8.0, quick=60.0, jitter=0.5)
UNOPENED = (
    "message 1 from rank 0 to rank 1 of job 1 does not open with the job's key: "
    "it was changed on its way"
)


# -- the rules, as pure functions -------------------------------------------------------------


def test_the_first_quick_loss_restarts_at_once_then_the_wait_doubles_to_its_cap() -> None:
    assert restart_delay_range(0) == restart_delay_range(1) == (0.0, 0.0)
    assert [restart_delay_range(n) for n in (2, 3, 4, 5, 6, 40)] == [
        (1.0, 1.5),
        (2.0, 3.0),
        (4.0, 6.0),
        (8.0, 12.0),
        (8.0, 12.0),
        (8.0, 12.0),
    ]
    # The jitter spreads the ranks of one job lost together.
    assert len({scheduler.restart_delay(3, POLICY, d / 10) for d in range(10)}) == 10


def restart_delay_range(streak: int) -> tuple[float, float]:
    """The least and (almost) the most ``restart_delay`` gives for ``streak``."""
    return (
        scheduler.restart_delay(streak, POLICY, 0.0),
        round(scheduler.restart_delay(streak, POLICY, 0.999999), 3),
    )


@pytest.mark.parametrize(
    ("history", "ends"),
    [
        ([], ""),
        ([("a", "")], ""),
        ([("a", "S")], ""),
        ([("b", "S"), ("a", "S")], "rank 3 failed the same way on agents a and b: S"),
        ([("b", "S"), ("c", ""), ("a", "S")], "rank 3 failed the same way on agents a and b: S"),
        ([("b", "S"), ("a", "T")], ""),
        ([("a", "S"), ("a", "S")], ""),
        (
            [("a", "S"), ("a", "S"), ("a", "S")],
            "rank 3 failed the same way 3 times in a row on agent a: S",
        ),
        ([("a", "S"), ("a", ""), ("a", "S")], ""),
        ([("a", ""), ("b", "S"), ("a", "S")], ""),  # the newest did not say how it failed
    ],
)  # fmt: skip
def test_a_failure_repeated_on_two_agents_or_three_times_in_a_row_ends_the_job(
    history: list[tuple[str, str]], ends: str
) -> None:
    assert repeated_failure(3, history) == ends


# -- in a coordinator -------------------------------------------------------------------------


async def _start(pool: Pool, agents: int = 2) -> tuple[list[Agent], api.Lease, int]:
    """A 1-rank job running on the first of ``agents`` agents (1 slot each)."""
    await pool.register_relay("relay-0")
    job = await pool.submit(1)
    enrolled = [await pool.enroll(f"agent-{i + 1}", slots=1) for i in range(agents)]
    [lease] = await pool.lease(enrolled[0], free=1)
    await pool.heartbeat(enrolled[0], [lease], free=0)
    return enrolled, lease, job.id


async def _problem(pool: Pool, agent: Agent, lease: api.Lease, **kw: str) -> None:
    pr = api.RankProblem(
        job=lease.job,
        rank=lease.rank,
        incarnation=lease.incarnation,
        message=kw.pop("message", "rank 0 of job 1 cannot start: something broke"),
        **kw,
    )
    r = await pool.post("/api/v1/agents/problem", pr, agent.headers)
    assert r.status_code == 200, r.text


async def _crash(pool: Pool, agent: Agent, lease: api.Lease, sig: signal.Signals) -> None:
    ex = api.RankExit(
        job=lease.job, rank=lease.rank, incarnation=lease.incarnation, code=-int(sig), lost=True
    )
    r = await pool.post("/api/v1/agents/exit", ex, agent.headers)
    assert r.status_code == 200, r.text


async def _placed(pool: Pool, agents: list[Agent]) -> tuple[Agent, api.Lease] | None:
    """Schedule, then the lease one of ``agents`` gets (and runs), if any."""
    await pool.core.schedule()
    for agent in agents:
        leases = await pool.lease(agent, free=1)
        if leases:
            await pool.heartbeat(agent, leases, free=0)
            return agent, leases[0]
    return None


async def _placed_after(
    pool: Pool, clock: FakeClock, agents: list[Agent], least: float, most: float
) -> tuple[Agent, api.Lease]:
    """The replacement is not placed before ``least`` seconds and is by ``most``."""
    if least > 0:
        clock.advance(least * 0.999)
        assert await _placed(pool, agents) is None, f"placed before {least:g} s"
        clock.advance(most - least * 0.999)
    else:
        clock.advance(most)
    placed = await _placed(pool, agents)
    assert placed is not None, f"not placed within {most:g} s"
    return placed


def _settings(**kw: object) -> dict[str, object]:
    return {
        "restart_backoff_first": POLICY.backoff_first,
        "restart_backoff_max": POLICY.backoff_max,
        "restart_quick": POLICY.quick,
        **kw,
    }


async def test_quick_losses_in_a_row_back_off_and_a_long_run_resets_the_streak(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    async with open_pool(tmp_path, clock, **_settings()) as pool:
        agents, lease, job = await _start(pool)
        agent = agents[0]
        # Killed by SIGKILL again and again (no failure to compare: only the backoff holds it).
        for streak, (least, most) in enumerate([(0, 0), (1, 1.5), (2, 3), (4, 6), (8, 12)], 1):
            await _crash(pool, agent, lease, signal.SIGKILL)
            agent, lease = await _placed_after(pool, clock, agents, least, most)
            assert lease.incarnation == streak + 1
        detail = await pool.job(job)
        assert detail.job.state == "running" and detail.job.restarts == 5
        lost = [e.message for e in detail.events if e.kind == "rank_lost"]
        assert "lost 5 times in a row soon after starting: restarting in" in lost[-1]
        assert "in a row" not in lost[0]

        clock.advance(POLICY.quick)  # ran a while: its loss ends the streak
        for least, most in [(0, 0), (0, 0), (1, 1.5)]:
            await _crash(pool, agent, lease, signal.SIGKILL)
            agent, lease = await _placed_after(pool, clock, agents, least, most)


async def test_the_same_failure_on_two_agents_ends_the_job_at_the_second(tmp_path: Path) -> None:
    clock = FakeClock()
    async with open_pool(tmp_path, clock, **_settings()) as pool:
        agents, lease, job = await _start(pool)
        failure = "cannot start: the environment's numpy does not import"
        await _problem(pool, agents[0], lease, failure=failure)
        agent, lease = await _placed_after(pool, clock, agents, 0, 0)
        assert agent is agents[1]  # the suspect agent is avoided
        await _problem(pool, agent, lease, failure=failure)
        detail = await pool.job(job)
        assert detail.job.state == "failed" and detail.job.restarts == 1
        assert detail.job.reason == (
            f"rank 0 failed the same way on agents agent-1 and agent-2: {failure}"
        )
        await pool.core.schedule()
        assert await pool.lease(agents[0], free=1) == []


async def test_two_agents_of_one_name_are_two_agents(tmp_path: Path) -> None:
    clock = FakeClock()
    async with open_pool(tmp_path, clock, **_settings()) as pool:
        await pool.register_relay("relay-0")
        job = (await pool.submit(1)).id
        agents = [await pool.enroll("laptop", slots=1) for _ in range(2)]
        failure = "cannot start: the bundle's entry app.py is not in it"
        placed = await _placed(pool, agents)
        assert placed is not None
        agent, lease = placed
        await _problem(pool, agent, lease, failure=failure)
        other, lease = await _placed_after(pool, clock, agents, 0, 0)
        assert other is not agent
        await _problem(pool, other, lease, failure=failure)
        detail = await pool.job(job)
        assert detail.job.state == "failed"
        assert detail.job.reason == (
            f"rank 0 failed the same way on agents laptop ({agent.id}) and laptop ({other.id}): "
            f"{failure}"
        )


async def test_the_same_failure_three_times_on_a_lone_agent_ends_the_job_after_the_backoff(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    async with open_pool(tmp_path, clock, **_settings()) as pool:
        agents, lease, job = await _start(pool, agents=1)
        failure = "cannot start: the bundle's entry app.py is not in it"
        started = [clock()]
        for least, most in [(0, 0), (1, 1.5)]:
            await _problem(pool, agents[0], lease, failure=failure)
            _, lease = await _placed_after(pool, clock, agents, least, most)
            started.append(clock())
        assert started[2] - started[1] >= POLICY.backoff_first
        await _problem(pool, agents[0], lease, failure=failure)
        detail = await pool.job(job)
        assert detail.job.state == "failed" and detail.job.restarts == 2
        assert detail.job.reason == (
            f"rank 0 failed the same way 3 times in a row on agent agent-1: {failure}"
        )


async def test_kills_say_nothing_of_how_a_rank_failed_so_they_only_back_off(
    tmp_path: Path,
) -> None:
    """A rank killed by a signal its agent did not send (a volunteer, the OOM killer), again
    and again: no failure to compare, so the job goes on, backing off (a crash of the program
    itself is an error exit, which ends its job as under mpiexec)."""
    clock = FakeClock()
    async with open_pool(tmp_path, clock, **_settings()) as pool:
        agents, lease, job = await _start(pool)
        agent = agents[0]
        for least, most in [(0, 0), (1, 1.5), (2, 3), (4, 6)]:
            await _crash(pool, agent, lease, signal.SIGKILL)
            agent, lease = await _placed_after(pool, clock, agents, least, most)
        assert (await pool.job(job)).job.state == "running"


async def test_a_message_that_does_not_open_is_counted_against_its_relay_and_agent(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    async with open_pool(tmp_path, clock, max_restarts=0, **_settings()) as pool:
        agents, lease, job = await _start(pool)
        message = f"relay relay-0 (127.0.0.1:7000): {UNOPENED}"
        await _problem(
            pool, agents[0], lease, message=message, failure=UNOPENED, unopened_from="relay-0"
        )
        detail = await pool.job(job)
        # Not a lost rank: no restart spent (max_restarts is 0), an event of its own.
        assert detail.job.state == "running" and detail.job.restarts == 0
        [event] = [e for e in detail.events if e.kind == "integrity_failure"]
        assert event.message == (
            "rank 0: a message relay relay-0 pushed did not open at agent agent-1 (counted "
            f"against relay relay-0 and agent agent-1, not as a lost rank): {UNOPENED}"
        )
        assert not [e for e in detail.events if e.kind == "rank_lost"]
        operator = pool.add_user("olga", role="operator")
        listed = await pool.client.get("/api/v1/pool/agents", headers=operator)
        counts = {a["name"]: a["integrity_failures"] for a in listed.json()}
        assert counts == {"agent-1": 1, "agent-2": 0}
        relays = await pool.client.get("/api/v1/pool/relays", headers=operator)
        assert [(r["name"], r["integrity_failures"]) for r in relays.json()] == [("relay-0", 1)]

        # The replacement goes to the other agent; the same message fails there too: the
        # relay's copy is bad (or every agent's software is), and the job ends with why.
        agent, lease = await _placed_after(pool, clock, agents, 0, 0)
        assert agent is agents[1]
        await _problem(
            pool, agent, lease, message=message, failure=UNOPENED, unopened_from="relay-0"
        )
        detail = await pool.job(job)
        assert detail.job.state == "failed"
        assert detail.job.reason == (
            f"rank 0 failed the same way on agents agent-1 and agent-2: {UNOPENED}"
        )


async def test_an_agent_blaming_a_relay_of_another_job_loses_the_rank_as_usual(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    async with open_pool(tmp_path, clock, **_settings()) as pool:
        agents, lease, job = await _start(pool)
        await _problem(pool, agents[0], lease, failure=UNOPENED, unopened_from="relay-9")
        detail = await pool.job(job)
        assert detail.job.restarts == 1
        assert [e.kind for e in detail.events if e.kind in ("rank_lost", "integrity_failure")] == [
            "rank_lost"
        ]
        operator = pool.add_user("olga", role="operator")
        listed = await pool.client.get("/api/v1/pool/agents", headers=operator)
        assert {a["integrity_failures"] for a in listed.json()} == {0}
