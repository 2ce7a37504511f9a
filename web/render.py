"""Rendering the portal's pages: one Jinja environment, its filters and the page helper.

Templates are in ``web/templates``; every page extends ``base.html``. Autoescaping is on and
undefined names are errors, so a template mistake fails a test instead of showing nothing.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
from fastapi import Request
from fastapi.responses import HTMLResponse

from vpool import __version__
from vpool.sizes import format_size

if TYPE_CHECKING:
    from vpool.web.session import Viewer

TEMPLATES = Path(__file__).parent / "templates"

env = jinja2.Environment(
    loader=jinja2.FileSystemLoader(TEMPLATES),
    autoescape=True,
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)


def ago(then: float | None, now: float) -> str:
    if then is None:
        return "-"
    seconds = max(0.0, now - then)
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.0f} h ago"
    return clock(then)


def clock(then: float | None) -> str:
    return "-" if then is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(then))


def duration(start: float | None, end: float | None) -> str:
    if start is None:
        return "-"
    if end is None:
        return "-"
    seconds = max(0.0, end - start)
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


# A job's failure mode (``api.JobInfo.on_failure``) on its page: what a lost rank does.
FAILURE_MODE_WORDS = {
    "transparent": "restart transparently",
    "abort": "fail the job",
    "ulfm": "report to the program (ULFM)",
    "blank": "report to the program (FT-MPI blank)",
    "shrink": "report to the program (FT-MPI shrink)",
    "rebuild": "report to the program (FT-MPI rebuild)",
}


def failure_mode(mode: str) -> str:
    """The words for ``mode``; a mode this portal does not know is shown as it is."""
    return FAILURE_MODE_WORDS.get(mode, mode)


env.filters["ago"] = ago
env.filters["clock"] = clock
env.filters["size"] = format_size
env.filters["failure_mode"] = failure_mode
env.globals["duration"] = duration
env.globals["version"] = __version__


def render(template: str, **context: Any) -> str:
    return env.get_template(template).render(**context)


def page(
    request: Request,
    viewer: Viewer | None,
    template: str,
    *,
    status: int = 200,
    **context: Any,
) -> HTMLResponse:
    """A whole page for ``viewer`` (None: signed out)."""
    core = request.app.state.coordinator
    html = render(
        template,
        viewer=viewer,
        pool_name=core.settings.pool_name,
        path=request.url.path,
        now=core.clock(),
        **context,
    )
    return HTMLResponse(html, status_code=status, headers={"Cache-Control": "no-store"})
