"""The agent's heartbeats: each asks the coordinator to hold its answer for up to one interval
(so stop orders come at once), and a rank that starts is reported at once rather than at the
next interval (a held heartbeat covers only the ranks it lists); an answer with stop orders is
followed by the next heartbeat soon."""

from __future__ import annotations

import pytest

from vpool.protocol import api

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


class _StopsOnceTold(FakeCoordinator):
    """Hands its stop orders (``held``) out only in the answer to the heartbeat that tells the
    agent's capability: the last heartbeat due before the interval, so any after it was woken."""

    held: list[api.StopOrder] = []

    def _told(self) -> bool:
        return bool(self.heartbeats and self.heartbeats[-1].fingerprint)

    @property  # type: ignore[override]
    def pending_stops(self) -> list[api.StopOrder]:
        return self.held if self._told() else []

    @pending_stops.setter
    def pending_stops(self, value: list[api.StopOrder]) -> None:
        if self._told():
            self.held = value


class TestStopOrders:
    @pytest.fixture
    def coordinator(self) -> FakeCoordinator:
        coordinator = _StopsOnceTold(heartbeat_interval=INTERVAL)
        coordinator.held = [api.StopOrder(99, 0, 1, "the rank was declared failed")]
        return coordinator

    async def test_an_answer_with_stop_orders_is_followed_by_a_heartbeat_soon(
        self, agent: RunningAgent, coordinator: FakeCoordinator
    ) -> None:
        # A stop order may be followed at once by more news (the failure of the rank it
        # stopped, which the other ranks here must hear): the next heartbeat goes within a
        # fraction of a second, not at the next interval (an hour here).
        told = await coordinator.wait_for(
            lambda: next((i for i, h in enumerate(coordinator.heartbeats) if h.fingerprint), None)
        )
        assert isinstance(coordinator, _StopsOnceTold)
        await coordinator.wait_for(lambda: not coordinator.held)  # went in that answer
        await coordinator.wait_for(lambda: len(coordinator.heartbeats) > told + 1)
