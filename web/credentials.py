"""The operators' credentials page (``/pool/credentials``): the pool's join tokens, made and
revoked here as ``vpool-coordinator join-token`` does, and its relays' keys (listed only: a
relay key is made on the coordinator's host, ``vpool-coordinator relay add``).

Only operators see it (``access.check_operator``: anyone else gets 403). A new join token is
shown once, on the page that made it; only its hash is stored, and no key or hash is ever
shown. The forms carry the session's CSRF secret like every portal form. The JSON API has no
routes for credentials, so this page calls the store's methods itself, as the CLI does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import HTMLResponse, RedirectResponse

from vpool import sizes
from vpool.coordinator import keys
from vpool.coordinator.access import check_operator
from vpool.coordinator.transport import coordinator
from vpool.coordinator.transport import form as read_form
from vpool.protocol import api
from vpool.web import session
from vpool.web.render import page
from vpool.web.session import Viewer, viewer

router = APIRouter()

MAX_LABEL = 100  # as for API tokens
MAX_USES = 1_000_000
MAX_EXPIRY = 10 * 365 * 86400.0


@dataclass
class JoinDraft:
    """What the operator typed in the form for a join token, to show again with the errors."""

    label: str = ""
    uses: str = ""
    expires: str = ""
    errors: dict[str, str] = field(default_factory=dict)


@router.get("/pool/credentials", response_class=HTMLResponse)
async def credentials(request: Request) -> Response:
    v = await _operator(request)
    return await _page(request, v, JoinDraft())


async def _page(
    request: Request,
    v: Viewer,
    draft: JoinDraft,
    *,
    made: tuple[str, api.JoinTokenInfo] | None = None,
    status: int = 200,
) -> Response:
    core = coordinator(request)
    tokens = await core.db.call(core.store.list_join_tokens, core.clock())
    relays: list[dict[str, Any]] = await core.db.call(core.store.list_relay_keys)
    return page(
        request,
        v,
        "credentials.html",
        status=status,
        tokens=tokens,
        relays=relays,
        draft=draft,
        made=made,
        open_enrollment=core.settings.open_enrollment,
    )


@router.post("/pool/join-tokens", response_class=HTMLResponse)
async def create_join_token(request: Request) -> Response:
    v = await _operator(request)
    form = await read_form(request, max_files=0, max_fields=10)
    session.check_post(request, form, v.csrf)
    draft = JoinDraft(
        label=_text(form.get("label"), 4096),
        uses=_text(form.get("uses"), 100),
        expires=_text(form.get("expires"), 100),
    )
    label = draft.label.strip()
    if len(label) > MAX_LABEL:
        draft.errors["label"] = f"at most {MAX_LABEL} characters"
    uses = _uses(draft)
    lifetime = _lifetime(draft)
    if draft.errors:
        return await _page(request, v, draft, status=422)
    core = coordinator(request)
    now = core.clock()
    token, token_hash = keys.new_api_token(keys.JOIN_PREFIX)
    expires = None if lifetime is None else now + lifetime
    info = await core.db.call(
        lambda: core.store.create_join_token(token_hash, label, now, uses=uses, expires=expires)
    )
    return await _page(request, v, JoinDraft(), made=(token, info), status=201)


@router.post("/pool/join-tokens/{token_id}/revoke")
async def revoke_join_token(request: Request, token_id: int) -> Response:
    v = await _operator(request)
    session.check_post(request, await read_form(request, max_files=0, max_fields=10), v.csrf)
    core = coordinator(request)
    await core.db.call(core.store.revoke_join_token, token_id, core.clock())
    return RedirectResponse("/pool/credentials", 303)


async def _operator(request: Request) -> Viewer:
    v = await viewer(request)
    check_operator(v.who)
    return v


def _uses(draft: JoinDraft) -> int | None:
    """The agents the token may admit; None (empty): any number."""
    text = draft.uses.strip()
    if not text:
        return None
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= MAX_USES:
        draft.errors["uses"] = f"a whole number of agents from 1 to {MAX_USES}, or empty for any"
        return None
    return int(text)


def _lifetime(draft: JoinDraft) -> float | None:
    """Seconds the token stays valid; None (empty): for ever."""
    text = draft.expires.strip().lower()
    if not text:
        return None
    # As ``vpool-coordinator join-token create --expires`` takes it: 90 (seconds), 30m, 7d.
    try:
        seconds = sizes.parse_duration(text)
    except ValueError:
        seconds = 0.0
    if not (0 < seconds <= MAX_EXPIRY and math.isfinite(seconds)):
        draft.errors["expires"] = "a duration such as 30m, 12h, 7d or 2w (at most 10 years)"
        return None
    return seconds


def _text(value: object, limit: int) -> str:
    return value[:limit] if isinstance(value, str) else ""
