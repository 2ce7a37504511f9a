"""Sandboxes and memory: ranks go only to agents that reported a sandbox (or to agents that
cannot sandbox, for jobs that accept them) and that let a rank use the memory the job asks
for; leases carry that memory; users see each agent's isolation."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import sqlite_utils
from coord_helpers import SANDBOX, Pool, decode, make_zip

from vpool.coordinator import migrations, scheduler
from vpool.coordinator.scheduler import Offer
from vpool.protocol import api

MiB, GiB = 1024**2, 1024**3
NONE = api.IsolationReport(level="none", detail="bubblewrap cannot make a sandbox here")
RLIMITS = api.IsolationReport(level="sandbox-rlimits", detail="no cgroup: rlimits only")


def sandbox(rank_memory: int) -> api.IsolationReport:
    return api.IsolationReport(level="sandbox", rank_memory=rank_memory)


# -- the rule, pure ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("offer", "memory", "unsandboxed", "expected"),
    [
        # Not reported yet (an agent from before sandboxes, or one still finding out): nothing.
        (Offer(), 0, False, False),
        (Offer(), 0, True, False),
        (Offer("", 8 * GiB), 0, True, False),
        # The level.
        (Offer("sandbox"), 0, False, True),
        (Offer("sandbox-rlimits"), 0, False, True),
        (Offer("none"), 0, False, False),
        (Offer("none"), 0, True, True),
        (Offer("something-new"), 0, False, False),
        (Offer("something-new"), 0, True, True),
        (Offer("sandbox"), 0, True, True),  # accepting unsandboxed agents does not refuse others
        # Memory: enough, exactly enough, not enough, no limit, the job asks nothing.
        (Offer("sandbox", 2 * GiB), GiB, False, True),
        (Offer("sandbox", GiB), GiB, False, True),
        (Offer("sandbox", 256 * MiB), GiB, False, False),
        (Offer("sandbox", 0), GiB, False, True),
        (Offer("sandbox", 256 * MiB), 0, False, True),
        # Both conditions hold, always.
        (Offer("none", 256 * MiB), GiB, True, False),
        (Offer("none", 2 * GiB), GiB, False, False),
    ],
)
def test_can_run(offer: Offer, memory: int, unsandboxed: bool, expected: bool) -> None:
    assert scheduler.can_run(offer, memory=memory, unsandboxed=unsandboxed) is expected


def test_open_to_keeps_the_free_slots_of_eligible_agents() -> None:
    free = {"a": 2, "b": 0, "c": 3, "d": 1}
    offers = {"a": Offer("sandbox", GiB), "b": Offer("sandbox"), "c": Offer("none")}
    assert scheduler.open_to(free, offers, memory=0, unsandboxed=False) == {"a": 2, "b": 0}
    assert scheduler.open_to(free, offers, memory=2 * GiB, unsandboxed=True) == {"b": 0, "c": 3}
    assert scheduler.open_to({}, offers, memory=0, unsandboxed=True) == {}


# -- through the API ---------------------------------------------------------------------------


async def test_agent_without_a_sandbox_gets_only_jobs_that_accept_it(pool: Pool) -> None:
    await pool.register_relay()
    normal = await pool.submit(1)
    agent = await pool.enroll("agent-1", slots=2, isolation=NONE)
    assert await pool.lease(agent) == []
    assert (await pool.job(normal.id)).job.state == "queued"

    accepting = await pool.submit(1, unsandboxed=True)
    assert accepting.unsandboxed is True and normal.unsandboxed is False
    (lease,) = await pool.lease(agent)
    assert lease.job == accepting.id
    assert (await pool.job(normal.id)).job.state == "queued"

    # An agent whose sandbox has only rlimits sandboxes all the same.
    other = await pool.enroll("agent-2", slots=1, isolation=RLIMITS)
    (lease,) = await pool.lease(other)
    assert lease.job == normal.id


async def test_memory_goes_only_where_a_rank_may_use_it(pool: Pool) -> None:
    await pool.register_relay()
    small = await pool.enroll("small", slots=8, isolation=sandbox(256 * MiB))
    job = await pool.submit(2, memory=GiB)
    assert job.memory == GiB
    assert await pool.lease(small) == []
    assert (await pool.job(job.id)).job.state == "queued"

    big = await pool.enroll("big", slots=3, isolation=sandbox(2 * GiB))
    assert await pool.lease(small) == []
    leases = await pool.lease(big)
    assert [(x.rank, x.memory) for x in leases] == [(0, GiB), (1, GiB)]
    await pool.heartbeat(big, leases, free=1, isolation=sandbox(2 * GiB))

    # A replacement incarnation too: small has the most free slots, yet it goes to big.
    lost = api.RankExit(job=job.id, rank=0, incarnation=1, code=-9, lost=True)
    assert (await pool.post("/api/v1/agents/exit", lost, big.headers)).status_code == 200
    assert await pool.lease(small) == []
    (fresh,) = await pool.lease(big)
    assert (fresh.rank, fresh.incarnation, fresh.memory) == (0, 2, GiB)

    # A job asking nothing goes anywhere, and its leases say so; so does an agent with no limit.
    anything = await pool.submit(1)
    (lease,) = await pool.lease(small)
    assert (lease.job, lease.memory) == (anything.id, 0)
    unlimited = await pool.enroll("unlimited", slots=1, isolation=sandbox(0))
    huge = await pool.submit(1, memory=64 * GiB)
    (lease,) = await pool.lease(unlimited)
    assert (lease.job, lease.memory) == (huge.id, 64 * GiB)

    detail = await pool.job(job.id)
    assert detail.job.memory == GiB
    assert detail.events[0].message == "submitted by alice: 2 ranks, 1 GiB of memory per rank"


async def test_agent_that_has_not_reported_its_isolation_gets_nothing(pool: Pool) -> None:
    await pool.register_relay()
    job = await pool.submit(1, unsandboxed=True)
    agent = await pool.enroll("agent-1", slots=2, isolation=None)
    assert await pool.lease(agent) == []
    await pool.heartbeat(agent, [], isolation=None)
    assert await pool.lease(agent) == []
    assert (await pool.job(job.id)).job.state == "queued"

    await pool.heartbeat(agent, [], isolation=SANDBOX)
    (lease,) = await pool.lease(agent)
    assert lease.job == job.id

    # Enrolling again (a restarted agent) forgets the report until a heartbeat brings it, and
    # a heartbeat without one (still finding out) makes the agent ineligible again.
    again = await pool.enroll_key(agent.key, "agent-1", 2, isolation=None)
    second = await pool.submit(1)
    assert await pool.lease(again) == []
    await pool.heartbeat(again, [], isolation=SANDBOX)
    assert [x.job for x in await pool.lease(again)] == [second.id]
    await pool.heartbeat(again, [], isolation=None)
    third = await pool.submit(1)
    assert await pool.lease(again) == []
    assert (await pool.job(third.id)).job.state == "queued"


async def test_bad_memory_is_refused_at_submit(pool: Pool) -> None:
    bundle = await pool.upload(make_zip({"app.py": b"print('hi')\n"}))

    async def submit(memory: object) -> httpx.Response:
        body = {"ranks": 1, "bundle": bundle, "entry": "app.py", "memory": memory}
        return await pool.client.post("/api/v1/jobs", json=body, headers=pool.user())

    for memory in (-1, 1, 16 * MiB - 1, 2**50 + 1, 2**64, 10**30):
        r = await submit(memory)
        assert r.status_code == 422, (memory, r.text)
        assert r.json()["error"]["code"] == "bad_memory"
        assert "16777216 (16 MiB)" in r.json()["error"]["message"]
    for memory in ("1G", 1.5e9, None, [1]):
        r = await submit(memory)
        assert r.status_code == 422, (memory, r.text)
        assert set(r.json()) == {"error"} and r.json()["error"]["code"] == "bad_request"
    for memory in (0, 16 * MiB, 2**50):
        r = await submit(memory)
        assert r.status_code == 201, (memory, r.text)
        assert decode(r, api.JobInfo).memory == memory


async def test_isolation_reports_are_stored_and_shown(pool: Pool) -> None:
    report = api.IsolationReport(
        level="sandbox-rlimits",
        detail="no cgroup: systemd has no delegated subtree",
        rank_memory=3 * GiB // 2,
        rank_processes=64,
        rank_disk=4 * GiB,
        checkpoints=True,
        probes={"bwrap": "ok", "cgroup": "no delegation"},
    )
    agent = await pool.enroll("volunteer-1", slots=4, isolation=report)
    await pool.enroll("old-agent", slots=1, isolation=None)
    rows = {r["name"]: r for r in pool.core.store.list_agents()}
    assert rows["volunteer-1"]["isolation"] == "sandbox-rlimits"
    assert rows["volunteer-1"]["rank_memory"] == 3 * GiB // 2
    stored = rows["volunteer-1"]["isolation_report"]
    assert decode(httpx.Response(200, content=stored), api.IsolationReport) == report
    assert (rows["old-agent"]["isolation"], rows["old-agent"]["isolation_report"]) == ("", "")

    r = await pool.client.get("/api/v1/pool/agents", headers=pool.add_user("ops", "operator"))
    agents = {a.name: a for a in decode(r, list[api.AgentInfo])}
    assert agents["volunteer-1"] == api.AgentInfo(
        id=agent.id,
        name="volunteer-1",
        state="alive",
        slots=4,
        ranks=0,
        last_seen=pool.clock(),
        isolation="sandbox-rlimits",
        isolation_detail="no cgroup: systemd has no delegated subtree",
        rank_memory=3 * GiB // 2,
        checkpoints=False,  # its heartbeats said no CRIU
        activity_since=pool.clock(),  # available since it enrolled
    )
    assert (agents["old-agent"].isolation, agents["old-agent"].rank_memory) == ("", 0)
    # Users see what each agent offers, not who the volunteers are.
    r = await pool.client.get("/api/v1/pool/agents", headers=pool.user())
    seen = decode(r, list[api.AgentInfo])
    assert sorted(a.rank_memory for a in seen) == [0, 3 * GiB // 2]
    assert {(a.id, a.name) for a in seen} == {("", "volunteer 1"), ("", "volunteer 2")}

    # A changed report replaces the stored one; the same one again changes nothing.
    await pool.heartbeat(agent, [], isolation=sandbox(GiB))
    await pool.heartbeat(agent, [], isolation=sandbox(GiB))
    (row,) = [r for r in pool.core.store.list_agents() if r["name"] == "volunteer-1"]
    assert (row["isolation"], row["rank_memory"]) == ("sandbox", GiB)


def test_migration_makes_older_agents_unknown_and_older_jobs_sandboxed(tmp_path: Path) -> None:
    db = sqlite_utils.Database(tmp_path / "old.db")
    db.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    db.execute("INSERT INTO schema_version (version) VALUES (5)")
    for step in migrations.MIGRATIONS[:5]:
        step(db)
    db.execute(
        "INSERT INTO jobs (user, name, state, ranks, bundle, entry, args, created) "
        "VALUES ('alice', 'a', 'queued', 1, 'b', 'app.py', '[]', 0)"
    )
    db.execute(
        "INSERT INTO agents (id, public_key, name, slots, free_slots, enrolled, last_seen, "
        "state) VALUES ('agent-1', 'k', 'a', 1, 1, 0, 0, 'alive')"
    )
    assert migrations.migrate(db) == len(migrations.MIGRATIONS) >= 6
    (job,) = db.query("SELECT memory, unsandboxed FROM jobs")
    assert (job["memory"], job["unsandboxed"]) == (0, 0)
    (agent,) = db.query("SELECT isolation, rank_memory, isolation_report FROM agents")
    assert (agent["isolation"], agent["rank_memory"], agent["isolation_report"]) == ("", 0, "")
    db.close()
