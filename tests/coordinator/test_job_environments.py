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


async def test_images_made_in_an_environment_go_where_it_is(pool: Pool) -> None:
    """An image of a rank that ran in a job environment carries that environment's
    fingerprint: only an agent that built the same environment (it reports the fingerprint)
    may restore it, even one with the same base fingerprint may not."""
    from ckpt_helpers import FP_X, beat, commit, image, relay_loses, running

    env_fp = "e" * 64
    _, leases = await running(pool, ranks=2)
    job = leases[0].job
    same_base = await pool.enroll("agent-2", slots=2)
    await beat(pool, same_base, [], fp=FP_X, free=2)
    built = await pool.enroll("agent-3", slots=1)
    hb = api.AgentHeartbeat(
        ranks=[],
        free_slots=1,
        criu="4.1.1",
        fingerprint=FP_X,
        isolation=SANDBOX,
        environments=["k" * 16],
        env_fingerprints=[env_fp],
    )
    decode(
        await pool.post("/api/v1/agents/heartbeat", hb, built.headers), api.AgentHeartbeatResponse
    )
    ckpt = image(job, 1, 1, [1], fp=env_fp)
    assert (await commit(pool, ckpt)).status_code == 200
    await relay_loses(pool, job, 1)
    assert await pool.lease(same_base) == []  # more free slots, not the environment
    (lease,) = await pool.lease(built)
    assert [x.fingerprint for x in lease.restore] == [env_fp]
