"""The read-only dashboard at ``/``: pool summary, agents, relays and recent jobs."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from vpool.sizes import format_size

if TYPE_CHECKING:
    from vpool.coordinator.service import Coordinator

router = APIRouter()

_env = jinja2.Environment(
    loader=jinja2.FileSystemLoader(Path(__file__).parent / "templates"),
    autoescape=True,
    undefined=jinja2.StrictUndefined,
)


def _ago(then: float | None, now: float) -> str:
    if then is None:
        return "-"
    seconds = max(0.0, now - then)
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(then))


_env.filters["ago"] = _ago
_env.filters["size"] = format_size


async def _context(core: Coordinator) -> dict[str, Any]:
    store, db = core.store, core.db
    agents = await core.list_agents()
    relays = await db.call(store.list_relays)
    jobs = await db.call(store.list_jobs, None, 50)
    counts = await db.call(store.count_jobs)
    return {
        "pool": core.pool_info(),
        "public_url": core.settings.public_url,
        "now": core.clock(),
        "agents": agents,
        "relays": relays,
        "jobs": jobs,
        "counts": counts,
        "slots": sum(a.slots for a in agents if a.state == "alive"),
        "busy": sum(a.ranks for a in agents if a.state == "alive"),
    }


@router.get("/", response_class=HTMLResponse)
async def dashboard(request: Request) -> HTMLResponse:
    core: Coordinator = request.app.state.coordinator
    html = _env.get_template("dashboard.html").render(**await _context(core))
    return HTMLResponse(html)
