"""The web portal's pages: sign-in, jobs, one job (live), submit, pool, account, and the
operators' credentials (``web/credentials.py``, included in this router).

Every page calls the same ``Coordinator`` methods as the JSON API (``coordinator/api_jobs.py``),
so both enforce the same rules (``coordinator/access.py``). Pages need a session
(``web/session.py``); forms carry its CSRF secret. The job page follows its job through
server-sent events from one shared feed per job (``web/feed.py``).
"""

from __future__ import annotations

import base64
import math
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Literal
from urllib.parse import urlencode

import msgspec
import trio
from fastapi import APIRouter, Request, Response
from fastapi.responses import HTMLResponse, RedirectResponse, StreamingResponse
from markupsafe import Markup

from vpool.coordinator.api_jobs import results_file
from vpool.coordinator.errors import CoordinatorError, Unauthorized
from vpool.coordinator.service import Coordinator
from vpool.coordinator.transport import coordinator, presented
from vpool.coordinator.transport import form as read_form
from vpool.protocol import api
from vpool.protocol.lines import LineAssembler
from vpool.web import credentials, feed, session, timeline
from vpool.web.render import page, render
from vpool.web.session import Viewer, viewer

router = APIRouter()
# The operators' credentials page, a concern of its own, served with the portal's pages (the
# coordinator's app includes this router).
router.include_router(credentials.router)

JOBS_PER_PAGE = 25
FIRST_OUTPUT_RECORDS = 20_000  # rendered into the job page; the rest comes live
FIRST_OUTPUT_BYTES = 1 << 20  # and no more output than this in it
OUTPUT_PAGE_BYTES = 1 << 20  # output read at once for a live feed
MAX_STREAM = 600.0  # seconds an event stream lasts; the browser reconnects (and re-authenticates)
STATES: tuple[api.JobState, ...] = ("queued", "running", "succeeded", "failed", "cancelled")


def feeds(request: Request) -> feed.Feeds:
    f: feed.Feeds = request.app.state.feeds
    return f


def make_feeds(core: Coordinator) -> feed.Feeds:
    async def detail(job: int) -> api.JobDetail | None:
        return await core.db.call(core.store.job_detail, job)

    async def output(job: int, after: int, limit: int) -> tuple[list[api.OutputRecord], bool]:
        return await visible_output(core, job, after, None, limit, OUTPUT_PAGE_BYTES)

    async def settled(job: api.JobInfo) -> bool:
        return await core.settle_time(job) <= 0

    return feed.Feeds(
        feed.Sources(
            detail=detail,
            output=output,
            render=lambda d: live_panel(d, core.clock()),
            changes=core.changes.current,
            settled=settled,
        )
    )


def live_panel(detail: api.JobDetail, now: float) -> str:
    """The part of the job page that changes: state, ranks, timeline and events."""
    tl = timeline.build(detail.job, detail.events, now)
    return render(
        "_live.html",
        job=detail.job,
        detail=detail,
        svg=timeline.render_svg(tl),
        now=now,
        mark_kind=timeline.mark_kind,
    )


async def visible_output(
    core: Coordinator, job: int, after: int, rank: int | None, limit: int, max_bytes: int
) -> tuple[list[api.OutputRecord], bool]:
    """The output page the portal may show: the job's state is read in the same database
    call, before its output, so a job that is withheld at the read shows nothing."""

    def read() -> tuple[list[api.OutputRecord], bool]:
        info = core.store.job_info(job)
        if info is None or info.output_withheld():
            return [], False
        return core.store.output_page(job, after, rank, limit, max_bytes)

    return await core.db.call(read)


# -- signing in ---------------------------------------------------------------------------------


@router.get("/", response_class=HTMLResponse)
async def home(request: Request) -> Response:
    await viewer(request)
    return RedirectResponse("/jobs", 303)


@router.get("/login", response_class=HTMLResponse)
async def login_form(request: Request, next: str = "/jobs") -> Response:
    if await session.optional_viewer(request) is not None:
        return RedirectResponse(session.safe_next(next), 303)
    return _login_page(request, next, error="", status=200)


def _login_page(request: Request, next_path: str, *, error: str, status: int) -> Response:
    secret = session.login_secret(request)
    response = page(
        request,
        None,
        "login.html",
        status=status,
        next=session.safe_next(next_path),
        csrf=secret,
        error=error,
    )
    session.set_login_secret(response, secret)
    return response


@router.post("/login", response_class=HTMLResponse)
async def login(request: Request) -> Response:
    form = await read_form(request, max_files=0, max_fields=10)
    next_path = session.safe_next(_text(form.get("next")))
    session.check_post(request, form, request.cookies.get(session.LOGIN_COOKIE, "\0"))
    token = _text(form.get("token")).strip()
    if not token:
        return _login_page(request, next_path, error="Paste your API token.", status=422)
    core = coordinator(request)
    try:
        cookie, _, _ = await presented(request, lambda: core.sign_in(token))
    except Unauthorized:
        return _login_page(
            request, next_path, error="This token is unknown or was revoked.", status=401
        )
    response = RedirectResponse(next_path, 303)
    session.set_session(response, cookie, core.settings.session_lifetime)
    response.delete_cookie(session.LOGIN_COOKIE, path="/login")
    return response


@router.get("/logout", response_class=HTMLResponse)
async def logout_form(request: Request) -> Response:
    v = await session.optional_viewer(request)
    if v is None:
        return RedirectResponse("/login", 303)
    return page(request, v, "logout.html")


@router.post("/logout")
async def logout(request: Request) -> Response:
    v = await viewer(request)
    session.check_post(request, await read_form(request, max_files=0, max_fields=10), v.csrf)
    await coordinator(request).sign_out(request.cookies.get(session.SESSION_COOKIE, ""))
    response = RedirectResponse("/login", 303)
    session.clear_session(response)
    return response


# -- jobs ---------------------------------------------------------------------------------------


@router.get("/jobs", response_class=HTMLResponse)
async def jobs(
    request: Request,
    state: str = "",
    q: str = "",
    sort: str = "id",
    order: Literal["asc", "desc"] = "desc",
    page_no: int = 1,
    all: bool = False,
) -> Response:
    v = await viewer(request)
    core = coordinator(request)
    chosen: api.JobState | None = next((s for s in STATES if s == state), None)
    key: api.JobSort = next((s for s in api.JOB_SORTS if s == sort), "id")
    page_no = max(1, min(page_no, 10**6))
    everyone = all and v.who.operator
    query = api.JobQuery(
        state=chosen,
        name=q[:200],
        sort=key,
        descending=order == "desc",
        offset=(page_no - 1) * JOBS_PER_PAGE,
        limit=JOBS_PER_PAGE,
    )
    found = await core.find_jobs(v.who, query, everyone=everyone)
    pages = max(1, math.ceil(found.total / JOBS_PER_PAGE))
    here = {
        "state": chosen or "",
        "q": query.name,
        "sort": key,
        "order": order,
        "page_no": page_no,
        **({"all": "true"} if everyone else {}),
    }

    def link(**changes: object) -> str:
        """This listing's URL with ``changes``; a new filter or order starts at page 1."""
        params = {**here, "page_no": 1, **changes}
        return "/jobs?" + urlencode(params)

    return page(
        request,
        v,
        "jobs.html",
        found=found,
        query=query,
        state=chosen or "",
        states=STATES,
        sorts=api.JOB_SORTS,
        page_no=page_no,
        pages=pages,
        everyone=everyone,
        link=link,
    )


@router.get("/jobs/{job_id}", response_class=HTMLResponse)
async def job_page(
    request: Request, job_id: int, rank: int | None = None, asked: int | None = None
) -> Response:
    v = await viewer(request)
    core = coordinator(request)
    detail = await core.job_detail(v.who, job_id)
    if rank is not None and not 0 <= rank < detail.job.ranks:
        rank = None
    records, more = await visible_output(
        core, job_id, 0, rank, FIRST_OUTPUT_RECORDS, FIRST_OUTPUT_BYTES
    )
    cursor = records[-1].id if records else 0
    # Ended, and every stopped rank has reported: no more output can come.
    terminal = detail.job.state in api.TERMINAL_STATES and await core.settle_time(detail.job) <= 0
    assembler = LineAssembler()
    lines = assembler.feed_records(records)
    seed: dict[str, str] = {}
    if terminal and not more:
        lines += assembler.flush()
    else:  # the live stream completes these lines; the browser holds them until then
        for (r, stream), data in assembler.pending().items():
            seed[f"{r}:{stream}"] = base64.b64encode(data).decode("ascii")
    return page(
        request,
        v,
        "job.html",
        job=detail.job,
        panel=Markup(live_panel(detail, core.clock())),
        lines=[(r, s, data.decode("utf-8", "replace")) for r, s, data in lines],
        cursor=cursor,
        seed=msgspec.json.encode(seed).decode(),
        rank=rank,
        terminal=terminal,
        asked=asked,
        withheld=detail.job.output_withheld(),
    )


@router.get("/jobs/{job_id}/live")
async def live(request: Request, job_id: int, after: int = 0, rank: int | None = None) -> Response:
    """Server-sent events: ``output`` (a JSON list of records, ``id`` the cursor), ``state``
    (the live panel's HTML, when it changed) and ``end`` (the job ended; all output sent)."""
    core = coordinator(request)
    try:
        v = await viewer(request)
    except session.SignInRequired:
        raise Unauthorized("not signed in, or the session ended", code="no_session") from None
    info = await core.job(v.who, job_id)
    last = request.headers.get("last-event-id", "")
    if last.isascii() and last.isdigit() and len(last) < 19:  # isdigit() alone takes '²' too
        after = max(after, int(last))
    # Nobody has seen output of a job that withholds it: a feed started while it does starts
    # at 0, so no subscriber is ever behind its floor with nothing readable to catch up from.
    after = 0 if info.output_withheld() else max(0, min(after, 2**62))

    async def events() -> AsyncIterator[bytes]:
        async with feeds(request).watch(job_id, after) as f:
            with trio.move_on_after(MAX_STREAM):
                async with aclosing(f.follow(after, rank)) as updates:
                    async for update in updates:
                        if update.records:
                            data = msgspec.json.encode(update.records).decode()
                            yield _sse("output", data, event_id=update.records[-1].id)
                        if update.panel is not None:
                            yield _sse("state", update.panel, extra=update.state)
                        if update.done:
                            yield _sse("end", update.state)
                            return

    return StreamingResponse(
        events(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
    )


def _sse(event: str, data: str, *, event_id: int | None = None, extra: str = "") -> bytes:
    head = f"event: {event}\n" + (f"id: {event_id}\n" if event_id is not None else "")
    if extra:  # the job's state, before the HTML, so a client can read it first
        data = f"{extra}\n{data}"
    body = "".join(f"data: {line}\n" for line in data.split("\n"))
    return (head + body + "\n").encode()


@router.post("/jobs/{job_id}/cancel")
async def cancel(request: Request, job_id: int) -> Response:
    v = await viewer(request)
    session.check_post(request, await read_form(request, max_files=0, max_fields=10), v.csrf)
    await coordinator(request).cancel(v.who, job_id)
    return RedirectResponse(f"/jobs/{job_id}", 303)


@router.post("/jobs/{job_id}/checkpoint")
async def checkpoint(request: Request, job_id: int) -> Response:
    v = await viewer(request)
    session.check_post(request, await read_form(request, max_files=0, max_fields=10), v.csrf)
    asked = await coordinator(request).ask_checkpoint(v.who, job_id, api.CheckpointAsk())
    return RedirectResponse(f"/jobs/{job_id}?asked={len(asked.ranks)}", 303)


@router.get("/jobs/{job_id}/results")
async def results(request: Request, job_id: int) -> Response:
    v = await viewer(request)
    path = await coordinator(request).results(v.who, job_id)
    return results_file(path, job_id)


# -- pool and account ---------------------------------------------------------------------------


@router.get("/pool", response_class=HTMLResponse)
async def pool(request: Request) -> Response:
    v = await viewer(request)
    core = coordinator(request)
    totals = await core.pool_totals()
    agents: list[api.AgentInfo] = []
    relays: list[api.RelayStatus] = []
    recent: api.JobPage | None = None
    if v.who.operator:
        agents = await core.list_agents(v.who)
        relays = await core.list_relays(v.who)
        recent = await core.find_jobs(v.who, api.JobQuery(limit=50), everyone=True)
    return page(
        request,
        v,
        "pool.html",
        totals=totals,
        agents=agents,
        relays=relays,
        recent=recent,
        public_url=core.settings.public_url,
    )


@router.get("/account", response_class=HTMLResponse)
async def account(request: Request) -> Response:
    v = await viewer(request)
    return await _account_page(request, v, new_token=None)


async def _account_page(
    request: Request, v: Viewer, *, new_token: api.TokenCreated | None, status: int = 200
) -> Response:
    tokens = await coordinator(request).list_tokens(v.who)
    return page(
        request, v, "account.html", tokens=tokens, new_token=new_token, status=status, error=""
    )


@router.post("/account/tokens", response_class=HTMLResponse)
async def create_token(request: Request) -> Response:
    v = await viewer(request)
    form = await read_form(request, max_files=0, max_fields=10)
    session.check_post(request, form, v.csrf)
    try:
        made = await coordinator(request).create_token(v.who, _text(form.get("label")))
    except CoordinatorError as exc:
        tokens = await coordinator(request).list_tokens(v.who)
        return page(
            request,
            v,
            "account.html",
            tokens=tokens,
            new_token=None,
            error=exc.message,
            status=exc.status,
        )
    return await _account_page(request, v, new_token=made, status=201)


@router.post("/account/tokens/{token_id}/revoke")
async def revoke_token(request: Request, token_id: int) -> Response:
    v = await viewer(request)
    session.check_post(request, await read_form(request, max_files=0, max_fields=10), v.csrf)
    await coordinator(request).revoke_token(v.who, token_id)
    if token_id == v.who.token:  # the session was opened with it: it ended too
        response = RedirectResponse("/login", 303)
        session.clear_session(response)
        return response
    return RedirectResponse("/account", 303)


def _text(value: object) -> str:
    return value if isinstance(value, str) else ""
