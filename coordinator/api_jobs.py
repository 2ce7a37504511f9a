"""User endpoints: pool info, agents and relays, whoami and tokens, blobs, jobs, output,
checkpoints and results (see protocol/api.py). Who may see what is decided in ``access``."""

from __future__ import annotations

from contextlib import aclosing
from pathlib import Path
from typing import Literal

import trio
from fastapi import APIRouter, Request, Response
from fastapi.responses import FileResponse
from starlette.background import BackgroundTask

from vpool.coordinator.access import Action
from vpool.coordinator.errors import NotFound
from vpool.coordinator.transport import (
    chunks,
    coordinator,
    declared_length,
    decode,
    principal,
    reply,
)
from vpool.protocol import api
from vpool.web import timeline

router = APIRouter(prefix="/api/v1")


@router.get("/pool")
async def pool(request: Request) -> Response:
    return reply(await coordinator(request).live_pool_info())


@router.get("/pool/ca")
async def pool_ca(request: Request) -> Response:
    """The pool CA's certificate (the ``tls_ca`` setting), to anyone: it is no secret, and a
    volunteer's ``vpool-agent join --ca-sha256`` trusts what it got only if its digest is the
    one the operator gave."""
    path = coordinator(request).settings.tls_ca
    if not path:
        raise NotFound("this coordinator does not serve its CA (tls_ca is not set)", code="no_ca")
    try:
        pem = await trio.Path(path).read_bytes()
    except OSError as exc:
        raise NotFound(f"the pool CA cannot be read: {exc.strerror}", code="no_ca") from exc
    return Response(pem, media_type="application/x-pem-file")


@router.get("/pool/totals")
async def totals(request: Request) -> Response:
    await principal(request)
    return reply(await coordinator(request).pool_totals())


@router.get("/pool/agents")
async def agents(request: Request) -> Response:
    return reply(await coordinator(request).list_agents(await principal(request)))


@router.get("/pool/relays")
async def relays(request: Request) -> Response:
    return reply(await coordinator(request).list_relays(await principal(request)))


@router.get("/whoami")
async def whoami(request: Request) -> Response:
    return reply((await principal(request)).info())


@router.get("/tokens")
async def tokens(request: Request) -> Response:
    return reply(await coordinator(request).list_tokens(await principal(request)))


@router.post("/tokens")
async def create_token(request: Request) -> Response:
    c = coordinator(request)
    who = await principal(request)
    ask = await decode(request, api.TokenCreate)
    return reply(await c.create_token(who, ask.label), status=201)


@router.post("/tokens/{token_id}/revoke")
async def revoke_token(request: Request, token_id: int) -> Response:
    c = coordinator(request)
    return reply(await c.revoke_token(await principal(request), token_id))


@router.put("/blobs/{sha256}")
async def put_blob(request: Request, sha256: str) -> Response:
    c = coordinator(request)
    who = await principal(request)
    declared_length(request, c.settings.max_blob_bytes)
    async with aclosing(chunks(request)) as body:  # read to its end only if it fits
        return reply(await c.put_blob(who, sha256, body))


@router.head("/blobs/{sha256}")
async def head_blob(request: Request, sha256: str) -> Response:
    c = coordinator(request)
    who = await principal(request)
    return Response(status_code=200 if await c.has_blob(who, sha256) else 404)


@router.post("/jobs")
async def submit(request: Request) -> Response:
    c = coordinator(request)
    who = await principal(request)
    sub = await decode(request, api.JobSubmit)
    return reply(await c.submit(who, sub), status=201)


@router.get("/jobs")
async def list_jobs(
    request: Request,
    limit: int = 100,
    offset: int = 0,
    state: api.JobState | None = None,
    name: str = "",
    sort: api.JobSort = "id",
    order: Literal["asc", "desc"] = "desc",
    all: bool = False,
) -> Response:
    """The user's jobs, newest first (a list). ``all=true``: every user's (operators)."""
    c = coordinator(request)
    query = api.JobQuery(
        state=state, name=name, sort=sort, descending=order == "desc", offset=offset, limit=limit
    )
    page = await c.find_jobs(await principal(request), query, everyone=all)
    return reply(page.jobs)


@router.get("/jobs/{job_id}")
async def job(request: Request, job_id: int, wait: float = 0.0, seen: str = "") -> Response:
    c = coordinator(request)
    return reply(await c.job_detail(await principal(request), job_id, wait, seen[:64]))


@router.get("/jobs/{job_id}/timeline")
async def job_timeline(request: Request, job_id: int) -> Response:
    c = coordinator(request)
    detail = await c.job_detail(await principal(request), job_id)
    return reply(timeline.build(detail.job, detail.events, c.clock()))


@router.get("/jobs/{job_id}/output")
async def output(
    request: Request,
    job_id: int,
    after: int = 0,
    rank: int | None = None,
    wait: float = 0.0,
    seen: str = "",
) -> Response:
    c = coordinator(request)
    who = await principal(request)
    return reply(await c.output(who, job_id, after, rank, wait, seen[:64]))


@router.post("/jobs/{job_id}/cancel")
async def cancel(request: Request, job_id: int) -> Response:
    c = coordinator(request)
    return reply(await c.cancel(await principal(request), job_id))


@router.post("/jobs/{job_id}/checkpoint")
async def checkpoint(request: Request, job_id: int) -> Response:
    c = coordinator(request)
    who = await principal(request)
    await c.job(who, job_id, Action.CONTROL)  # someone else's job: 404 whatever the body
    ask = await decode(request, api.CheckpointAsk)
    return reply(await c.ask_checkpoint(who, job_id, ask), status=202)


@router.get("/jobs/{job_id}/results")
async def results(request: Request, job_id: int) -> Response:
    c = coordinator(request)
    path = await c.results(await principal(request), job_id)
    return results_file(path, job_id)


def results_file(path: Path, job_id: int) -> FileResponse:
    """A results zip as a download; the temporary file goes once sent."""
    return FileResponse(
        path,
        media_type="application/zip",
        filename=f"job-{job_id}-results.zip",
        background=BackgroundTask(path.unlink, missing_ok=True),
    )
