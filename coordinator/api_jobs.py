"""User endpoints: pool info and agents, whoami, blobs, jobs, output, checkpoints and results
(see protocol/api.py)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import FileResponse
from starlette.background import BackgroundTask

from vpool.coordinator.transport import bearer, coordinator, declared_length, decode, reply
from vpool.protocol import api

router = APIRouter(prefix="/api/v1")


async def _user(request: Request) -> str:
    return await coordinator(request).user(bearer(request))


@router.get("/pool")
async def pool(request: Request) -> Response:
    return reply(await coordinator(request).live_pool_info())


@router.get("/pool/agents")
async def agents(request: Request) -> Response:
    c = coordinator(request)
    await _user(request)
    return reply(await c.list_agents())


@router.get("/whoami")
async def whoami(request: Request) -> Response:
    return reply(api.UserInfo(name=await _user(request)))


@router.put("/blobs/{sha256}")
async def put_blob(request: Request, sha256: str) -> Response:
    c = coordinator(request)
    await _user(request)
    declared_length(request, c.settings.max_blob_bytes)
    return reply(await c.put_blob(sha256, request.stream()))


@router.head("/blobs/{sha256}")
async def head_blob(request: Request, sha256: str) -> Response:
    c = coordinator(request)
    await _user(request)
    return Response(status_code=200 if await c.has_blob(sha256) else 404)


@router.post("/jobs")
async def submit(request: Request) -> Response:
    c = coordinator(request)
    user = await _user(request)
    sub = await decode(request, api.JobSubmit)
    return reply(await c.submit(user, sub), status=201)


@router.get("/jobs")
async def list_jobs(request: Request, limit: int = 100) -> Response:
    c = coordinator(request)
    return reply(await c.list_jobs(await _user(request), max(1, min(limit, 1000))))


@router.get("/jobs/{job_id}")
async def job(request: Request, job_id: int) -> Response:
    c = coordinator(request)
    return reply(await c.job_detail(await _user(request), job_id))


@router.get("/jobs/{job_id}/output")
async def output(
    request: Request, job_id: int, after: int = 0, rank: int | None = None, wait: float = 0.0
) -> Response:
    c = coordinator(request)
    user = await _user(request)
    return reply(await c.output(user, job_id, after, rank, wait))


@router.post("/jobs/{job_id}/cancel")
async def cancel(request: Request, job_id: int) -> Response:
    c = coordinator(request)
    return reply(await c.cancel(await _user(request), job_id))


@router.post("/jobs/{job_id}/checkpoint")
async def checkpoint(request: Request, job_id: int) -> Response:
    c = coordinator(request)
    user = await _user(request)
    ask = await decode(request, api.CheckpointAsk)
    return reply(await c.ask_checkpoint(user, job_id, ask), status=202)


@router.get("/jobs/{job_id}/results")
async def results(request: Request, job_id: int) -> Response:
    c = coordinator(request)
    path = await c.results(await _user(request), job_id)
    return FileResponse(
        path,
        media_type="application/zip",
        filename=f"job-{job_id}-results.zip",
        background=BackgroundTask(path.unlink, missing_ok=True),
    )
