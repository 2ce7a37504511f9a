"""Helpers of the coordinator's checkpoint tests (test_checkpoints.py,
test_checkpoint_orders.py)."""

from __future__ import annotations

import httpx
from coord_helpers import HELLO, SANDBOX, Agent, Pool, decode, make_zip, relay_headers

from vpool.protocol import api

RELAY = relay_headers()
FP_X = "x" * 64
FP_Y = "y" * 64
FP_Z = "z" * 64
DIGEST = "ab" * 32


async def submit(
    pool: Pool, ranks: int = 2, *, every: float = 0.0, ft: bool = True
) -> httpx.Response:
    bundle = await pool.upload(make_zip({"app.py": HELLO}))
    sub = api.JobSubmit(
        ranks=ranks, bundle=bundle, entry="app.py", fault_tolerance=ft, checkpoint_every=every
    )
    return await pool.post("/api/v1/jobs", sub, pool.user())


async def beat(
    pool: Pool,
    agent: Agent,
    leases: list[api.Lease],
    *,
    criu: str = "4.1.1",
    fp: str = FP_Z,
    free: int = 8,
    wait: float = 0.0,
    restored_from: int = -1,
    state: str = "running",
    acks: list[int] | None = None,
    isolation: api.IsolationReport | None = SANDBOX,
) -> api.AgentHeartbeatResponse:
    hb = api.AgentHeartbeat(
        ranks=[
            api.RankState(
                job=x.job,
                rank=x.rank,
                incarnation=x.incarnation,
                state=state,
                restored_from=restored_from if x.incarnation > 1 else -1,
            )
            for x in leases
        ],
        free_slots=free,
        criu=criu,
        fingerprint=fp,
        wait=wait,
        checkpoint_acks=acks or [],
        isolation=isolation,
    )
    r = await pool.post("/api/v1/agents/heartbeat", hb, agent.headers)
    return decode(r, api.AgentHeartbeatResponse)


def image(
    job: int, rank: int, ckpt: int, retained: list[int], *, fp: str = FP_X, incarnation: int = 1
) -> api.RelayCheckpoint:
    return api.RelayCheckpoint(
        name="relay-0",
        job=job,
        rank=rank,
        incarnation=incarnation,
        ckpt=ckpt,
        size=210_000_000,
        digest=DIGEST,
        fingerprint=fp,
        received={0: 5 * ckpt, 1: 0},
        dets=ckpt,
        meta=b"\x00meta",
        retained=retained,
    )


async def commit(pool: Pool, report: api.RelayCheckpoint) -> httpx.Response:
    """Post ``report`` with the key of the relay it names."""
    return await pool.post("/api/v1/relays/checkpoint", report, relay_headers(report.name))


async def running(pool: Pool, ranks: int = 2) -> tuple[Agent, list[api.Lease]]:
    """A job whose ranks run on agent-1 (CRIU, fingerprint Z, no free slot left)."""
    await pool.register_relay("relay-0")
    r = await submit(pool, ranks, every=30)
    assert r.status_code == 201, r.text
    agent = await pool.enroll("agent-1", slots=ranks)
    leases = await pool.lease(agent)
    await beat(pool, agent, leases, free=0)
    return agent, leases


async def relay_loses(pool: Pool, job: int, rank: int, incarnation: int = 1) -> None:
    lost = api.RankLost(job=job, rank=rank, incarnation=incarnation, reason="dropped")
    r = await pool.post("/api/v1/relays/lost", api.RelayLost(name="relay-0", lost=[lost]), RELAY)
    assert r.status_code == 200, r.text


def events(detail: api.JobDetail, kind: str) -> list[str]:
    return [e.message for e in detail.events if e.kind == kind]


def from_start(pool: Pool, job: int, rank: int) -> bool:
    rows = pool.core.store.db.query(  # type: ignore[attr-defined]
        "SELECT from_start FROM ranks WHERE job = ? AND rank = ?", [job, rank]
    )
    return bool(next(iter(rows))["from_start"])
