"""The coordinator's ASGI app: routers, the one JSON error shape, and the monitor loop.

``create_app(settings)`` builds everything; tests pass a fake ``clock`` (wall time used for
heartbeat deadlines and token expiry) and drive the app in-process. The failure-detection loop
runs in the app's lifespan, so it exists only under a real server (hypercorn); in-process tests
call ``Coordinator.check_timeouts()`` themselves.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import trio
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import RedirectResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from vpool import __version__, heap
from vpool.coordinator import api_agents, api_jobs, api_relays, scheduler
from vpool.coordinator.errors import CoordinatorError
from vpool.coordinator.guesses import TooManyGuesses
from vpool.coordinator.service import Coordinator
from vpool.coordinator.settings import CoordinatorSettings
from vpool.coordinator.transport import reply
from vpool.protocol import api
from vpool.web import portal, session, submit
from vpool.web.headers import SecurityHeaders
from vpool.web.render import page

log = logging.getLogger("vpool.coordinator")
STATIC = Path(portal.__file__).parent / "static"

_STATUS_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    406: "not_acceptable",
    411: "length_required",
    413: "too_large",
    415: "unsupported_media_type",
    422: "bad_request",
}


def error(status: int, code: str, message: str) -> Response:
    return reply(api.ErrorBody(error=api.ErrorDetail(code=code, message=message)), status)


def create_app(
    settings: CoordinatorSettings,
    *,
    clock: Callable[[], float] = time.time,
    coordinator: Coordinator | None = None,
) -> FastAPI:
    """The coordinator app. Opens (and migrates) the store under ``settings.state_dir``
    unless a ``coordinator`` is given."""
    core = coordinator if coordinator is not None else Coordinator(settings, clock=clock)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        period = max(0.2, min(1.0, settings.heartbeat_interval / 2))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: scheduler.monitor(core, period=period))
            # Pages of output freed after a view stay in glibc's heaps otherwise.
            nursery.start_soon(heap.keep_trimmed)
            try:
                yield
            finally:
                nursery.cancel_scope.cancel()

    app = FastAPI(
        title="vpool coordinator",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.coordinator = core
    app.state.feeds = portal.make_feeds(core)
    app.include_router(api_jobs.router)
    app.include_router(api_agents.router)
    app.include_router(api_relays.router)
    app.include_router(submit.router)  # before portal's /jobs/{job_id}
    app.include_router(portal.router)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    app.add_middleware(SecurityHeaders)
    _install_error_handlers(app)
    return app


def _is_page(request: Request) -> bool:
    """A request of the portal (an HTML answer), not of the JSON API or the event stream."""
    path = request.url.path
    return not path.startswith("/api/") and not path.endswith("/live")


def _answer(request: Request, status: int, code: str, message: str) -> Response:
    """The error as JSON for the API, as a page for the portal (sign-in for 401)."""
    if not _is_page(request):
        return error(status, code, message)
    if status == 401:
        return session.login_redirect(request.url.path)
    return page(request, None, "error.html", status=status, code=code, message=message)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(CoordinatorError)
    async def coordinator_error(request: Request, exc: CoordinatorError) -> Response:
        answer = _answer(request, exc.status, exc.code, exc.message)
        if isinstance(exc, TooManyGuesses):
            answer.headers["Retry-After"] = str(int(exc.retry_after))
        return answer

    @app.exception_handler(session.SignInRequired)
    async def sign_in(request: Request, exc: session.SignInRequired) -> RedirectResponse:
        return session.login_redirect(exc.next_path)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        parts = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err.get("loc", ()))
            parts.append(f"{where}: {err.get('msg', 'invalid')}")
        return _answer(request, 422, "bad_request", "; ".join(parts) or "invalid request")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        code = _STATUS_CODES.get(exc.status_code, "error")
        return _answer(request, exc.status_code, code, str(exc.detail))

    @app.exception_handler(OverflowError)
    async def out_of_range(request: Request, exc: OverflowError) -> Response:
        # A number from the client beyond what the database stores (a 64-bit integer): every
        # id, rank, offset and count the coordinator keeps is one, so this is the client's.
        log.info("%s %s: a number out of range: %s", request.method, request.url.path, exc)
        return _answer(
            request,
            422,
            "out_of_range",
            "a number in the request is out of range (integers are at most 2**63 - 1)",
        )

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, exc: ClientDisconnect) -> Response:
        # The client (an agent that died mid-upload, say) is gone: nothing was stored, and
        # nobody reads this answer; not an internal error.
        log.info("%s %s: the client disconnected mid-request", request.method, request.url.path)
        return error(400, "client_disconnected", "the client disconnected before the body ended")

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        # The traceback goes to our log, never to the client.
        log.error("internal error on %s %s", request.method, request.url.path, exc_info=exc)
        return _answer(request, 500, "internal", "internal error; see the coordinator's log")
