"""The relay and the coordinator: registration (with retries), heartbeats, lost ranks."""

from __future__ import annotations

from pathlib import Path

import httpx
import trio
from relay_fakes import FakeAgent, FakeCoordinator, Pool, start_relay


async def test_registers_and_heartbeats(
    pool: Pool, nursery: trio.Nursery, tmp_path: Path, agents: object
) -> None:
    coord = FakeCoordinator(pool, register_failures=2)
    settings = pool.settings(
        tmp_path / "relay",
        coordinator_url="http://coord",
        relay_key="s3cret",
        advertise_host="relay.example",
    )
    relay = await start_relay(nursery, settings, coordinator_transport=coord.transport)
    # An agent may connect before registration is done: its Hello waits for the signing key.
    a = await FakeAgent.connect(pool, relay.addr, "agent-a")
    assert len(coord.registered) == 1
    reg = coord.registered[0]
    assert (reg.name, reg.host, reg.port) == ("relay-t", "relay.example", relay.addr[1])
    await a.attach(pool, 1, 0, size=2, home=True)
    await coord.wait_for(lambda: any(h.load.ranks == 1 for h in coord.heartbeats))
    assert coord.heartbeats[-1].name == "relay-t"


async def test_lost_ranks_are_reported_after_grace(
    pool: Pool, nursery: trio.Nursery, tmp_path: Path, agents: object
) -> None:
    coord = FakeCoordinator(pool)
    settings = pool.settings(
        tmp_path / "relay", coordinator_url="http://coord", relay_key="s3cret", lost_grace=0.3
    )
    relay = await start_relay(nursery, settings, coordinator_transport=coord.transport)
    a = await FakeAgent.connect(pool, relay.addr, "agent-a")
    await a.attach(pool, 1, 0, size=3, home=True)
    await a.attach(pool, 1, 1, size=3, home=True, incarnation=2)
    b = await FakeAgent.connect(pool, relay.addr, "agent-b")
    await b.attach(pool, 1, 2, size=3, home=True)
    start = trio.current_time()
    await a.aclose()
    await b.aclose()
    # Agent b comes back within the grace period; agent a does not.
    b2 = await FakeAgent.connect(pool, relay.addr, "agent-b")
    await b2.attach(pool, 1, 2, size=3, home=True)
    await coord.wait_for(lambda: len(coord.lost) >= 2)
    assert trio.current_time() - start >= 0.3
    lost = sorted((x.job, x.rank, x.incarnation) for x in coord.lost)
    assert lost == [(1, 0, 1), (1, 1, 2)]
    assert "agent-a" in coord.lost[0].reason and "relay-t" in coord.lost[0].reason
    await coord.wait_for(lambda: len(coord.heartbeats) >= 3)
    assert len(coord.lost) == 2


async def test_keeps_serving_while_the_coordinator_is_away(
    pool: Pool, nursery: trio.Nursery, tmp_path: Path, agents: object
) -> None:
    coord = FakeCoordinator(pool)
    away = False
    refused = 0
    refused_twice = trio.Event()

    async def flaky(request: httpx.Request) -> httpx.Response:
        nonlocal refused
        if away:
            refused += 1
            if refused >= 2:
                refused_twice.set()
            raise httpx.ConnectError("connection refused", request=request)
        return await coord.handle(request)

    settings = pool.settings(tmp_path / "relay", coordinator_url="http://coord", relay_key="s3cret")
    relay = await start_relay(nursery, settings, coordinator_transport=httpx.MockTransport(flaky))
    await coord.wait_for(lambda: len(coord.heartbeats) >= 1)
    away = True
    a = await FakeAgent.connect(pool, relay.addr, "agent-a")
    await a.attach(pool, 1, 0, size=2, home=True)
    await a.deposit(1, 0, 0, 1, b"to myself")
    _, payload = await a.next_data()
    assert payload == b"to myself"
    with trio.fail_after(5):
        await refused_twice.wait()
    away = False
    seen = len(coord.heartbeats)
    await coord.wait_for(lambda: len(coord.heartbeats) > seen)
