"""Relay endpoints: register, heartbeat (answers with finished jobs), lost ranks, divergence,
verdicts on re-executions for validation, committed checkpoint images."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from vpool.coordinator.transport import bearer, coordinator, decode, empty, presented, reply
from vpool.protocol import api

router = APIRouter(prefix="/api/v1/relays")


async def _relay(request: Request) -> str:
    """The name of the relay the request's key belongs to."""
    core, token = coordinator(request), bearer(request)
    return await presented(request, lambda: core.relay(token))


@router.post("/register")
async def register(request: Request) -> Response:
    relay = await _relay(request)
    reg = await decode(request, api.RelayRegister)
    return reply(await coordinator(request).register_relay(relay, reg))


@router.post("/heartbeat")
async def heartbeat(request: Request) -> Response:
    relay = await _relay(request)
    hb = await decode(request, api.RelayHeartbeat)
    return reply(await coordinator(request).relay_heartbeat(relay, hb))


@router.post("/lost")
async def lost(request: Request) -> Response:
    relay = await _relay(request)
    report = await decode(request, api.RelayLost)
    await coordinator(request).relay_lost(relay, report)
    return empty()


@router.post("/diverged")
async def diverged(request: Request) -> Response:
    relay = await _relay(request)
    report = await decode(request, api.RelayDiverged)
    await coordinator(request).relay_diverged(relay, report)
    return empty()


@router.post("/validated")
async def validated(request: Request) -> Response:
    relay = await _relay(request)
    report = await decode(request, api.RelayValidated)
    await coordinator(request).relay_validated(relay, report)
    return empty()


@router.post("/refused")
async def refused(request: Request) -> Response:
    relay = await _relay(request)
    report = await decode(request, api.RelayRefused)
    await coordinator(request).relay_refused(relay, report)
    return empty()


@router.post("/checkpoint")
async def checkpoint(request: Request) -> Response:
    relay = await _relay(request)
    report = await decode(request, api.RelayCheckpoint)
    return reply(await coordinator(request).relay_checkpoint(relay, report))
