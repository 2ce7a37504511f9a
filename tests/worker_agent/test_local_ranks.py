from __future__ import annotations

import socket
from typing import Any

import pytest
import trio
import trio.testing

from vpool.protocol.api import Lease
from vpool.protocol.framing import encode_frame
from vpool.protocol.messages import Ack, Data
from vpool.worker_agent.local_ranks import LocalRank, Outbox


class FakeLink:
    pass


async def test_outbox_coalesces_acks_and_counts_credit() -> None:
    outbox = Outbox()
    a: Any = FakeLink()
    b: Any = FakeLink()
    d1 = encode_frame(Data(1, 2, 0, 1, 0, 0)) + b"xyz"
    d2 = encode_frame(Data(1, 3, 0, 1, 0, 0))
    outbox.push_data([d1], len(d1), a)
    outbox.push_ack(2, encode_frame(Ack(1, 0, 2, 1)))
    outbox.push_ack(2, encode_frame(Ack(1, 0, 2, 5)))
    outbox.push_data([d2], len(d2), b)
    outbox.push_data([d2], len(d2), a)
    batch, credits = await outbox.take()
    assert batch == [[d1], [d2], [d2], [encode_frame(Ack(1, 0, 2, 5))]]
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


class CreditLink:
    def __init__(self, batch: int) -> None:
        self.credit_batch = batch


def _socketpair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    return a, b


def test_write_through_goes_straight_into_an_idle_socket() -> None:
    outbox = Outbox()
    link: Any = CreditLink(batch=10)
    written: list[tuple[Any, int]] = []
    a, b = _socketpair()
    with a, b:
        outbox.set_socket(a.fileno(), lambda lk, n: written.append((lk, n)))
        frame = encode_frame(Data(1, 2, 0, 1, 0, 0))
        outbox.push_data([frame[:5], frame[5:]], len(frame), link)
        assert b.recv(1000) == frame
        assert written == [(link, len(frame))]
        # Held credit adds up until the link's batch size is reached.
        assert outbox.credit_due(link, 4) == 0
        assert outbox.credit_due(link, 7) == 11


async def test_write_through_keeps_order_behind_queued_frames() -> None:
    outbox = Outbox()
    link: Any = CreditLink(batch=0)
    a, b = _socketpair()
    with a, b:
        outbox.set_socket(a.fileno(), lambda lk, n: None)
        outbox.push_control(b"first")
        outbox.push_data([b"second"], 6, link)  # queued: the control frame is ahead of it
        batch, credits = await outbox.take()
        assert batch == [[b"first"], [b"second"]] and credits == {link: 6}
        assert outbox.busy
        outbox.push_data([b"third"], 5, link)  # the writer is busy: queued too
        with pytest.raises(BlockingIOError):
            b.recv(100)
        outbox.busy = False
        assert (await outbox.take())[0] == [[b"third"]]


def test_write_through_queues_what_a_full_socket_does_not_take() -> None:
    outbox = Outbox()
    link: Any = CreditLink(batch=0)
    a, b = _socketpair()
    with a, b:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        written: list[int] = []
        outbox.set_socket(a.fileno(), lambda lk, n: written.append(n))
        big = bytes(range(256)) * 4096
        outbox.push_data([b"head", big], 4 + len(big), link)
        assert written == []
        got = b.recv(len(big) * 2)
        rest = outbox._frames[0][0]
        assert got + b"".join(bytes(p) for p in rest) == b"head" + big
