"""The dashboard at ``/`` shows the pool, its agents (with their isolation), relays and recent
jobs."""

from __future__ import annotations

from pathlib import Path

import httpx

from vpool.coordinator.app import create_app
from vpool.coordinator.service import Coordinator
from vpool.coordinator.settings import CoordinatorSettings
from vpool.protocol import api


async def test_dashboard_lists_pool_state(tmp_path: Path) -> None:
    settings = CoordinatorSettings(
        state_dir=str(tmp_path), pool_name="dash<pool>", public_url="https://pool.example"
    )
    core = Coordinator(settings)
    now = core.clock()
    core.store.enroll_agent("key-1", "volunteer-1", 4, "", now)
    sandboxed = core.store.enroll_agent("key-2", "volunteer-2", 2, "", now)
    report = api.IsolationReport(level="sandbox-rlimits", detail="no <cgroup>", rank_memory=2 << 30)
    hb = api.AgentHeartbeat(ranks=[], free_slots=2, isolation=report)
    core.store.agent_heartbeat(sandboxed, hb, now, 10.0)
    core.store.register_relay(api.RelayRegister(name="relay-0", host="10.0.0.1", port=7000), now)
    core.store.add_user("alice", "h" * 64, now)
    core.store.create_job(
        "alice", api.JobSubmit(ranks=2, bundle="b" * 64, entry="app.py", name="my-job"), now
    )
    transport = httpx.ASGITransport(app=create_app(settings, coordinator=core))
    async with httpx.AsyncClient(transport=transport, base_url="http://c") as client:
        r = await client.get("/")
    core.close()
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    html = r.text
    assert "dash&lt;pool&gt;" in html and "dash<pool>" not in html  # escaped
    for text in (
        "https://pool.example",
        "volunteer-1",
        "relay-0",
        "10.0.0.1:7000",
        "my-job",
        "queued",
        "0 / 6 slots busy",
        "<th>isolation</th>",
        "<th>rank memory</th>",
        ">sandbox-rlimits</td>",
        'title="no &lt;cgroup&gt;"',  # why it is not stronger, escaped
        "<td>2 GiB</td>",
        ">not reported</td>",  # volunteer-1 has not said: it gets no ranks
    ):
        assert text in html, text


async def test_dashboard_empty_pool(tmp_path: Path) -> None:
    settings = CoordinatorSettings(state_dir=str(tmp_path))
    core = Coordinator(settings)
    transport = httpx.ASGITransport(app=create_app(settings, coordinator=core))
    async with httpx.AsyncClient(transport=transport, base_url="http://c") as client:
        r = await client.get("/")
    core.close()
    assert r.status_code == 200
    assert "No agent has enrolled yet." in r.text and "No job yet." in r.text
