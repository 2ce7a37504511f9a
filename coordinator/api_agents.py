"""Agent endpoints: enroll, lease long-poll, heartbeat, blobs, output, exits, problems, results,
checkpoint failures and restore reports."""

from __future__ import annotations

from contextlib import aclosing

from fastapi import APIRouter, Request, Response
from fastapi.responses import FileResponse

from vpool.coordinator.transport import (
    bearer,
    chunks,
    client_address,
    coordinator,
    declared_length,
    decode,
    empty,
    presented,
    presented_now,
    reply,
)
from vpool.protocol import api

router = APIRouter(prefix="/api/v1/agents")


async def _agent(request: Request) -> str:
    core, token = coordinator(request), bearer(request)
    return await presented(request, lambda: core.agent(token))


@router.post("/enroll")
async def enroll(request: Request) -> Response:
    req = await decode(request, api.EnrollRequest)
    core = coordinator(request)
    return reply(await presented(request, lambda: core.enroll(req)))


@router.post("/lease")
async def lease(request: Request) -> Response:
    c = coordinator(request)
    token = bearer(request)
    agent = presented_now(request, lambda: c.agent_id(token))
    req = await decode(request, api.LeaseRequest)
    await c.agent_seen(agent, req.free_slots, client_address(request))
    return reply(await c.lease(agent, req, gone=request.is_disconnected))


@router.post("/heartbeat")
async def heartbeat(request: Request) -> Response:
    c = coordinator(request)
    token = bearer(request)
    agent = presented_now(request, lambda: c.agent_id(token))
    hb = await decode(request, api.AgentHeartbeat)
    await c.agent_seen(agent, hb.free_slots, client_address(request))
    return reply(await c.heartbeat(agent, hb))


@router.get("/blobs/{sha256}")
async def blob(request: Request, sha256: str) -> Response:
    c = coordinator(request)
    agent = await _agent(request)
    return FileResponse(
        await c.agent_blob_path(agent, sha256), media_type="application/octet-stream"
    )


@router.post("/output")
async def output(request: Request) -> Response:
    agent = await _agent(request)
    batch = await decode(request, api.OutputBatch)
    await coordinator(request).post_output(agent, batch)
    return empty()


@router.post("/exit")
async def rank_exit(request: Request) -> Response:
    agent = await _agent(request)
    ex = await decode(request, api.RankExit)
    await coordinator(request).rank_exit(agent, ex)
    return empty()


@router.post("/spawn")
async def spawn(request: Request) -> Response:
    """A rank's ``MPI.Comm.Spawn`` (``api.SpawnAsk``): the new processes' ranks, or why not."""
    agent = await _agent(request)
    ask = await decode(request, api.SpawnAsk)
    return reply(await coordinator(request).spawn(agent, ask))


@router.post("/problem")
async def problem(request: Request) -> Response:
    agent = await _agent(request)
    pr = await decode(request, api.RankProblem)
    await coordinator(request).rank_problem(agent, pr)
    return empty()


@router.post("/checkpoint-failed")
async def checkpoint_failed(request: Request) -> Response:
    agent = await _agent(request)
    cf = await decode(request, api.CheckpointFailed)
    await coordinator(request).checkpoint_failed(agent, cf)
    return empty()


@router.post("/restored")
async def restored(request: Request) -> Response:
    agent = await _agent(request)
    rr = await decode(request, api.RestoreReport)
    await coordinator(request).restore_report(agent, rr)
    return empty()


@router.put("/results/{job}/{rank}/{incarnation}")
async def results(request: Request, job: int, rank: int, incarnation: int) -> Response:
    c = coordinator(request)
    agent = await _agent(request)
    declared_length(request, c.settings.max_blob_bytes)
    async with aclosing(chunks(request)) as body:  # read to its end only if it fits
        return reply(await c.put_result(agent, job, rank, incarnation, body))
