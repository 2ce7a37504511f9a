"""HTTP client of the coordinator's agent API (``/api/v1/agents/...``, see ``protocol/api.py``).

One ``httpx.AsyncClient`` (it runs under trio through anyio) verifying the pool CA. Calls that
must eventually land (output, exit reports, problems) are retried with exponential backoff, at
most ``retry_max_delay`` apart, while the coordinator is unreachable (refused, reset, timed out:
typically restarting) or answers 5xx; a 4xx answer is final (``CoordinatorRejected``).
The agent token is replaced whenever a heartbeat hands out a fresh one.

A coordinator that vanishes without a reset (a middlebox dropped the connection) is noticed:
every request has a connect timeout and a read timeout (a held heartbeat or lease long-poll:
``HOLD_MARGIN`` above its hold), a request that failed closes its connection (httpx never
reuses one that errored), idle pooled connections are not reused past ``KEEPALIVE_EXPIRY``, and
the sockets have TCP keepalive (``vpool.sockopts``).
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import httpx
import msgspec
import trio

from vpool import tls
from vpool.protocol import api
from vpool.reasons import describe, untrusted
from vpool.sockopts import keepalive_options
from vpool.worker_agent.errors import (
    CoordinatorRejected,
    CoordinatorUnreachable,
    CoordinatorUntrusted,
)

if TYPE_CHECKING:
    from vpool.worker_agent.settings import AgentSettings

log = logging.getLogger("vpool.agent")

T = TypeVar("T")
PREFIX = "/api/v1/agents"
_json = msgspec.json.Encoder()
_error_body = msgspec.json.Decoder(api.ErrorBody)

CONNECT_TIMEOUT = 10.0
# Read (and write) timeout of a request that is answered at once.
TIMEOUT = 15.0
# How much longer than its hold a long-poll's answer may take to come (a busy coordinator).
HOLD_MARGIN = 5.0
# An idle pooled connection is not reused after this (a middlebox may have forgotten it).
KEEPALIVE_EXPIRY = 5.0
# A blob download may pause this long between chunks (the coordinator streams a file).
BLOB_TIMEOUT = 60.0
# The answer to a results upload may take this long (the coordinator stores the zip first).
RESULTS_TIMEOUT = 600.0


class CoordinatorClient:
    """The agent's view of the coordinator. ``transport`` replaces the network in tests."""

    def __init__(
        self,
        url: str,
        *,
        ca: Path | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        retry_max_delay: float = 2.0,
    ) -> None:
        self.url = url.rstrip("/")
        self.token = ""
        self.retry_max_delay = retry_max_delay
        verify: Any = tls.client_context(ca) if url.startswith("https:") else True
        if transport is None:
            transport = httpx.AsyncHTTPTransport(
                verify=verify,
                # Long-polls and uploads run side by side with heartbeats.
                limits=httpx.Limits(
                    max_connections=32,
                    max_keepalive_connections=8,
                    keepalive_expiry=KEEPALIVE_EXPIRY,
                ),
                socket_options=keepalive_options(),
            )
        self._http = httpx.AsyncClient(
            base_url=self.url,
            transport=transport,
            timeout=_timeout(TIMEOUT),
        )

    @classmethod
    def of(
        cls, settings: AgentSettings, transport: httpx.AsyncBaseTransport | None = None
    ) -> CoordinatorClient:
        """The client an agent of ``settings`` uses."""
        return cls(
            settings.coordinator_url,
            ca=settings.ca_path,
            transport=transport,
            retry_max_delay=settings.retry_max_delay,
        )

    async def __aenter__(self) -> CoordinatorClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        with trio.move_on_after(2, shield=True):
            await self._http.aclose()

    # -- one request ------------------------------------------------------------------------

    async def _request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        content: bytes | None = None,
        http_timeout: float | None = None,
    ) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        if body is not None:
            content = _json.encode(body)
            headers["Content-Type"] = "application/json"
        elif content is not None:
            headers["Content-Type"] = "application/octet-stream"
        timeout = httpx.USE_CLIENT_DEFAULT if http_timeout is None else _timeout(http_timeout)
        try:
            resp = await self._http.request(
                method, path, content=content, headers=headers, timeout=timeout
            )
        except (httpx.HTTPError, OSError) as exc:
            # OSError: whatever the transport let through of a connection that broke.
            if untrusted(exc):  # no retry helps: the agent's `ca` setting has to change
                raise CoordinatorUntrusted(
                    f"{method} {self.url}{path}: {describe(exc)}; check the agent's `ca` setting"
                ) from exc
            raise CoordinatorUnreachable(
                f"{method} {self.url}{path} failed: {describe(exc)}"
            ) from exc
        _check(resp, method, path)
        return resp

    async def _retrying(
        self,
        what: str,
        call: Callable[[], Awaitable[T]],
        *,
        fatal: tuple[type[Exception], ...] = (),
    ) -> T:
        """Await ``call()`` until it does not raise ``CoordinatorUnreachable`` (but for the
        ``fatal`` kinds of it, raised at once)."""
        delay = 0.2
        while True:
            try:
                return await call()
            except fatal:
                raise
            except CoordinatorUnreachable as exc:
                log.warning("%s: %s; retrying in %.1f s", what, exc, delay)
            # Jitter keeps a pool of agents from hammering a restarted coordinator in step.
            await trio.sleep(delay * (0.75 + random.random() / 2))
            delay = min(delay * 2, self.retry_max_delay)

    async def _json_call(
        self, path: str, body: Any, type_: type[T], *, http_timeout: float | None = None
    ) -> T:
        resp = await self._request("POST", path, body=body, http_timeout=http_timeout)
        try:
            return msgspec.json.decode(resp.content, type=type_)
        except msgspec.DecodeError as exc:
            raise CoordinatorUnreachable(
                f"POST {path}: unreadable answer: {describe(exc)}"
            ) from exc

    # -- the agent API ----------------------------------------------------------------------

    async def enroll(self, req: api.EnrollRequest) -> api.EnrollResponse:
        """Enroll (retrying while unreachable); remembers the agent token."""
        resp = await self._retrying(
            "enroll",
            lambda: self._json_call(f"{PREFIX}/enroll", req, api.EnrollResponse),
            # Not yet running anything: a CA that does not fit is said, not waited out.
            fatal=(CoordinatorUntrusted,),
        )
        self.token = resp.agent_token
        return resp

    async def lease(self, free_slots: int, wait: float) -> list[api.Lease]:
        """One long-poll for leases (not retried: the lease loop backs off itself)."""
        resp = await self._json_call(
            f"{PREFIX}/lease",
            api.LeaseRequest(free_slots=free_slots, wait=wait),
            api.LeaseResponse,
            http_timeout=wait + HOLD_MARGIN,
        )
        return resp.leases

    async def heartbeat(self, hb: api.AgentHeartbeat) -> api.AgentHeartbeatResponse:
        resp = await self._json_call(
            f"{PREFIX}/heartbeat",
            hb,
            api.AgentHeartbeatResponse,
            http_timeout=max(hb.wait, 0.0) + HOLD_MARGIN,
        )
        if resp.agent_token:
            self.token = resp.agent_token
        return resp

    async def post_output(self, batch: api.OutputBatch) -> None:
        await self._retrying(
            "posting output", lambda: self._request("POST", f"{PREFIX}/output", body=batch)
        )

    async def post_exit(self, report: api.RankExit) -> None:
        await self._retrying(
            "reporting a rank's exit",
            lambda: self._request("POST", f"{PREFIX}/exit", body=report),
        )

    async def spawn(self, ask: api.SpawnAsk) -> api.SpawnAnswer:
        """A rank's ``MPI.Comm.Spawn`` (retried while unreachable: the coordinator keeps its
        answer, so asking twice is harmless)."""
        return await self._retrying(
            "asking to spawn", lambda: self._json_call(f"{PREFIX}/spawn", ask, api.SpawnAnswer)
        )

    async def post_problem(self, problem: api.RankProblem) -> None:
        await self._retrying(
            "reporting a rank problem",
            lambda: self._request("POST", f"{PREFIX}/problem", body=problem),
        )

    async def post_checkpoint_failed(self, report: api.CheckpointFailed) -> None:
        await self._retrying(
            "reporting a failed checkpoint",
            lambda: self._request("POST", f"{PREFIX}/checkpoint-failed", body=report),
        )

    async def post_restored(self, report: api.RestoreReport) -> None:
        await self._retrying(
            "reporting how a rank started",
            lambda: self._request("POST", f"{PREFIX}/restored", body=report),
        )

    async def put_results(self, job: int, rank: int, incarnation: int, data: bytes) -> None:
        await self._retrying(
            "uploading results",
            lambda: self._request(
                "PUT",
                f"{PREFIX}/results/{job}/{rank}/{incarnation}",
                content=data,
                http_timeout=RESULTS_TIMEOUT,
            ),
        )

    async def fetch_blob(self, sha256: str, dest: Path) -> str:
        """Download blob ``sha256`` into ``dest``; return the sha256 of what arrived."""
        return await self._retrying("fetching a blob", lambda: self._fetch_once(sha256, dest))

    async def _fetch_once(self, sha256: str, dest: Path) -> str:
        path = f"{PREFIX}/blobs/{sha256}"
        headers = {"Authorization": f"Bearer {self.token}"}
        digest = hashlib.sha256()
        try:
            async with self._http.stream(
                "GET", path, headers=headers, timeout=_timeout(BLOB_TIMEOUT)
            ) as resp:
                if resp.status_code >= 400:
                    await resp.aread()
                    _check(resp, "GET", path)
                async with await trio.open_file(dest, "wb") as f:
                    async for chunk in resp.aiter_bytes(1024 * 1024):
                        digest.update(chunk)
                        await f.write(chunk)
        except (httpx.HTTPError, OSError) as exc:
            raise CoordinatorUnreachable(f"GET {self.url}{path} failed: {describe(exc)}") from exc
        return digest.hexdigest()


def _timeout(seconds: float) -> httpx.Timeout:
    """``seconds`` to read (and write), the connection made within ``CONNECT_TIMEOUT``."""
    return httpx.Timeout(seconds, connect=CONNECT_TIMEOUT)


def _check(resp: httpx.Response, method: str, path: str) -> None:
    if resp.status_code < 400:
        return
    try:
        detail = _error_body.decode(resp.content).error
        code, message = detail.code, detail.message
    except msgspec.DecodeError:
        code, message = "http_error", resp.text[:200]
    if resp.status_code >= 500 or resp.status_code in (408, 429):
        raise CoordinatorUnreachable(
            f"{method} {path}: coordinator answered {resp.status_code} {code}: {message}"
        )
    raise CoordinatorRejected(resp.status_code, code, message)
