"""Validation by replay in the portal: the submit form's checkbox (and hostile values of every
checkbox), and a validated job's pages as validation goes: the badge, what validation did so
far, a column per rank, output withheld until the job ended (on the page and in the live
stream), and the same job in the listing.

Jobs are driven through validation as ``tests/coordinator/test_validation.py`` does: fake
agents and a fake relay speak the coordinator's real HTTP API."""

from __future__ import annotations

import base64
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from html import unescape
from pathlib import Path

import pytest
import trio
from coord_helpers import HELLO, Agent, Pool, relay_headers
from portal_helpers import Browser, Portal, field_errors, open_portal

from vpool.protocol import api
from vpool.web import feed
from vpool.web import portal as web_portal

TRUE, FORGED = b"pi = 3.14159\n", b"pi = 3.0\n"


def _program() -> list:
    return [("program", ("app.py", HELLO, "text/x-python"))]


async def _submit(alice: Browser, **fields: str) -> int:
    body = {"csrf": alice.csrf, "ranks": "1", "fault_tolerance": "on", **fields}
    r = await alice.client.post("/jobs/new", data=body, files=_program())
    assert r.status_code == 303, field_errors(r.text) or r.text
    return int(r.headers["location"].rsplit("/", 1)[1])


# -- the submit form ----------------------------------------------------------------------------


async def test_the_validate_checkbox_makes_a_validated_job(portal: Portal) -> None:
    alice = await portal.sign_in("alice")
    form = (await alice.get("/jobs/new")).text
    assert 'name="validate"' in form and "Validate the result by replay" in form
    assert 'id="validate-pool"' not in form  # this pool validates only jobs that ask
    validated = await _submit(alice, validate="on")
    plain = await _submit(alice)
    assert (await portal.pool.job(validated)).job.validate
    assert not (await portal.pool.job(plain)).job.validate
    # Validation needs lost ranks restarted (a post of the old form without its fault tolerance
    # checkbox asks for "abort"): the refusal is shown by the checkbox.
    r = await alice.client.post(
        "/jobs/new", data={"csrf": alice.csrf, "ranks": "1", "validate": "on"}, files=_program()
    )
    assert r.status_code == 422
    assert (
        "validation replays the messages logged only to restart"
        in (field_errors(r.text)["validate"])
    )
    assert re.search(r'id="validate" name="validate" checked aria-invalid="true"', r.text)


async def test_hostile_checkbox_values_are_a_field_error_not_a_guess(portal: Portal) -> None:
    alice = await portal.sign_in("alice")
    hostile: list[tuple[str, dict[str, str | list[str]], list]] = [
        ("validate", {"validate": "yes"}, []),
        ("validate", {"validate": ["on", "off"]}, []),
        ("validate", {"validate": "\x00" * 5000}, []),
        ("validate", {}, [("validate", ("on", b"on", "text/plain"))]),  # a file
        ("fault_tolerance", {"fault_tolerance": "true"}, []),
        ("unsandboxed", {"unsandboxed": "1"}, []),
    ]
    for name, fields, files in hostile:
        data = {"csrf": alice.csrf, "ranks": "1", **fields}
        r = await alice.client.post("/jobs/new", data=data, files=[*_program(), *files])
        assert r.status_code == 422, (name, fields, r.status_code)
        errors = field_errors(r.text)
        assert "tick it or leave it out" in errors[name], (name, errors)
        assert "Submit a job" in r.text
    r = await portal.pool.client.get("/api/v1/jobs", headers=portal.pool.user())
    assert r.json() == []  # nothing was submitted
    # What a browser sends: "on" when ticked; an empty value counts as not ticked.
    job = await _submit(alice, validate="", unsandboxed="on")
    info = (await portal.pool.job(job)).job
    assert (info.validate, info.unsandboxed, info.fault_tolerance) == (False, True, True)


async def test_a_pool_that_validates_every_job_says_so_on_the_form(tmp_path: Path) -> None:
    async with open_portal(tmp_path, validate_jobs=True) as portal:
        alice = await portal.sign_in("alice")
        form = (await alice.get("/jobs/new")).text
        assert re.search(r'id="validate" name="validate" checked disabled>', form)
        assert "This pool validates every job." in form
        job = await _submit(alice)  # a disabled checkbox sends nothing: the pool decides
        assert (await portal.pool.job(job)).job.validate
        r = await alice.client.post(
            "/jobs/new", data={"csrf": alice.csrf, "ranks": "1"}, files=_program()
        )
        assert "this pool validates every job" in field_errors(r.text)["on_failure"]


# -- a validated job's pages --------------------------------------------------------------------


def _warning(lease: api.Lease, rank_dir: str | None = None) -> bytes:
    """What the program prints on stderr: a warning naming its own path, as seen in the
    sandbox (``rank_dir`` None) or in an unsandboxed agent's directory for the rank."""
    where = rank_dir or "/vpool/rank"
    return f"{where}/work/app.py:3: UserWarning: slow\n".encode()


async def _original_run(pool: Pool, stdout: bytes) -> tuple[int, Agent, api.Lease]:
    """A validated one-rank job run by agent-a (unsandboxed), which printed ``stdout`` and
    its warning, and has not exited."""
    await pool.register_relay("relay-0")
    a = await pool.enroll("agent-a", slots=1)
    job = await pool.submit(1, validate=True)
    [lease] = await pool.lease(a)
    await pool.heartbeat(a, [lease])
    await pool.output(a, lease, "stdout", 0, stdout)
    await pool.output(a, lease, "stderr", 0, _warning(lease, _unsandboxed(lease)))
    return job.id, a, lease


def _unsandboxed(lease: api.Lease) -> str:
    return f"/home/alice/.vpool/ranks/{lease.job_uid}-{lease.rank}-{lease.incarnation}-x1y2z3"


async def _validators(pool: Pool) -> list[Agent]:
    """Two more agents, unrelated to agent-a, to re-execute the rank."""
    return [await pool.enroll(f"agent-{c}", slots=1) for c in "bc"]


async def _reexecution(pool: Pool, agents: list[Agent]) -> tuple[Agent, api.Lease]:
    got = [(agent, lease) for agent in agents for lease in await pool.lease(agent)]
    assert len(got) == 1, got
    agent, lease = got[0]
    pool.clock.advance(1)  # a second to start, so the timeline has segments to draw
    await pool.heartbeat(agent, [lease])
    pool.clock.advance(1)
    return agent, lease


async def _replay(pool: Pool, agent: Agent, lease: api.Lease, stdout: bytes) -> None:
    """The re-execution prints ``stdout`` and the warning (sandboxed: paths of its own), exits
    0, and the relay finds its messages as logged."""
    await pool.output(agent, lease, "stdout", 0, stdout)
    await pool.output(agent, lease, "stderr", 0, _warning(lease))
    r = await pool.exit(agent, lease)
    assert r.status_code == 200, r.text
    report = api.RelayValidated(
        name="relay-0", job=lease.job, rank=lease.rank, incarnation=lease.incarnation, agreed=True
    )
    r = await pool.post("/api/v1/relays/validated", report, relay_headers("relay-0"))
    assert r.status_code == 200, r.text


def _output(html: str) -> str:
    """The text of the page's output area."""
    pre = html.split('<pre id="output"')[1].split(">", 1)[1].split("</pre>")[0]
    return unescape(re.sub(r"<[^>]+>", "", pre))


def _rank_cells(html: str) -> list[str]:
    """The validation cell of each row of the ranks table, as text."""
    table = html.split('id="ranks"')[1].split("</table>")[0]
    cells = re.findall(r'<td class="validation">(.*?)</td>', table, re.S)
    return [unescape(re.sub(r"<[^>]+>", "", c)).strip() for c in cells]


async def test_a_validated_job_page_as_validation_goes(portal: Portal) -> None:
    pool = portal.pool
    alice = await portal.sign_in("alice")
    job, a, lease = await _original_run(pool, TRUE)
    html = (await alice.get(f"/jobs/{job}")).text
    assert 'id="job-validate"' in html and "validated by replay" in html
    assert "<th>validation</th>" in html and _rank_cells(html) == ["-"]
    assert 'id="job-validation"' not in html  # nothing to say before every rank exited
    # Its output so far is withheld, and the page says why instead of looking empty.
    assert "pi = " not in _output(html)
    assert 'id="output-withheld"' in html and "shown once it is validated" in html
    assert "Waiting for the job to be validated" in html
    assert re.search(r'class="button when-ended" id="results"', html)
    r = await pool.exit(a, lease)
    assert r.status_code == 200, r.text

    html = (await alice.get(f"/jobs/{job}")).text
    live = re.compile(r'<p class="validation live" id="job-validation"[^>]*>([^<]*)</p>')
    said = live.search(html)
    assert said and said.group(1).startswith("validating: rank 0 waits for a free agent")
    assert _rank_cells(html) == ["running"]
    assert "pi = " not in _output(html) and 'id="output-withheld"' in html
    assert (await web_portal.visible_output(pool.core, job, 0, None, 100, 1 << 20)) == ([], False)
    v, lease2 = await _reexecution(pool, await _validators(pool))
    html = (await alice.get(f"/jobs/{job}")).text
    said = live.search(html)
    assert said and "rank 0 re-executed to validate it on agent agent-" in said.group(1)
    assert 'class="seg seg-validating"' in html
    await _replay(pool, v, lease2, TRUE)

    detail = await pool.job(job)
    assert detail.job.state == "succeeded", detail.job.reason
    html = (await alice.get(f"/jobs/{job}")).text
    done = re.search(r'<p class="validation" id="job-validation">([^<]*)</p>', html)
    assert done and done.group(1) == f"Validation: {detail.job.validation}"
    assert "validated: rank(s) 0 re-executed and confirmed" in done.group(1)
    assert _rank_cells(html) == [f"agreed by {detail.ranks[0].validated_by}"]
    assert detail.ranks[0].validated_by.startswith("agent agent-")
    # The original's output, both streams: the validator's (its paths) is never the job's.
    assert _output(html) == (TRUE + _warning(lease, _unsandboxed(lease))).decode()
    assert 'id="output-withheld"' not in html and "this is all of its output" in html
    assert 'class="seg seg-validating"' in html
    listing = (await alice.get("/jobs")).text
    assert listing.count('class="badge validate"') == 1


async def test_a_corrected_rank_and_its_warnings_on_the_page(portal: Portal) -> None:
    """Agent-a forged its output: two re-executions outvote it. The page shows the mismatch
    and the distrust as warnings, the correction as notable, and only the true output."""
    pool = portal.pool
    alice = await portal.sign_in("alice")
    job, a, lease = await _original_run(pool, FORGED)
    await pool.exit(a, lease)
    others = await _validators(pool)
    v, lease2 = await _reexecution(pool, others)
    await _replay(pool, v, lease2, TRUE)
    html = (await alice.get(f"/jobs/{job}")).text
    assert "a third execution decides" in html
    assert 'class="event-validation_mismatch marked-warning"' in html
    assert "pi = " not in _output(html)
    t, lease3 = await _reexecution(pool, [o for o in others if o is not v])
    await _replay(pool, t, lease3, TRUE)

    detail = await pool.job(job)
    assert detail.job.state == "succeeded", detail.job.reason
    html = (await alice.get(f"/jobs/{job}")).text
    assert _output(html) == (TRUE + _warning(lease2)).decode()  # the agreed run's, both
    [cell] = _rank_cells(html)
    assert cell.startswith("corrected by agents agent-")
    assert 'class="badge validation-corrected"' in html
    assert 'class="event-validation_corrected marked-corrected"' in html
    assert 'class="event-agent_distrusted marked-warning"' in html
    assert 'class="mark mark-warning"' in html and 'class="mark mark-corrected"' in html
    validating = r'class="seg seg-validating" data-rank="0" [^>]*data-incarnation="(\d+)"'
    assert re.findall(validating, html) == ["2", "3"]


async def test_the_live_stream_withholds_output_until_validated(
    portal: Portal, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two tabs follow a validated job, the first with a forged cursor: neither gets output
    while it validates (only the panel, which says what validation does); both get all of it,
    the validated output, once the job ended."""
    pool = portal.pool
    alice = await portal.sign_in("alice")
    job, a, lease = await _original_run(pool, TRUE)
    await pool.exit(a, lease)
    feeds: feed.Feeds = pool.client._transport.app.state.feeds  # type: ignore[attr-defined]
    watch = feeds.watch
    watching: list[trio.Event] = [trio.Event(), trio.Event()]

    @asynccontextmanager
    async def counted(job_id: int, after: int) -> AsyncIterator[feed.JobFeed]:
        async with watch(job_id, after) as f:
            next(e for e in watching if not e.is_set()).set()
            yield f

    monkeypatch.setattr(feeds, "watch", counted)
    streams: dict[str, str] = {}

    async def tab(name: str, after: int) -> None:
        r = await alice.get(f"/jobs/{job}/live", params={"after": after})
        streams[name] = r.text

    async with trio.open_nursery() as nursery:
        nursery.start_soon(tab, "forged", 1)  # it would set the feed's floor at 1
        await watching[0].wait()
        nursery.start_soon(tab, "honest", 0)
        await watching[1].wait()
        shared = feeds.feeds[job]
        assert shared.subscribers == 2 and shared.floor == 0
        v, lease2 = await _reexecution(pool, await _validators(pool))
        await _replay(pool, v, lease2, TRUE)
    for name, text in streams.items():
        blocks = [b for b in text.split("\n\n") if b]
        kinds = [b.split("\n")[0] for b in blocks]
        assert kinds[-1] == "event: end" and kinds.count("event: output") == 1, (name, kinds)
        at = kinds.index("event: output")
        assert set(kinds[:at]) == {"event: state"}, (name, kinds)
        assert "validating: rank 0 waits for a free agent" in blocks[0], name
        encoded = base64.b64encode(TRUE).decode()
        assert '"rank":0' in blocks[at] and encoded in blocks[at], (name, blocks[at])
