"""The bounded send queue of one relay connection."""

from __future__ import annotations

import trio

from vpool.worker_agent import relay_writer
from vpool.worker_agent.relay_writer import FrameWriter


class GatedStream(trio.abc.SendStream):
    """Takes writes only while ``open`` is set; records what it got."""

    def __init__(self) -> None:
        self.open = trio.Event()
        self.got: list[bytes] = []

    async def send_all(self, data) -> None:
        await self.open.wait()
        self.got.append(bytes(data))

    async def wait_send_all_might_not_block(self) -> None:
        await self.open.wait()

    async def aclose(self) -> None:
        pass


async def test_every_sender_waiting_for_room_gets_through(monkeypatch) -> None:
    # Regression: each waiting sender used to replace the shared "room" event, stranding the
    # senders that waited on the one it replaced (a replaying rank then hung its agent).
    monkeypatch.setattr(relay_writer, "QUEUE", 2)
    stream = GatedStream()
    writer = FrameWriter(stream, "relay test")
    senders = 4
    per_sender = 6
    async with trio.open_nursery() as nursery:
        nursery.start_soon(writer.run)

        async def sender(i: int) -> None:
            for k in range(per_sender):
                await writer.put([b"%d-%d;" % (i, k)])

        with trio.fail_after(10):
            async with trio.open_nursery() as inner:
                for i in range(senders):
                    inner.start_soon(sender, i)
                await trio.testing.wait_all_tasks_blocked()
                stream.open.set()  # the relay reads again: every sender must finish
            await trio.testing.wait_all_tasks_blocked()  # the writer drained the queue
        writer.close()
    sent = b"".join(stream.got).split(b";")[:-1]
    assert sorted(sent) == sorted(
        b"%d-%d" % (i, k) for i in range(senders) for k in range(per_sender)
    )
    for i in range(senders):  # each sender's frames stay in order
        mine = [s for s in sent if s.startswith(b"%d-" % i)]
        assert mine == [b"%d-%d" % (i, k) for k in range(per_sender)]


async def test_lazy_frames_wait_for_their_delay_then_go_in_one_write(
    autojump_clock: trio.testing.MockClock,
) -> None:
    stream = GatedStream()
    stream.open.set()
    writer = FrameWriter(stream, "relay test")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(writer.run)
        for k in range(3):
            await writer.put_lazy([b"lazy-%d;" % k])
        await trio.sleep(relay_writer.LAZY_DELAY * 0.9)
        await trio.testing.wait_all_tasks_blocked()
        assert stream.got == []  # waiting for company
        await trio.sleep(relay_writer.LAZY_DELAY * 0.2)
        await trio.testing.wait_all_tasks_blocked()
        assert stream.got == [b"lazy-0;lazy-1;lazy-2;"]
        writer.close()


async def test_a_frame_put_the_usual_way_takes_the_lazy_ones_along_ahead_of_it() -> None:
    stream = GatedStream()
    stream.open.set()
    writer = FrameWriter(stream, "relay test")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(writer.run)
        await writer.put_lazy([b"0->1#1;"])
        await writer.put_lazy([b"0->1#2;"])
        await writer.put([b"0->1#3;"])  # the channel's next message: it must not overtake
        await trio.testing.wait_all_tasks_blocked()
        assert b"".join(stream.got) == b"0->1#1;0->1#2;0->1#3;"
        writer.close()


async def test_lazy_frames_go_at_once_when_enough_gathered(monkeypatch) -> None:
    monkeypatch.setattr(relay_writer, "LAZY_BYTES", 10)
    stream = GatedStream()
    stream.open.set()
    writer = FrameWriter(stream, "relay test")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(writer.run)
        await writer.put_lazy([b"12345;"])
        await trio.testing.wait_all_tasks_blocked()
        assert stream.got == []
        await writer.put_lazy([b"67890;"])
        await trio.testing.wait_all_tasks_blocked()
        assert b"".join(stream.got) == b"12345;67890;"
        writer.close()
