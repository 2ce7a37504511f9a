"""Failure modes in the portal (issue 23): the submit form's "When a rank is lost" choice
(``on_failure``, as ``vsdk submit --on-failure``), what it refuses and how, and the page of a job
whose mode reports failures ("ulfm", FT-MPI's "blank", "shrink", "rebuild") and whose rank was
declared failed: the mode, the failed ranks, a failed badge in the ranks table and a failed
segment on the timeline.

The failed rank is made as ``tests/coordinator/test_failure_modes.py`` makes it: a fake agent
reports the rank's process lost through the coordinator's real HTTP API."""

from __future__ import annotations

import re
from html import unescape
from pathlib import Path

import httpx
import pytest
from coord_helpers import HELLO
from portal_helpers import Browser, Portal, field_errors, open_portal

from vpool.protocol import api
from vpool.web import portal as web_portal
from vpool.web.submit import ON_FAILURE_CHOICES

REPORTING = [mode for mode in api.FAILURE_MODES if mode in api.REPORTING_MODES]
# What a job's page says its mode does.
WORDS = {
    "transparent": "restart transparently",
    "abort": "fail the job",
    "ulfm": "report to the program (ULFM)",
    "blank": "report to the program (FT-MPI blank)",
    "shrink": "report to the program (FT-MPI shrink)",
    "rebuild": "report to the program (FT-MPI rebuild)",
}


def _program() -> list:
    return [("program", ("app.py", HELLO, "text/x-python"))]


async def _post(
    alice: Browser, fields: dict[str, str | list[str]], files: list | None = None
) -> httpx.Response:
    data = {"csrf": alice.csrf, "ranks": "3", **fields}
    return await alice.client.post("/jobs/new", data=data, files=[*_program(), *(files or [])])


async def _submit(alice: Browser, **fields: str) -> int:
    r = await _post(alice, dict(fields))
    assert r.status_code == 303, field_errors(r.text) or r.text
    return int(r.headers["location"].rsplit("/", 1)[1])


def _checked(html: str) -> list[str]:
    """The modes of the choice shown as chosen."""
    return re.findall(r'name="on_failure" value="([a-z]+)" checked', html)


async def _no_jobs(portal: Portal) -> None:
    r = await portal.pool.client.get("/api/v1/jobs", headers=portal.pool.user())
    assert r.json() == []


def _summary(html: str, id_: str) -> str:
    found = re.search(rf'<dd id="{id_}"[^>]*>([^<]*)</dd>', html)
    assert found, id_
    return unescape(found.group(1))


# -- the submit form ----------------------------------------------------------------------------


async def test_each_choice_makes_the_job_vsdk_submit_on_failure_would(portal: Portal) -> None:
    assert tuple(ON_FAILURE_CHOICES) == api.FAILURE_MODES  # every mode, in the API's order
    alice = await portal.sign_in("alice")
    form = (await alice.get("/jobs/new")).text
    assert "When a rank is lost" in form and 'name="fault_tolerance"' not in form
    assert re.findall(r'type="radio" id="on_failure-([a-z]+)"', form) == list(api.FAILURE_MODES)
    assert _checked(form) == ["transparent"]  # the default, as vsdk's
    for label, means in ON_FAILURE_CHOICES.values():
        assert label in form and unescape(means) in unescape(form)
    for mode in api.FAILURE_MODES:
        job = await _submit(alice, on_failure=mode)
        info = (await portal.pool.job(job)).job
        assert (info.on_failure, info.fault_tolerance) == (mode, mode == "transparent")
        page = (await alice.get(f"/jobs/{job}")).text
        assert _summary(page, "job-on-failure") == WORDS[mode]
        assert 'id="job-failed-ranks"' not in page
        disabled = re.search(
            r'<button type="submit" id="checkpoint" disabled title="([^"]*)"', page
        )
        if mode == "transparent":
            assert disabled is None
        else:
            assert disabled and "lost ranks are restarted" in unescape(disabled.group(1))


async def test_posts_of_the_old_form_keep_their_meaning(portal: Portal) -> None:
    """Before the choice, the form had a fault tolerance checkbox: ticked, lost ranks were
    restarted; left out, the job failed. A post that still sends it means the same."""
    alice = await portal.sign_in("alice")
    for fields, mode in (
        ({"fault_tolerance": "on"}, "transparent"),
        ({"fault_tolerance": ""}, "abort"),
        ({}, "abort"),
        # The choice, when sent, is what counts.
        *(({"fault_tolerance": "on", "on_failure": mode}, mode) for mode in REPORTING),
    ):
        job = await _submit(alice, **fields)
        assert (await portal.pool.job(job)).job.on_failure == mode, fields


async def test_checkpoints_and_validation_need_lost_ranks_restarted(portal: Portal) -> None:
    alice = await portal.sign_in("alice")
    typed = {"name": "my <job>", "args": "1000 'two words'", "memory": "512M"}
    for mode in ("abort", *REPORTING):
        r = await _post(alice, {**typed, "on_failure": mode, "checkpoint_every": "60"})
        assert r.status_code == 422, r.text
        errors = field_errors(r.text)
        assert errors == {
            "checkpoint_every": 'checkpoints are for restarting lost ranks: choose "Restart it '
            'elsewhere" when a rank is lost, or leave this empty'
        }
        # Nothing typed is lost: the choice made and every field come back.
        assert _checked(r.text) == [mode]
        assert 'value="60" aria-invalid="true" aria-describedby="checkpoint_every-error"' in r.text
        assert 'value="my &lt;job&gt;"' in r.text and 'value="512M"' in r.text
        assert 'value="1000 &#39;two words&#39;"' in r.text

        r = await _post(alice, {"on_failure": mode, "validate": "on"})
        assert r.status_code == 422, r.text
        assert (
            "validation replays the messages logged only to restart lost ranks"
            in (field_errors(r.text)["validate"])
        )
        assert _checked(r.text) == [mode]
        assert re.search(r'id="validate" name="validate" checked aria-invalid="true"', r.text)
    await _no_jobs(portal)
    # With lost ranks restarted, both are fine.
    job = await _submit(alice, on_failure="transparent", checkpoint_every="60", validate="on")
    info = (await portal.pool.job(job)).job
    assert (info.checkpoint_every, info.validate, info.on_failure) == (60, True, "transparent")


async def test_a_pool_that_validates_every_job_takes_only_restarts(tmp_path: Path) -> None:
    async with open_portal(tmp_path, validate_jobs=True) as portal:
        alice = await portal.sign_in("alice")
        for mode in REPORTING:
            r = await _post(alice, {"on_failure": mode})
            assert r.status_code == 422
            assert field_errors(r.text) == {
                "on_failure": "this pool validates every job, which replays the messages logged "
                'only to restart lost ranks: choose "Restart it elsewhere"'
            }
            assert re.search(
                rf'value="{mode}" checked aria-invalid="true" aria-describedby', r.text
            )
        await _no_jobs(portal)


async def test_hostile_choices_are_a_field_error_not_a_guess(portal: Portal) -> None:
    alice = await portal.sign_in("alice")
    hostile: list[tuple[dict[str, str | list[str]], list]] = [
        ({"on_failure": "shrug"}, []),
        ({"on_failure": "TRANSPARENT"}, []),
        ({"on_failure": ""}, []),
        ({"on_failure": "ulfm\x00"}, []),
        ({"on_failure": "\x00" * 5000}, []),
        ({"on_failure": ["ulfm", "abort"]}, []),
        ({"on_failure": ["shrink", "blank"]}, []),
        ({"on_failure": "Rebuild"}, []),
        ({"on_failure": "shrink "}, []),
        ({"on_failure": "respawn"}, []),  # a mode of other runtimes, not of this pool
        ({"on_failure": ["ulfm", "ulfm"]}, []),  # a browser sends one value
        ({}, [("on_failure", ("ulfm", b"ulfm", "text/plain"))]),  # a file
        ({"on_failure": "ulfm"}, [("on_failure", ("ulfm", b"ulfm", "text/plain"))]),
    ]
    for fields, files in hostile:
        r = await _post(alice, {"name": "kept", "ranks": "2", **fields}, files)
        assert r.status_code == 422, (fields, r.status_code)
        errors = field_errors(r.text)
        assert errors["on_failure"] == (
            'choose one: "Restart it elsewhere", "Fail the job", "Tell the other ranks (ULFM)", '
            '"Leave a hole (FT-MPI blank)", "Shrink the world (FT-MPI shrink)" or "Start a new '
            'rank in its place (FT-MPI rebuild)"'
        ), errors
        assert "Submit a job" in r.text and 'value="kept"' in r.text
        assert _checked(r.text) == []  # nothing shown as chosen that was not
        assert "\x00" not in r.text
    # The old checkbox, sent with the choice, is checked all the same.
    r = await _post(alice, {"on_failure": "ulfm", "fault_tolerance": "true"})
    assert r.status_code == 422
    assert "tick it or leave it out" in field_errors(r.text)["fault_tolerance"]
    await _no_jobs(portal)


# -- the page of a job whose mode reports failures ----------------------------------------------


def _rank_rows(html: str) -> list[str]:
    table = html.split('<table class="ranks" id="ranks">', 1)[1].split("</table>", 1)[0]
    return re.findall(r'<tr data-rank="\d+">(.*?)</tr>', table, re.S)


def _segments(html: str, rank: int) -> list[tuple[str, str]]:
    """(state, incarnation) of the timeline's segments of ``rank``, in order."""
    found = re.findall(
        rf'<rect class="seg seg-[a-z]+" data-rank="{rank}" data-state="([a-z]+)" '
        r'data-incarnation="(\d*)"',
        html,
    )
    return [(state, inc) for state, inc in found]


@pytest.mark.parametrize("mode", REPORTING)
async def test_the_page_of_a_job_that_reports_failures_shows_its_failed_rank(
    portal: Portal, mode: str
) -> None:
    pool = portal.pool
    alice = await portal.sign_in("alice")
    await pool.register_relay()
    job = await _submit(alice, on_failure=mode)
    agent = await pool.enroll("agent-1", slots=3)
    leases = await pool.lease(agent)
    pool.clock.advance(1)
    await pool.heartbeat(agent, leases)
    pool.clock.advance(2)
    lost = leases[1]
    ex = api.RankExit(job=job, rank=lost.rank, incarnation=lost.incarnation, code=-9, lost=True)
    assert (await pool.post("/api/v1/agents/exit", ex, agent.headers)).status_code == 200
    pool.clock.advance(3)

    html = (await alice.get(f"/jobs/{job}")).text
    assert _summary(html, "job-on-failure") == WORDS[mode]
    assert _summary(html, "job-failed-ranks") == "1"
    assert 'id="job-state">running<' in html
    rows = _rank_rows(html)
    assert ['class="badge rank-failed"' in row for row in rows] == [False, True, False]
    assert re.search(
        r'<span class="badge rank-failed" title="declared failed[^"]*">failed<', rows[1]
    )
    assert 'class="badge rank-running"' in rows[0]
    # The failed rank's row ends with a failed segment, drawn until now; the others run on.
    assert _segments(html, 1) == [("starting", "1"), ("running", "1"), ("failed", "1")]
    assert _segments(html, 0)[-1] == ("running", "1")
    tip = re.search(r'data-state="failed" [^>]*><title>([^<]*)</title>', html)
    assert tip and "rank 1, incarnation 1: failed from 3.0 s to 6.0 s: " in unescape(tip.group(1))
    assert f"declared failed; the other ranks are told (on-failure {mode})" in unescape(
        tip.group(1)
    )
    assert re.search(r'class="mark mark-fault" data-rank="1"', html)
    assert 'class="swatch seg-failed"' in html  # in the legend
    assert re.search(r'<tr class="event-rank_failed marked-fault">', html)
    # No checkpoint for such a job: the button is disabled, and a forged post is refused.
    assert re.search(r'id="checkpoint" disabled title="[^"]*report to the program', html)
    r = await alice.post_form(f"/jobs/{job}/checkpoint")
    assert r.status_code == 409 and "fault tolerance off" in r.text
    # The live stream's panel is the same part of the page.
    detail = await pool.job(job)
    panel = web_portal.live_panel(detail, pool.core.clock())
    assert panel in html

    # The survivors exit 0: the job succeeded, and the failed segment lasts until its end.
    for lease in (leases[0], leases[2]):
        assert (await pool.exit(agent, lease, 0)).status_code == 200
    pool.clock.advance(10)
    html = (await alice.get(f"/jobs/{job}")).text
    assert 'id="job-state">succeeded<' in html
    assert _summary(html, "job-failed-ranks") == "1"
    tip = re.search(r'data-state="failed" [^>]*><title>([^<]*)</title>', html)
    assert tip and "failed from 3.0 s to 6.0 s" in tip.group(1)
    assert "rank(s) 1 failed and the program carried on without them" in unescape(html)
