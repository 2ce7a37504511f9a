"""The portal's pages through an in-process app: signing in and out, CSRF, tokens, the jobs
listing, the submit form and its errors, the job page, and no outside URLs anywhere."""

from __future__ import annotations

import io
import re
import zipfile
from collections.abc import AsyncIterator
from pathlib import Path

import trio
from ckpt_helpers import beat
from coord_helpers import HELLO, make_zip
from portal_helpers import BASE, Portal, csrf_of, field_errors, running_job

from vpool.protocol import api
from vpool.web import session
from vpool.web.render import TEMPLATES

STATIC = TEMPLATES.parent / "static"
PI = (Path(__file__).parents[2] / "examples" / "pi.py").read_bytes()


# -- signing in ---------------------------------------------------------------------------------


async def test_sign_in_sets_a_strict_session_cookie_and_sign_out_ends_it(portal: Portal) -> None:
    token = portal.pool.add_user("alice")["Authorization"].removeprefix("Bearer ")
    async with portal.client() as c:
        form = await c.get("/login?next=/pool")
        assert form.status_code == 200 and 'name="token"' in form.text
        r = await c.post(
            "/login", data={"csrf": csrf_of(form.text), "token": token, "next": "/pool"}
        )
        assert r.status_code == 303 and r.headers["location"] == "/pool"
        cookie = next(h for h in r.headers.get_list("set-cookie") if h.startswith("vpool_session="))
        for attribute in ("HttpOnly", "Secure", "SameSite=strict", "Path=/"):
            assert attribute.lower() in cookie.lower(), attribute
        assert (await c.get("/pool")).status_code == 200
        # Signed in, /login goes straight on; /logout asks, POST /logout does it.
        assert (await c.get("/login")).headers["location"] == "/jobs"
        page = await c.get("/logout")
        r = await c.post("/logout", data={"csrf": csrf_of(page.text)})
        assert r.status_code == 303 and r.headers["location"] == "/login"
        assert (await c.get("/pool")).status_code == 303
    # The old cookie is dead on the server too, not only forgotten by the browser.
    async with portal.client() as c:
        c.cookies.set(session.SESSION_COOKIE, cookie.split(";")[0].split("=", 1)[1])
        assert (await c.get("/jobs")).status_code == 303


async def test_sign_in_refuses_bad_tokens_and_forged_forms(portal: Portal) -> None:
    token = portal.pool.add_user("alice")["Authorization"].removeprefix("Bearer ")
    async with portal.client() as c:
        csrf = csrf_of((await c.get("/login")).text)
        r = await c.post("/login", data={"csrf": csrf, "token": "vpt_wrong", "next": "/"})
        assert r.status_code == 401 and "unknown or was revoked" in r.text
        r = await c.post("/login", data={"csrf": csrf, "token": "", "next": "/"})
        assert r.status_code == 422 and "Paste your API token" in r.text
        # No pre-session secret, or another site's origin: refused, and no session.
        r = await c.post("/login", data={"csrf": "forged", "token": token})
        assert r.status_code == 403 and "bad_csrf" in r.text
        r = await c.post(
            "/login",
            data={"csrf": csrf, "token": token},
            headers={"Origin": "https://evil.example"},
        )
        assert r.status_code == 403 and "bad_origin" in r.text
        r = await c.post(
            "/login",
            data={"csrf": csrf, "token": token},
            headers={"Sec-Fetch-Site": "cross-site", "Origin": "null"},
        )
        assert r.status_code == 403 and "bad_origin" in r.text
        assert (await c.get("/jobs")).status_code == 303
    # ``next`` never leaves the site.
    for target in ("//evil.example/x", "https://evil.example", "\\\\evil"):
        async with portal.client() as c:
            csrf = csrf_of((await c.get("/login")).text)
            r = await c.post("/login", data={"csrf": csrf, "token": token, "next": target})
            assert r.status_code == 303 and r.headers["location"] == "/jobs", target


async def test_forms_need_the_session_csrf_secret(portal: Portal) -> None:
    alice = await portal.sign_in("alice")
    job = await portal.pool.submit(1)
    r = await alice.post_form(f"/jobs/{job.id}/cancel", {"csrf": "not-the-secret"})
    assert r.status_code == 403 and "reload the page" in r.text
    assert (await portal.pool.job(job.id)).job.state == "queued"
    r = await alice.post_form(f"/jobs/{job.id}/cancel")
    assert r.status_code == 303 and r.headers["location"] == f"/jobs/{job.id}"
    assert (await portal.pool.job(job.id)).job.state == "cancelled"


async def test_tokens_are_made_listed_and_revoked(portal: Portal) -> None:
    alice = await portal.sign_in("alice")
    r = await alice.post_form("/account/tokens", {"label": "laptop <b>"})
    assert r.status_code == 201
    new = re.search(r'<pre class="token">([^<]+)</pre>', r.text)
    assert new and new.group(1).startswith("vpt_")
    assert "laptop &lt;b&gt;" in r.text
    made = {"Authorization": f"Bearer {new.group(1)}"}
    who = await portal.pool.client.get("/api/v1/whoami", headers=made)
    assert who.json() == {"name": "alice", "role": "user"}
    listed = (await portal.pool.client.get("/api/v1/tokens", headers=made)).json()
    assert [t["label"] for t in listed] == ["first token", "laptop <b>"]
    # Revoking the new token: it stops working at once; the session (first token) lives on.
    second = listed[1]["id"]
    r = await alice.post_form(f"/account/tokens/{second}/revoke")
    assert r.status_code == 303 and r.headers["location"] == "/account"
    assert (await portal.pool.client.get("/api/v1/whoami", headers=made)).status_code == 401
    assert "revoked" in (await alice.get("/account")).text
    # Revoking the token the session was opened with ends the session too.
    r = await alice.post_form(f"/account/tokens/{listed[0]['id']}/revoke")
    assert r.status_code == 303 and r.headers["location"] == "/login"
    assert (await alice.get("/jobs")).status_code == 303
    assert (await alice.client.get("/api/v1/whoami", headers=portal.pool.user())).status_code == 401


async def test_json_token_routes(portal: Portal) -> None:
    headers = portal.pool.user()
    r = await portal.pool.client.post("/api/v1/tokens", json={"label": "ci"}, headers=headers)
    assert r.status_code == 201
    made = api.TokenCreated(**{**r.json(), "info": api.TokenInfo(**r.json()["info"])})
    assert made.info.label == "ci" and made.token.startswith("vpt_")
    r = await portal.pool.client.post("/api/v1/tokens", json={"label": "x" * 101}, headers=headers)
    assert r.status_code == 422 and r.json()["error"]["code"] == "bad_label"
    r = await portal.pool.client.post(f"/api/v1/tokens/{2**70}/revoke", headers=headers)
    assert r.status_code == 404  # not a 500 from SQLite's 64-bit integers


ROW = re.compile(r'<td><a href="/jobs/(\d+)">\d+</a></td>')


# -- the jobs listing ---------------------------------------------------------------------------


async def test_jobs_are_filtered_sorted_paginated_and_counted(portal: Portal) -> None:
    alice = await portal.sign_in("alice")
    pool = portal.pool
    for n in range(30):
        job = await pool.submit(1 + n % 3)
        name = f"sweep-{n:02d}" if n % 2 else f"other-{n:02d}"
        await pool.core.db.call(
            pool.core.store.db.execute, "UPDATE jobs SET name = ? WHERE id = ?", [name, job.id]
        )
        if n % 5 == 0:
            await pool.client.post(f"/api/v1/jobs/{job.id}/cancel", headers=pool.user())
    r = await alice.get("/jobs")
    counts = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", r.text.split('id="counts"')[1][:2000]))
    assert "all 30" in counts and "queued 24" in counts and "cancelled 6" in counts
    assert "page 1 of 2 (30 jobs)" in r.text
    first = re.findall(ROW, r.text)
    assert first == [str(n) for n in range(30, 5, -1)]  # newest first, 25 a page
    r = await alice.get("/jobs?page_no=2")
    assert re.findall(ROW, r.text) == ["5", "4", "3", "2", "1"]
    r = await alice.get("/jobs?q=SWEEP&sort=name&order=asc")
    names = re.findall(r">(sweep-\d+|other-\d+)</a>", r.text)
    assert names == sorted(names) and len(names) == 15 and all(n.startswith("sweep") for n in names)
    r = await alice.get("/jobs?state=cancelled")
    assert len(re.findall(ROW, r.text)) == 6
    # Nonsense parameters give the default listing, never an error.
    r = await alice.get("/jobs?state=bogus&sort=evil;drop&page_no=999999999999")
    assert r.status_code == 200
    # The JSON API takes the same filters.
    r = await pool.client.get(
        "/api/v1/jobs",
        params={"state": "cancelled", "sort": "ranks", "order": "asc"},
        headers=pool.user(),
    )
    ranks = [j["ranks"] for j in r.json()]
    assert len(ranks) == 6 and ranks == sorted(ranks)
    r = await pool.client.get("/api/v1/jobs", params={"sort": "evil"}, headers=pool.user())
    assert r.status_code == 422 and r.json()["error"]["code"] == "bad_request"


# -- the submit form ----------------------------------------------------------------------------


def _files(program: tuple[str, bytes] | None, **more: list[tuple[str, bytes]]) -> list:
    files = []
    if program is not None:
        files.append(("program", (program[0], program[1], "application/octet-stream")))
    for name, items in more.items():
        files += [(name, (n, data, "application/octet-stream")) for n, data in items]
    return files


async def test_submit_form_makes_the_job_vsdk_would(portal: Portal) -> None:
    alice = await portal.sign_in("alice")
    r = await alice.client.post(
        "/jobs/new",
        data={
            "csrf": alice.csrf,
            "ranks": "4",
            "args": "1000 'two words'",
            "fault_tolerance": "on",
            "checkpoint_every": "60",
            "memory": "512M",
            "name": "",
        },
        files=_files(
            ("pi.py", PI),
            inputs=[("data.csv", b"1,2\n"), ("more.txt", b"x")],
            stdin=[("in.txt", b"42\n")],
        ),
    )
    assert r.status_code == 303, field_errors(r.text) or r.text
    job_id = int(r.headers["location"].rsplit("/", 1)[1])
    detail = await portal.pool.job(job_id)
    assert (detail.job.ranks, detail.job.name) == (4, "pi.py")
    assert detail.job.checkpoint_every == 60 and detail.job.memory == 512 << 20
    row = portal.pool.core.store.job_row(job_id)
    assert row is not None and row["entry"] == "pi.py" and row["args"] == '["1000", "two words"]'
    with zipfile.ZipFile(portal.pool.core.blobs.path(row["bundle"])) as zf:
        assert sorted(zf.namelist()) == ["data.csv", "more.txt", "pi.py"]
        assert zf.read("pi.py") == PI
    assert portal.pool.core.blobs.path(row["stdin"]).read_bytes() == b"42\n"
    # The same files from vsdk give the same bundle (one packer for both).
    from vpool.sdk import bundle as sdk_bundle

    tmp = portal.pool.core.settings.state_path() / "vsdk"
    tmp.mkdir()
    for name, data in (("pi.py", PI), ("data.csv", b"1,2\n"), ("more.txt", b"x")):
        (tmp / name).write_bytes(data)
    same = sdk_bundle.build(tmp / "pi.py", [tmp / "data.csv", tmp / "more.txt"])
    assert same.data == portal.pool.core.blobs.path(row["bundle"]).read_bytes()


async def test_submit_form_shows_each_error_next_to_its_field(portal: Portal) -> None:
    alice = await portal.sign_in("alice")

    async def post(data: dict[str, str], files: list) -> dict[str, str]:
        body = {"csrf": alice.csrf, "ranks": "2", "fault_tolerance": "on", **data}
        r = await alice.client.post("/jobs/new", data=body, files=files)
        assert 400 <= r.status_code < 500, (r.status_code, data)
        assert "Submit a job" in r.text  # the form again, with what was typed
        return field_errors(r.text)

    py = ("app.py", HELLO)
    assert "choose the program" in (await post({}, []))["program"]
    assert "neither a .py" in (await post({}, _files(("notes.txt", b"x"))))["program"]
    assert "not Python source" in (await post({}, _files(("app.py", b"def (:\n"))))["program"]
    assert "not a whole number" in (await post({"ranks": "two"}, _files(py)))["ranks"]
    assert "between 1 and 16" in (await post({"ranks": "99"}, _files(py)))["ranks"]
    errors = await post({"checkpoint_every": "60", "on_failure": "abort"}, _files(py))
    assert "checkpoints are for restarting lost ranks" in errors["checkpoint_every"]
    errors = await post({"checkpoint_every": "0.001"}, _files(py))
    assert "checkpoint_every is 0" in errors["checkpoint_every"]  # the coordinator's own check
    assert "not a size" in (await post({"memory": "lots"}, _files(py)))["memory"]
    assert "shell" in (await post({"args": "'unclosed"}, _files(py)))["args"]
    assert "not a valid zip" in (await post({}, _files(("app.zip", b"PK nope"))))["program"]
    errors = await post({}, _files(("app.zip", make_zip({"x.py": HELLO}))))
    assert "has no '__main__.py'" in errors["entry"]
    errors = await post({}, _files(py, inputs=[("a.txt", b"1"), ("a.txt", b"2")]))
    assert "two input files" in errors["inputs"]
    errors = await post({}, _files(py, inputs=[("app.py", b"1")]))
    assert "program's name" in errors["inputs"]
    # Typed values come back; nothing was submitted.
    r = await alice.client.post(
        "/jobs/new",
        data={"csrf": alice.csrf, "ranks": "0", "name": "my <run>", "args": "-x 1"},
        files=_files(py),
    )
    assert 'value="my &lt;run&gt;"' in r.text and 'value="-x 1"' in r.text
    assert (await portal.pool.client.get("/api/v1/jobs", headers=portal.pool.user())).json() == []


async def test_submit_form_refuses_oversized_and_forged_uploads(portal: Portal) -> None:
    alice = await portal.sign_in("alice")
    big = b"#" * (2 << 20)  # max_blob_bytes is 1 MiB in the test settings
    r = await alice.client.post(
        "/jobs/new", data={"csrf": alice.csrf, "ranks": "1"}, files=_files(("app.py", big))
    )
    assert r.status_code == 413
    r = await alice.client.post(
        "/jobs/new", data={"csrf": "forged", "ranks": "1"}, files=_files(("app.py", HELLO))
    )
    assert r.status_code == 403


# -- the job page -------------------------------------------------------------------------------


async def test_job_page_shows_ranks_output_and_events_escaped(portal: Portal) -> None:
    pool = portal.pool
    alice = await portal.sign_in("alice")
    job, agent, leases = await running_job(pool, 2)
    await pool.output(agent, leases[0], "stdout", 0, b"<script>alert(1)</script>\nhalf a li")
    await pool.output(agent, leases[1], "stderr", 0, b"rank one complains\n")
    r = await alice.get(f"/jobs/{job.id}")
    assert r.status_code == 200
    html = r.text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html and "<script>alert" not in html
    assert '<span class="ln err" data-rank="1">rank one complains\n</span>' in html
    assert "half a li" not in html.split('id="output"')[1].split("</pre>")[0]  # held, not shown
    assert 'data-live="yes"' in html and 'data-state="running"' in html
    assert html.count('<tr data-rank="') == 2 and "agent-1" in html
    assert 'class="timeline"' in html and "seg seg-running" in html
    # Rank 1 alone.
    r = await alice.get(f"/jobs/{job.id}?rank=1")
    out = r.text.split('id="output"')[1].split("</pre>")[0]
    assert "rank one complains" in out and "alert" not in out
    # Once the job ended, the partial line is shown too, and the page stops being live.
    for lease in leases:
        await pool.exit(agent, lease, 0)
    html = (await alice.get(f"/jobs/{job.id}")).text
    assert "half a li" in html and 'data-live="no"' in html


async def test_job_page_with_64_ranks_and_10000_lines(portal: Portal) -> None:
    pool = portal.pool
    alice = await portal.sign_in("alice")
    await pool.register_relay()
    job = await pool.submit(16)  # the test settings allow 16 ranks; make it 64 below
    await pool.core.db.call(
        pool.core.store.db.execute, "UPDATE jobs SET ranks = 64 WHERE id = ?", [job.id]
    )
    rows = [(job.id, r, "pending") for r in range(16, 64)]
    for row in rows:
        await pool.core.db.call(
            pool.core.store.db.execute,
            "INSERT INTO ranks (job, rank, state) VALUES (?, ?, ?)",
            list(row),
        )
    records = [
        [job.id, n % 64, "stdout", (n // 64) * 16, f"line {n:05d} of 10000\n".encode()]
        for n in range(10_000)
    ]

    def insert() -> None:
        with pool.core.store.db.atomic():
            pool.core.store.db.conn.executemany(
                "INSERT INTO output (job, rank, stream, offset, data) VALUES (?, ?, ?, ?, ?)",
                records,
            )

    await pool.core.db.call(insert)
    r = await alice.get(f"/jobs/{job.id}")
    assert r.status_code == 200
    assert r.text.count("of 10000\n</span>") == 10_000
    assert r.text.count('<tr data-rank="') == 64


async def test_results_download_from_the_page(portal: Portal) -> None:
    pool = portal.pool
    alice = await portal.sign_in("alice")
    job, agent, (lease,) = await running_job(pool, 1)
    await pool.output(agent, lease, "stdout", 0, b"hello\n")
    await pool.exit(agent, lease, 0)
    r = await alice.get(f"/jobs/{job.id}/results")
    assert r.status_code == 200 and r.headers["content-type"] == "application/zip"
    assert f"job-{job.id}-results.zip" in r.headers["content-disposition"]
    with zipfile.ZipFile(io.BytesIO(r.content)) as zf:
        assert any(zf.read(n) == b"hello\n" for n in zf.namelist())


async def test_live_stream_of_an_ended_job(portal: Portal) -> None:
    """The event stream: output records from the cursor, the live panel, the end."""
    pool = portal.pool
    alice = await portal.sign_in("alice")
    job, agent, (lease,) = await running_job(pool, 1)
    await pool.output(agent, lease, "stdout", 0, b"first\n")
    await pool.output(agent, lease, "stdout", 6, b"second\n")
    await pool.exit(agent, lease, 0)
    r = await alice.get(f"/jobs/{job.id}/live", params={"after": 0})
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [block for block in r.text.split("\n\n") if block]
    kinds = [b.split("\n")[0] for b in events]
    assert kinds == ["event: output", "event: state", "event: end"]
    assert "id: 2" in events[0]
    data = "".join(line[6:] for line in events[1].split("\n") if line.startswith("data: "))
    assert data.startswith("succeeded") and 'class="timeline"' in data
    # From a cursor: only what came after it; a Last-Event-ID header counts as one.
    r = await alice.get(f"/jobs/{job.id}/live", headers={"Last-Event-ID": "1"})
    (output,) = [b for b in r.text.split("\n\n") if b.startswith("event: output")]
    assert "id: 2" in output and output.count('"rank"') == 1


# -- nothing from outside -----------------------------------------------------------------------

OUTSIDE = re.compile(r"""(?:https?:)?//(?!www\.w3\.org/2000/svg)[\w.-]+""", re.IGNORECASE)


def test_no_template_or_asset_refers_to_an_outside_url() -> None:
    files = [*TEMPLATES.glob("*.html"), *STATIC.iterdir()]
    assert len(files) >= 10
    for path in files:
        for n, line in enumerate(path.read_text().splitlines(), start=1):
            code = line.split("// ", 1)[0]  # a JS comment is not a URL
            match = OUTSIDE.search(code)
            assert match is None, f"{path.name}:{n} refers outside: {match.group(0)!r}"


async def test_pages_carry_a_policy_that_blocks_outside_resources(portal: Portal) -> None:
    alice = await portal.sign_in("alice")
    job = await portal.pool.submit(1)
    for url in ("/jobs", "/jobs/new", f"/jobs/{job.id}", "/pool", "/account", "/login"):
        r = await alice.get(url)
        csp = r.headers["content-security-policy"]
        assert "default-src 'none'" in csp and "script-src 'self'" in csp, url
        assert r.headers["x-frame-options"] == "DENY"
        for src in re.findall(r'(?:src|href|action)="([^"]*)"', r.text):
            assert src.startswith(("/", "#", "?", "data:")) or src == "", (url, src)
    assert BASE.startswith("https://")


async def test_checkpoint_now_from_the_page(portal: Portal) -> None:
    pool = portal.pool
    alice = await portal.sign_in("alice")
    job, agent, leases = await running_job(pool, 2)
    await beat(pool, agent, leases)  # it says it has CRIU
    r = await alice.post_form(f"/jobs/{job.id}/checkpoint")
    assert r.status_code == 303, r.text
    assert r.headers["location"] == f"/jobs/{job.id}?asked=2"
    page = await alice.get(r.headers["location"])
    assert "A checkpoint of 2 ranks was asked for" in page.text
    orders = (await beat(pool, agent, leases)).checkpoint
    assert sorted(o.rank for o in orders) == [0, 1]


async def test_a_waiting_job_says_why_on_its_page_and_in_the_list(portal: Portal) -> None:
    alice = await portal.sign_in("alice")
    await portal.pool.register_relay()
    await portal.pool.enroll("agent-1", slots=2)
    job = await portal.pool.submit(5)
    page = (await alice.get(f"/jobs/{job.id}")).text
    assert "Waiting: needs 5 slots; the agents that may run it have 2 in all." in page
    assert "can never run this job" in page
    assert "needs 5 slots" in (await alice.get("/jobs")).text


async def test_submit_a_project_folder(portal: Portal) -> None:
    alice = await portal.sign_in("alice")
    folder = [
        ("sim/main.py", b"import lib.core\n"),
        ("sim/lib/__init__.py", b""),
        ("sim/lib/core.py", b"X = 1\n"),
        ("sim/data/grid.csv", b"1\n"),
        ("sim/lib/__pycache__/core.cpython-311.pyc", b"junk"),
        ("sim/.venv/pyvenv.cfg", b"home = /usr"),
        ("sim/.venv/lib/site.py", b""),
    ]
    r = await alice.client.post(
        "/jobs/new",
        data={"csrf": alice.csrf, "ranks": "2", "entry": "main.py", "fault_tolerance": "on"},
        files=_files(None, project=folder),
    )
    assert r.status_code == 303, field_errors(r.text) or r.text
    job_id = int(r.headers["location"].rsplit("/", 1)[1])
    row = portal.pool.core.store.job_row(job_id)
    assert row is not None and (row["entry"], row["name"]) == ("main.py", "sim")
    with zipfile.ZipFile(portal.pool.core.blobs.path(row["bundle"])) as zf:
        assert sorted(zf.namelist()) == [
            "data/grid.csv",
            "lib/__init__.py",
            "lib/core.py",
            "main.py",
        ]
    # Both a program and a folder, or a folder that escapes: the form says so.
    r = await alice.client.post(
        "/jobs/new",
        data={"csrf": alice.csrf, "ranks": "2"},
        files=_files(("app.py", HELLO), project=folder),
    )
    assert "or a project folder" in field_errors(r.text)["program"]
    r = await alice.client.post(
        "/jobs/new",
        data={"csrf": alice.csrf, "ranks": "2", "entry": "main.py"},
        files=_files(None, project=[("sim/main.py", b""), ("sim/../../x", b"")]),
    )
    assert "not a relative path inside" in field_errors(r.text)["program"]


async def test_submit_with_requirements(portal: Portal) -> None:
    alice = await portal.sign_in("alice")
    folder = [
        ("sim/main.py", b"import astropy\n"),
        (
            "sim/pyproject.toml",
            b'[project]\nname = "s"\nversion = "0"\ndependencies = ["astropy"]\n',
        ),
    ]
    r = await alice.client.post(
        "/jobs/new",
        data={
            "csrf": alice.csrf,
            "ranks": "1",
            "entry": "main.py",
            "requirements": "numpy>=1.26\n",
        },
        files=_files(None, project=folder),
    )
    assert r.status_code == 303, field_errors(r.text) or r.text
    job_id = int(r.headers["location"].rsplit("/", 1)[1])
    detail = await portal.pool.job(job_id)
    assert detail.job.requirements == ["astropy", "numpy>=1.26"]
    assert "astropy, numpy&gt;=1.26" in (await alice.get(f"/jobs/{job_id}")).text
    r = await alice.client.post(
        "/jobs/new",
        data={"csrf": alice.csrf, "ranks": "1", "requirements": "x @ https://evil.example/x.whl"},
        files=_files(("app.py", HELLO)),
    )
    assert "names a URL" in field_errors(r.text)["requirements"]


async def test_a_stalled_form_upload_is_refused(portal: Portal, autojump_clock: object) -> None:
    """The form is read like any upload: a body that stops coming is refused (408, the error
    page) once ``upload_idle_timeout`` passes with nothing, and nothing is submitted."""
    alice = await portal.sign_in("alice")
    idle = portal.pool.core.settings.upload_idle_timeout
    boundary = "b0undary"
    part = f"--{boundary}\r\nContent-Disposition: form-data; name="
    head = (
        f'{part}"csrf"\r\n\r\n{alice.csrf}\r\n{part}"ranks"\r\n\r\n1\r\n'
        f'{part}"program"; filename="app.py"\r\nContent-Type: text/x-python\r\n\r\n'
    ).encode() + HELLO
    tail = f"\r\n--{boundary}--\r\n".encode()
    gave_up = []

    async def stalls() -> AsyncIterator[bytes]:
        yield head
        await trio.sleep(idle * 10)
        gave_up.append(True)  # never: the server ended the request first
        yield tail

    start = trio.current_time()
    r = await alice.client.post(
        "/jobs/new",
        content=stalls(),
        headers={
            "content-type": f"multipart/form-data; boundary={boundary}",
            "content-length": str(len(head) + len(tail)),
        },
    )
    assert r.status_code == 408 and "nothing came for" in r.text, (r.status_code, r.text)
    assert idle <= trio.current_time() - start < 2 * idle and gave_up == []
    assert (await portal.pool.client.get("/api/v1/jobs", headers=portal.pool.user())).json() == []
