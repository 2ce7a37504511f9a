"""The portal shows what volunteers let their agents do (issue 22): the pool page's agents
with their activity as a badge (available, busy, suspended and why, leaving) and agents that
left as gone; a job page marks suspended ranks and lists their suspensions in its events."""

from __future__ import annotations

import re
from html import unescape

from coord_helpers import SANDBOX, Agent, Pool
from portal_helpers import Portal, running_job

from vpool.protocol import api


async def _say(
    pool: Pool,
    agent: Agent,
    activity: str,
    reason: str = "",
    *,
    frozen: list[api.Lease] | None = None,
    free: int = 0,
) -> None:
    hb = api.AgentHeartbeat(
        ranks=[
            api.RankState(job=x.job, rank=x.rank, incarnation=x.incarnation, state="suspended")
            for x in frozen or []
        ],
        free_slots=free,
        isolation=SANDBOX,
        activity=activity,
        activity_reason=reason,
    )
    r = await pool.post("/api/v1/agents/heartbeat", hb, agent.headers)
    assert r.status_code == 200, r.text


def _agent_rows(html: str) -> dict[str, str]:
    """The pool page's agents table: name -> its row's HTML."""
    table = html.split('<table id="agents">', 1)[1].split("</table>", 1)[0]
    rows = re.findall(r"<tr>\s*<td>([^<]*)</td>(.*?)</tr>", table, re.S)
    return {unescape(name): row for name, row in rows}


def _activity(row: str) -> str:
    cell = re.search(r'<td class="activity">(.*?)</td>', row, re.S)
    assert cell is not None, row
    return " ".join(unescape(re.sub(r"<[^>]+>", "", cell.group(1))).split())


async def test_the_pool_page_shows_each_agents_activity(portal: Portal) -> None:
    pool = portal.pool
    ops = await portal.sign_in("ops", "operator")
    await pool.register_relay()
    idle = await pool.enroll("idle", slots=1)
    full = await pool.enroll("full", slots=1)
    away = await pool.enroll("away", slots=1)
    bye = await pool.enroll("bye", slots=1)
    await _say(pool, away, "suspended", "the owner is <using> the machine")
    await _say(pool, bye, "leaving", "stopping")  # before the job: it must not go there
    await pool.submit(1)  # to idle or full (equals: enrolled at once)
    placed = {a.id: a for a in (idle, full)}
    [(agent, leases)] = [(a, ls) for a in placed.values() if (ls := await pool.lease(a))]
    await pool.heartbeat(agent, leases, free=0)
    names = {idle.id: "idle", full.id: "full"}
    html = (await ops.get("/pool")).text
    rows = _agent_rows(html)
    assert {n: _activity(r) for n, r in rows.items()} == {
        "away": "suspended the owner is <using> the machine",
        "bye": "leaving stopping",
        names[agent.id]: "busy",
        names[next(a for a in placed if a != agent.id)]: "available",
    }
    assert "&lt;using&gt;" in rows["away"]  # escaped
    assert 'class="badge activity-suspended"' in rows["away"]
    assert 'class="badge activity-busy"' in rows[names[agent.id]]

    # bye goes silent: gone, not lost; the others heartbeat on.
    pool.clock.advance(11)
    await pool.relay_heartbeat()
    for a in (idle, full):
        await pool.heartbeat(a, leases if a is agent else [], free=0 if a is agent else 1)
    await _say(pool, away, "suspended", "the owner is <using> the machine")
    await pool.core.check_timeouts()
    rows = _agent_rows((await ops.get("/pool")).text)
    assert 'class="badge agent-gone">gone<' in rows["bye"] and _activity(rows["bye"]) == "-"
    assert 'class="badge agent-alive">alive<' in rows["away"]


async def test_a_job_page_marks_suspended_ranks_and_lists_the_events(portal: Portal) -> None:
    pool = portal.pool
    alice = await portal.sign_in("alice")
    job, agent, leases = await running_job(pool, 2)
    await _say(pool, agent, "suspended", "on battery", frozen=leases[:1])
    html = (await alice.get(f"/jobs/{job.id}")).text
    ranks = html.split('<table class="ranks" id="ranks">', 1)[1].split("</table>", 1)[0]
    row0, row1 = re.findall(r'<tr data-rank="\d+">(.*?)</tr>', ranks, re.S)
    assert 'class="badge rank-suspended"' in row0 and "rank-suspended" not in row1
    assert "rank 0 suspended on agent agent-1: on battery" in html
    assert 'data-state="suspended"' in html  # the timeline's segment
    await pool.heartbeat(agent, leases)
    html = (await alice.get(f"/jobs/{job.id}")).text
    assert "rank-suspended" not in html.split('id="ranks"', 1)[1].split("</table>", 1)[0]
    assert "rank 0 resumed after 0 s" in html
