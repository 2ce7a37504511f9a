"""The happy path and the job end rules, through the HTTP API."""

from __future__ import annotations

import io
import zipfile

import trio
import trio.testing
from coord_helpers import Pool, decode, make_zip

from vpool.coordinator.service import Signal
from vpool.protocol import api
from vpool.protocol.tokens import RankClaims, public_key_from_text, verify_token


async def parked(signal: Signal) -> None:
    """Wait until a long-poll is parked on ``signal`` (so the test exercises the wake-up, not
    an answer that was ready at once). The caller's fail_after bounds the wait."""
    while signal.current().statistics().tasks_waiting == 0:
        await trio.testing.wait_all_tasks_blocked(cushion=0.001)


async def test_submit_lease_run_succeed(pool: Pool) -> None:
    r = await pool.client.get("/api/v1/pool")
    info = decode(r, api.PoolInfo)
    assert info.name == "test-pool"
    who = decode(await pool.client.get("/api/v1/whoami", headers=pool.user()), api.UserInfo)
    assert who.name == "alice"

    job = await pool.submit(2, stdin=b"input\n", args=["-n", "3"])
    assert job.state == "queued" and job.user == "alice"
    await pool.register_relay("relay-0")
    await pool.register_relay("relay-1", port=7001)
    agent = await pool.enroll("agent-1", slots=4)
    live = decode(await pool.client.get("/api/v1/pool"), api.PoolInfo)
    assert (live.agents, live.relays) == (1, 2)

    leases = await pool.lease(agent)
    assert [x.rank for x in leases] == [0, 1]
    first = leases[0]
    assert first.size == 2 and first.entry == "app.py" and first.args == ["-n", "3"]
    assert first.stdin is not None and first.incarnation == 1
    assert sorted(x.name for x in first.relays) == ["relay-0", "relay-1"]
    assert first.homes == [r % len(first.relays) for r in range(2)]
    claims = verify_token(
        first.token, public_key_from_text(info.signing_key), now=pool.clock(), kind=RankClaims
    )
    assert (claims.job, claims.rank, claims.agent, claims.size) == (job.id, 0, agent.id, 2)
    assert claims.expires > pool.clock() + 6 * 24 * 3600

    # A lease is handed out once.
    assert await pool.lease(agent) == []

    blob = await pool.client.get(f"/api/v1/agents/blobs/{first.bundle}", headers=agent.headers)
    assert blob.status_code == 200 and zipfile.is_zipfile(io.BytesIO(blob.content))

    hb = await pool.heartbeat(agent, leases)
    assert hb.stop == [] and hb.agent_token
    detail = await pool.job(job.id)
    assert detail.job.state == "running"
    assert [x.state for x in detail.ranks] == ["running", "running"]
    assert {x.agent for x in detail.ranks} == {agent.id}

    for lease in leases:
        assert (await pool.output(agent, lease, "stdout", 0, b"hi\n")).status_code == 200
        assert (await pool.exit(agent, lease, 0)).status_code == 200
    detail = await pool.job(job.id)
    assert detail.job.state == "succeeded" and detail.job.exit_code == 0
    assert detail.job.finished is not None
    assert [x.state for x in detail.ranks] == ["exited", "exited"]
    kinds = [e.kind for e in detail.events]
    assert kinds[0] == "queued" and "running" in kinds and kinds[-1] == "succeeded"

    # Relays are told the job is over so they can delete its logs.
    assert job.id in (await pool.relay_heartbeat("relay-0")).finished_jobs

    listed = decode(await pool.client.get("/api/v1/jobs", headers=pool.user()), list[api.JobInfo])
    assert [j.id for j in listed] == [job.id]


async def test_reenrolling_the_same_key_keeps_the_id(pool: Pool) -> None:
    agent = await pool.enroll("a", slots=1)
    again = await pool.enroll_key(agent.key, "a", 3)
    assert again.id == agent.id


async def test_gang_job_waits_for_enough_slots(pool: Pool) -> None:
    await pool.register_relay()
    job = await pool.submit(3)
    a1 = await pool.enroll("agent-1", slots=2)
    assert await pool.lease(a1) == []
    assert (await pool.job(job.id)).job.state == "queued"

    a2 = await pool.enroll("agent-2", slots=1)
    l1, l2 = await pool.lease(a1), await pool.lease(a2)
    assert len(l1) == 2 and len(l2) == 1
    # Round-robin, agent with most free slots first.
    placed = {x.rank: x.agent for x in (await pool.job(job.id)).ranks}
    assert placed == {0: a1.id, 1: a2.id, 2: a1.id}


async def test_lease_long_poll_wakes_on_submit(pool: Pool) -> None:
    await pool.register_relay()
    agent = await pool.enroll("agent-1", slots=1)
    got: list[api.Lease] = []

    async def poll() -> None:
        got.extend(await pool.lease(agent, wait=10))

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(poll)
            await parked(pool.core.work)
            await pool.submit(1)
    assert len(got) == 1


async def test_job_detail_long_poll_wakes_on_a_change(pool: Pool) -> None:
    job, agent, leases = await pool.running_job(2)
    url = f"/api/v1/jobs/{job.id}"
    first = await pool.job(job.id)
    assert first.job.state == "running" and len(first.mark) == 16
    # Asked again with nothing changed, the same detail and mark; a mark that is not the
    # current one (a stale or made-up one) is answered at once.
    assert await pool.job(job.id) == first
    with trio.fail_after(2):
        stale = await pool.client.get(
            url, params={"wait": 30, "seen": "0" * 16}, headers=pool.user()
        )
    assert decode(stale, api.JobDetail) == first
    got: list[api.JobDetail] = []

    async def poll() -> None:
        r = await pool.client.get(url, params={"wait": 30, "seen": first.mark}, headers=pool.user())
        got.append(decode(r, api.JobDetail))

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(poll)
            await parked(pool.core.changes)
            assert got == []  # held: nothing changed yet
            await pool.exit(agent, leases[1], 3)
    (woken,) = got
    assert woken.job.state == "failed" and woken.mark != first.mark
    assert woken.events[-1].kind == "failed", woken.events


async def test_job_detail_long_poll_ends_after_its_wait_unchanged(pool: Pool) -> None:
    job = await pool.submit(1)
    first = await pool.job(job.id)
    url = f"/api/v1/jobs/{job.id}"
    with trio.fail_after(5):
        r = await pool.client.get(
            url, params={"wait": 0.3, "seen": first.mark}, headers=pool.user()
        )
    assert decode(r, api.JobDetail) == first
    # Only the job's owner (or an operator) may wait on it; a malformed wait is a 422.
    for params, user, status in [
        ({"wait": 5, "seen": first.mark}, "bob", 404),
        ({"wait": "soon"}, "alice", 422),
    ]:
        with trio.fail_after(2):
            r = await pool.client.get(url, params=params, headers=pool.user(user))
        assert r.status_code == status, r.text


async def test_nonzero_exit_fails_job_and_stops_others(pool: Pool) -> None:
    job, agent, leases = await pool.running_job(3)
    await pool.exit(agent, leases[1], 3)
    detail = await pool.job(job.id)
    assert detail.job.state == "failed" and detail.job.exit_code == 3
    assert detail.job.reason == "rank 1 exited with code 3"
    hb = await pool.heartbeat(agent, [leases[0], leases[2]])
    assert sorted(s.rank for s in hb.stop) == [0, 2]
    assert all("rank 1 exited with code 3" in s.reason for s in hb.stop)
    # The stopped ranks' exits are recorded without changing the outcome.
    await pool.exit(agent, leases[0], -15)
    detail = await pool.job(job.id)
    assert detail.job.exit_code == 3
    assert [x.state for x in detail.ranks] == ["killed", "exited", "killed"]


async def test_abort_fails_job(pool: Pool) -> None:
    await pool.register_relay()
    job = await pool.submit(2)
    agent = await pool.enroll(slots=2)
    leases = await pool.lease(agent)
    await pool.exit(agent, leases[0], 7, aborted=True)
    detail = await pool.job(job.id)
    assert detail.job.state == "failed" and detail.job.exit_code == 7
    assert detail.job.reason == "rank 0 called MPI.Abort(7)"


async def test_cancel(pool: Pool) -> None:
    await pool.register_relay()
    job = await pool.submit(1)
    agent = await pool.enroll(slots=1)
    leases = await pool.lease(agent)
    r = await pool.client.post(f"/api/v1/jobs/{job.id}/cancel", headers=pool.user())
    info = decode(r, api.JobInfo)
    assert info.state == "cancelled" and info.exit_code is None
    hb = await pool.heartbeat(agent, leases, state="starting")
    assert [s.reason for s in hb.stop] == ["job cancelled"]
    # Cancelling an ended job is refused, and the job stays as it was.
    again = await pool.client.post(f"/api/v1/jobs/{job.id}/cancel", headers=pool.user())
    assert again.status_code == 409 and again.json()["error"]["code"] == "job_ended"
    assert "already ended (cancelled)" in again.json()["error"]["message"]
    assert (await pool.job(job.id)).job.state == "cancelled"


async def test_cancel_queued_job_never_leases(pool: Pool) -> None:
    job = await pool.submit(1)
    await pool.client.post(f"/api/v1/jobs/{job.id}/cancel", headers=pool.user())
    await pool.register_relay()
    agent = await pool.enroll(slots=1)
    assert await pool.lease(agent) == []


async def test_users_see_only_their_jobs(pool: Pool) -> None:
    job = await pool.submit(1, user="alice")
    bob = pool.user("bob")
    assert decode(await pool.client.get("/api/v1/jobs", headers=bob), list[api.JobInfo]) == []
    for method, url in (
        ("GET", f"/api/v1/jobs/{job.id}"),
        ("GET", f"/api/v1/jobs/{job.id}/output"),
        ("GET", f"/api/v1/jobs/{job.id}/results"),
        ("POST", f"/api/v1/jobs/{job.id}/cancel"),
    ):
        r = await pool.client.request(method, url, headers=bob)
        assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_job"
    assert (await pool.job(job.id)).job.state == "queued"


async def test_output_idempotent_and_long_poll(pool: Pool) -> None:
    await pool.register_relay()
    job = await pool.submit(2)
    agent = await pool.enroll(slots=2)
    leases = await pool.lease(agent)
    url = f"/api/v1/jobs/{job.id}/output"

    page = decode(await pool.client.get(url, headers=pool.user()), api.OutputPage)
    assert page.records == [] and page.next == 0 and not page.complete

    results: list[api.OutputPage] = []

    async def poll() -> None:
        r = await pool.client.get(url, params={"after": 0, "wait": 10}, headers=pool.user())
        results.append(decode(r, api.OutputPage))

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(poll)
            await parked(pool.core.changes)
            await pool.output(agent, leases[0], "stdout", 0, b"one\n")
    assert [x.data for x in results[0].records] == [b"one\n"]

    await pool.output(agent, leases[0], "stdout", 0, b"one\n")  # re-sent: stored once
    await pool.output(agent, leases[0], "stdout", 4, b"two\n")
    await pool.output(agent, leases[1], "stderr", 0, b"oops\n")
    page = decode(await pool.client.get(url, headers=pool.user()), api.OutputPage)
    assert [(x.rank, x.stream, x.data) for x in page.records] == [
        (0, "stdout", b"one\n"),
        (0, "stdout", b"two\n"),
        (1, "stderr", b"oops\n"),
    ]
    assert [x.id for x in page.records] == sorted(x.id for x in page.records)

    only1 = decode(
        await pool.client.get(url, params={"rank": 1}, headers=pool.user()), api.OutputPage
    )
    assert [x.data for x in only1.records] == [b"oops\n"]
    after = decode(
        await pool.client.get(url, params={"after": page.records[0].id}, headers=pool.user()),
        api.OutputPage,
    )
    assert len(after.records) == 2

    for lease in leases:
        await pool.exit(agent, lease, 0)
    # Terminal: a long poll returns at once, complete.
    with trio.fail_after(2):
        last = decode(
            await pool.client.get(
                url, params={"after": page.next, "wait": 30}, headers=pool.user()
            ),
            api.OutputPage,
        )
    assert last.records == [] and last.complete and last.state == "succeeded"


async def test_results_zip(pool: Pool) -> None:
    await pool.register_relay()
    job = await pool.submit(2)
    agent = await pool.enroll(slots=2)
    leases = await pool.lease(agent)
    await pool.output(agent, leases[0], "stdout", 0, b"hello ")
    await pool.output(agent, leases[0], "stdout", 6, b"world\n")
    await pool.output(agent, leases[1], "stderr", 0, b"warn\n")
    for lease in leases:
        files = make_zip({"out/result.txt": f"rank {lease.rank}".encode()})
        r = await pool.client.put(
            f"/api/v1/agents/results/{job.id}/{lease.rank}/{lease.incarnation}",
            content=files,
            headers=agent.headers,
        )
        assert r.status_code == 200, r.text
        await pool.exit(agent, lease, 0)

    r = await pool.client.get(f"/api/v1/jobs/{job.id}/results", headers=pool.user())
    assert r.status_code == 200 and r.headers["content-type"] == "application/zip"
    with zipfile.ZipFile(io.BytesIO(r.content)) as zf:
        assert zf.read("rank-0.stdout") == b"hello world\n"
        assert zf.read("rank-1.stderr") == b"warn\n"
        assert zf.read("rank-0.stderr") == b""
        assert zf.read("rank-0/out/result.txt") == b"rank 0"
        assert zf.read("rank-1/out/result.txt") == b"rank 1"


async def test_agent_cannot_report_for_others(pool: Pool) -> None:
    await pool.register_relay()
    await pool.submit(1)
    a1 = await pool.enroll("agent-1", slots=1)
    a2 = await pool.enroll("agent-2", slots=1)
    leases = await pool.lease(a1) + await pool.lease(a2)
    assert len(leases) == 1
    owner, other = (
        (a1, a2) if leases[0].rank == 0 and await _owns(pool, a1, leases[0]) else (a2, a1)
    )
    r = await pool.exit(other, leases[0], 0)
    assert r.status_code == 403 and r.json()["error"]["code"] == "not_your_rank"
    assert (await pool.exit(owner, leases[0], 0)).status_code == 200


async def _owns(pool: Pool, agent: object, lease: api.Lease) -> bool:
    detail = await pool.job(lease.job)
    return detail.ranks[lease.rank].agent == agent.id  # type: ignore[attr-defined]
