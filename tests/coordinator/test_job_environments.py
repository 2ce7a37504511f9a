"""Jobs that need packages: requirements checked at submission, handed to agents in leases,
and jobs placed on agents that already built their environment."""

from __future__ import annotations

from typing import Any

from coord_helpers import SANDBOX, Pool, decode, make_zip, sha

from vpool import requirements
from vpool.protocol import api


async def _submit(pool: Pool, ranks: int, needs: list[str]) -> tuple[int, Any]:
    bundle = make_zip({"app.py": b"import vpooldemo\n"})
    digest = await pool.upload(bundle)
    assert digest == sha(bundle)
    sub = api.JobSubmit(ranks=ranks, bundle=digest, entry="app.py", requirements=needs)
    r = await pool.post("/api/v1/jobs", sub, pool.user())
    return r.status_code, r.json()


async def test_requirements_are_checked_and_leased(pool: Pool) -> None:
    code, body = await _submit(pool, 1, ["vpooldemo @ https://evil.example/x.whl"])
    assert code == 422 and body["error"]["code"] == "bad_requirements"
    code, body = await _submit(pool, 1, ["numpy"] * 2 + ["Vpooldemo>=1.0"])
    assert code == 201 and body["requirements"] == ["Vpooldemo>=1.0", "numpy"]
    await pool.register_relay()
    agent = await pool.enroll()
    (lease,) = await pool.lease(agent)
    assert lease.requirements == ["Vpooldemo>=1.0", "numpy"]


async def test_jobs_go_where_their_environment_is(pool: Pool) -> None:
    await pool.register_relay()
    needs = requirements.normalize(["vpooldemo"])
    plain = await pool.enroll("plain", slots=4)
    ready = await pool.enroll("ready", slots=2)
    # "ready" built the environment before (its heartbeats say so).
    hb = api.AgentHeartbeat(
        ranks=[], free_slots=2, isolation=SANDBOX, environments=[requirements.key(needs)]
    )
    decode(
        await pool.post("/api/v1/agents/heartbeat", hb, ready.headers), api.AgentHeartbeatResponse
    )
    code, _ = await _submit(pool, 2, needs)
    assert code == 201
    assert [x.rank for x in await pool.lease(ready)] == [0, 1]  # both ranks where it is built
    assert await pool.lease(plain) == []
    # A job with no requirements spreads as before.
    code, _ = await _submit(pool, 2, [])
    assert code == 201
    assert len(await pool.lease(plain)) == 2
    # Nonsense in heartbeats is refused.
    hb = api.AgentHeartbeat(ranks=[], free_slots=2, isolation=SANDBOX, environments=["x" * 65])
    r = await pool.post("/api/v1/agents/heartbeat", hb, ready.headers)
    assert r.status_code == 422 and r.json()["error"]["code"] == "bad_environments"
