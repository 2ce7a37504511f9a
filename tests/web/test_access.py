"""Who sees what, for every route of the coordinator, HTML and JSON alike.

The routes are read from the app itself, and each must be in ``CLASSES``: a route added
without saying who may use it fails ``test_every_route_is_classified``. Then, for every route:
a signed-out request sees nothing but the sign-in page (or a 401), and another user's job,
its output, events, timeline and results do not exist for a second user (404), on any route.
"""

from __future__ import annotations

from fastapi.routing import APIRoute
from portal_helpers import Portal, running_job
from starlette.routing import Mount

from vpool.protocol import api

# route (method, path) -> who may use it
PUBLIC = "public"  # anyone: pool info, the sign-in page, static files
USER_API = "user_api"  # a user's bearer token
PAGE = "page"  # a portal session
OPERATOR_PAGE = "operator_page"  # a portal session of an operator (others: 403)
AGENT = "agent"  # an enrolled agent's token (or the enrollment itself)
RELAY = "relay"  # a relay key

CLASSES: dict[tuple[str, str], str] = {
    ("GET", "/api/v1/pool"): PUBLIC,
    ("GET", "/api/v1/pool/ca"): PUBLIC,  # a certificate: what `vpool-agent join` pins
    ("GET", "/login"): PUBLIC,
    ("POST", "/login"): PUBLIC,
    ("GET", "/logout"): PUBLIC,  # signed out: a redirect to /login
    ("GET", "/static"): PUBLIC,
    **{
        (m, p): USER_API
        for m, p in [
            ("GET", "/api/v1/pool/totals"),
            ("GET", "/api/v1/pool/agents"),
            ("GET", "/api/v1/pool/relays"),
            ("GET", "/api/v1/whoami"),
            ("GET", "/api/v1/tokens"),
            ("POST", "/api/v1/tokens"),
            ("POST", "/api/v1/tokens/{token_id}/revoke"),
            ("PUT", "/api/v1/blobs/{sha256}"),
            ("HEAD", "/api/v1/blobs/{sha256}"),
            ("POST", "/api/v1/jobs"),
            ("GET", "/api/v1/jobs"),
            ("GET", "/api/v1/jobs/{job_id}"),
            ("GET", "/api/v1/jobs/{job_id}/timeline"),
            ("GET", "/api/v1/jobs/{job_id}/output"),
            ("POST", "/api/v1/jobs/{job_id}/cancel"),
            ("POST", "/api/v1/jobs/{job_id}/checkpoint"),
            ("GET", "/api/v1/jobs/{job_id}/results"),
        ]
    },
    **{
        (m, p): PAGE
        for m, p in [
            ("GET", "/"),
            ("POST", "/logout"),
            ("GET", "/jobs"),
            ("GET", "/jobs/new"),
            ("POST", "/jobs/new"),
            ("GET", "/jobs/{job_id}"),
            ("GET", "/jobs/{job_id}/live"),
            ("POST", "/jobs/{job_id}/cancel"),
            ("POST", "/jobs/{job_id}/checkpoint"),
            ("GET", "/jobs/{job_id}/results"),
            ("GET", "/pool"),
            ("GET", "/account"),
            ("POST", "/account/tokens"),
            ("POST", "/account/tokens/{token_id}/revoke"),
        ]
    },
    ("GET", "/pool/credentials"): OPERATOR_PAGE,
    ("POST", "/pool/join-tokens"): OPERATOR_PAGE,
    ("POST", "/pool/join-tokens/{token_id}/revoke"): OPERATOR_PAGE,
    **{
        (m, "/api/v1/agents" + p): AGENT
        for m, p in [
            ("POST", "/enroll"),
            ("POST", "/lease"),
            ("POST", "/heartbeat"),
            ("GET", "/blobs/{sha256}"),
            ("POST", "/output"),
            ("POST", "/exit"),
            ("POST", "/spawn"),
            ("POST", "/problem"),
            ("POST", "/checkpoint-failed"),
            ("POST", "/restored"),
            ("PUT", "/results/{job}/{rank}/{incarnation}"),
        ]
    },
    **{
        ("POST", "/api/v1/relays" + p): RELAY
        for p in [
            "/register",
            "/heartbeat",
            "/lost",
            "/diverged",
            "/validated",
            "/refused",
            "/checkpoint",
        ]
    },
}
SECRET = "secret-job-of-alice"
SECRET_OUTPUT = b"alice's private output\n"


def app_routes(portal: Portal) -> set[tuple[str, str]]:
    """Every (method, path) the app answers, through included routers (FastAPI keeps an
    included router as one entry holding ``original_router``)."""
    app = portal.pool.client._transport.app  # type: ignore[attr-defined]
    found: set[tuple[str, str]] = set()
    todo = list(app.routes)
    while todo:
        route = todo.pop()
        if isinstance(route, APIRoute):
            found |= {(m, route.path) for m in route.methods}
        elif isinstance(route, Mount):
            found.add(("GET", route.path))
        elif hasattr(route, "original_router"):
            prefix = route.include_context.prefix
            assert not prefix, "routers carry their prefix themselves here"
            todo += route.original_router.routes
        else:
            raise AssertionError(f"unknown kind of route {route!r}")
    return found


def fill(path: str, job: int) -> str:
    return (
        path.replace("{job_id}", str(job))
        .replace("{token_id}", "1")
        .replace("{sha256}", "0" * 64)
        .replace("{job}", str(job))
        .replace("{rank}", "0")
        .replace("{incarnation}", "1")
    )


async def alice_job(portal: Portal) -> api.JobInfo:
    """A job of alice's that ran and printed something, so every route has something to show."""
    pool = portal.pool
    job, agent, (lease,) = await running_job(pool, 1)
    await pool.core.db.call(
        pool.core.store.db.execute, "UPDATE jobs SET name = ? WHERE id = ?", [SECRET, job.id]
    )
    assert (await pool.output(agent, lease, "stdout", 0, SECRET_OUTPUT)).status_code == 200
    assert (await pool.exit(agent, lease, 0)).status_code == 200
    return job


async def test_every_route_is_classified(portal: Portal) -> None:
    routes = app_routes(portal)
    assert routes - set(CLASSES) == set(), "new routes: say who may use them in CLASSES"
    assert set(CLASSES) - routes == set(), "CLASSES names routes the app no longer has"


async def test_signed_out_sees_only_the_sign_in_page(portal: Portal) -> None:
    job = await alice_job(portal)
    async with portal.client() as anonymous:
        for method, path in sorted(CLASSES):
            kind = CLASSES[(method, path)]
            url = fill(path, job.id)
            if kind == PUBLIC:
                continue
            r = await anonymous.request(method, url)
            text = r.text
            assert SECRET not in text and "private output" not in text, (method, path)
            if kind in (PAGE, OPERATOR_PAGE) and not path.endswith("/live"):
                assert r.status_code == 303, (method, path, r.status_code)
                assert r.headers["location"].startswith("/login?next="), (method, path)
            elif kind in (USER_API, PAGE):  # the API and the event stream: 401, JSON
                assert r.status_code == 401, (method, path, r.status_code)
                if method != "HEAD":
                    assert r.json()["error"]["code"] in ("missing_token", "no_session")
            else:  # agents and relays have their own credentials
                assert r.status_code in (401, 403, 422), (method, path, r.status_code)
        # Following the redirect: the sign-in page, and nothing of the pool.
        r = await anonymous.get("/", follow_redirects=True)
        assert r.url.path == "/login" and 'name="token"' in r.text
        assert SECRET not in r.text and "agent-1" not in r.text and "relay-0" not in r.text


async def test_another_user_sees_none_of_the_job(portal: Portal) -> None:
    job = await alice_job(portal)
    alice = await portal.sign_in("alice")
    bob = await portal.sign_in("bob")
    bob_api = portal.pool.user("bob")
    alice_api = portal.pool.user("alice")
    for (method, path), kind in sorted(CLASSES.items()):
        if kind not in (USER_API, PAGE, OPERATOR_PAGE):
            continue
        url = fill(path, job.id)
        if kind == USER_API:
            r = await portal.pool.client.request(method, url, headers=bob_api)
        elif method == "POST":
            r = await bob.post_form(url)
        else:
            r = await bob.get(url)
        assert SECRET not in r.text and "private output" not in r.text, (method, path)
        if "{job_id}" in path:
            assert r.status_code == 404, (method, path, r.status_code)
            if method != "HEAD" and kind == USER_API:
                assert r.json()["error"]["code"] == "unknown_job"
    # Bob's token and session cannot revoke alice's token (token 1 is alice's first).
    r = await portal.pool.client.post("/api/v1/tokens/1/revoke", headers=bob_api)
    assert r.status_code == 404
    assert (await portal.pool.client.get("/api/v1/whoami", headers=alice_api)).status_code == 200
    # The job is untouched, and alice sees it on every job route.
    detail = await portal.pool.job(job.id, "alice")
    assert detail.job.state == "succeeded"
    for url in (f"/jobs/{job.id}", "/jobs", f"/jobs/{job.id}/results"):
        r = await alice.get(url)
        assert r.status_code == 200, url
    assert SECRET in (await alice.get("/jobs")).text
    assert "private output" in (await alice.get(f"/jobs/{job.id}")).text


async def test_operators_see_every_job_and_users_only_totals(portal: Portal) -> None:
    job = await alice_job(portal)
    ops = await portal.sign_in("ops", "operator")
    bob = await portal.sign_in("bob")
    r = await ops.get("/pool")
    assert r.status_code == 200
    for text in (SECRET, "agent-1", "relay-0", "127.0.0.1:7000", "alice"):
        assert text in r.text, text
    assert SECRET in (await ops.get("/jobs?all=true")).text
    assert (await ops.get(f"/jobs/{job.id}")).status_code == 200
    r = await bob.get("/pool")
    assert r.status_code == 200 and 'id="totals"' in r.text
    for text in (SECRET, "agent-1", "relay-0", "127.0.0.1"):
        assert text not in r.text, text
    # Bob asking for everyone's jobs gets his own (none).
    assert SECRET not in (await bob.get("/jobs?all=true")).text
    bob_api = portal.pool.user("bob")
    r = await portal.pool.client.get("/api/v1/jobs", params={"all": "true"}, headers=bob_api)
    assert r.status_code == 403 and r.json()["error"]["code"] == "operators_only"
    r = await portal.pool.client.get("/api/v1/pool/relays", headers=bob_api)
    assert r.status_code == 403
    # The credentials pages are the operators' alone, and only they are shown the way there.
    assert 'href="/pool/credentials"' in (await ops.get("/jobs")).text
    assert 'href="/pool/credentials"' not in (await bob.get("/jobs")).text
    for (method, path), kind in sorted(CLASSES.items()):
        if kind == OPERATOR_PAGE:
            url = fill(path, job.id)
            r = await (bob.post_form(url) if method == "POST" else bob.get(url))
            assert r.status_code == 403 and "operators_only" in r.text, (method, path)
            assert "relay-0" not in r.text and "vpj_" not in r.text
            r = await (ops.post_form(url) if method == "POST" else ops.get(url))
            assert r.status_code < 500 and r.status_code != 403, (method, path)
