"""A job's output is complete only once every rank stopped at its end has reported its exit:
the traceback of a rank that fails a moment after another is not lost to ``vsdk submit
--wait``, whose last page must hold it."""

from __future__ import annotations

import trio
import trio.testing
from coord_helpers import Pool, decode

from vpool.protocol import api


async def test_the_last_page_waits_for_the_stopped_ranks_last_words(pool: Pool) -> None:
    job, agent, leases = await pool.running_job(2)
    url = f"/api/v1/jobs/{job.id}/output"
    # Rank 0 fails: the job ends; rank 1 is told to stop and has not reported yet.
    await pool.exit(agent, leases[0], 3)
    first = decode(await pool.client.get(url, headers=pool.user()), api.OutputPage)
    assert first.state == "failed" and not first.complete
    got: list[api.OutputPage] = []

    async def follow() -> None:
        r = await pool.client.get(
            url, params={"after": first.next, "wait": 30}, headers=pool.user()
        )
        got.append(decode(r, api.OutputPage))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(follow)
        await trio.testing.wait_all_tasks_blocked()
        assert got == []  # held: rank 1 may still speak
        tb = b"Traceback (most recent call last):\nValueError: late\n"
        await pool.output(agent, leases[1], "stderr", 0, tb)
    assert got[0].records[0].data.startswith(b"Traceback") and not got[0].complete
    await pool.exit(agent, leases[1], 1)
    last = decode(
        await pool.client.get(url, params={"after": got[0].next, "wait": 30}, headers=pool.user()),
        api.OutputPage,
    )
    assert last.complete and last.records == []


async def test_a_silent_agent_does_not_hold_the_output_forever(pool: Pool) -> None:
    job, agent, leases = await pool.running_job(2)
    await pool.exit(agent, leases[0], 3)
    url = f"/api/v1/jobs/{job.id}/output"
    assert not decode(await pool.client.get(url, headers=pool.user()), api.OutputPage).complete
    pool.clock.advance(pool.core.settings.agent_timeout + 1)  # rank 1's agent never answers
    assert decode(await pool.client.get(url, headers=pool.user()), api.OutputPage).complete
