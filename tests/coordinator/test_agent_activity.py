"""Volunteers' machines come and go (issue 22): agents say what their volunteer lets them do
(``AgentHeartbeat.activity``), and the coordinator plans around it. Only available agents get
ranks; suspended ranks are events, and replaced once suspended past the pool's limit and a
grace; an agent that said it was leaving and went silent is gone, not lost."""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import sqlite_utils
from ckpt_helpers import FP_Z, commit, image
from click.testing import CliRunner
from coord_helpers import HELLO, SANDBOX, Agent, Pool, decode, make_zip, open_pool

from vpool.coordinator import cli, migrations, scheduler
from vpool.protocol import api

Frozen = tuple[api.Lease, float]  # a rank reported suspended for so many seconds


async def beat(
    pool: Pool,
    agent: Agent,
    ranks: list[api.Lease] | None = None,
    *,
    frozen: list[Frozen] | None = None,
    activity: str = "available",
    reason: str = "",
    free: int = 2,
    criu: str = "",
) -> api.AgentHeartbeatResponse:
    """A heartbeat listing ``ranks`` as running and ``frozen`` as suspended."""
    states = [
        api.RankState(job=x.job, rank=x.rank, incarnation=x.incarnation, state="running")
        for x in ranks or []
    ] + [
        api.RankState(
            job=x.job, rank=x.rank, incarnation=x.incarnation, state="suspended", suspended_for=s
        )
        for x, s in frozen or []
    ]
    hb = api.AgentHeartbeat(
        ranks=states,
        free_slots=free,
        isolation=SANDBOX,
        activity=activity,
        activity_reason=reason,
        criu=criu,
        fingerprint=FP_Z if criu else "",
    )
    r = await pool.post("/api/v1/agents/heartbeat", hb, agent.headers)
    return decode(r, api.AgentHeartbeatResponse)


def events(detail: api.JobDetail, *kinds: str) -> list[str]:
    return [e.message for e in detail.events if e.kind in kinds]


async def agents(pool: Pool, user: str = "ops") -> dict[str, api.AgentInfo]:
    headers = pool.add_user(user, "operator") if user not in pool.users else pool.user(user)
    r = await pool.client.get("/api/v1/pool/agents", headers=headers)
    return {a.name: a for a in decode(r, list[api.AgentInfo])}


async def running(pool: Pool, slots: int = 1) -> tuple[api.JobInfo, Agent, list[api.Lease]]:
    """A one-rank job running on agent-1."""
    await pool.register_relay("relay-0")
    job = await pool.submit(1)
    agent = await pool.enroll("agent-1", slots=slots)
    leases = await pool.lease(agent)
    assert len(leases) == 1
    await beat(pool, agent, leases, free=slots - 1)
    return job, agent, leases


async def passes(
    pool: Pool, seconds: float, step: float, *beats: Callable[[], Awaitable[object]]
) -> None:
    """``seconds`` of fake time in ``step``s; each step every heartbeat of ``beats`` and the
    relay's are sent, then timeouts are checked."""
    left = seconds
    while left > 0:
        pool.clock.advance(min(step, left))
        left -= step
        await pool.relay_heartbeat("relay-0")
        for b in beats:
            await b()
        await pool.core.check_timeouts()


# -- placement --------------------------------------------------------------------------------


async def test_a_suspended_agent_gets_no_new_ranks_whatever_slots_it_says(pool: Pool) -> None:
    await pool.register_relay("relay-0")
    agent = await pool.enroll("agent-1", slots=2)
    await beat(pool, agent, activity="suspended", reason="the owner is using the machine", free=2)
    job = await pool.submit(2)
    assert await pool.lease(agent, free=2) == []
    info = (await pool.job(job.id)).job
    assert info.state == "queued" and not info.never_fits
    assert info.waiting == (
        "needs 2 slots; 0 are free now (0 run other ranks, 2 are on agents whose volunteers "
        "need their machines now)"
    )
    # Leaving: no new work either.
    await beat(pool, agent, activity="leaving", reason="stopping", free=2)
    assert await pool.lease(agent, free=2) == []
    # Available again: the job is placed there.
    await beat(pool, agent, free=2)
    assert len(await pool.lease(agent, free=2)) == 2
    assert (await pool.job(job.id)).job.state == "running"


async def test_new_ranks_go_to_available_agents_only(pool: Pool) -> None:
    await pool.register_relay("relay-0")
    away = await pool.enroll("away", slots=4)
    here = await pool.enroll("here", slots=2)
    await beat(pool, away, activity="suspended", reason="on battery", free=4)
    job = await pool.submit(2)
    assert await pool.lease(away) == []
    assert [x.rank for x in await pool.lease(here)] == [0, 1]
    assert (await pool.job(job.id)).job.state == "running"


async def test_among_equals_the_agent_available_longest_gets_the_rank(pool: Pool) -> None:
    await pool.register_relay("relay-0")
    first = await pool.enroll("first", slots=1)
    second = await pool.enroll("second", slots=1)
    pool.clock.advance(5)
    await beat(pool, first, activity="suspended", reason="paused", free=1)
    pool.clock.advance(1)
    await beat(pool, first, free=1)  # available again, since now: second has been longer
    for _ in range(2):
        await pool.submit(1)
        pool.clock.advance(1)
    assert [x.job for x in await pool.lease(second)] == [1]
    assert [x.job for x in await pool.lease(first)] == [2]


def test_plan_gang_and_pick_agent_keep_the_given_order_among_equals() -> None:
    assert scheduler.plan_gang(2, [("z", 1), ("a", 1)]) == ["z", "a"]
    assert scheduler.plan_gang(1, [("z", 1), ("a", 2)]) == ["a"]  # most free slots first
    assert scheduler.pick_agent({"z": 1, "a": 1}, None) == "z"
    assert scheduler.pick_agent({"z": 1, "a": 1}, "z") == "a"


async def test_leases_not_taken_by_an_agent_that_is_suspended_go_elsewhere(pool: Pool) -> None:
    await pool.register_relay("relay-0")
    agent = await pool.enroll("agent-1", slots=2)
    job = await pool.submit(2)  # placed on agent-1, which has not asked for its leases
    other = await pool.enroll("agent-2", slots=2)
    await beat(pool, agent, activity="suspended", reason="outside its hours", free=0)
    detail = await pool.job(job.id)
    assert events(detail, "rank_lost") == [
        f"rank {r} moved before it started: agent agent-1 is suspended (outside its hours)"
        for r in (0, 1)
    ]
    assert detail.job.restarts == 0  # they never ran
    assert await pool.lease(agent) == []
    assert [(x.rank, x.incarnation) for x in await pool.lease(other)] == [(0, 2), (1, 2)]


async def test_a_suspended_agent_is_handed_no_lease(pool: Pool) -> None:
    await pool.register_relay("relay-0")
    agent = await pool.enroll("agent-1", slots=1)
    bundle = await pool.upload(make_zip({"app.py": HELLO}))
    sub = api.JobSubmit(ranks=1, bundle=bundle, entry="app.py", fault_tolerance=False)
    job = decode(await pool.post("/api/v1/jobs", sub, pool.user()), api.JobInfo)
    assert job.state == "running"  # placed on agent-1, which has not taken it yet
    await beat(pool, agent, activity="suspended", free=0)
    # Fault tolerance off: the rank is never replaced, so it is not given back; it waits.
    assert await pool.lease(agent) == []
    assert events(await pool.job(job.id), "rank_lost") == []
    await beat(pool, agent, free=1)
    assert [(x.job, x.incarnation) for x in await pool.lease(agent)] == [(job.id, 1)]


async def test_busy_is_an_available_agent_with_no_free_slot(pool: Pool) -> None:
    _, agent, leases = await running(pool, slots=1)
    assert (await agents(pool))["agent-1"].activity == "busy"
    await beat(
        pool, agent, frozen=[(leases[0], 1.0)], activity="suspended", reason="paused", free=0
    )
    shown = (await agents(pool))["agent-1"]
    assert (shown.activity, shown.activity_reason) == ("suspended", "paused")
    assert shown.doing() == "suspended: paused"


# -- suspended ranks --------------------------------------------------------------------------


async def test_suspended_and_resumed_ranks_are_events_once(pool: Pool) -> None:
    job, agent, leases = await running(pool)
    pool.clock.advance(30)
    why = "the owner is using the machine"
    for _ in range(3):
        await beat(pool, agent, frozen=[(leases[0], 5.0)], activity="suspended", reason=why)
    detail = await pool.job(job.id)
    assert events(detail, "rank_suspended", "rank_resumed") == [
        f"rank 0 suspended on agent agent-1: {why}"
    ]
    assert detail.ranks[0].state == "running"
    assert detail.ranks[0].suspended_since == pool.clock() - 5
    pool.clock.advance(60)
    for _ in range(2):
        await beat(pool, agent, leases, free=0)
    detail = await pool.job(job.id)
    assert events(detail, "rank_suspended", "rank_resumed") == [
        f"rank 0 suspended on agent agent-1: {why}",
        "rank 0 resumed after 1 min 5 s",
    ]
    assert detail.ranks[0].suspended_since is None
    assert [e.rank for e in detail.events if e.kind.startswith("rank_s")] == [0]


async def test_odd_suspension_times_are_clamped(pool: Pool) -> None:
    job, agent, leases = await running(pool)
    await beat(pool, agent, frozen=[(leases[0], -50.0)], activity="suspended")
    assert (await pool.job(job.id)).ranks[0].suspended_since == pool.clock()
    await beat(pool, agent, leases)
    pool.clock.advance(20)
    # Frozen for longer than it was here: since it was handed over.
    delivered = pool.clock() - 20
    await beat(pool, agent, frozen=[(leases[0], 1e300)], activity="suspended")
    assert (await pool.job(job.id)).ranks[0].suspended_since == delivered
    assert (
        events(await pool.job(job.id), "rank_suspended")[0] == "rank 0 suspended on agent agent-1"
    )


def test_suspended_since_is_within_the_incarnation() -> None:
    assert scheduler.suspended_since(100.0, 10.0, 50.0) == 90.0
    assert scheduler.suspended_since(100.0, 80.0, 50.0) == 50.0
    for odd in (-1.0, math.nan, math.inf, -math.inf):
        assert scheduler.suspended_since(100.0, odd, 50.0) == 100.0


async def test_a_rank_suspended_past_the_limit_is_replaced_elsewhere(tmp_path: Path) -> None:
    async with open_pool(tmp_path, suspend_limit=100.0) as pool:
        await pool.register_relay("relay-0")
        job = await pool.submit(1, checkpoint_every=30)
        agent = await pool.enroll("agent-1", slots=1)
        leases = await pool.lease(agent)
        await beat(pool, agent, leases, free=0, criu="4.1")
        r = await commit(pool, image(job.id, 0, 7, [7], fp=FP_Z))
        assert r.status_code == 200, r.text
        other = await pool.enroll("agent-2", slots=1)

        why = "the owner is using the machine"
        hb = await beat(pool, agent, frozen=[(leases[0], 0.0)], activity="suspended", reason=why)
        assert hb.suspend_limit == 100.0 and hb.stop == []

        async def frozen() -> None:
            await beat(pool, agent, frozen=[(leases[0], 0.0)], activity="suspended", reason=why)

        async def idle() -> None:
            await beat(pool, other, free=1, criu="4.1")

        # The limit, 2 heartbeat intervals (1 s each here) and 60 s: 162 s.
        await passes(pool, 161, 7, frozen, idle)
        detail = await pool.job(job.id)
        assert (detail.ranks[0].incarnation, events(detail, "rank_lost")) == (1, [])
        await passes(pool, 2, 2, frozen, idle)
        detail = await pool.job(job.id)
        assert detail.job.state == "running"
        assert events(detail, "rank_lost") == [
            "rank 0 lost: suspended on agent agent-1 for 2 min 43 s, longer than the pool's "
            "suspend_limit (1 min 40 s), and its agent did not move it"
        ]
        assert events(detail, "rank_restarted") == [
            "rank 0 incarnation 2 on agent agent-2, to restore from checkpoint 7"
        ]
        hb = await beat(pool, agent, frozen=[(leases[0], 0.0)], activity="suspended")
        assert [s.reason for s in hb.stop] == ["incarnation 1 was replaced by incarnation 2"]
        fresh = await pool.lease(other)
        assert [(x.rank, x.incarnation, [c.ckpt for c in x.restore]) for x in fresh] == [
            (0, 2, [7])
        ]


async def test_suspend_limit_0_never_moves_a_rank(tmp_path: Path) -> None:
    async with open_pool(tmp_path, suspend_limit=0.0) as pool:
        job, agent, leases = await running(pool)

        async def frozen() -> None:
            hb = await beat(pool, agent, frozen=[(leases[0], 0.0)], activity="suspended")
            assert hb.suspend_limit == scheduler.SUSPEND_NEVER > 3e8  # not "the agent's own"

        await passes(pool, 3600, 9, frozen)
        detail = await pool.job(job.id)
        assert (detail.job.state, detail.ranks[0].incarnation) == ("running", 1)
        assert events(detail, "rank_lost") == []


async def test_the_pool_suspend_limit_is_in_every_heartbeat_answer(pool: Pool) -> None:
    agent = await pool.enroll("agent-1")
    assert (await beat(pool, agent)).suspend_limit == 600.0  # the default


def test_suspend_limit_setting(tmp_path: Path) -> None:
    from coord_helpers import test_settings

    assert test_settings(tmp_path).suspend_limit == 600.0
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="suspend_limit"):
            test_settings(tmp_path, suspend_limit=bad)
    assert scheduler.suspend_backstop(0.0, 2.0) is None
    assert scheduler.suspend_backstop(600.0, 2.0) == 664.0


# -- leaving ----------------------------------------------------------------------------------


async def test_an_agent_that_left_and_went_silent_is_gone_not_lost(pool: Pool) -> None:
    job, agent, leases = await running(pool)
    other = await pool.enroll("agent-2", slots=1)
    await beat(pool, agent, leases, activity="leaving", reason="stopping (SIGTERM)", free=0)
    shown = (await agents(pool))["agent-1"]
    assert (shown.state, shown.doing()) == ("alive", "leaving: stopping (SIGTERM)")

    async def idle() -> None:
        await beat(pool, other, free=1)

    await passes(pool, 12, 6, idle)
    listed = await agents(pool)
    assert (listed["agent-1"].state, listed["agent-1"].doing()) == ("gone", "-")
    assert listed["agent-2"].state == "alive"
    detail = await pool.job(job.id)
    assert events(detail, "rank_lost") == ["rank 0 stopped: its agent agent-1 left the pool"]
    assert events(detail, "rank_restarted") == ["rank 0 incarnation 2 on agent agent-2"]
    assert await pool.core.live_pool_info() == pool.core.pool_info(1, 1)

    # It comes back (heartbeats again): alive and available as usual.
    await beat(pool, agent, free=1)
    shown = (await agents(pool))["agent-1"]
    assert (shown.state, shown.activity, shown.activity_since) == (
        "alive",
        "available",
        pool.clock(),
    )


async def test_an_agent_silent_without_leaving_is_still_lost(pool: Pool) -> None:
    job, agent, leases = await running(pool)
    other = await pool.enroll("agent-2", slots=1)
    await beat(pool, agent, frozen=[(leases[0], 0.0)], activity="suspended")

    async def idle() -> None:
        await beat(pool, other, free=1)

    await passes(pool, 12, 6, idle)
    assert (await agents(pool))["agent-1"].state == "lost"
    assert events(await pool.job(job.id), "rank_lost") == [
        "rank 0 lost: agent agent-1 stopped heartbeating"
    ]


async def test_ranks_handed_back_by_a_leaving_agent_say_it_left(pool: Pool) -> None:
    job, agent, leases = await running(pool)
    await beat(pool, agent, leases, activity="leaving", free=0)
    pr = api.RankProblem(job=job.id, rank=0, incarnation=1, message="checkpointed, handed back")
    r = await pool.post("/api/v1/agents/problem", pr, agent.headers)
    assert r.status_code == 200, r.text
    detail = await pool.job(job.id)
    assert events(detail, "rank_lost") == [
        "rank 0 stopped: its agent agent-1 left the pool (checkpointed, handed back)"
    ]
    assert detail.ranks[0].state == "pending"


@pytest.mark.parametrize(
    ("activity", "said"),
    [
        ("suspended", "rank 0 lost: agent agent-1 handed it back ({})"),
        ("leaving", "rank 0 stopped: its agent agent-1 left the pool ({})"),
        ("available", "rank 0 lost: its process on agent agent-1 died ({})"),
    ],
)
async def test_a_lost_exit_says_why_the_agent_gave_the_rank_up(
    pool: Pool, activity: str, said: str
) -> None:
    job, agent, leases = await running(pool)
    await beat(pool, agent, leases, activity=activity, free=0)
    why = "suspended for more than 10 min: moved to another machine from a checkpoint taken now"
    ex = api.RankExit(job=job.id, rank=0, incarnation=1, code=-15, message=why, lost=True)
    r = await pool.post("/api/v1/agents/exit", ex, agent.headers)
    assert r.status_code == 200, r.text
    assert events(await pool.job(job.id), "rank_lost") == [said.format(why)]


# -- leases, listings, odd values -------------------------------------------------------------


async def test_leases_name_the_user_who_submitted_the_job(pool: Pool) -> None:
    await pool.register_relay("relay-0")
    agent = await pool.enroll("agent-1", slots=2)
    await pool.submit(1, user="bob")
    assert [x.user for x in await pool.lease(agent)] == ["bob"]


async def test_users_see_activities_but_not_why(pool: Pool) -> None:
    agent = await pool.enroll("agent-1", slots=1)
    await beat(pool, agent, activity="suspended", reason="firefox is running", free=0)
    r = await pool.client.get("/api/v1/pool/agents", headers=pool.user("alice"))
    [seen] = decode(r, list[api.AgentInfo])
    assert (seen.name, seen.activity, seen.activity_reason) == ("volunteer 1", "suspended", "")
    assert (await agents(pool))["agent-1"].activity_reason == "firefox is running"


async def test_an_unknown_activity_counts_as_available_and_is_logged_once(
    pool: Pool, caplog: pytest.LogCaptureFixture
) -> None:
    await pool.register_relay("relay-0")
    agent = await pool.enroll("agent-1", slots=1)
    with caplog.at_level(logging.WARNING, logger="vpool.coordinator.service"):
        for _ in range(3):
            await beat(pool, agent, activity="hibernating", reason="zzz", free=1)
    assert caplog.text.count("'hibernating'") == 1
    shown = (await agents(pool))["agent-1"]
    assert (shown.activity, shown.activity_reason) == ("available", "")
    await pool.submit(1)
    assert len(await pool.lease(agent)) == 1


async def test_a_reason_is_one_short_line_of_text(pool: Pool) -> None:
    job, agent, leases = await running(pool)
    reason = "owner\x1b[31m is\nback\t" + "x" * 1000
    await beat(pool, agent, frozen=[(leases[0], 0.0)], activity="suspended", reason=reason)
    shown = (await agents(pool))["agent-1"].activity_reason
    assert shown.startswith("owner [31m is back xxx") and len(shown) == 200
    [message] = events(await pool.job(job.id), "rank_suspended")
    assert message == f"rank 0 suspended on agent agent-1: {shown}"


async def test_the_operators_agent_list_shows_activities(pool: Pool, tmp_path: Path) -> None:
    await pool.register_relay("relay-0")
    away = await pool.enroll("away", slots=1)
    await beat(pool, away, activity="suspended", reason="on battery", free=0)
    full = await pool.enroll("full", slots=1)
    await pool.submit(1)
    leases = await pool.lease(full)
    assert len(leases) == 1
    bye = await pool.enroll("bye", slots=1)
    await beat(pool, bye, activity="leaving", free=0)
    await pool.enroll("silent", slots=1)
    pool.clock.advance(11)
    await beat(pool, away, activity="suspended", reason="on battery", free=0)
    await beat(pool, full, leases, free=0)
    await pool.core.check_timeouts()
    config = tmp_path / "pool.toml"
    config.write_text(f'state_dir = "{tmp_path / "state"}"\ninsecure_http = true\n')
    res = CliRunner().invoke(cli.main, ["agent", "list", "--config", str(config)])
    assert res.exit_code == 0, res.output
    lines = [line.split("\t") for line in res.stdout.splitlines()]
    assert lines[0][2:4] == ["state", "activity"]
    assert {row[1]: tuple(row[2:4]) for row in lines[1:]} == {
        "away": ("alive", "suspended: on battery"),
        "bye": ("gone", "-"),
        "full": ("alive", "busy"),
        "silent": ("lost", "-"),
    }


def test_migration_makes_agents_from_before_available_since_they_enrolled(tmp_path: Path) -> None:
    db = sqlite_utils.Database(tmp_path / "old.db")
    db.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    db.execute("INSERT INTO schema_version (version) VALUES (14)")
    for step in migrations.MIGRATIONS[:14]:
        step(db)
    db.execute(
        "INSERT INTO agents (id, public_key, name, slots, free_slots, software, enrolled, "
        "last_seen, state) VALUES ('agent-1', 'pk', 'desk', 2, 2, '', 123.0, 456.0, 'alive')"
    )
    assert migrations.migrate(db) == len(migrations.MIGRATIONS) >= 15
    row = next(iter(db.query("SELECT activity, activity_reason, activity_since FROM agents")))
    assert row == {"activity": "available", "activity_reason": "", "activity_since": 123.0}
    assert "suspended_since" in db["incarnations"].columns_dict
    db.close()
