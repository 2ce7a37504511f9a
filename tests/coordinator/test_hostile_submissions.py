"""Bad and hostile input at submit, and blobs that belong to their uploaders (issue 35, part 6).

Each case was an attack that worked: another user's bundle run by its hash, any agent
downloading any bundle, a NUL in ``args`` restarting a job over and over, a 200,000-term
expression answered with a 500, bundles of 20,001 and 99,000 members accepted.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from coord_helpers import HELLO, FakeClock, Pool, decode, make_zip, open_pool
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from vpool.coordinator import migrations
from vpool.coordinator.access import Principal
from vpool.coordinator.errors import BadRequest
from vpool.coordinator.guesses import GuessLimiter, TooManyGuesses
from vpool.coordinator.service import MAX_ARGS, MAX_ARGS_BYTES
from vpool.protocol import api


async def _submit(pool: Pool, user: str, bundle: str, **fields: object) -> tuple[int, dict]:
    sub = api.JobSubmit(ranks=1, bundle=bundle, entry="app.py", **fields)  # type: ignore[arg-type]
    r = await pool.post("/api/v1/jobs", sub, pool.user(user))
    return r.status_code, r.json()


def _error(answer: tuple[int, dict], status: int, code: str) -> str:
    got, body = answer
    assert got == status, body
    assert body["error"]["code"] == code, body
    return str(body["error"]["message"])


async def test_a_blob_hash_is_not_a_capability(tmp_path: Path) -> None:
    async with open_pool(tmp_path) as pool:
        bundle = await pool.upload(make_zip({"app.py": HELLO}), user="alice")
        ok = await pool.client.head(f"/api/v1/blobs/{bundle}", headers=pool.user("alice"))
        assert ok.status_code == 200
        # bob knows the hash (a shared notebook, a log line): it shows him nothing...
        r = await pool.client.head(f"/api/v1/blobs/{bundle}", headers=pool.user("bob"))
        assert r.status_code == 404
        # ...and runs nothing of alice's.
        message = _error(await _submit(pool, "bob", bundle), 422, "unknown_blob")
        assert "was not uploaded" in message
        # Holding the bytes is what counts: uploaded by bob, they are his too.
        assert await pool.upload(make_zip({"app.py": HELLO}), user="bob") == bundle
        status, _ = await _submit(pool, "bob", bundle)
        assert status == 201
        # The same for a stdin blob.
        stdin = await pool.upload(b"alice's secret input\n", user="alice")
        await pool.upload(make_zip({"app.py": HELLO}), user="carol")
        message = _error(await _submit(pool, "carol", bundle, stdin=stdin), 422, "unknown_blob")
        assert "stdin" in message


async def test_an_agent_fetches_only_what_it_was_leased(tmp_path: Path) -> None:
    async with open_pool(tmp_path) as pool:
        await pool.register_relay()
        runner = await pool.enroll("runner", slots=1)
        job = await pool.submit(1, stdin=b"42\n")
        idle = await pool.enroll("idle", slots=1)  # leased nothing: it asks for no work
        [lease] = await pool.lease(runner)
        assert lease.job == job.id
        for sha in (lease.bundle, lease.stdin):
            url = f"/api/v1/agents/blobs/{sha}"
            assert (await pool.client.get(url, headers=runner.headers)).status_code == 200
            r = await pool.client.get(url, headers=idle.headers)
            assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_blob"
        # Once its rank ended, the runner has no more business with the bundle.
        assert (await pool.exit(runner, lease)).status_code == 200
        url = f"/api/v1/agents/blobs/{lease.bundle}"
        assert (await pool.client.get(url, headers=runner.headers)).status_code == 404


async def test_arguments_no_program_can_be_given_are_refused(tmp_path: Path) -> None:
    async with open_pool(tmp_path) as pool:
        bundle = await pool.upload(make_zip({"app.py": HELLO}))
        message = _error(await _submit(pool, "alice", bundle, args=["a", "b\0c"]), 422, "bad_args")
        assert "argument 1 holds a NUL" in message
        many = ["x"] * (MAX_ARGS + 1)
        _error(await _submit(pool, "alice", bundle, args=many), 422, "bad_args")
        # Past the API's body limit already (413); the portal submits in process.
        long = ["y" * (MAX_ARGS_BYTES // 2)] * 2
        alice = Principal("alice", "user", 0)
        with pytest.raises(BadRequest, match="more than the limit") as refused:
            await pool.core.submit(alice, api.JobSubmit(1, bundle, "app.py", args=long))
        assert refused.value.code == "bad_args"
        status, _ = await _submit(pool, "alice", bundle, args=["ünïcode", "--n=3", ""])
        assert status == 201
        jobs = (await pool.client.get("/api/v1/jobs", headers=pool.user())).json()
        assert len(jobs) == 1  # nothing refused was kept


async def test_a_program_that_cannot_be_compiled_is_a_4xx(tmp_path: Path) -> None:
    async with open_pool(tmp_path) as pool:
        deep = b"x = " + b"+".join([b"1"] * 200_000) + b"\n"
        bundle = await pool.upload(make_zip({"app.py": deep}))
        status, body = await _submit(pool, "alice", bundle)
        assert status == 422 and body["error"]["code"] == "not_python", body
        assert "cannot be compiled" in body["error"]["message"]
        nested = b"x = " + b"(" * 10_000 + b"1" + b")" * 10_000 + b"\n"
        bundle = await pool.upload(make_zip({"app.py": nested}))
        status, body = await _submit(pool, "alice", bundle)
        assert status == 422 and body["error"]["code"] == "not_python", body


async def test_bundles_past_max_bundle_members_are_refused(tmp_path: Path) -> None:
    async with open_pool(tmp_path, max_bundle_members=200) as pool:
        files = {f"data/{i}.txt": b"" for i in range(200)}
        crowded = await pool.upload(make_zip({"app.py": HELLO, **files}))
        message = _error(await _submit(pool, "alice", crowded), 422, "bad_bundle")
        assert "201 members" in message and "max_bundle_members" in message
        files.pop("data/0.txt")
        fits = await pool.upload(make_zip({"app.py": HELLO, **files}))
        status, body = await _submit(pool, "alice", fits)
        assert status == 201, body
    (tmp_path / "default").mkdir()
    async with open_pool(tmp_path / "default", max_blob_bytes=16 << 20) as pool:
        files = {f"{i}": b"" for i in range(20_001)}
        crowded = await pool.upload(make_zip({"app.py": HELLO, **files}))
        assert "20002 members" in _error(await _submit(pool, "alice", crowded), 422, "bad_bundle")


async def test_blob_owners_come_from_the_jobs_and_uploads_before(tmp_path: Path) -> None:
    """The migration: a blob a user uploaded, or a job of theirs names, stays theirs."""
    async with open_pool(tmp_path) as pool:
        job = await pool.submit(1, user="dave", stdin=b"in\n")
        row = pool.core.store.job_row(job.id)
        assert row is not None
        db = pool.core.store.db
        db.execute("DROP TABLE blob_owners")
        # The stdin's uploader is unknown (a result's blob, say): its job names it.
        db.execute("UPDATE blobs SET uploader = NULL WHERE sha256 = ?", [row["stdin"]])
        migrations.MIGRATIONS[18](db)  # the 19th: blob owners
        for sha in (row["bundle"], row["stdin"]):
            r = await pool.client.head(f"/api/v1/blobs/{sha}", headers=pool.user("dave"))
            assert r.status_code == 200
            r = await pool.client.head(f"/api/v1/blobs/{sha}", headers=pool.user("erin"))
            assert r.status_code == 404
        info = decode(
            await pool.client.get(f"/api/v1/jobs/{job.id}", headers=pool.user("dave")),
            api.JobDetail,
        )
        assert info.job.id == job.id


async def test_credential_guesses_are_rate_limited(tmp_path: Path) -> None:
    clock = FakeClock()
    async with open_pool(tmp_path, clock, guess_limit=5, guess_window=60.0) as pool:
        alice = pool.user("alice")
        assert (await pool.client.get("/api/v1/jobs", headers=alice)).status_code == 200
        guess = {"Authorization": "Bearer " + "A" * 43}
        for _ in range(5):
            r = await pool.client.get("/api/v1/jobs", headers=guess)
            assert r.status_code == 401
        # Used up: every credential from this address waits, the right one too.
        for headers in (guess, alice):
            r = await pool.client.get("/api/v1/jobs", headers=headers)
            assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_guesses"
            assert r.headers["retry-after"] == "60"
        # No credential at all is not a guess: it is told what is missing, as ever.
        assert (await pool.client.get("/api/v1/jobs")).status_code == 401
        # Agents' tokens, relays' keys and join tokens count as well.
        agent_guess = {"Authorization": "Bearer not-an-agent-token"}
        r = await pool.client.post("/api/v1/agents/lease", content=b"{}", headers=agent_guess)
        assert r.status_code == 429
        clock.advance(30)
        r = await pool.client.get("/api/v1/jobs", headers=alice)
        assert r.status_code == 429 and r.headers["retry-after"] == "30"
        clock.advance(30)
        assert (await pool.client.get("/api/v1/jobs", headers=alice)).status_code == 200


async def test_join_token_guesses_count(tmp_path: Path) -> None:
    async with open_pool(tmp_path, guess_limit=3, open_enrollment=False) as pool:
        key = Ed25519PrivateKey.generate()
        for _ in range(3):
            r = await pool.enroll_request(key, join_token="wrong-" + "x" * 40)
            assert r.status_code == 403 and r.json()["error"]["code"] == "bad_join_token"
        r = await pool.enroll_request(key, join_token="wrong-" + "y" * 40)
        assert r.status_code == 429


def test_the_guess_table_is_bounded() -> None:
    limiter = GuessLimiter(3, 60.0, max_addresses=100)
    for i in range(1000):
        limiter.failed(f"10.0.{i // 256}.{i % 256}", now=float(i))
    assert len(limiter._failures) == 100
    limiter.check("10.0.0.1", now=1000.0)  # forgotten: the oldest went first
    for _ in range(3):
        limiter.failed("10.0.3.231", now=1000.0)
    with pytest.raises(TooManyGuesses):
        limiter.check("10.0.3.231", now=1000.0)
    limiter.check("10.0.3.231", now=1060.0)  # the window passed
