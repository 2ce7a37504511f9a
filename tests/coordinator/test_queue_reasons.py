"""A queued job says why it waits, for each cause, and is flagged at once when the pool as it
is can never run it (``scheduler.queue_reason``, applied by the store's scheduling pass)."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from coord_helpers import Pool, decode

from vpool.coordinator.scheduler import AgentView, Offer, Waiting, queue_reason
from vpool.protocol import api

GiB = 1 << 30
SANDBOX = Offer("sandbox", 2 * GiB)


def reason(
    ranks: int,
    agents: list[AgentView],
    *,
    memory: int = 0,
    relays: int = 1,
    unsandboxed: bool = False,
) -> Waiting:
    return queue_reason(ranks, memory=memory, unsandboxed=unsandboxed, agents=agents, relays=relays)


@pytest.mark.parametrize(
    ("ranks", "agents", "kw", "text", "never"),
    [
        (2, [AgentView(4, 4, SANDBOX)], {"relays": 0}, "no relay is up", False),
        (2, [], {}, "no volunteer's agent is online", True),
        (2, [AgentView(4, 4, Offer())], {}, "have not said yet how they isolate", False),
        (2, [AgentView(4, 4, Offer("none"))], {}, "--allow-unsandboxed", True),
        (
            2,
            [AgentView(4, 4, SANDBOX)],
            {"memory": 8 * GiB},
            "no agent online offers 8 GiB per rank (the most is 2 GiB",
            True,
        ),
        (
            30,
            [AgentView(8, 8, SANDBOX)] * 3,
            {},
            "needs 30 slots; the agents that may run it have 24 in all",
            True,
        ),
        (
            6,
            [AgentView(4, 4, SANDBOX), AgentView(4, 4, Offer("sandbox", GiB // 2))],
            {"memory": GiB},
            "needs 6 slots; the agents that may run it have 4 in all (4 more "
            "on agents that cannot run it)",
            True,
        ),
        (
            6,
            [AgentView(4, 1, SANDBOX), AgentView(4, 2, SANDBOX)],
            {},
            "needs 6 slots; 3 are free now (5 run other ranks)",
            False,
        ),
    ],
)
def test_each_cause(ranks: int, agents: list[AgentView], kw: dict, text: str, never: bool) -> None:
    got = reason(ranks, agents, **kw)
    assert text in got.reason and got.never is never, got


def test_unsandboxed_agents_count_for_jobs_that_accept_them() -> None:
    agents = [AgentView(4, 0, Offer("none"))]
    got = reason(2, agents, unsandboxed=True)
    assert got == Waiting("needs 2 slots; 0 are free now (4 run other ranks)")


async def _job(pool: Pool, job_id: int) -> api.JobInfo:
    r = await pool.client.get(f"/api/v1/jobs/{job_id}", headers=pool.user())
    return decode(r, api.JobDetail).job


async def test_reasons_follow_the_pool(pool: Pool) -> None:
    job = await pool.submit(3)
    assert (job.waiting, job.never_fits) == ("no relay is up: ranks talk through relays", False)
    await pool.register_relay()
    await pool.core.schedule()
    job = await _job(pool, job.id)
    assert job.waiting == "no volunteer's agent is online" and job.never_fits
    agent = await pool.enroll("agent-1", slots=2)
    job = await _job(pool, job.id)
    assert job.waiting == "needs 3 slots; the agents that may run it have 2 in all"
    assert job.never_fits
    # Another job takes the two slots; a third agent makes room in all, but not free now.
    small = await pool.submit(2)
    assert small.state == "running"
    await pool.enroll("agent-2", slots=2)
    job = await _job(pool, job.id)
    assert job.waiting == "needs 3 slots; 2 are free now (2 run other ranks)"
    assert not job.never_fits
    # The small job ends: the big one is placed and its reason goes.
    for lease in await pool.lease(agent):
        await pool.heartbeat(agent, [lease])
        await pool.exit(agent, lease, 0)
    job = await _job(pool, job.id)
    assert (job.state, job.waiting, job.never_fits) == ("running", "", False)


async def test_memory_and_isolation_reasons(pool: Pool) -> None:
    await pool.register_relay()
    await pool.enroll(
        "small", slots=4, isolation=api.IsolationReport(level="sandbox", rank_memory=GiB)
    )
    job = await pool.submit(1, memory=4 * GiB)
    assert job.waiting.startswith("no agent online offers 4 GiB per rank (the most is 1 GiB")
    assert job.never_fits
    plain = await pool.submit(1, user="bob")
    assert plain.state == "running"
    # An unsandboxed agent with no memory limit does not help a job that wants a sandbox.
    await pool.enroll("open", slots=1, isolation=api.IsolationReport(level="none"))
    job = await _job(pool, job.id)
    assert "4 GiB per rank" in job.waiting


async def test_a_reason_that_changes_wakes_watchers(pool: Pool) -> None:
    job = await pool.submit(2)
    changed = pool.core.changes.current()
    await pool.register_relay()
    await pool.core.schedule()
    assert changed.is_set()  # the reason went from "no relay" to "no agent"
    same = pool.core.changes.current()
    await pool.core.schedule()  # nothing new: nobody is woken
    assert not same.is_set()
    assert (await _job(pool, job.id)).waiting == "no volunteer's agent is online"


async def test_an_output_long_poll_returns_when_the_reason_changes(pool: Pool) -> None:
    job = await pool.submit(2)
    url = f"/api/v1/jobs/{job.id}/output"
    first = decode(await pool.client.get(url, headers=pool.user()), api.OutputPage)
    assert first.waiting.startswith("no relay is up") and first.mark
    got: list[api.OutputPage] = []

    async def poll() -> None:
        r = await pool.client.get(
            url, params={"after": 0, "wait": 30, "seen": first.mark}, headers=pool.user()
        )
        got.append(decode(r, api.OutputPage))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(poll)
        await trio.testing.wait_all_tasks_blocked()
        assert got == []  # held: nothing changed
        await pool.register_relay()  # now the job waits for agents instead
    (page,) = got
    assert page.waiting == "no volunteer's agent is online" and page.mark != first.mark
    assert page.records == [] and not page.complete
