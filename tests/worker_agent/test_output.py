from __future__ import annotations

import httpx
import msgspec
import trio
import trio.lowlevel
import trio.testing

from vpool.protocol.api import Lease, OutputBatch, OutputChunk
from vpool.worker_agent.coordinator import CoordinatorClient
from vpool.worker_agent.output import OutputPump

LEASE = Lease(
    job=1,
    rank=2,
    incarnation=3,
    size=4,
    token="",
    bundle="",
    entry="",
    args=[],
    stdin=None,
    relays=[],
    homes=[],
)


async def test_offsets_are_contiguous() -> None:
    posted: list[OutputBatch] = []

    async def post(batch: OutputBatch) -> None:
        posted.append(batch)

    out_send, out_recv = trio.testing.memory_stream_one_way_pair()
    err_send, err_recv = trio.testing.memory_stream_one_way_pair()
    pump = OutputPump(LEASE, post, batch_bytes=1000, max_post=700)
    sent = b"".join(bytes([i % 251]) * 300 for i in range(20))

    async def write() -> None:
        for i in range(0, len(sent), 300):
            await out_send.send_all(sent[i : i + 300])
            await trio.lowlevel.checkpoint()
        await err_send.send_all(b"oops\n")
        await out_send.aclose()
        await err_send.aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(write)
        nursery.start_soon(pump.run, out_recv, err_recv)
    offset = 0
    for c in (c for b in posted for c in b.chunks if c.stream == "stdout"):
        assert (c.job, c.rank, c.incarnation) == (1, 2, 3)
        assert c.offset == offset and 0 < len(c.data) <= 700
        assert c.data == sent[offset : offset + len(c.data)]
        offset += len(c.data)
    assert offset == len(sent)
    assert pump.offsets == {"stdout": len(sent), "stderr": 5}
    assert pump.done.is_set()


async def test_output_post_is_resent_unchanged(autojump_clock: object) -> None:
    bodies: list[bytes] = []

    async def flaky(request: httpx.Request) -> httpx.Response:
        bodies.append(request.content)
        if len(bodies) < 3:
            return httpx.Response(503, json={"error": {"code": "busy", "message": "later"}})
        return httpx.Response(200, json={})

    batch = OutputBatch(chunks=[OutputChunk(1, 2, 3, "stdout", 40, b"hello")])
    async with CoordinatorClient("https://c.invalid", transport=httpx.MockTransport(flaky)) as c:
        await c.post_output(batch)
    assert len(bodies) == 3 and len(set(bodies)) == 1
    assert msgspec.json.decode(bodies[0], type=OutputBatch) == batch
