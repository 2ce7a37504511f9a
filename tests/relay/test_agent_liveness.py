"""The relay's side of liveness: it answers Pings, closes a connection of a pinging agent that
brought nothing for ``agent_idle_timeout`` (its ranks then go through ``lost_grace`` and are
reported lost), and never closes one of an agent too old to ping for being quiet."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from relay_fakes import DEADLINE, FakeAgent, FakeCoordinator, Pool, start_relay

from vpool.protocol.messages import PROTOCOL_VERSION, Hello, Ping, Pong, Welcome


async def _connect(pool: Pool, addr: tuple[str, int], agent: str, *, pings: bool) -> FakeAgent:
    conn = await FakeAgent.connect(pool, addr, agent, hello=False)
    await conn.send(
        Hello(version=PROTOCOL_VERSION, role="agent", token=pool.agent_token(agent), pings=pings)
    )
    conn.welcome = await conn.expect(Welcome)
    assert conn.welcome.pings
    return conn


async def test_a_silent_connection_is_closed_and_its_ranks_lost(
    pool: Pool, nursery: trio.Nursery, tmp_path: Path, agents: object
) -> None:
    coord = FakeCoordinator(pool)
    settings = pool.settings(
        tmp_path / "relay",
        coordinator_url="http://coord",
        relay_key="s3cret",
        agent_idle_timeout=0.5,
        lost_grace=0.2,
    )
    relay = await start_relay(nursery, settings, coordinator_transport=coord.transport)
    old = await _connect(pool, relay.addr, "agent-old", pings=False)
    await old.attach(pool, 1, 1, size=2, home=True)
    silent = await _connect(pool, relay.addr, "agent-a", pings=True)
    await silent.attach(pool, 1, 0, size=2, home=True)
    await silent.send(Ping(nonce=5))
    assert await silent.expect(Pong) == Pong(nonce=5)

    quiet_from = trio.current_time()
    with pytest.raises(EOFError):
        await silent.recv()
    closed = trio.current_time() - quiet_from
    print(f"relay closed the silent connection after {closed:.2f} s")
    assert 0.5 <= closed <= 0.5 + 1.5
    await coord.wait_for(lambda: bool(coord.lost))
    [lost] = coord.lost
    assert (lost.job, lost.rank) == (1, 0)
    assert "nothing from the agent for" in lost.reason, lost.reason
    assert trio.current_time() - quiet_from >= 0.5 + 0.2

    # The agent that does not ping was as quiet all along, and is still served.
    await old.send(Ping(nonce=6))
    assert await old.expect(Pong) == Pong(nonce=6)


async def test_an_agent_that_pings_is_never_closed(
    pool: Pool, nursery: trio.Nursery, tmp_path: Path, agents: object
) -> None:
    settings = pool.settings(tmp_path / "relay", agent_idle_timeout=1.0)
    relay = await start_relay(nursery, settings, signing_key=pool.key.public_key())
    agent = await _connect(pool, relay.addr, "agent-a", pings=True)
    await agent.attach(pool, 1, 0, size=2, home=True)
    # Three idle timeouts long, a Ping every 0.2 s and nothing else.
    with trio.fail_after(DEADLINE):
        for nonce in range(1, 16):
            await trio.sleep(0.2)
            await agent.send(Ping(nonce=nonce))
            assert await agent.expect(Pong) == Pong(nonce=nonce)
    assert len(relay.hub.connections) == 1
