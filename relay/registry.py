"""The relay's side of the coordinator API: register, heartbeat, report lost ranks.

``CoordinatorClient`` translates HTTP and transport failures into ``CoordinatorError`` in one
place. ``run_registry`` keeps the relay registered: it retries registration with backoff until
the coordinator answers (it may start after the relay), hands the coordinator's signing key to
the hub, heartbeats with the relay's load, deletes the logs of jobs the coordinator says are
finished, and posts lost ranks, divergences and the verdicts on validating incarnations
(``determinism``) and committed checkpoint images (``ckptstore``; the rank's log is trimmed
only once the coordinator accepted the image, and only if its ``CheckpointAccepted`` allows
it). A coordinator that is briefly unreachable only delays these; the relay keeps serving agents
meanwhile.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TypeVar

import httpx
import msgspec
import trio

from vpool import __version__, tls
from vpool.protocol.api import (
    CheckpointAccepted,
    ErrorBody,
    RankFence,
    RelayCheckpoint,
    RelayDiverged,
    RelayHeartbeat,
    RelayHeartbeatResponse,
    RelayLost,
    RelayRefused,
    RelayRegister,
    RelayRegistered,
    RelayValidated,
)
from vpool.protocol.errors import TokenError
from vpool.protocol.tokens import public_key_from_text
from vpool.reasons import describe
from vpool.relay.ckptstore import Image, report_settled
from vpool.relay.errors import CoordinatorError
from vpool.relay.hub import Hub

logger = logging.getLogger(__name__)

T = TypeVar("T")

BACKOFF_FIRST = 0.2
BACKOFF_MAX = 5.0


class CoordinatorClient:
    def __init__(
        self,
        base_url: str,
        secret: str,
        *,
        ca: str = "",
        transport: httpx.AsyncBaseTransport | None = None,
        timeout: float = 10.0,
    ) -> None:
        verify = tls.client_context(Path(ca)) if ca else True
        self._http = httpx.AsyncClient(
            base_url=base_url.rstrip("/") + "/api/v1",
            headers={"authorization": f"Bearer {secret}", "content-type": "application/json"},
            verify=verify,
            transport=transport,
            timeout=timeout,
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _post(self, path: str, body: object, answer: type[T]) -> T:
        try:
            resp = await self._http.post(path, content=msgspec.json.encode(body))
        except httpx.HTTPError as exc:
            raise CoordinatorError(f"cannot reach the coordinator: {describe(exc)}") from exc
        if resp.status_code >= 400:
            try:
                err = msgspec.json.decode(resp.content, type=ErrorBody).error
                message, code = err.message, err.code
            except msgspec.DecodeError:
                message, code = resp.text[:200], "http_error"
            raise CoordinatorError(
                f"coordinator answered {resp.status_code} to {path}: {message}",
                status=resp.status_code,
                code=code,
            )
        try:
            return msgspec.json.decode(resp.content, type=answer)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise CoordinatorError(f"unexpected answer to {path}: {describe(exc)}") from exc

    async def register(self, req: RelayRegister) -> RelayRegistered:
        return await self._post("/relays/register", req, RelayRegistered)

    async def heartbeat(self, req: RelayHeartbeat) -> RelayHeartbeatResponse:
        return await self._post("/relays/heartbeat", req, RelayHeartbeatResponse)

    async def report_lost(self, req: RelayLost) -> None:
        await self._post("/relays/lost", req, dict)

    async def report_diverged(self, req: RelayDiverged) -> None:
        await self._post("/relays/diverged", req, dict)

    async def report_refused(self, req: RelayRefused) -> None:
        await self._post("/relays/refused", req, dict)

    async def report_validated(self, req: RelayValidated) -> None:
        await self._post("/relays/validated", req, dict)

    async def report_checkpoint(self, req: RelayCheckpoint) -> CheckpointAccepted:
        # An older coordinator answers {}: accepted, trim (the defaults).
        return await self._post("/relays/checkpoint", req, CheckpointAccepted)


async def _register(hub: Hub, client: CoordinatorClient, req: RelayRegister) -> float:
    """Register until the coordinator accepts; return its heartbeat interval."""
    delay = BACKOFF_FIRST
    while True:
        try:
            reg = await client.register(req)
            key = public_key_from_text(reg.signing_key)
        except (CoordinatorError, TokenError) as exc:
            logger.warning("registration failed, retrying in %.1fs: %s", delay, exc.message)
            await trio.sleep(delay)
            delay = min(delay * 2, BACKOFF_MAX)
            continue
        if hub.signing_key is None:
            hub.set_signing_key(key)
        logger.info("registered with the coordinator as %s (%s:%d)", req.name, req.host, req.port)
        return max(0.05, reg.heartbeat_interval)


async def _report_lost(hub: Hub, client: CoordinatorClient) -> None:
    while True:
        await hub.lost_ready.wait()
        lost = hub.take_lost()
        delay = BACKOFF_FIRST
        while True:
            try:
                await client.report_lost(RelayLost(name=hub.name, lost=lost))
                break
            except CoordinatorError as exc:
                logger.warning("cannot report lost ranks, retrying: %s", exc.message)
                await trio.sleep(delay)
                delay = min(delay * 2, BACKOFF_MAX)


async def _report_determinism(hub: Hub, client: CoordinatorClient) -> None:
    """Divergences and validation verdicts (``determinism``), in order. A 4xx but 401 is final
    (the job is over, a coordinator that predates the endpoint): the report is dropped rather
    than holding back the ones behind it."""
    determinism = hub.determinism
    while True:
        await determinism.ready.wait()
        for report in determinism.take():
            what = "a divergence" if isinstance(report, RelayDiverged) else "a validation verdict"
            delay = BACKOFF_FIRST
            while True:
                try:
                    if isinstance(report, RelayDiverged):
                        await client.report_diverged(report)
                    else:
                        await client.report_validated(report)
                    break
                except CoordinatorError as exc:
                    if exc.status is not None and 400 <= exc.status < 500 and exc.status != 401:
                        logger.warning(
                            "%s of job %d rank %d not taken: %s",
                            what,
                            report.job,
                            report.rank,
                            exc.message,
                        )
                        break
                    logger.warning("cannot report %s, retrying: %s", what, exc.message)
                    await trio.sleep(delay)
                    delay = min(delay * 2, BACKOFF_MAX)


async def _report_refused(hub: Hub, client: CoordinatorClient) -> None:
    """Jobs refused for good (``relay.quotas``): the coordinator fails them. A 4xx is final
    (the job is over, or not this relay's to speak of)."""
    quotas = hub.quotas
    while True:
        await quotas.ready.wait()
        for report in quotas.take():
            delay = BACKOFF_FIRST
            while True:
                try:
                    await client.report_refused(report)
                    break
                except CoordinatorError as exc:
                    if exc.status is not None and 400 <= exc.status < 500 and exc.status != 401:
                        logger.warning("refusal of job %d not taken: %s", report.job, exc.message)
                        break
                    logger.warning("cannot report a refused job, retrying: %s", exc.message)
                    await trio.sleep(delay)
                    delay = min(delay * 2, BACKOFF_MAX)


async def _report_checkpoints(hub: Hub, client: CoordinatorClient) -> None:
    """Post committed images in commit order; an accepted one lets the store trim the rank's
    log (unless the answer's ``trim`` is False: a job validated by replay needs all of it), a
    refused one (409) is deleted. Unreachable or failing: retried with backoff."""
    store = hub.store
    while True:
        if not store.reports:
            await store.reports_ready.wait()
        for img, report in store.take_reports():
            try:
                await _report_one(hub, client, img, report)
            finally:
                report_settled(img)  # accepted, refused, given up, or the job ended meanwhile


async def _report_one(
    hub: Hub, client: CoordinatorClient, img: Image, report: RelayCheckpoint
) -> None:
    store = hub.store
    delay = BACKOFF_FIRST
    while True:
        try:
            answer = await client.report_checkpoint(report)
        except CoordinatorError as exc:
            if exc.status == 409:
                await store.refused(img)
                return
            if exc.status is not None and 400 <= exc.status < 500 and exc.status not in (401, 404):
                logger.warning(
                    "checkpoint report of job %d rank %d refused: %s",
                    report.job,
                    report.rank,
                    exc.message,
                )
                return
            logger.warning("cannot report a checkpoint, retrying: %s", exc.message)
            await trio.sleep(delay)
            delay = min(delay * 2, BACKOFF_MAX)
            if report.job in hub.finished:
                return
            continue
        await store.accepted(img, trim=answer.trim)
        return


async def run_registry(hub: Hub, client: CoordinatorClient, req: RelayRegister) -> None:
    """Register, then heartbeat and report for as long as the relay runs."""
    try:
        interval = await _register(hub, client, req)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_report_lost, hub, client)
            nursery.start_soon(_report_determinism, hub, client)
            nursery.start_soon(_report_refused, hub, client)
            nursery.start_soon(_report_checkpoints, hub, client)
            fenced: list[RankFence] = []
            while True:
                if not fenced:  # fences just put up are confirmed at once
                    await trio.sleep(interval)
                try:
                    resp = await client.heartbeat(
                        RelayHeartbeat(
                            name=hub.name,
                            load=hub.load_report(),
                            jobs=hub.held_jobs(),
                            fenced=fenced,
                        )
                    )
                except CoordinatorError as exc:
                    logger.warning("heartbeat failed: %s", exc.message)
                    if exc.status in (401, 404):
                        # The coordinator forgot us (restarted with a fresh database).
                        interval = await _register(hub, client, req)
                    fenced = []  # the coordinator repeats what it did not hear of
                    continue
                if resp.finished_jobs:
                    await hub.finish_jobs(resp.finished_jobs)
                fenced = hub.declare_failed(resp.fence)
    finally:
        with trio.move_on_after(1, shield=True):
            await client.aclose()


def register_request(hub: Hub, host: str, port: int) -> RelayRegister:
    return RelayRegister(name=hub.name, host=host, port=port, software=f"vpool {__version__}")
