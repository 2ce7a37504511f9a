"""vpool.framestream.FrameStream (the relay's and agent's reader): whole frames out of any split
of the byte stream, limits first, on streams that hand out bytes (TLS) and on sockets
(``recv_into``)."""

from __future__ import annotations

import itertools

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from vpool.framestream import FrameStream, send_frames
from vpool.protocol.errors import RemoteProtocolError
from vpool.protocol.framing import LARGE, PREFIX, encode_frame
from vpool.protocol.messages import Credit, Data


class Chunks(trio.abc.ReceiveStream):
    """A stream that returns the given chunks, one per receive, never more than asked."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = list(chunks)

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        await trio.lowlevel.checkpoint()
        if not self.chunks:
            return b""
        chunk = self.chunks.pop(0)
        if max_bytes is not None and len(chunk) > max_bytes:
            self.chunks.insert(0, chunk[max_bytes:])
            chunk = chunk[:max_bytes]
        return chunk

    async def aclose(self) -> None:
        pass


def frames_of(sizes: list[int]) -> list[bytes]:
    out = []
    for i, size in enumerate(sizes):
        if size < 0:
            out.append(encode_frame(Credit(job=1, rank=0, nbytes=-size)))
        else:
            payload = bytes([i % 251]) * size
            out.append(encode_frame(Data(job=1, src=0, dst=1, seq=i + 1, ctx=0, tag=0), payload))
    return out


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points) if b > a]


async def read_all(chunks: list[bytes], *, max_payload: int = 1 << 30) -> list[bytes]:
    reader = FrameStream(Chunks(chunks), max_header=65536, max_payload=max_payload)
    got: list[bytes] = []
    while frames := await reader.receive_frames():
        for header_len, frame in frames:
            assert PREFIX.unpack_from(frame)[0] == header_len
            got.append(bytes(frame))
    return got


sizes = st.lists(
    st.one_of(st.integers(-5, -1), st.integers(0, 300), st.integers(LARGE - 50, LARGE + 3000)),
    min_size=1,
    max_size=8,
)


@settings(max_examples=60)
@given(sizes, st.lists(st.integers(0, 10**6), max_size=30))
def test_any_split_gives_back_the_frames(sizes: list[int], cuts: list[int]) -> None:
    frames = frames_of(sizes)
    data = b"".join(frames)
    assert trio.run(read_all, split(data, cuts)) == frames


async def test_limits_are_checked_on_the_prefix() -> None:
    # Only the prefix arrives: the reader must refuse before waiting for a body.
    with pytest.raises(RemoteProtocolError) as info:
        await read_all([PREFIX.pack(10, 1001)], max_payload=1000)
    assert info.value.code == "frame_too_large"


async def test_end_of_stream_inside_a_frame() -> None:
    frame = frames_of([LARGE * 2])[0]
    with pytest.raises(RemoteProtocolError):
        await read_all([frame[:1000]])
    with pytest.raises(RemoteProtocolError):
        await read_all([frame[:5]])


async def test_a_socket_receives_into_the_scanner_and_frames_decode() -> None:
    a, b = trio.socket.socketpair()
    sender, receiver = trio.SocketStream(a), trio.SocketStream(b)
    frames = frames_of([-3, 10, LARGE * 4 + 7, 0, 200])
    reader = FrameStream(receiver)
    assert reader._recv_into is not None  # the zero-copy path is the one under test
    got = []
    async with trio.open_nursery() as nursery:

        async def send() -> None:
            await send_frames(sender, frames)
            await sender.aclose()

        nursery.start_soon(send)
        while (frame := await reader.receive()) is not None:
            got.append(frame)
    await receiver.aclose()
    assert [bytes(f.frame) for f in got] == frames
    assert type(got[0].message) is Credit and got[0].payload_len == 0
    assert [f.payload_len for f in got[1:]] == [10, LARGE * 4 + 7, 0, 200]
    assert all(type(f.message) is Data and f.size == len(f.frame) for f in got[1:])


@settings(max_examples=40)
@given(sizes, st.lists(st.integers(0, 10**6), max_size=30), st.integers(0, 3))
def test_admit_sees_each_large_frame_first_and_changes_nothing(
    sizes: list[int], cuts: list[int], cancel_every: int
) -> None:
    """``admit`` (the agent's budget) is awaited with each large frame's size before a buffer
    is taken for it, after the frames before it were given out; cancelled there (a rank's
    connection torn down), the reader picks up where it was."""
    frames = frames_of(sizes)

    async def main() -> tuple[list[bytes], list[tuple[str, int]]]:
        reader = FrameStream(Chunks(split(b"".join(frames), cuts)), max_payload=1 << 30)
        seen: list[tuple[str, int]] = []
        calls = 0

        async def admit(size: int) -> None:
            nonlocal calls
            calls += 1
            seen.append(("admit", size))
            if cancel_every and calls % (cancel_every + 1) == 0:
                scope.cancel()  # torn down while it waits; the reader is asked again
            await trio.lowlevel.checkpoint()

        reader.admit = admit
        got: list[bytes] = []
        while True:
            with trio.CancelScope() as scope:
                batch = await reader.receive_frames()
                if not batch:
                    return got, seen
                for _, frame in batch:
                    seen.append(("frame", len(frame)))
                    got.append(bytes(frame))

    got, seen = trio.run(main)
    assert got == frames
    large = [len(f) for f, size in zip(frames, sizes, strict=True) if size > LARGE]
    admitted = [n for what, n in seen if what == "admit"]
    assert sorted(set(admitted)) == sorted(set(large))
    # Each large frame comes out right after it was admitted, never before.
    for i, (what, n) in enumerate(seen):
        if what == "frame" and n in large:
            assert ("admit", n) in seen[:i]
