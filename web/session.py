"""Portal sign-in: session cookies, CSRF tokens and who is looking.

A user signs in on ``/login`` with one of their API tokens and gets a session cookie
(``HttpOnly; Secure; SameSite=Strict``); the coordinator keeps only its sha256, with a CSRF
secret that every form of the session carries. A POST is accepted only with that secret and,
when the browser says where it comes from (``Origin``), from this server's own origin. The
sign-in form itself is protected the same way with a short-lived pre-session cookie (double
submit). Pages of a signed-out visitor redirect to ``/login?next=...``.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from urllib.parse import quote, urlsplit

from fastapi import Request
from fastapi.responses import RedirectResponse, Response
from starlette.datastructures import FormData

from vpool.coordinator.access import Principal
from vpool.coordinator.errors import Forbidden, Unauthorized
from vpool.coordinator.keys import new_session_secret
from vpool.coordinator.transport import coordinator, presented

SESSION_COOKIE = "vpool_session"
LOGIN_COOKIE = "vpool_login"
LOGIN_COOKIE_AGE = 3600


class SignInRequired(Exception):
    """A page needs a session; the app's handler redirects to the sign-in page."""

    def __init__(self, next_path: str) -> None:
        super().__init__(next_path)
        self.next_path = next_path


@dataclass(frozen=True)
class Viewer:
    who: Principal
    csrf: str


async def viewer(request: Request) -> Viewer:
    """The signed-in user of a page request, or ``SignInRequired``."""
    cookie = request.cookies.get(SESSION_COOKIE, "")
    if cookie:
        try:
            core = coordinator(request)
            who, csrf = await presented(request, lambda: core.session(cookie))
            return Viewer(who=who, csrf=csrf)
        except Unauthorized:
            pass
    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    raise SignInRequired(target)


async def optional_viewer(request: Request) -> Viewer | None:
    try:
        return await viewer(request)
    except SignInRequired:
        return None


def check_post(request: Request, form: FormData, secret: str) -> None:
    """A form POST of this session (CSRF): the secret matches and the origin is ours."""
    check_origin(request)
    sent = form.get("csrf")
    if not isinstance(sent, str) or not hmac.compare_digest(sent.encode(), secret.encode()):
        raise Forbidden(
            "the form is stale or was not sent from this site; reload the page and try again",
            code="bad_csrf",
        )


def check_origin(request: Request) -> None:
    """A browser's word on where a POST comes from: ``Sec-Fetch-Site`` when it sends it (all
    current browsers), else ``Origin``. Clients that send neither are not browsers a forged
    page could drive; the CSRF secret still has to match."""
    site = request.headers.get("sec-fetch-site")
    if site is not None:
        if site != "same-origin":
            raise Forbidden(f"a form from a {site} page may not post here", code="bad_origin")
        return
    origin = request.headers.get("origin")
    if origin is not None and _netloc(origin) != request.headers.get("host", ""):
        raise Forbidden(f"a form from {origin} may not post here", code="bad_origin")


def _netloc(url: str) -> str | None:
    """The host (and port) of a URL; None for what does not parse as one (``http://[::1``):
    no origin of ours."""
    try:
        return urlsplit(url).netloc
    except ValueError:
        return None


def safe_next(target: str | None) -> str:
    """Where to go after signing in: a path of this site only (never ``//host``)."""
    if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return "/jobs"
    return target


def login_redirect(next_path: str) -> RedirectResponse:
    return RedirectResponse(f"/login?next={quote(safe_next(next_path), safe='/')}", 303)


def set_session(response: Response, cookie: str, max_age: float) -> None:
    response.set_cookie(
        SESSION_COOKIE,
        cookie,
        max_age=int(max_age),
        path="/",
        secure=True,
        httponly=True,
        samesite="strict",
    )


def clear_session(response: Response) -> None:
    response.delete_cookie(SESSION_COOKIE, path="/", secure=True, httponly=True, samesite="strict")


def login_secret(request: Request) -> str:
    """The sign-in form's CSRF secret: the pre-session cookie's, or a new one."""
    return request.cookies.get(LOGIN_COOKIE) or new_session_secret()


def set_login_secret(response: Response, secret: str) -> None:
    response.set_cookie(
        LOGIN_COOKIE,
        secret,
        max_age=LOGIN_COOKIE_AGE,
        path="/login",
        secure=True,
        httponly=True,
        samesite="strict",
    )
