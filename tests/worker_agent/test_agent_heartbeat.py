"""The agent's heartbeats: each asks the coordinator to hold its answer for up to one interval
(so stop orders come at once), and a rank that starts is reported at once rather than at the
next interval (a held heartbeat covers only the ranks it lists)."""

from __future__ import annotations

import pytest

from .conftest import FakeCoordinator, RunningAgent, lease_for, lines

INTERVAL = 3600.0  # no heartbeat is due by the clock during a test: any second one was woken


@pytest.fixture
def coordinator() -> FakeCoordinator:
    return FakeCoordinator(heartbeat_interval=INTERVAL)


async def test_heartbeat_asks_to_be_held_for_one_interval(
    agent: RunningAgent, coordinator: FakeCoordinator
) -> None:
    first = (await coordinator.wait_for(lambda: coordinator.heartbeats))[0]
    assert first.wait == INTERVAL
    assert first.ranks == []


async def test_a_starting_rank_is_reported_at_once(
    agent: RunningAgent, coordinator: FakeCoordinator
) -> None:
    await coordinator.wait_for(lambda: coordinator.heartbeats)
    coordinator.add_lease(lease_for(coordinator, None, args=["hang"]))
    beat = await coordinator.wait_for(
        lambda: next((h for h in coordinator.heartbeats if h.ranks), None)
    )
    assert [(r.job, r.rank) for r in beat.ranks] == [(7, 0)]
    # Not ending the test (and the agent) while the rank's bundle is still being fetched.
    await coordinator.wait_for(
        lambda: [x for x in lines(coordinator.output_of(7, 0)) if "pid" in x]
    )
