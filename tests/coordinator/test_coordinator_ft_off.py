"""Jobs with fault tolerance off (``JobSubmit.fault_tolerance=False``): the flag is stored and
shown, their leases tell the ranks not to log (``VPOOL_FT=0``), and a lost rank fails the job
instead of being restarted."""

from __future__ import annotations

from pathlib import Path

import sqlite_utils
from coord_helpers import HELLO, Agent, Pool, decode, make_zip, relay_headers

from vpool.coordinator import migrations
from vpool.protocol import api

RELAY = relay_headers()


async def _submit(pool: Pool, ranks: int = 2, *, ft: bool = True) -> api.JobInfo:
    bundle = await pool.upload(make_zip({"app.py": HELLO}))
    sub = api.JobSubmit(ranks=ranks, bundle=bundle, entry="app.py", fault_tolerance=ft)
    r = await pool.post("/api/v1/jobs", sub, pool.user())
    assert r.status_code == 201, r.text
    return decode(r, api.JobInfo)


async def _running(pool: Pool, *, ft: bool) -> tuple[Agent, list[api.Lease]]:
    await pool.register_relay("relay-0")
    await _submit(pool, ft=ft)
    agent = await pool.enroll("agent-1", slots=3)
    leases = await pool.lease(agent)
    await pool.heartbeat(agent, leases)
    return agent, leases


async def test_flag_is_stored_and_shown(pool: Pool) -> None:
    off = await _submit(pool, ft=False)
    on = await _submit(pool)
    assert (off.fault_tolerance, on.fault_tolerance) == (False, True)
    # Fault tolerance off alone is the "abort" failure mode.
    assert (off.on_failure, on.on_failure) == ("abort", "transparent")
    assert (await pool.job(off.id)).job.fault_tolerance is False
    assert (await pool.job(on.id)).job.fault_tolerance is True
    r = await pool.client.get("/api/v1/jobs", headers=pool.user())
    listed = {j.id: j.fault_tolerance for j in decode(r, list[api.JobInfo])}
    assert listed == {off.id: False, on.id: True}
    queued = [e.message for e in (await pool.job(off.id)).events if e.kind == "queued"]
    assert queued == ["submitted by alice: 2 ranks, a lost rank fails the job (on-failure abort)"]


async def test_flag_defaults_to_on_for_older_clients(pool: Pool) -> None:
    # A body without the field (a client from before it existed).
    bundle = await pool.upload(make_zip({"app.py": HELLO}))
    body = {"ranks": 1, "bundle": bundle, "entry": "app.py"}
    r = await pool.client.post("/api/v1/jobs", json=body, headers=pool.user())
    assert decode(r, api.JobInfo).fault_tolerance is True


async def test_leases_carry_the_switch(pool: Pool) -> None:
    await pool.register_relay("relay-0")
    off = await _submit(pool, ft=False)
    on = await _submit(pool, ft=True)
    agent = await pool.enroll("agent-1", slots=4)
    leases = await pool.lease(agent)
    assert {(x.job, x.rank): x.env for x in leases} == {
        (off.id, 0): {"VPOOL_FT": "0"},
        (off.id, 1): {"VPOOL_FT": "0"},
        (on.id, 0): {},
        (on.id, 1): {},
    }


async def test_lost_rank_fails_the_job_instead_of_restarting(pool: Pool) -> None:
    agent, leases = await _running(pool, ft=False)
    job = leases[0].job
    ex = api.RankExit(job=job, rank=1, incarnation=1, code=-9, lost=True)
    assert (await pool.post("/api/v1/agents/exit", ex, agent.headers)).status_code == 200
    detail = await pool.job(job)
    assert detail.job.state == "failed"
    assert detail.job.reason == (
        "rank 1 lost: its process on agent agent-1 died (killed by signal 9) "
        "(fault tolerance is off for this job)"
    )
    assert [e.kind for e in detail.events if e.kind.startswith("rank_")] == [
        "rank_running",
        "rank_running",
        "rank_lost",
    ]
    assert [(r.rank, r.incarnation, r.state) for r in detail.ranks] == [
        (0, 1, "killed"),
        (1, 1, "lost"),
    ]
    # No replacement is leased; the surviving rank is told to stop.
    assert await pool.lease(agent) == []
    hb = await pool.heartbeat(agent, leases)
    assert [(s.rank, s.incarnation) for s in hb.stop] == [(0, 1), (1, 1)]


async def test_other_losses_fail_it_too(pool: Pool) -> None:
    # A relay-reported loss and an agent heartbeat timeout: the same rule.
    agent, leases = await _running(pool, ft=False)
    report = api.RelayLost(
        name="relay-0", lost=[api.RankLost(job=leases[0].job, rank=0, incarnation=1, reason="x")]
    )
    assert (await pool.post("/api/v1/relays/lost", report, RELAY)).status_code == 200
    detail = await pool.job(leases[0].job)
    assert detail.job.state == "failed"
    assert detail.job.reason.endswith("(fault tolerance is off for this job)")
    assert "relay relay-0 reported: x" in detail.job.reason

    await _submit(pool, ft=False)
    second = await pool.lease(agent)
    await pool.heartbeat(agent, second)
    pool.clock.advance(60)
    await pool.relay_heartbeat("relay-0")
    await pool.core.check_timeouts()
    detail = await pool.job(second[0].job)
    assert detail.job.state == "failed"
    assert detail.job.reason == (
        "rank 0 lost: agent agent-1 stopped heartbeating (fault tolerance is off for this job)"
    )


async def test_fault_tolerant_job_still_restarts(pool: Pool) -> None:
    agent, leases = await _running(pool, ft=True)
    ex = api.RankExit(job=leases[0].job, rank=1, incarnation=1, code=-9, lost=True)
    assert (await pool.post("/api/v1/agents/exit", ex, agent.headers)).status_code == 200
    (fresh,) = await pool.lease(agent, free=1)
    assert (fresh.rank, fresh.incarnation, fresh.env) == (1, 2, {})
    assert (await pool.job(leases[0].job)).job.state == "running"


def test_migration_keeps_older_jobs_fault_tolerant(tmp_path: Path) -> None:
    db = sqlite_utils.Database(tmp_path / "old.db")
    db.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    db.execute("INSERT INTO schema_version (version) VALUES (2)")
    for step in migrations.MIGRATIONS[:2]:
        step(db)
    db.execute(
        "INSERT INTO jobs (user, name, state, ranks, bundle, entry, args, created) "
        "VALUES ('alice', 'old', 'running', 1, 'b', 'app.py', '[]', 0)"
    )
    assert migrations.migrate(db) == len(migrations.MIGRATIONS)
    assert [r["fault_tolerance"] for r in db.query("SELECT fault_tolerance FROM jobs")] == [1]
    db.close()
