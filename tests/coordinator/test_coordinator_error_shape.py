"""Every bad request gets a 4xx and exactly ``{"error": {"code": str, "message": str}}``."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator

import httpx
import pytest
import trio
from coord_helpers import Pool, make_zip, relay_headers, sha

from vpool.coordinator.access import Principal
from vpool.protocol import api
from vpool.protocol.tokens import sign_possession


def assert_error(r: httpx.Response, status: int, code: str | None = None) -> None:
    assert r.status_code == status, (r.request.method, r.request.url, r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"code", "message"}, body
    assert isinstance(body["error"]["code"], str) and isinstance(body["error"]["message"], str)
    assert "Traceback" not in body["error"]["message"]
    if code is not None:
        assert body["error"]["code"] == code, body


async def test_every_error_has_the_one_shape(pool: Pool) -> None:
    c = pool.client
    user = pool.user()
    relay = relay_headers()
    await pool.register_relay()
    agent = await pool.enroll(slots=1)
    good = make_zip({"app.py": b"print('hi')\n"})
    bundle = await pool.upload(good)
    not_zip = await pool.upload(b"this is not a zip")
    not_py = await pool.upload(make_zip({"app.py": b"def broken(:\n"}))

    def job(**kw: object) -> bytes:
        base: dict[str, object] = {"ranks": 1, "bundle": bundle, "entry": "app.py"}
        base.update(kw)
        return httpx.Request("POST", "/", json=base).content

    cases: list[tuple[str, str, dict[str, str], bytes | None, int, str | None]] = [
        # (method, url, headers, body, status, code)
        ("POST", "/api/v1/jobs", user, b"{not json", 422, "bad_request"),
        ("POST", "/api/v1/jobs", user, b"[1, 2]", 422, "bad_request"),
        ("POST", "/api/v1/jobs", user, b"\xff\xfe\x00", 422, "bad_request"),
        ("POST", "/api/v1/jobs", user, b"", 422, "bad_request"),
        ("POST", "/api/v1/jobs", user, job(ranks="two"), 422, "bad_request"),
        ("POST", "/api/v1/jobs", user, b'{"ranks": 1}', 422, "bad_request"),
        ("POST", "/api/v1/jobs", user, job(ranks=0), 422, "bad_ranks"),
        ("POST", "/api/v1/jobs", user, job(ranks=10_000), 422, "bad_ranks"),
        ("POST", "/api/v1/jobs", user, job(bundle="0" * 64), 422, "unknown_blob"),
        ("POST", "/api/v1/jobs", user, job(bundle="nope"), 422, "bad_request"),
        ("POST", "/api/v1/jobs", user, job(stdin="1" * 64), 422, "unknown_blob"),
        ("POST", "/api/v1/jobs", user, job(bundle=not_zip), 422, "bad_bundle"),
        ("POST", "/api/v1/jobs", user, job(bundle=not_py), 422, "not_python"),
        ("POST", "/api/v1/jobs", user, job(entry="missing.py"), 422, "bad_bundle"),
        ("POST", "/api/v1/jobs", user, job(entry="../app.py"), 422, "bad_bundle"),
        ("POST", "/api/v1/jobs", user, job(memory=-1), 422, "bad_memory"),
        ("POST", "/api/v1/jobs", user, job(memory=2**70), 422, "bad_memory"),
        ("POST", "/api/v1/jobs", user, job(memory="2G"), 422, "bad_request"),
        ("POST", "/api/v1/jobs", user, job(unsandboxed="yes"), 422, "bad_request"),
        ("POST", "/api/v1/jobs", user, b"x" * (300 << 10), 413, "too_large"),
        ("POST", "/api/v1/jobs", {}, job(), 401, "missing_token"),
        ("POST", "/api/v1/jobs", {"Authorization": "Basic abc"}, job(), 401, None),
        ("POST", "/api/v1/jobs", {"Authorization": "Bearer wrong"}, job(), 401, "bad_token"),
        ("GET", "/api/v1/whoami", {"Authorization": "Bearer "}, None, 401, None),
        ("GET", "/api/v1/jobs/999", user, None, 404, "unknown_job"),
        ("GET", "/api/v1/jobs/abc", user, None, 422, "bad_request"),
        ("GET", "/api/v1/jobs/999/output", user, None, 404, "unknown_job"),
        ("GET", "/api/v1/jobs/1/output?wait=soon", user, None, 422, "bad_request"),
        ("GET", "/api/v1/jobs/1/output?after=-x", user, None, 422, "bad_request"),
        ("POST", "/api/v1/jobs/999/cancel", user, None, 404, "unknown_job"),
        ("GET", "/api/v1/jobs/999/results", user, None, 404, "unknown_job"),
        ("PUT", f"/api/v1/blobs/{'0' * 64}", user, b"abc", 400, "hash_mismatch"),
        ("PUT", "/api/v1/blobs/NOT-A-HASH", user, b"abc", 422, "bad_request"),
        ("PUT", f"/api/v1/blobs/{sha(b'x' * (2 << 20))}", user, b"x" * (2 << 20), 413, "too_large"),
        ("PUT", f"/api/v1/blobs/{sha(b'abc')}", {}, b"abc", 401, "missing_token"),
        ("GET", "/api/v1/nothing-here", user, None, 404, "not_found"),
        ("DELETE", "/api/v1/jobs", user, None, 405, "method_not_allowed"),
        (
            "POST",
            "/api/v1/agents/lease",
            {"Authorization": "Bearer x.y"},
            b"{}",
            401,
            "malformed_token",
        ),
        ("POST", "/api/v1/agents/lease", {"Authorization": "Bearer abc"}, b"{}", 401, None),
        ("POST", "/api/v1/agents/lease", agent.headers, b'{"free_slots": "x"}', 422, "bad_request"),
        ("POST", "/api/v1/agents/heartbeat", agent.headers, b'{"ranks": 5}', 422, "bad_request"),
        (
            "POST",
            "/api/v1/agents/exit",
            agent.headers,
            b'{"job": 999, "rank": 0, "incarnation": 1, "code": 0}',
            403,
            "not_your_rank",
        ),
        (
            "POST",
            "/api/v1/agents/output",
            agent.headers,
            b'{"chunks": [{"job": 1, "rank": 0, "incarnation": 1, "stream": "stdin", '
            b'"offset": 0, "data": ""}]}',
            422,
            "bad_request",
        ),
        (
            "POST",
            "/api/v1/agents/heartbeat",
            agent.headers,
            b'{"ranks": [], "free_slots": 1, "isolation": {"level": "sandbox", "rank_memory": -1}}',
            422,
            "bad_isolation",
        ),
        (
            "POST",
            "/api/v1/agents/heartbeat",
            agent.headers,
            b'{"ranks": [], "free_slots": 1, "isolation": {"rank_memory": 1}}',
            422,
            "bad_request",
        ),
        ("GET", "/api/v1/pool/agents", {}, None, 401, "missing_token"),
        ("GET", f"/api/v1/agents/blobs/{'2' * 64}", agent.headers, None, 404, "unknown_blob"),
        ("GET", f"/api/v1/agents/blobs/{bundle}", user, None, 401, None),
        ("PUT", "/api/v1/agents/results/1/0/1", agent.headers, b"not a zip", 422, "bad_results"),
        ("PUT", "/api/v1/agents/results/999/0/1", agent.headers, good, 403, "not_your_rank"),
        ("PUT", "/api/v1/agents/results/x/0/1", agent.headers, good, 422, "bad_request"),
        ("POST", "/api/v1/agents/enroll", {}, b'{"public_key": 1}', 422, "bad_request"),
        (
            "POST",
            "/api/v1/relays/register",
            {"Authorization": "Bearer nope"},
            b'{"name": "r", "host": "h", "port": 1}',
            401,
            "bad_token",
        ),
        (
            "POST",
            "/api/v1/relays/register",
            relay,
            b'{"name": "relay-0", "host": "h", "port": 0}',
            422,
            "bad_request",
        ),
        (
            "POST",
            "/api/v1/relays/heartbeat",
            relay_headers("relay-5"),
            b'{"name": "relay-5", "load": {}}',
            404,
            "unknown_relay",
        ),
        (
            "POST",
            "/api/v1/relays/heartbeat",
            relay,
            b'{"name": "relay-5", "load": {}}',
            403,
            "not_your_name",
        ),
        (
            "POST",
            "/api/v1/relays/lost",
            relay,
            b'{"name": "relay-0", "lost": [{}]}',
            422,
            "bad_request",
        ),
    ]
    for method, url, headers, body, status, code in cases:
        r = await c.request(method, url, headers=headers, content=body)
        assert_error(r, status, code)


async def test_enroll_errors(pool: Pool) -> None:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key, other = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    now = pool.clock()
    pub, sig = sign_possession(key, now)
    _, other_sig = sign_possession(other, now)
    _, old_sig = sign_possession(key, now - 3600)
    for req, status, code in (
        (api.EnrollRequest(pub, now, other_sig, "a", 1), 401, "forged_token"),
        (api.EnrollRequest(pub, now - 3600, old_sig, "a", 1), 401, "expired_token"),
        (api.EnrollRequest("AAAA", now, sig, "a", 1), 401, "malformed_token"),
        (api.EnrollRequest(pub, now, sig, "a", 0), 422, "bad_request"),
    ):
        assert_error(await pool.post("/api/v1/agents/enroll", req, {}), status, code)


def test_sha_helper() -> None:
    assert sha(b"") == hashlib.sha256(b"").hexdigest()


async def test_internal_error_leaks_nothing(pool: Pool) -> None:
    def broken() -> None:
        raise RuntimeError("secret detail")

    pool.core.live_pool_info = broken  # type: ignore[assignment,method-assign]
    from vpool.coordinator.app import create_app

    app = create_app(pool.core.settings, coordinator=pool.core)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://c") as client:
        r = await client.get("/api/v1/pool")
    assert r.status_code == 500
    assert r.json() == {
        "error": {"code": "internal", "message": "internal error; see the coordinator's log"}
    }


async def test_client_gone_mid_upload_is_a_4xx_not_an_internal_error(
    pool: Pool, caplog: pytest.LogCaptureFixture
) -> None:
    """An uploader that dies mid-body (an agent killed during a results upload): the request
    ends with a 4xx, nothing is stored, and no traceback lands in the log."""
    from vpool.coordinator.app import create_app

    app = create_app(pool.core.settings, coordinator=pool.core)
    headers = pool.add_user("alice")
    sha256 = hashlib.sha256(b"x" * 100).hexdigest()
    body = [
        {"type": "http.request", "body": b"x" * 10, "more_body": True},
        {"type": "http.disconnect"},
    ]
    sent: list[dict] = []

    async def receive() -> dict:
        return body.pop(0) if body else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "PUT",
        "scheme": "http",
        "path": f"/api/v1/blobs/{sha256}",
        "raw_path": f"/api/v1/blobs/{sha256}".encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]
        + [(b"content-length", b"100")],
        "server": ("coordinator", 80),
        "client": ("127.0.0.1", 1),
    }
    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    assert 400 <= start["status"] < 500
    assert not await pool.core.has_blob(Principal("alice", "user", 0), sha256)
    assert "internal error" not in caplog.text


BIG = 2**70


async def test_integers_beyond_64_bits_are_refused_not_crashed(pool: Pool) -> None:
    """Every route that takes an integer, in its path, query or body: 4xx, never a 500 (the
    database keeps 64-bit integers)."""
    c = pool.client
    user = pool.user()
    relay = relay_headers()
    await pool.register_relay()
    agent = await pool.enroll(slots=1)
    good = make_zip({"app.py": b"print('hi')\n"})
    wrong = []
    for method, url, headers, body in [
        ("GET", f"/api/v1/jobs/{BIG}", user, None),
        ("GET", f"/api/v1/jobs/{BIG}/timeline", user, None),
        ("GET", f"/api/v1/jobs/{BIG}/output", user, None),
        ("GET", f"/api/v1/jobs/1/output?after={BIG}", user, None),
        ("GET", f"/api/v1/jobs/1/output?rank={BIG}", user, None),
        ("POST", f"/api/v1/jobs/{BIG}/cancel", user, None),
        ("POST", f"/api/v1/jobs/{BIG}/checkpoint", user, None),
        ("GET", f"/api/v1/jobs/{BIG}/results", user, None),
        ("POST", f"/api/v1/tokens/{BIG}/revoke", user, None),
        ("PUT", f"/api/v1/agents/results/{BIG}/0/1", agent.headers, good),
        ("PUT", f"/api/v1/agents/results/1/{BIG}/1", agent.headers, good),
        ("PUT", f"/api/v1/agents/results/1/0/{BIG}", agent.headers, good),
        (
            "POST",
            "/api/v1/agents/exit",
            agent.headers,
            f'{{"job": {BIG}, "rank": 0, "incarnation": 1, "code": 0}}'.encode(),
        ),
        (
            "POST",
            "/api/v1/agents/problem",
            agent.headers,
            f'{{"job": {BIG}, "rank": 0, "incarnation": 1, "message": "x"}}'.encode(),
        ),
        (
            "POST",
            "/api/v1/agents/restored",
            agent.headers,
            f'{{"job": 1, "rank": 0, "incarnation": {BIG}, "ckpt": -1}}'.encode(),
        ),
        (
            "POST",
            "/api/v1/agents/checkpoint-failed",
            agent.headers,
            f'{{"job": {BIG}, "rank": 0, "incarnation": 1, "reason": "x"}}'.encode(),
        ),
        (
            "POST",
            "/api/v1/agents/output",
            agent.headers,
            f'{{"chunks": [{{"job": {BIG}, "rank": 0, "incarnation": 1, "stream": "stdout", '
            f'"offset": 0, "data": ""}}]}}'.encode(),
        ),
        (
            "POST",
            "/api/v1/agents/heartbeat",
            agent.headers,
            f'{{"ranks": [{{"job": {BIG}, "rank": 0, "incarnation": 1, "state": "running"}}], '
            f'"free_slots": 1}}'.encode(),
        ),
        (
            "POST",
            "/api/v1/relays/lost",
            relay,
            f'{{"name": "relay-0", "lost": [{{"job": {BIG}, "rank": 0, "incarnation": 1, '
            f'"reason": "x"}}]}}'.encode(),
        ),
        (
            "POST",
            "/api/v1/relays/diverged",
            relay,
            f'{{"name": "relay-0", "job": {BIG}, "rank": 0, "incarnation": 1, '
            f'"message": "x"}}'.encode(),
        ),
        ("GET", f"/jobs/{BIG}", user, None),
        ("GET", f"/jobs/{BIG}/live", user, None),
        ("GET", f"/jobs/{BIG}/results", user, None),
    ]:
        r = await c.request(method, url, headers=headers, content=body)
        if url.startswith("/api/"):
            if not 400 <= r.status_code < 500:
                wrong.append((method, url, r.status_code, r.text[:200]))
            else:
                assert_error(r, r.status_code)
        elif r.status_code >= 500:  # a page (this client has no session: sign-in)
            wrong.append((method, url, r.status_code, r.text[:200]))
    assert wrong == []


async def test_a_stalled_upload_is_refused_and_leaves_nothing(
    pool: Pool, autojump_clock: object
) -> None:
    """A body that stops coming: 408 upload_stalled once ``upload_idle_timeout`` passes with
    nothing, and the blob is not stored."""
    user = pool.user()
    sent = b"x" * 1000
    gave_up = []

    async def stalls() -> AsyncIterator[bytes]:
        yield sent[:500]
        await trio.sleep(pool.core.settings.upload_idle_timeout * 10)
        gave_up.append(True)  # never: the server ended the request first
        yield sent[500:]

    digest = hashlib.sha256(sent).hexdigest()
    start = trio.current_time()
    r = await pool.client.put(f"/api/v1/blobs/{digest}", headers=user, content=stalls())
    assert_error(r, 408, "upload_stalled")
    waited = trio.current_time() - start
    assert (
        pool.core.settings.upload_idle_timeout
        <= waited
        < 2 * pool.core.settings.upload_idle_timeout
    )
    assert gave_up == []
    assert not pool.core.blobs.path(digest).exists()  # nothing stored
