"""``vsdk checkpoint`` orders on the coordinator's side: handed out in heartbeat answers until
acknowledged, kept for a rank still starting, dropped when they can never apply, refused with
clear errors, and waking a held heartbeat."""

from __future__ import annotations

from pathlib import Path

import trio
from ckpt_helpers import (
    FP_Z,
    beat,
    relay_loses,
    running,
    submit,
)
from coord_helpers import Pool, decode, open_pool

from vpool.protocol import api

# -- users: checkpoint now ------------------------------------------------------------------


def _orders(pool: Pool) -> list[tuple[str, int, int, int]]:
    rows = pool.core.store.db.query(  # type: ignore[attr-defined]
        "SELECT agent, job, rank, incarnation FROM checkpoint_orders ORDER BY job, rank"
    )
    return [(r["agent"], r["job"], r["rank"], r["incarnation"]) for r in rows]


def _targets(resp: api.AgentHeartbeatResponse) -> list[tuple[int, int, int]]:
    return [(o.job, o.rank, o.incarnation) for o in resp.checkpoint]


async def test_checkpoint_order_is_handed_out_until_acknowledged(pool: Pool) -> None:
    agent, leases = await running(pool, ranks=3)
    job = leases[0].job
    r = await pool.post(f"/api/v1/jobs/{job}/checkpoint", api.CheckpointAsk(), pool.user())
    assert r.status_code == 202, r.text
    assert decode(r, api.CheckpointAsked) == api.CheckpointAsked(job=job, ranks=[0, 1, 2])
    r = await pool.post(f"/api/v1/jobs/{job}/checkpoint", api.CheckpointAsk(rank=1), pool.user())
    assert decode(r, api.CheckpointAsked).ranks == [1]  # not twice for rank 1
    first = await beat(pool, agent, leases)
    assert _targets(first) == [(job, r, 1) for r in (0, 1, 2)]
    ids = [o.id for o in first.checkpoint]
    assert all(i > 0 for i in ids) and len(set(ids)) == 3
    # Not acknowledged (the answer may never have reached the agent): handed out again.
    assert (await beat(pool, agent, leases)).checkpoint == first.checkpoint
    # Another agent cannot acknowledge them.
    other = await pool.enroll("agent-2", slots=1)
    await beat(pool, other, [], free=1, acks=ids)
    assert (await beat(pool, agent, leases)).checkpoint == first.checkpoint
    again = await beat(pool, agent, leases, acks=ids[:2])
    assert again.checkpoint == first.checkpoint[2:]
    assert (await beat(pool, agent, leases, acks=ids)).checkpoint == []
    assert (await beat(pool, agent, leases)).checkpoint == []
    assert _orders(pool) == []


async def test_order_for_a_starting_rank_waits_until_it_runs(pool: Pool) -> None:
    await pool.register_relay("relay-0")
    r = await submit(pool, 2)
    assert r.status_code == 201, r.text
    agent = await pool.enroll("agent-1", slots=2)
    leases = await pool.lease(agent)
    job = leases[0].job
    # ``vsdk checkpoint`` asks only running ranks, but one may be leased again before its order
    # goes out; queue one for the leased (not yet running) rank 0 directly.
    pool.core.store.db.execute(  # type: ignore[attr-defined]
        "INSERT INTO checkpoint_orders (agent, job, rank, incarnation) VALUES (?, ?, 0, 1)",
        [agent.id, job],
    )
    assert (await beat(pool, agent, leases, state="starting", free=0)).checkpoint == []
    assert _orders(pool) == [(agent.id, job, 0, 1)]  # kept
    hb = await beat(pool, agent, leases, free=0)
    assert _targets(hb) == [(job, 0, 1)]
    assert (await beat(pool, agent, leases, free=0, acks=[hb.checkpoint[0].id])).checkpoint == []
    assert _orders(pool) == []


async def test_order_that_can_never_apply_is_dropped(pool: Pool) -> None:
    agent, leases = await running(pool)
    job = leases[0].job
    r = await pool.post(f"/api/v1/jobs/{job}/checkpoint", api.CheckpointAsk(), pool.user())
    assert r.status_code == 202, r.text
    # Rank 0's incarnation 1 is lost before the order went out: its order is stale.
    await relay_loses(pool, job, 0)
    hb = await beat(pool, agent, leases[1:], free=1)
    assert _targets(hb) == [(job, 1, 1)]
    assert _orders(pool) == [(agent.id, job, 1, 1)]
    # Incarnation 2 runs (here, or anywhere): the stale order never goes out.
    replacement = await pool.lease(agent, free=1)
    assert [(x.rank, x.incarnation) for x in replacement] == [(0, 2)]
    hb = await beat(pool, agent, [*replacement, leases[1]], free=0)
    assert _targets(hb) == [(job, 1, 1)]
    # The job ends before the agent acknowledges rank 1's order; the agent never comes back,
    # yet its order goes at another agent's heartbeat.
    await pool.client.post(f"/api/v1/jobs/{job}/cancel", headers=pool.user())
    other = await pool.enroll("agent-2", slots=1)
    await beat(pool, other, [], free=1)
    assert _orders(pool) == []


async def test_checkpoint_ask_errors(pool: Pool) -> None:
    agent, leases = await running(pool)
    job = leases[0].job
    url = f"/api/v1/jobs/{job}/checkpoint"
    r = await pool.post(url, api.CheckpointAsk(rank=2), pool.user())
    assert (r.status_code, r.json()["error"]["code"]) == (422, "bad_rank")
    r = await pool.post("/api/v1/jobs/999/checkpoint", api.CheckpointAsk(), pool.user())
    assert (r.status_code, r.json()["error"]["code"]) == (404, "unknown_job")
    r = await pool.post(url, api.CheckpointAsk(), pool.user("bob"))
    assert r.status_code == 404  # someone else's job does not exist
    await beat(pool, agent, leases, criu="", fp=FP_Z, free=0)
    r = await pool.post(url, api.CheckpointAsk(), pool.user())
    assert (r.status_code, r.json()["error"]["code"]) == (409, "cannot_checkpoint")
    assert "its ranks run on agents without CRIU" in r.json()["error"]["message"]
    await beat(pool, agent, leases, free=0)
    await relay_loses(pool, job, 1)
    r = await pool.post(url, api.CheckpointAsk(rank=1), pool.user())
    assert (r.status_code, r.json()["error"]["code"]) == (409, "not_running")
    assert f"job {job}: rank 1 is pending, not running: nothing" in r.json()["error"]["message"]
    await pool.client.post(f"/api/v1/jobs/{job}/cancel", headers=pool.user())
    r = await pool.post(url, api.CheckpointAsk(), pool.user())
    assert (r.status_code, r.json()["error"]["code"]) == (409, "job_not_running")
    assert (await beat(pool, agent, leases)).checkpoint == []


async def test_checkpoint_order_wakes_a_held_heartbeat(tmp_path: Path) -> None:
    async with open_pool(tmp_path, heartbeat_interval=30.0) as pool:
        agent, leases = await running(pool)
        job = leases[0].job
        got: list[api.AgentHeartbeatResponse] = []

        async def held_beat() -> None:
            got.append(await beat(pool, agent, leases, wait=30.0))

        with trio.fail_after(10):  # held for 30 s if the order did not wake it
            async with trio.open_nursery() as nursery:
                nursery.start_soon(held_beat)
                await trio.testing.wait_all_tasks_blocked()
                ask = api.CheckpointAsk(rank=0)
                r = await pool.post(f"/api/v1/jobs/{job}/checkpoint", ask, pool.user())
                assert r.status_code == 202
        assert _targets(got[0]) == [(job, 0, 1)]
        assert got[0].stop == []

        # The next heartbeat acknowledges the order: with nothing to hand out, it is held.
        ack = [got[0].checkpoint[0].id]
        with trio.move_on_after(1) as held:
            await beat(pool, agent, leases, wait=30.0, acks=ack)
        assert held.cancelled_caught
        assert _orders(pool) == []
