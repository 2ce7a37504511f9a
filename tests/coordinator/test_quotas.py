"""Quotas per user (issue 20): jobs queued or running (``max_queued_jobs``), bytes of uploads
those jobs hold (``max_user_blob_bytes``) and bytes of output stored per job
(``max_job_output``). A submission over a quota is refused with 409 ``quota_exceeded`` naming
it; a job whose output goes past its quota fails once, naming it, its ranks are stopped, and
nothing beyond the quota is stored. Other users notice nothing.

Held heartbeats run on trio's MockClock without autojump (as in
``test_coordinator_held_heartbeat``): an answer at trio time 0 was woken by the failure.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import sqlite_utils
import trio
import trio.testing
from coord_helpers import HELLO, Agent, Pool, decode, make_zip, open_pool, sha, test_settings

from vpool.coordinator import migrations
from vpool.coordinator.sqlite_store import SqliteStore
from vpool.protocol import api


async def _submit(
    pool: Pool, bundle: str, stdin: str | None = None, user: str = "alice"
) -> httpx.Response:
    sub = api.JobSubmit(ranks=1, bundle=bundle, entry="app.py", stdin=stdin)
    return await pool.post("/api/v1/jobs", sub, pool.user(user))


def _quota_error(r: httpx.Response, quota: str) -> str:
    """The message of a 409 ``quota_exceeded`` answer naming ``quota``."""
    assert r.status_code == 409, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message"}, body
    assert body["error"]["code"] == "quota_exceeded"
    message: str = body["error"]["message"]
    assert quota in message
    return message


async def _held_heartbeat(
    pool: Pool, agent: Agent, leases: list[api.Lease]
) -> api.AgentHeartbeatResponse:
    hb = api.AgentHeartbeat(
        ranks=[
            api.RankState(job=x.job, rank=x.rank, incarnation=x.incarnation, state="running")
            for x in leases
        ],
        free_slots=0,
        wait=30.0,
    )
    r = await pool.post("/api/v1/agents/heartbeat", hb, agent.headers)
    return decode(r, api.AgentHeartbeatResponse)


async def _until(done: Callable[[], object], what: str) -> None:
    """Until ``done()`` (the store runs in threads, so "all tasks blocked" alone may come
    before a request got where it waits)."""
    for _ in range(100_000):
        if done():
            return
        await trio.testing.wait_all_tasks_blocked()
    raise AssertionError(f"never {what}")


def _events(detail: api.JobDetail, *kinds: str) -> list[api.JobEvent]:
    return [e for e in detail.events if e.kind in kinds]


async def test_output_past_max_job_output_fails_the_job_once(tmp_path: Path) -> None:
    async with open_pool(tmp_path, max_job_output=1000) as pool:
        await pool.register_relay()
        alice = await pool.submit(2)
        bob = await pool.submit(1, user="bob")
        agent = await pool.enroll(slots=3)
        leases = await pool.lease(agent)
        await pool.heartbeat(agent, leases)
        mine = [x for x in leases if x.job == alice.id]
        theirs = [x for x in leases if x.job == bob.id]
        carol = await pool.submit(2, user="carol")
        assert carol.state == "queued"  # no free slot

        assert (await pool.output(agent, mine[0], "stdout", 0, b"a" * 600)).status_code < 300
        r = await pool.output(agent, mine[1], "stderr", 0, b"b" * 600)
        assert r.status_code < 300  # the agent's post is fine: it is the job that failed

        detail = await pool.job(alice.id)
        assert detail.job.state == "failed"
        assert detail.job.reason.startswith("job output exceeded max_job_output (1000 bytes)")
        assert "rank 1's stderr" in detail.job.reason
        # Its slots went to the job that waited, at once.
        assert (await pool.job(carol.id, "carol")).job.state == "running"
        stops = (await pool.heartbeat(agent, leases)).stop
        assert sorted((s.job, s.rank) for s in stops) == [(alice.id, 0), (alice.id, 1)]
        assert all("max_job_output" in s.reason for s in stops)

        # Ranks that go on talking before they stop: nothing more is stored, no second end.
        await pool.output(agent, mine[1], "stderr", 600, b"c" * 100)
        await pool.output(agent, mine[0], "stdout", 600, b"d" * 100)
        assert pool.core.store.output_streams(alice.id) == {
            (0, "stdout"): b"a" * 600,
            (1, "stderr"): b"b" * 400,  # up to the quota, not a byte more
        }
        detail = await pool.job(alice.id)
        assert len(_events(detail, "failed", "output_cut")) == 1

        # Bob's job runs on, on the same agent, and his output is his own quota's.
        await pool.output(agent, theirs[0], "stdout", 0, b"e" * 900)
        assert pool.core.store.output_streams(bob.id) == {(0, "stdout"): b"e" * 900}
        assert (await pool.job(bob.id, "bob")).job.state == "running"


async def test_the_others_ranks_stop_at_once_when_output_goes_past_the_quota(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with open_pool(tmp_path, max_job_output=100) as pool:
        _, agent, leases = await pool.running_job(2)
        got: list[api.AgentHeartbeatResponse] = []

        async def beat() -> None:
            got.append(await _held_heartbeat(pool, agent, leases[1:]))

        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(beat)
            await _until(lambda: pool.core.ended.current().statistics().tasks_waiting, "held")
            assert not got
            await pool.output(agent, leases[0], "stdout", 0, b"x" * 101)
            await _until(lambda: got, "answered")
        assert trio.current_time() == start  # woken by the failure, not by the hold's end
        assert [s.rank for s in got[0].stop] == [1]
        assert "max_job_output (100 bytes)" in got[0].stop[0].reason


async def test_output_of_an_ended_job_is_cut_at_the_quota_with_one_event(
    tmp_path: Path,
) -> None:
    async with open_pool(tmp_path, max_job_output=100) as pool:
        job, agent, leases = await pool.running_job(2)
        await pool.exit(agent, leases[0], 3)  # the job fails; rank 1 is being stopped
        # Rank 1's last words come after the end, and are more than the quota holds.
        for offset, size in ((0, 80), (80, 80), (160, 50)):
            await pool.output(agent, leases[1], "stderr", offset, b"t" * size)
        assert pool.core.store.output_streams(job.id) == {(1, "stderr"): b"t" * 100}
        detail = await pool.job(job.id)
        assert (detail.job.state, detail.job.reason) == ("failed", "rank 0 exited with code 3")
        [cut] = _events(detail, "output_cut")
        assert cut.rank == 1 and "max_job_output (100 bytes)" in cut.message


async def test_submissions_past_max_queued_jobs_are_refused(tmp_path: Path) -> None:
    async with open_pool(tmp_path, max_queued_jobs=2) as pool:
        await pool.register_relay()
        agent = await pool.enroll(slots=1)
        bundle = await pool.upload(make_zip({"app.py": HELLO}))
        first = decode(await _submit(pool, bundle), api.JobInfo)
        assert first.state == "running"
        assert decode(await _submit(pool, bundle), api.JobInfo).state == "queued"

        message = _quota_error(await _submit(pool, bundle), "max_queued_jobs (2)")
        assert "you have 2 jobs queued or running" in message
        assert len((await pool.client.get("/api/v1/jobs", headers=pool.user())).json()) == 2
        # Another user's jobs are not counted against alice, nor hers against them (bob
        # uploads the same bundle: a blob is the uploader's).
        assert await pool.upload(make_zip({"app.py": HELLO}), user="bob") == bundle
        assert (await _submit(pool, bundle, user="bob")).status_code == 201

        [lease] = await pool.lease(agent)
        await pool.heartbeat(agent, [lease])
        await pool.exit(agent, lease, 0)  # alice's running job ends: one place is free
        assert (await _submit(pool, bundle)).status_code == 201
        _quota_error(await _submit(pool, bundle), "max_queued_jobs")


async def test_submissions_past_max_user_blob_bytes_are_refused(tmp_path: Path) -> None:
    app = make_zip({"app.py": HELLO})
    limit = len(app) + 600 + 300
    async with open_pool(tmp_path, max_user_blob_bytes=limit) as pool:
        bundle = await pool.upload(app)
        big, small = [await pool.upload(bytes([n]) * size) for n, size in enumerate((600, 300))]

        first = decode(await _submit(pool, bundle, big), api.JobInfo)
        # The bundle the first job holds already is counted once: this fits exactly.
        assert (await _submit(pool, bundle, small)).status_code == 201
        one = await pool.upload(b"\x02")
        message = _quota_error(await _submit(pool, bundle, one), "max_user_blob_bytes")
        assert "queued and running jobs would hold" in message
        # A blob her jobs hold already adds nothing.
        again = decode(await _submit(pool, bundle, big), api.JobInfo)
        # Another user's uploads are his own (the same bytes, uploaded by him).
        for blob in (app, bytes([0]) * 600):
            await pool.upload(blob, user="bob")
        assert (await _submit(pool, bundle, big, user="bob")).status_code == 201

        # A job that could never fit says so. (Its two blobs could not even wait for a job
        # together: one is named by a job already.)
        half = b"h" * (limit // 2 + 1)
        stdin = await pool.upload(half, user="carol")
        await pool.upload(app, user="carol")
        assert (await _submit(pool, bundle, stdin, user="carol")).status_code == 201
        bundle2 = await pool.upload(make_zip({"app.py": HELLO, "pad": half}), user="carol")
        message = _quota_error(
            await _submit(pool, bundle2, stdin, user="carol"), "max_user_blob_bytes"
        )
        assert "this job's bundle and stdin hold" in message

        # Ended jobs hold nothing.
        for job in (first, again):
            r = await pool.client.post(f"/api/v1/jobs/{job.id}/cancel", headers=pool.user())
            assert r.status_code == 200, r.text
        assert (await _submit(pool, bundle, one)).status_code == 201


async def test_uploads_no_job_uses_are_held_to_max_user_blob_bytes(tmp_path: Path) -> None:
    """Uploads are counted before any job names them (else a user could fill the disk with
    uploads never submitted until they are collected): past the quota an upload is refused,
    and stored nowhere."""
    async with open_pool(tmp_path, max_user_blob_bytes=1000) as pool:
        first = await pool.upload(b"a" * 600)
        data = b"b" * 500
        r = await pool.client.put(f"/api/v1/blobs/{sha(data)}", content=data, headers=pool.user())
        assert r.status_code == 409, r.text
        error = r.json()["error"]
        assert error["code"] == "quota_exceeded" and "max_user_blob_bytes" in error["message"]
        assert not pool.core.blobs.path(sha(data)).exists()
        r = await pool.client.head(f"/api/v1/blobs/{sha(data)}", headers=pool.user())
        assert r.status_code == 404
        # The same blob again adds nothing; another user's uploads are his own.
        assert await pool.upload(b"a" * 600) == first
        assert await pool.upload(data, user="bob") == sha(data)
        # A blob a job names is used: it no longer counts, and anything it names is taken.
        app = await pool.upload(make_zip({"app.py": HELLO}), user="bob")
        r = await pool.post(
            "/api/v1/jobs",
            api.JobSubmit(ranks=1, bundle=app, entry="app.py", stdin=sha(data)),
            pool.user("bob"),
        )
        assert r.status_code == 201, r.text
        assert await pool.upload(data) == sha(data)  # alice: named by bob's job


def test_quotas_are_at_least_one(tmp_path: Path) -> None:
    for quota in ("max_queued_jobs", "max_job_output", "max_user_blob_bytes"):
        with pytest.raises(ValueError, match=quota):
            test_settings(tmp_path, **{quota: 0})


def test_an_older_database_counts_the_output_its_jobs_stored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "vpool.db"
    before = migrations.MIGRATIONS.index(migrations._m12_quotas)
    with monkeypatch.context() as patch:
        patch.setattr(migrations, "MIGRATIONS", migrations.MIGRATIONS[:before])
        SqliteStore(path).close()
    db = sqlite_utils.Database(path)
    for job, state in ((1, "running"), (2, "succeeded"), (3, "queued")):
        db.execute(
            "INSERT INTO jobs (id, user, name, state, ranks, bundle, entry, args, created) "
            "VALUES (?, 'alice', '', ?, 1, '', 'app.py', '[]', 0)",
            [job, state],
        )
    db.execute(
        "INSERT INTO output (job, rank, stream, offset, data) VALUES "
        "(1, 0, 'stdout', 0, ?), (1, 0, 'stderr', 0, ?), (2, 0, 'stdout', 0, ?)",
        [b"x" * 10, b"y" * 5, b"z" * 7],
    )
    db.close()
    store = SqliteStore(path)
    rows = store.db.query("SELECT id, output_bytes, output_cut FROM jobs ORDER BY id")
    assert [(r["id"], r["output_bytes"], r["output_cut"]) for r in rows] == [
        (1, 15, None),
        (2, 7, None),
        (3, 0, None),
    ]
    store.close()


async def test_output_pages_read_no_more_than_their_bytes(tmp_path: Path) -> None:
    """Issue 35: eight portal views of a job with 48 MiB of output took the coordinator from
    175 MiB to 1.24 GiB. A page stops reading rows once it holds its bytes (the first record
    always comes, however large); what remains is said."""
    async with open_pool(tmp_path, max_request_bytes=8 << 20) as pool:
        await pool.register_relay()
        agent = await pool.enroll(slots=1)
        job = await pool.submit(1)
        [lease] = await pool.lease(agent)
        await pool.heartbeat(agent, [lease])
        chunk = b"x" * (1 << 20)
        for i in range(6):
            r = await pool.output(agent, lease, "stdout", i << 20, chunk)
            assert r.status_code == 200, r.text
        store = pool.core.store
        records, more = store.output_page(job.id, 0, None, 1000, 3 << 20)
        assert [len(r.data) for r in records] == [1 << 20] * 3 and more
        records, more = store.output_page(job.id, records[-1].id, None, 1000, 3 << 20)
        assert len(records) == 3 and not more
        records, more = store.output_page(job.id, 0, None, 1000, 1000)  # smaller than one
        assert len(records) == 1 and more
        records, more = store.output_page(job.id, 0, None, 2)  # by count, as before
        assert len(records) == 2 and more
        page = await pool.client.get(f"/api/v1/jobs/{job.id}/output", headers=pool.user())
        body = page.json()
        assert len(body["records"]) == 4 and not body["complete"]  # OUTPUT_PAGE_BYTES: 4 MiB
