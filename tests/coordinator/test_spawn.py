"""Spawning (``MPI.Comm.Spawn``), the coordinator's part: a running job's rank asks through its
agent for new processes, which become more ranks of the job, placed like replacements; the
answer is kept, so a replaying rank asking again gets the same ranks."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from coord_helpers import Agent, Pool, decode, make_zip, open_pool

from vpool.protocol import api

SERVER = ["/usr/bin/python3", "-B", "-m", "mpi4py.futures.server"]


@pytest.fixture
async def small(tmp_path: Path) -> AsyncIterator[Pool]:
    async with open_pool(tmp_path, max_spawned=5) as pool:
        yield pool


async def _master(
    pool: Pool, universe: int = 4, slots: int = 4
) -> tuple[api.JobInfo, Agent, api.Lease]:
    await pool.register_relay("relay-0", 7000)
    await pool.register_relay("relay-1", 7001)
    job = await pool.submit(1, universe=universe)
    agent = await pool.enroll("agent-1", slots=slots)
    (lease,) = await pool.lease(agent)
    await pool.heartbeat(agent, [lease])
    return job, agent, lease


def _ask(
    lease: api.Lease, seq: int = 1, n: int = 2, least: int | None = None, **kw: object
) -> api.SpawnAsk:
    fields: dict[str, object] = {
        "job": lease.job,
        "rank": lease.rank,
        "incarnation": lease.incarnation,
        "seq": seq,
        "command": SERVER,
        "maxprocs": n,
        "least": n if least is None else least,
        "parent": [lease.rank],
        "ctx": 6,
    }
    fields.update(kw)
    return api.SpawnAsk(**fields)  # type: ignore[arg-type]


async def _spawn(pool: Pool, agent: Agent, ask: api.SpawnAsk) -> api.SpawnAnswer:
    r = await pool.post("/api/v1/agents/spawn", ask, agent.headers)
    return decode(r, api.SpawnAnswer)


async def test_spawned_processes_are_ranks_of_the_job_with_their_world(small: Pool) -> None:
    job, agent, master = await _master(small)
    assert (job.universe, master.size, master.world, master.universe) == (4, 1 + 5, [0], 4)
    assert len(master.homes) == master.size
    answer = await _spawn(small, agent, _ask(master))
    assert answer == api.SpawnAnswer(ranks=[1, 2])
    workers = await small.lease(agent)
    assert [(w.rank, w.world, w.parent, w.parent_ctx, w.command, w.size) for w in workers] == [
        (1, [1, 2], [0], 6, SERVER[1:], 6),
        (2, [1, 2], [0], 6, SERVER[1:], 6),
    ]
    assert [w.homes for w in workers] == [master.homes] * 2
    detail = await small.job(job.id)
    assert detail.job.spawned == 2 and [r.rank for r in detail.ranks] == [0, 1, 2]
    kinds = [e.kind for e in detail.events]
    assert kinds.count("spawn") == 1 and kinds.count("rank_spawned") == 2

    # Asked again (a replaying incarnation): the same ranks, nothing new.
    assert await _spawn(small, agent, _ask(master)) == answer
    assert (await small.job(job.id)).job.spawned == 2

    # Everybody exits 0: the job succeeds.
    await small.heartbeat(agent, [master, *workers])
    for lease in [*workers, master]:
        assert (await small.exit(agent, lease, 0)).status_code == 200
    assert (await small.job(job.id)).job.state == "succeeded"


async def test_the_universe_and_the_rank_numbers_are_limits(small: Pool) -> None:
    job, agent, master = await _master(small, universe=3)
    assert (await _spawn(small, agent, _ask(master, 1, n=3))).error.startswith(
        "the job's universe is 3 processes at once and 1 are alive"
    )
    assert (await _spawn(small, agent, _ask(master, 2, n=2))).ranks == [1, 2]
    workers = await small.lease(agent)
    await small.heartbeat(agent, [master, *workers])
    for w in workers:
        await small.exit(agent, w, 0)
    # Exited processes leave room at once; rank numbers are not reused.
    assert (await _spawn(small, agent, _ask(master, 3, n=2))).ranks == [3, 4]
    workers = await small.lease(agent)
    await small.heartbeat(agent, [master, *workers])
    for w in workers:
        await small.exit(agent, w, 0)
    refused = await _spawn(small, agent, _ask(master, 4, n=2))
    assert refused.error.startswith("the job has spawned 4 processes, the most a job may")
    assert (await _spawn(small, agent, _ask(master, 5, n=1))).ranks == [5]
    events = [e.message for e in (await small.job(job.id)).events if e.kind == "spawn_refused"]
    assert len(events) == 2


async def test_a_soft_spawn_gets_what_the_free_slots_take(pool: Pool) -> None:
    job, agent, master = await _master(pool, universe=8, slots=3)
    # Two slots are free on the only agent: a soft spawn of 1 to 6 gets 2.
    assert (await _spawn(pool, agent, _ask(master, 1, n=6, least=1))).ranks == [1, 2]
    # None is free now (the two are pending): "0 to 4" gets nothing, "1 to 4" gets one that waits.
    assert await _spawn(pool, agent, _ask(master, 2, n=4, least=0)) == api.SpawnAnswer()
    assert (await _spawn(pool, agent, _ask(master, 3, n=4, least=1))).ranks == [3]
    assert len(await pool.lease(agent)) == 2
    assert (await pool.job(job.id)).ranks[3].state == "pending"


async def test_bad_spawns_are_refused_with_the_reason(pool: Pool) -> None:
    _, agent, master = await _master(pool)
    cases = {
        "is not a Python program": _ask(master, 1, command=["/bin/sh", "-c", "x"]),
        "must hold the root once": _ask(master, 2, parent=[5]),
        "cannot start": _ask(master, 3, n=2, least=3),
        "longer than": _ask(master, 4, command=["python3", "x" * 5000]),
    }
    for words, ask in cases.items():
        assert words in (await _spawn(pool, agent, ask)).error
    # Another agent may not spawn for a rank it does not run.
    other = await pool.enroll("agent-2", slots=1)
    r = await pool.post("/api/v1/agents/spawn", _ask(master, 9), other.headers)
    assert r.status_code == 403 and "not_your_rank" in r.text
    # A body that is not a SpawnAsk is a 4xx, never a 500.
    r = await pool.post("/api/v1/agents/spawn", {"job": "x"}, agent.headers)
    assert 400 <= r.status_code < 500


async def test_a_lost_worker_of_a_reported_spawn_is_declared_failed(pool: Pool) -> None:
    job, agent, master = await _master(pool)
    assert (await _spawn(pool, agent, _ask(master, reported=True))).ranks == [1, 2]
    workers = await pool.lease(agent)
    await pool.heartbeat(agent, [master, *workers])
    ex = api.RankExit(job=job.id, rank=2, incarnation=1, code=-9, lost=True)
    assert (await pool.post("/api/v1/agents/exit", ex, agent.headers)).status_code == 200
    detail = await pool.job(job.id)
    # The job (transparent) runs on; the worker is failed, not restarted.
    assert detail.job.state == "running" and detail.job.failed_ranks == [2]
    assert await pool.lease(agent) == []
    (event,) = [e for e in detail.events if e.kind == "rank_failed"]
    assert "(spawned with failures reported)" in event.message
    for relay in ("relay-0", "relay-1"):
        await pool.relay_heartbeat(relay, fenced=(await pool.relay_heartbeat(relay)).fence)
    hb = await pool.heartbeat(agent, [master, workers[0]])
    assert hb.failed == [api.JobFailures(job=job.id, ranks=[2])]
    for lease in (workers[0], master):
        await pool.exit(agent, lease, 0)
    assert (await pool.job(job.id)).job.state == "succeeded"


async def test_a_job_run_as_a_module_gives_its_ranks_the_command(pool: Pool) -> None:
    await pool.register_relay()
    job = await pool.submit(2, args=["7"], module="mpi4py.futures")
    assert job.module == "mpi4py.futures"
    agent = await pool.enroll(slots=2)
    leases = await pool.lease(agent)
    assert [x.command for x in leases] == [["-m", "mpi4py.futures", "app.py", "7"]] * 2
    bundle = await pool.upload(make_zip({"app.py": b"print(1)\n"}))
    for bad in ("os; rm", "-c", "a..b", "x" * 300, "mpi4py.futures "):
        sub = api.JobSubmit(ranks=1, bundle=bundle, entry="app.py", module=bad)
        r = await pool.post("/api/v1/jobs", sub, pool.user())
        assert 400 <= r.status_code < 500 and "bad_module" in r.text, (bad, r.text)


async def test_by_default_a_job_may_spawn_the_pools_spawn_default(tmp_path: Path) -> None:
    async with open_pool(tmp_path, spawn_default=16, max_spawned=100, max_ranks=64) as pool:
        await pool.register_relay()
        job = await pool.submit(2)
        assert job.universe == 18
        agent = await pool.enroll(slots=2)
        leases = await pool.lease(agent)
        assert {(x.size, tuple(x.world), x.universe) for x in leases} == {(102, (0, 1), 18)}
    async with open_pool(tmp_path / "small", spawn_default=16, max_ranks=10) as pool:
        assert (await pool.submit(4)).universe == 10  # never past max_ranks
