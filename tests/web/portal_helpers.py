"""Helpers of the portal tests: an in-process pool (``coord_helpers.open_pool``) and clients
that sign in through the real form, each with its own cookie jar, as separate browsers."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from html import unescape
from pathlib import Path
from typing import Any

import httpx
from coord_helpers import Agent, Pool, open_pool

from vpool.protocol import api

BASE = "https://coordinator"  # session cookies are Secure: the client must think it is HTTPS
CSRF = re.compile(r'name="csrf" value="([^"]+)"')


def csrf_of(html: str) -> str:
    match = CSRF.search(html)
    assert match, "the page has no form with a CSRF field"
    return match.group(1)


def field_errors(html: str) -> dict[str, str]:
    """The errors a form page shows, by field (``<p class="field-error" id="F-error">``)."""
    found = re.findall(r'<p class="field-error" id="([a-z_]+)-error">([^<]*)</p>', html)
    return {name: unescape(text) for name, text in found}


@dataclass
class Browser:
    """A signed-in client with its own cookies, like one browser."""

    client: httpx.AsyncClient
    name: str
    token: str
    csrf: str = ""

    async def get(self, url: str, **kw: Any) -> httpx.Response:
        return await self.client.get(url, **kw)

    async def post_form(
        self, url: str, data: dict[str, str] | None = None, **kw: Any
    ) -> httpx.Response:
        """POST a form of this session (with its CSRF secret unless ``data`` has one)."""
        body = {"csrf": self.csrf, **(data or {})}
        return await self.client.post(url, data=body, **kw)


@dataclass
class Portal:
    pool: Pool
    stack: AsyncExitStack
    browsers: dict[str, Browser] = field(default_factory=dict)

    def client(self) -> httpx.AsyncClient:
        """A fresh, signed-out client of the same app."""
        transport = self.pool.client._transport
        return httpx.AsyncClient(transport=transport, base_url=BASE)

    async def sign_in(self, name: str = "alice", role: api.Role = "user") -> Browser:
        known = name in self.pool.users
        headers = self.pool.user(name) if known else self.pool.add_user(name, role)
        token = headers["Authorization"].removeprefix("Bearer ")
        client = await self.stack.enter_async_context(self.client())
        form = await client.get("/login")
        assert form.status_code == 200
        r = await client.post(
            "/login", data={"csrf": csrf_of(form.text), "token": token, "next": "/jobs"}
        )
        assert r.status_code == 303 and r.headers["location"] == "/jobs", r.text
        browser = Browser(client, name, token)
        browser.csrf = csrf_of((await client.get("/account")).text)
        self.browsers[name] = browser
        return browser


async def running_job(pool: Pool, ranks: int) -> tuple[api.JobInfo, Agent, list[api.Lease]]:
    """A job of alice's whose ranks all run on one agent (a relay registered first)."""
    await pool.register_relay()
    job = await pool.submit(ranks)
    agent = await pool.enroll()
    leases = await pool.lease(agent)
    await pool.heartbeat(agent, leases)
    return job, agent, leases


@asynccontextmanager
async def open_portal(tmp_path: Path, **overrides: Any) -> AsyncIterator[Portal]:
    async with open_pool(tmp_path, **overrides) as pool, AsyncExitStack() as stack:
        yield Portal(pool, stack)
