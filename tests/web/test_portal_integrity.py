"""The pool page counts, for operators, the sealed messages that did not open (issue 34):
against the agent that saw it and the relay that pushed it, in their tables."""

from __future__ import annotations

import re
from html import unescape

from portal_helpers import Portal, running_job

from vpool.protocol import api


def _counts(html: str, table: str) -> dict[str, str]:
    """name -> its row's "unopened messages" cell, in table ``table`` of the pool page."""
    body = html.split(f'<table id="{table}">', 1)[1].split("</table>", 1)[0]
    rows = re.findall(r"<tr>\s*<td>([^<]*)</td>(.*?)</tr>", body, re.S)
    cells = {}
    for name, row in rows:
        cell = re.search(r'<td class="integrity">(.*?)</td>', row, re.S)
        assert cell is not None, row
        cells[unescape(name)] = cell.group(1).strip()
    return cells


async def test_unopened_messages_are_counted_against_the_agent_and_the_relay(
    portal: Portal,
) -> None:
    pool = portal.pool
    ops = await portal.sign_in("ops", "operator")
    job, agent, [lease] = await running_job(pool, 1)
    before = (await ops.get("/pool")).text
    assert _counts(before, "agents") == {"agent-1": "0"}
    assert _counts(before, "relays") == {"relay-0": "0"}
    problem = api.RankProblem(
        job=job.id,
        rank=0,
        incarnation=lease.incarnation,
        message="relay relay-0 (127.0.0.1:7000): message 1 ... does not open",
        failure="message 1 ... does not open",
        unopened_from="relay-0",
    )
    r = await pool.post("/api/v1/agents/problem", problem, agent.headers)
    assert r.status_code == 200, r.text
    after = (await ops.get("/pool")).text
    assert _counts(after, "agents") == {"agent-1": "1"}
    assert _counts(after, "relays") == {"relay-0": "1"}
