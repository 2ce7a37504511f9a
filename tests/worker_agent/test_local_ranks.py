from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from vpool.protocol.api import Lease
from vpool.protocol.messages import Ack, Data
from vpool.worker_agent.local_ranks import LocalRank, Outbox
from vpool.worker_agent.wire import encode_small


class FakeLink:
    pass


async def test_outbox_coalesces_acks_and_counts_credit() -> None:
    outbox = Outbox()
    a: Any = FakeLink()
    b: Any = FakeLink()
    d1 = encode_small(Data(1, 2, 0, 1, 0, 0)) + b"xyz"
    d2 = encode_small(Data(1, 3, 0, 1, 0, 0))
    outbox.push_data([d1], len(d1), a)
    outbox.push_ack(2, encode_small(Ack(1, 0, 2, 1)))
    outbox.push_ack(2, encode_small(Ack(1, 0, 2, 5)))
    outbox.push_data([d2], len(d2), b)
    outbox.push_data([d2], len(d2), a)
    batch, credits = await outbox.take()
    assert batch == [[d1], [d2], [d2], [encode_small(Ack(1, 0, 2, 5))]]
    assert credits == {a: len(d1) + len(d2), b: len(d2)}
    outbox.close()
    with pytest.raises(trio.EndOfChannel):
        await outbox.take()


async def test_take_waits_for_frames() -> None:
    outbox = Outbox()
    got: list[Any] = []

    async def taker() -> None:
        got.append(await outbox.take())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(taker)
        await trio.testing.wait_all_tasks_blocked()
        assert got == []
        outbox.push_control(b"stop")
    assert got == [([[b"stop"]], {})]


def test_each_lease_gets_its_own_secret() -> None:
    lease = Lease(1, 0, 1, 2, "t", "b", "app.py", [], None, [], [])
    one, two = LocalRank(lease), LocalRank(lease)
    assert one.secret != two.secret and len(one.secret) >= 40
