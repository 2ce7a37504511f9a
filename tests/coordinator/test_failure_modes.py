"""Failure modes (``JobSubmit.on_failure``), the coordinator's part: in "ulfm" and FT-MPI's
"blank", "shrink" and "rebuild" (which differ from it only inside the MPI runtime) a lost rank is
declared failed, not replaced; every relay of the job is told to fence it, and only once all have
put the fence up are the agents of the other ranks told (so no rank hears of a failure while a
relay would still take the failed rank's frames). The job succeeds when the survivors exit 0. A
"rebuild" job's new processes in the failed ranks' places are spawns of the job."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing
from coord_helpers import Agent, Pool, decode, make_zip, open_pool

from vpool.protocol import api

# The modes that report failures, in the API's order: each test below runs in every one.
REPORTING = [mode for mode in api.FAILURE_MODES if mode in api.REPORTING_MODES]
reporting = pytest.mark.parametrize("mode", REPORTING)


async def _running(
    pool: Pool, ranks: int = 3, mode: api.FailureMode = "ulfm"
) -> tuple[api.JobInfo, Agent, list[api.Lease]]:
    await pool.register_relay("relay-0", 7000)
    await pool.register_relay("relay-1", 7001)
    job = await pool.submit(ranks, on_failure=mode)
    agent = await pool.enroll("agent-1", slots=ranks)
    leases = await pool.lease(agent)
    await pool.heartbeat(agent, leases)
    return job, agent, leases


async def _lose(pool: Pool, agent: Agent, lease: api.Lease) -> None:
    ex = api.RankExit(
        job=lease.job, rank=lease.rank, incarnation=lease.incarnation, code=-9, lost=True
    )
    assert (await pool.post("/api/v1/agents/exit", ex, agent.headers)).status_code == 200


async def _fence_everywhere(pool: Pool) -> None:
    for relay in ("relay-0", "relay-1"):
        told = (await pool.relay_heartbeat(relay)).fence
        await pool.relay_heartbeat(relay, fenced=told)


def test_the_modes_and_those_that_report_failures() -> None:
    assert api.FAILURE_MODES == ("transparent", "abort", "ulfm", "blank", "shrink", "rebuild")
    assert REPORTING == ["ulfm", "blank", "shrink", "rebuild"]


@reporting
async def test_the_mode_is_stored_and_turns_logging_off(pool: Pool, mode: api.FailureMode) -> None:
    job, _, leases = await _running(pool, ranks=2, mode=mode)
    assert (job.on_failure, job.fault_tolerance) == (mode, False)
    assert {(x.on_failure, tuple(x.env.items())) for x in leases} == {(mode, (("VPOOL_FT", "0"),))}
    detail = await pool.job(job.id)
    assert detail.job.on_failure == mode
    queued = [e.message for e in detail.events if e.kind == "queued"]
    assert queued == [
        f"submitted by alice: 2 ranks, lost ranks are reported to the program (on-failure {mode})"
    ]


@reporting
async def test_checkpoints_and_validation_need_the_transparent_mode(
    pool: Pool, mode: api.FailureMode
) -> None:
    bundle = await pool.upload(make_zip({"app.py": b"print(1)\n"}))
    for extra in ({"checkpoint_every": 600.0}, {"validate": True}):
        sub = api.JobSubmit(ranks=2, bundle=bundle, entry="app.py", on_failure=mode, **extra)  # type: ignore[arg-type]
        r = await pool.post("/api/v1/jobs", sub, pool.user())
        assert 400 <= r.status_code < 500 and "on_failure" in r.text, r.text
    r = await pool.post(
        "/api/v1/jobs",
        {"ranks": 2, "bundle": bundle, "entry": "app.py", "on_failure": "shrug"},
        pool.user(),
    )
    assert 400 <= r.status_code < 500 and "on_failure" in r.text, r.text


@reporting
async def test_a_lost_rank_is_declared_failed_fenced_everywhere_then_told(
    pool: Pool, mode: api.FailureMode
) -> None:
    job, agent, leases = await _running(pool, mode=mode)
    await _lose(pool, agent, leases[1])
    detail = await pool.job(job.id)
    assert detail.job.state == "running" and detail.job.failed_ranks == [1]
    assert [(r.rank, r.incarnation, r.state) for r in detail.ranks] == [
        (0, 1, "running"),
        (1, 1, "failed"),
        (2, 1, "running"),
    ]
    (event,) = [e for e in detail.events if e.kind == "rank_failed"]
    assert event.rank == 1 and event.message.endswith(
        f"declared failed; the other ranks are told (on-failure {mode})"
    )
    assert await pool.lease(agent) == []  # no replacement
    assert not [e for e in detail.events if e.kind == "rank_restarted"]

    survivors = [leases[0], leases[2]]
    # Not told before every relay has fenced it.
    assert (await pool.heartbeat(agent, survivors)).failed == []
    fence = api.RankFence(job=job.id, rank=1, incarnation=1)
    assert (await pool.relay_heartbeat("relay-0")).fence == [fence]
    assert (await pool.relay_heartbeat("relay-0", fenced=[fence])).fence == []
    assert (await pool.heartbeat(agent, survivors)).failed == []
    assert (await pool.relay_heartbeat("relay-1")).fence == [fence]  # repeated until put up
    await pool.relay_heartbeat("relay-1", fenced=[fence])
    hb = await pool.heartbeat(agent, survivors)
    assert hb.failed == [api.JobFailures(job=job.id, ranks=[1])]
    assert hb.stop == []
    # The failed incarnation, still reported by its agent (a revenant), is told to stop.
    hb = await pool.heartbeat(agent, leases)
    assert [(s.rank, s.reason) for s in hb.stop] == [
        (1, "the rank was declared failed: the other ranks carry on without it")
    ]
    # A confirmation of a fence never asked for changes nothing.
    bogus = api.RankFence(job=job.id, rank=0, incarnation=1)
    await pool.relay_heartbeat("relay-0", fenced=[bogus])
    assert (await pool.heartbeat(agent, survivors)).failed == [
        api.JobFailures(job=job.id, ranks=[1])
    ]


@reporting
async def test_the_survivors_exiting_zero_make_the_job_succeed(
    pool: Pool, mode: api.FailureMode
) -> None:
    job, agent, leases = await _running(pool, mode=mode)
    await _lose(pool, agent, leases[2])
    await _fence_everywhere(pool)
    for lease in leases[:2]:
        assert (await pool.exit(agent, lease, 0)).status_code == 200
    detail = await pool.job(job.id)
    assert (detail.job.state, detail.job.exit_code) == ("succeeded", 0)
    assert detail.job.reason == (
        "every surviving rank exited with code 0; rank(s) 2 failed and the program carried on "
        f"without them (on-failure {mode})"
    )
    # The failed rank's late exit report changes nothing.
    assert (await pool.exit(agent, leases[2], 1)).status_code == 200
    assert (await pool.job(job.id)).job.state == "succeeded"


@reporting
async def test_a_survivor_failing_fails_the_job_and_so_does_losing_them_all(
    pool: Pool, mode: api.FailureMode
) -> None:
    job, agent, leases = await _running(pool, mode=mode)
    await _lose(pool, agent, leases[0])
    assert (await pool.exit(agent, leases[1], 2)).status_code == 200
    detail = await pool.job(job.id)
    assert (detail.job.state, detail.job.exit_code) == ("failed", 2)

    second = await pool.submit(2, on_failure=mode)
    leases = await pool.lease(agent)
    assert {x.job for x in leases} == {second.id}
    await pool.heartbeat(agent, leases)
    await _lose(pool, agent, leases[0])
    await _lose(pool, agent, leases[1])
    detail = await pool.job(second.id)
    assert detail.job.state == "failed"
    assert detail.job.reason.startswith("every rank failed; the last: rank 1 lost")
    assert detail.job.failed_ranks == [0, 1]


@reporting
async def test_an_agent_that_goes_silent_is_a_failure_too(
    pool: Pool, mode: api.FailureMode
) -> None:
    job, _, _ = await _running(pool, ranks=2, mode=mode)
    other = await pool.enroll("agent-2", slots=2)
    pool.clock.advance(60)
    await pool.heartbeat(other, [])
    for relay in ("relay-0", "relay-1"):
        await pool.relay_heartbeat(relay)
    await pool.core.check_timeouts()
    detail = await pool.job(job.id)
    # Both ranks ran there: both failed, so the job failed, and nothing was restarted.
    assert detail.job.state == "failed" and detail.job.failed_ranks == [0, 1]
    assert await pool.lease(other) == []


async def test_abort_mode_fails_the_job_at_the_first_loss(pool: Pool) -> None:
    await pool.register_relay()
    job = await pool.submit(2, on_failure="abort")
    assert (job.on_failure, job.fault_tolerance) == ("abort", False)
    agent = await pool.enroll(slots=2)
    leases = await pool.lease(agent)
    await pool.heartbeat(agent, leases)
    await _lose(pool, agent, leases[1])
    detail = await pool.job(job.id)
    assert detail.job.state == "failed"
    assert detail.job.reason.startswith("rank 1 lost: its process on agent agent-1 died")


async def test_a_held_heartbeat_answers_once_the_last_relay_fenced(
    pool: Pool, mock_clock: trio.testing.MockClock
) -> None:
    job, agent, leases = await _running(pool)
    await _lose(pool, agent, leases[1])
    survivors = [leases[0], leases[2]]
    fence = api.RankFence(job=job.id, rank=1, incarnation=1)
    await pool.relay_heartbeat("relay-0", fenced=[fence])
    got: list[api.AgentHeartbeatResponse] = []

    async def beat() -> None:
        hb = api.AgentHeartbeat(
            ranks=[
                api.RankState(job=x.job, rank=x.rank, incarnation=x.incarnation, state="running")
                for x in survivors
            ],
            free_slots=0,
            wait=30.0,
        )
        r = await pool.post("/api/v1/agents/heartbeat", hb, agent.headers)
        got.append(decode(r, api.AgentHeartbeatResponse))

    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(beat)
        for _ in range(100_000):
            if pool.core.ended.current().statistics().tasks_waiting:
                break
            await trio.testing.wait_all_tasks_blocked()
        else:
            raise AssertionError("no heartbeat is held")
        assert not got
        await pool.relay_heartbeat("relay-1", fenced=[fence])
    assert got[0].failed == [api.JobFailures(job=job.id, ranks=[1])]
    assert trio.current_time() == start  # woken by the fence, not by the hold running out


async def test_a_rebuild_jobs_new_processes_are_spawns_within_its_allowance(
    tmp_path: Path,
) -> None:
    """In "rebuild" the survivors start a new process in each failed rank's place (the
    runtime's ``MPI.COMM_WORLD.Dup()``): to the pool an ordinary spawn of the job's program,
    which counts against ``max_spawned``; lost in turn, it is declared failed like any rank.
    Such a job has rank numbers to spawn into even when its universe is its ranks (here, as
    ``spawn_default`` is 0), since its processes are never more than its ranks."""
    async with open_pool(tmp_path, max_spawned=1) as pool:
        job, agent, leases = await _running(pool, mode="rebuild")
        assert job.universe == 3 and {x.size for x in leases} == {3 + 1}
        await _lose(pool, agent, leases[1])
        await _fence_everywhere(pool)
        survivors = [leases[0], leases[2]]
        assert (await pool.heartbeat(agent, survivors)).failed == [
            api.JobFailures(job=job.id, ranks=[1])
        ]
        program = ["/usr/bin/python3", "app.py", "--steps", "10"]

        def ask(seq: int) -> api.SpawnAsk:
            root = leases[0]
            return api.SpawnAsk(
                job=job.id,
                rank=root.rank,
                incarnation=root.incarnation,
                seq=seq,
                command=program,
                maxprocs=1,
                least=1,
                parent=[0, 2],
                ctx=8,
            )

        r = await pool.post("/api/v1/agents/spawn", ask(1), agent.headers)
        assert decode(r, api.SpawnAnswer) == api.SpawnAnswer(ranks=[3])
        (new,) = await pool.lease(agent)
        assert (new.rank, new.parent, new.command, new.on_failure) == (
            3,
            [0, 2],
            program[1:],
            "rebuild",
        )
        detail = await pool.job(job.id)
        assert detail.job.spawned == 1 and detail.job.failed_ranks == [1]
        assert [(r.rank, r.incarnation) for r in detail.ranks if r.rank == 1] == [(1, 1)]

        # A second failure: the allowance is spent, so its new process is refused.
        await pool.heartbeat(agent, [*survivors, new])
        await _lose(pool, agent, new)
        detail = await pool.job(job.id)
        assert detail.job.state == "running" and detail.job.failed_ranks == [1, 3]
        assert await pool.lease(agent) == []  # declared failed, not restarted
        r = await pool.post("/api/v1/agents/spawn", ask(2), agent.headers)
        refused = decode(r, api.SpawnAnswer)
        assert refused.ranks == [] and "the job has spawned 1 processes" in refused.error

        await _fence_everywhere(pool)
        for lease in survivors:
            assert (await pool.exit(agent, lease, 0)).status_code == 200
        detail = await pool.job(job.id)
        assert (detail.job.state, detail.job.exit_code) == ("succeeded", 0)
