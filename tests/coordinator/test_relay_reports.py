"""A relay's refusal of a job (its quota, its disk) and the jobs it holds files of, on the
coordinator's side (issue 20)."""

from __future__ import annotations

from coord_helpers import Pool, decode, relay_headers

from vpool.protocol import api


async def _running(pool: Pool) -> tuple[int, list[api.Lease]]:
    await pool.register_relay("relay-0")
    job = await pool.submit(2)
    agent = await pool.enroll("agent-1", slots=2)
    leases = await pool.lease(agent)
    await pool.heartbeat(agent, leases)
    return job.id, leases


async def test_a_relay_refusal_fails_the_job_once_with_its_reason(pool: Pool) -> None:
    job, _ = await _running(pool)
    message = "job 1 exceeded job_log_quota (16 GiB) at relay relay-0: its message logs ..."
    report = api.RelayRefused(name="relay-0", job=job, code="quota_exceeded", message=message)
    await pool.register_relay("relay-1", port=7001)
    stranger = api.RelayRefused(name="relay-1", job=job, code="disk_full", message="forged")
    r = await pool.post("/api/v1/relays/refused", stranger, relay_headers("relay-1"))
    assert r.status_code == 403 and r.json()["error"]["code"] == "not_your_job"
    assert (await pool.job(job)).job.state == "running"
    for _ in range(2):  # the second is late: nothing changes
        r = await pool.post("/api/v1/relays/refused", report, relay_headers("relay-0"))
        assert r.status_code == 200, r.text
    detail = await pool.job(job)
    assert (detail.job.state, detail.job.reason) == ("failed", message)
    assert [e.message for e in detail.events if e.kind == "job_failed"] == [
        f"relay relay-0: {message}"
    ]


async def test_held_jobs_that_do_not_run_on_the_relay_are_answered_as_over(pool: Pool) -> None:
    running, _ = await _running(pool)
    queued = (await pool.submit(8)).id  # no room: never started
    hb = api.RelayHeartbeat(name="relay-0", load=api.RelayLoad(), jobs=[running, queued, 999])
    r = await pool.post("/api/v1/relays/heartbeat", hb, relay_headers("relay-0"))
    assert decode(r, api.RelayHeartbeatResponse).finished_jobs == [queued, 999]
