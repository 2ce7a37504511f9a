"""Checkpoints on the coordinator's side (issue 5): the job's uid and image key in leases only,
``checkpoint_every`` checks, agents' CRIU and fingerprint, relays' image reports, ``vsdk
checkpoint`` orders, restore reports, and where a lost rank with images is restarted: on an
agent that can restore one of them, never with an image made for another fingerprint, waiting
(then failing) when it can no longer start from the beginning."""

from __future__ import annotations

import base64
from pathlib import Path

import msgspec
import pytest
import sqlite_utils
from ckpt_helpers import (
    DIGEST,
    FP_X,
    FP_Y,
    beat,
    commit,
    events,
    from_start,
    image,
    relay_loses,
    running,
    submit,
)
from coord_helpers import Agent, Pool, decode, open_pool

from vpool.config import SettingsError
from vpool.coordinator import migrations, settings
from vpool.protocol import api

# -- the job: uid, key, period --------------------------------------------------------------


async def test_uid_and_key_are_in_leases_only(pool: Pool) -> None:
    await pool.register_relay("relay-0")
    first = decode(await submit(pool, 2, every=30), api.JobInfo)
    second = decode(await submit(pool, 1), api.JobInfo)
    assert (first.checkpoint_every, second.checkpoint_every) == (30.0, 0.0)
    agent = await pool.enroll("agent-1", slots=4)
    leases = await pool.lease(agent)
    by_job: dict[int, list[api.Lease]] = {}
    for lease in leases:
        by_job.setdefault(lease.job, []).append(lease)
    keys = set()
    for job, group in by_job.items():
        assert len({(x.job_uid, x.ckpt_key) for x in group}) == 1  # one per job
        lease = group[0]
        assert len(lease.job_uid) == 32 and int(lease.job_uid, 16) >= 0
        raw = base64.urlsafe_b64decode(lease.ckpt_key + "=" * (-len(lease.ckpt_key) % 4))
        assert len(raw) == 32
        assert lease.checkpoint_every == (30.0 if job == first.id else 0.0)
        assert (lease.restore, lease.from_start) == ([], True)
        keys.add(lease.ckpt_key)
    assert len(keys) == 2
    # Users never see them: not in the job, its detail, nor the list.
    for url in (f"/api/v1/jobs/{first.id}", "/api/v1/jobs", f"/api/v1/jobs/{second.id}"):
        text = (await pool.client.get(url, headers=pool.user())).text
        assert "ckpt_key" not in text and "job_uid" not in text
        for lease in leases:
            assert lease.ckpt_key not in text and lease.job_uid not in text
    detail = await pool.job(first.id)
    assert detail.job.checkpoint_every == 30.0
    assert events(detail, "queued") == ["submitted by alice: 2 ranks, a checkpoint every 30 s"]


@pytest.mark.parametrize(
    ("every", "ft", "needle"),
    [
        (-1.0, True, "not -1"),
        (0.5, True, "not 0.5"),
        (1e9, True, "not 1e+09"),
        (30.0, False, "checkpoints need fault tolerance"),
    ],
)
async def test_checkpoint_every_is_checked(pool: Pool, every: float, ft: bool, needle: str) -> None:
    r = await submit(pool, every=every, ft=ft)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "bad_checkpoint_every" and needle in error["message"]


async def test_no_checkpoints_without_fault_tolerance_is_fine(pool: Pool) -> None:
    assert (await submit(pool, every=0, ft=False)).status_code == 201
    assert (await submit(pool, every=1, ft=True)).status_code == 201


def test_settings_are_checked() -> None:
    assert settings.load().restore_wait_timeout == 600
    with pytest.raises(SettingsError, match="restore_wait_timeout"):
        settings.load(restore_wait_timeout=0)
    with pytest.raises(SettingsError, match="min_checkpoint_every"):
        settings.load(min_checkpoint_every=0)


async def test_agents_capability_is_kept(pool: Pool) -> None:
    agent = await pool.enroll("agent-1")
    await beat(pool, agent, [], criu="4.1.1", fp=FP_X)
    await beat(pool, agent, [], criu="4.1.1", fp=FP_Y)
    (row,) = pool.core.store.list_agents()
    assert (row["criu"], row["fingerprint"]) == ("4.1.1", FP_Y)


def test_migration_gives_older_jobs_a_uid_and_key(tmp_path: Path) -> None:
    db = sqlite_utils.Database(tmp_path / "old.db")
    db.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    db.execute("INSERT INTO schema_version (version) VALUES (3)")
    for step in migrations.MIGRATIONS[:3]:
        step(db)
    for name in ("a", "b"):
        db.execute(
            "INSERT INTO jobs (user, name, state, ranks, bundle, entry, args, created) "
            "VALUES ('alice', ?, 'running', 1, 'b', 'app.py', '[]', 0)",
            [name],
        )
    assert migrations.migrate(db) == len(migrations.MIGRATIONS)
    rows = list(db.query("SELECT job_uid, ckpt_key, checkpoint_every FROM jobs"))
    assert all(len(r["job_uid"]) == 32 and len(r["ckpt_key"]) == 43 for r in rows)
    assert rows[0]["job_uid"] != rows[1]["job_uid"] and rows[0]["checkpoint_every"] == 0
    db.close()


def test_migration_to_blake3_drops_the_sha256_images(tmp_path: Path) -> None:
    """Step 5 renames ``checkpoints.sha256`` to ``digest`` and deletes the images recorded
    before (SHA-256 digests no restore would accept); the rest of the rank is kept."""
    db = sqlite_utils.Database(tmp_path / "old.db")
    db.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    db.execute("INSERT INTO schema_version (version) VALUES (4)")
    for step in migrations.MIGRATIONS[:4]:
        step(db)
    db.execute(
        "INSERT INTO jobs (user, name, state, ranks, bundle, entry, args, created) "
        "VALUES ('alice', 'a', 'running', 1, 'b', 'app.py', '[]', 0)"
    )
    db.execute("INSERT INTO ranks (job, rank, state) VALUES (1, 0, 'running')")
    for ckpt in (1, 2):
        db.execute(
            "INSERT INTO checkpoints (job, rank, ckpt, incarnation, relay, size, sha256, "
            "fingerprint, received, dets, meta, pos, created) "
            "VALUES (1, 0, ?, 1, 'relay-0', 10, ?, 'fp', '{}', 0, x'', ?, 0)",
            [ckpt, "cd" * 32, 2 - ckpt],
        )
    assert migrations.migrate(db) == len(migrations.MIGRATIONS) >= 5
    assert "digest" in db["checkpoints"].columns_dict
    assert "sha256" not in db["checkpoints"].columns_dict
    assert list(db.query("SELECT * FROM checkpoints")) == []
    assert [r["state"] for r in db.query("SELECT state FROM ranks")] == ["running"]
    db.close()


# -- relays: committed images ---------------------------------------------------------------


async def test_relay_report_is_stored_and_retained_replaces_the_list(pool: Pool) -> None:
    _, leases = await running(pool)
    job = leases[0].job
    assert from_start(pool, job, 1)
    for ckpt, retained in ((1, [1]), (2, [2, 1]), (3, [3, 2])):
        r = await commit(pool, image(job, 1, ckpt, retained))
        assert r.status_code == 200 and r.json() == {"trim": True}, r.text
    assert (await commit(pool, image(job, 1, 3, [3, 2]))).status_code == 200  # a retry
    images = pool.core.store.rank_images(job, 1)  # type: ignore[attr-defined]
    assert [i["ckpt"] for i in images] == [3, 2]
    assert not from_start(pool, job, 1) and from_start(pool, job, 0)
    detail = await pool.job(job)
    assert events(detail, "checkpoint") == [
        f"rank 1: checkpoint {c} committed (210 MB)" for c in (1, 2, 3)
    ]
    assert [e.rank for e in detail.events if e.kind == "checkpoint"] == [1, 1, 1]


async def test_relay_report_is_refused_when_the_relay_should_delete_it(pool: Pool) -> None:
    _, leases = await running(pool)
    job = leases[0].job
    cases = [
        (image(999, 0, 1, [1]), 409, "unknown_job"),
        (image(job, 5, 1, [1]), 409, "unknown_rank"),
        (image(job, 0, 1, [1], incarnation=2), 409, "unknown_incarnation"),
        (msgspec.structs.replace(image(job, 0, 1, [1]), name="relay-9"), 403, "not_your_job"),
        (msgspec.structs.replace(image(job, 0, 1, [1]), digest="zz"), 422, "bad_request"),
    ]
    for report, status, code in cases:
        r = await commit(pool, report)
        assert (r.status_code, r.json()["error"]["code"]) == (status, code), r.text
    r = await pool.post("/api/v1/relays/checkpoint", image(job, 0, 1, [1]), {})
    assert r.status_code == 401
    assert pool.core.store.rank_images(job, 0) == []  # type: ignore[attr-defined]

    # An older incarnation's image still counts while the job runs.
    await relay_loses(pool, job, 0)
    assert (await commit(pool, image(job, 0, 1, [1], incarnation=1))).status_code == 200
    assert [i["ckpt"] for i in pool.core.store.rank_images(job, 0)] == [1]  # type: ignore[attr-defined]

    r = await pool.client.post(f"/api/v1/jobs/{job}/cancel", headers=pool.user())
    assert r.status_code == 200
    r = await commit(pool, image(job, 1, 2, [2]))
    assert (r.status_code, r.json()["error"]["code"]) == (409, "job_over")
    assert "cancelled" in r.json()["error"]["message"]


# -- replacements ---------------------------------------------------------------------------


async def _pool_of_three(pool: Pool) -> tuple[Agent, Agent, Agent, list[api.Lease]]:
    """agent-1 (fingerprint Z, full) runs the job; agent-2 (CRIU, fingerprint Y, 4 slots)
    and agent-3 (CRIU, fingerprint X, 1 slot) are idle."""
    one, leases = await running(pool)
    two = await pool.enroll("agent-2", slots=4)
    await beat(pool, two, [], criu="4.1.1", fp=FP_Y, free=4)
    three = await pool.enroll("agent-3", slots=1)
    await beat(pool, three, [], criu="4.1.1", fp=FP_X, free=1)
    return one, two, three, leases


async def test_replacement_goes_to_an_agent_that_can_restore(pool: Pool) -> None:
    _, two, three, leases = await _pool_of_three(pool)
    job = leases[0].job
    for ckpt, retained in ((1, [1]), (2, [2, 1])):
        assert (await commit(pool, image(job, 1, ckpt, retained))).status_code == 200
    await relay_loses(pool, job, 1)
    assert await pool.lease(two) == []  # most free slots, but the wrong environment
    (lease,) = await pool.lease(three)
    assert (lease.rank, lease.incarnation, lease.from_start) == (1, 2, False)
    assert [(x.ckpt, x.incarnation, x.relay, x.fingerprint) for x in lease.restore] == [
        (2, 1, 0, FP_X),
        (1, 1, 0, FP_X),
    ]
    ref = lease.restore[0]
    assert (ref.size, ref.digest, ref.received, ref.dets, ref.meta) == (
        210_000_000,
        DIGEST,
        {0: 10, 1: 0},
        2,
        b"\x00meta",
    )
    assert lease.homes[1] == ref.relay and lease.relays[ref.relay].name == "relay-0"
    assert lease.ckpt_key and lease.job_uid == leases[0].job_uid
    assert events(await pool.job(job), "rank_restarted") == [
        "rank 1 incarnation 2 on agent agent-3, to restore from checkpoint 2, 1"
    ]


async def test_images_go_only_to_their_own_fingerprint(pool: Pool) -> None:
    _, two, three, leases = await _pool_of_three(pool)
    job = leases[0].job
    # Two images of rank 0 made in different environments (two incarnations ago).
    assert (await commit(pool, image(job, 0, 1, [1], fp=FP_X))).status_code == 200
    assert (await commit(pool, image(job, 0, 2, [2, 1], fp=FP_Y))).status_code == 200
    await relay_loses(pool, job, 0)
    assert await pool.lease(three) == []
    (lease,) = await pool.lease(two)  # both can restore one; agent-2 has more room
    assert [(x.ckpt, x.fingerprint) for x in lease.restore] == [(2, FP_Y)]


async def test_rank_waits_for_a_restorer_then_starts(pool: Pool) -> None:
    one, leases = await running(pool)
    job = leases[0].job
    two = await pool.enroll("agent-2", slots=4)
    await beat(pool, two, [], criu="4.1.1", fp=FP_Y, free=4)
    assert (await commit(pool, image(job, 1, 3, [3]))).status_code == 200
    await relay_loses(pool, job, 1)
    for _ in range(3):
        await pool.core.schedule()
    assert await pool.lease(two) == [] and await pool.lease(one) == []
    detail = await pool.job(job)
    assert detail.job.state == "running" and detail.ranks[1].state == "pending"
    (waiting,) = events(detail, "rank_waiting_restore")
    assert waiting.startswith(
        "rank 1 incarnation 2 waits: it can only restart from a checkpoint image"
    )
    assert "no live agent has CRIU and the environment fingerprint (xxxxxxxxxxxx)" in waiting
    assert "within 600 s" in waiting
    # An agent without CRIU but with the fingerprint is no better.
    three = await pool.enroll("agent-3", slots=1)
    await beat(pool, three, [], criu="", fp=FP_X, free=1)
    assert await pool.lease(three) == []
    await beat(pool, three, [], criu="4.1.1", fp=FP_X, free=1)
    (lease,) = await pool.lease(three)
    assert [x.ckpt for x in lease.restore] == [3] and not lease.from_start
    assert len(events(await pool.job(job), "rank_waiting_restore")) == 1


async def test_rank_that_finds_no_restorer_fails_the_job(tmp_path: Path) -> None:
    async with open_pool(tmp_path, restore_wait_timeout=5.0) as pool:
        one, leases = await running(pool)
        job = leases[0].job
        two = await pool.enroll("agent-2", slots=4)
        await beat(pool, two, [], criu="4.1.1", fp=FP_Y, free=4)
        assert (await commit(pool, image(job, 1, 3, [3]))).status_code == 200
        await relay_loses(pool, job, 1)
        await pool.core.schedule()
        pool.clock.advance(4)
        await pool.core.check_timeouts()
        assert (await pool.job(job)).job.state == "running"
        pool.clock.advance(2)
        await beat(pool, two, [], criu="4.1.1", fp=FP_Y, free=4)
        await pool.core.check_timeouts()
        detail = await pool.job(job)
        assert detail.job.state == "failed" and detail.job.exit_code is None
        assert detail.job.reason == (
            "rank 1 could not be restarted: it can only start from a checkpoint image, and no "
            "agent with CRIU and its environment fingerprint (xxxxxxxxxxxx) had a free slot "
            "within 5 s"
        )
        hb = await beat(pool, one, leases[:1], free=0)
        assert [s.rank for s in hb.stop] == [0]


async def test_rank_starts_from_the_beginning_when_it_still_can(pool: Pool) -> None:
    _, leases = await running(pool)
    job = leases[0].job
    two = await pool.enroll("agent-2", slots=4)
    await beat(pool, two, [], criu="4.1.1", fp=FP_Y, free=4)
    assert (await commit(pool, image(job, 1, 3, [3]))).status_code == 200
    # A relay that kept the whole log: the rank may still start from the beginning.
    pool.core.store.db.execute(  # type: ignore[attr-defined]
        "UPDATE ranks SET from_start = 1 WHERE job = ? AND rank = 1", [job]
    )
    await relay_loses(pool, job, 1)
    (lease,) = await pool.lease(two)
    assert (lease.rank, lease.restore, lease.from_start) == (1, [], True)
    assert events(await pool.job(job), "rank_replaying") == [
        "rank 1 incarnation 2 starts from the beginning: its checkpoint images (3) were made "
        "for another environment than agent agent-2's (fingerprint yyyyyyyyyyyy)"
    ]


# -- agents: failures and restore reports ---------------------------------------------------


async def test_checkpoint_failed_is_an_event(pool: Pool) -> None:
    agent, leases = await running(pool)
    job = leases[0].job
    failed = api.CheckpointFailed(job=job, rank=0, incarnation=1, ckpt=4, message="criu dump\n 1")
    r = await pool.post("/api/v1/agents/checkpoint-failed", failed, agent.headers)
    assert r.status_code == 200 and r.json() == {}
    stranger = await pool.enroll("agent-9")
    r = await pool.post("/api/v1/agents/checkpoint-failed", failed, stranger.headers)
    assert (r.status_code, r.json()["error"]["code"]) == (403, "not_your_rank")
    await relay_loses(pool, job, 0)
    r = await pool.post("/api/v1/agents/checkpoint-failed", failed, agent.headers)
    assert r.status_code == 200  # stale: ignored
    assert events(await pool.job(job), "checkpoint_failed") == [
        "rank 0 incarnation 1: checkpoint 4 failed on agent agent-1: criu dump 1"
    ]


async def test_restore_reports_are_events(pool: Pool) -> None:
    one, two, three, leases = await _pool_of_three(pool)
    job = leases[0].job
    for ckpt, retained in ((4, [4]), (5, [5, 4])):
        assert (await commit(pool, image(job, 1, ckpt, retained))).status_code == 200
    await relay_loses(pool, job, 1)
    (lease,) = await pool.lease(three)
    await beat(pool, three, [lease], criu="4.1.1", fp=FP_X, free=0)  # starting, restoring
    tried = [api.RestoreAttempt(ckpt=5, reason="hash mismatch")]
    report = api.RestoreReport(job=job, rank=1, incarnation=2, ckpt=4, tried=tried)
    for _ in range(2):  # a repeat is no new event
        r = await pool.post("/api/v1/agents/restored", report, three.headers)
        assert r.status_code == 200, r.text
    await beat(pool, three, [lease], criu="4.1.1", fp=FP_X, free=0, restored_from=4)
    detail = await pool.job(job)
    assert events(detail, "restore_failed") == [
        "rank 1 incarnation 2: checkpoint 5 not used: hash mismatch"
    ]
    assert events(detail, "rank_restored") == ["rank 1 incarnation 2 restored from checkpoint 4"]
    assert events(detail, "rank_replaying") == []  # the restore said it
    row = next(
        iter(
            pool.core.store.db.query(  # type: ignore[attr-defined]
                "SELECT restored_from FROM incarnations WHERE job = ? AND rank = 1 "
                "AND incarnation = 2",
                [job],
            )
        )
    )
    assert row["restored_from"] == 4
    # ``vsdk status`` shows it per rank: the current incarnation's image, -1 for the others.
    assert [(r.rank, r.incarnation, r.restored_from) for r in detail.ranks] == [
        (0, 1, -1),
        (1, 2, 4),
    ]
    # A stale incarnation's report is ignored; one not leased to the agent is refused.
    stale = api.RestoreReport(job=job, rank=1, incarnation=1, ckpt=5)
    assert (await pool.post("/api/v1/agents/restored", stale, one.headers)).status_code == 200
    r = await pool.post("/api/v1/agents/restored", report, two.headers)
    assert r.status_code == 403
    assert len(events(await pool.job(job), "rank_restored")) == 1


async def test_failed_restore_replays_from_the_beginning(pool: Pool) -> None:
    _, _, three, leases = await _pool_of_three(pool)
    job = leases[0].job
    assert (await commit(pool, image(job, 0, 2, [2]))).status_code == 200
    await relay_loses(pool, job, 0)
    assert [x.rank for x in await pool.lease(three)] == [0]
    hb = api.AgentHeartbeat(
        ranks=[api.RankState(job=job, rank=0, incarnation=2, state="starting")],
        free_slots=0,
    )
    # Restoring: no replay event before the restore report says how it started.
    assert (await pool.post("/api/v1/agents/heartbeat", hb, three.headers)).status_code == 200
    assert events(await pool.job(job), "rank_replaying") == []
    tried = [api.RestoreAttempt(ckpt=2, reason="criu restore failed: exit 1")]
    report = api.RestoreReport(job=job, rank=0, incarnation=2, ckpt=-1, tried=tried)
    assert (await pool.post("/api/v1/agents/restored", report, three.headers)).status_code == 200
    hb = api.AgentHeartbeat(
        ranks=[api.RankState(job=job, rank=0, incarnation=2, state="running", replay_dets=3)],
        free_slots=0,
    )
    assert (await pool.post("/api/v1/agents/heartbeat", hb, three.headers)).status_code == 200
    detail = await pool.job(job)
    assert events(detail, "restore_failed") == [
        "rank 0 incarnation 2: checkpoint 2 not used: criu restore failed: exit 1"
    ]
    assert events(detail, "rank_restored") == []
    assert events(detail, "rank_replaying") == [
        "rank 0 incarnation 2 replays its logged messages and 3 determinant frames"
    ]


def test_checkpoint_event_shows_the_agents_timings() -> None:
    import msgspec

    from vpool.coordinator.sqlite_checkpoints import _timings

    meta = msgspec.msgpack.encode(
        {"pause_ms": 1.234, "pause_cpu_ms": 0.81, "dump_s": 0.5, "rank_dir": "/x"}
    )
    assert _timings(meta) == ", pause 1.2 ms, pause cpu 0.8 ms, dump 0.50 s"
    assert _timings(b"") == ""
    assert _timings(b"\xc1 not msgpack") == ""
    assert _timings(msgspec.msgpack.encode([1, 2])) == ""
    assert _timings(msgspec.msgpack.encode({"pause_ms": True})) == ""
