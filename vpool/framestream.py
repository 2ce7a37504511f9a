"""Frames on trio streams: the relay's and the agent's shell around ``protocol.framing``.

``FrameStream`` runs a ``FrameScanner`` over a trio stream. On a plain socket it receives
straight into the scanner's buffer (``recv_into``); on a TLS stream, which hands out bytes, it
reads at most what the scanner can take. Every frame comes out whole, as one buffer holding
prefix, header and payload, so it can be logged and forwarded verbatim: a small frame is one
copy out of the scanner's buffer, a large one (payload above ``framing.LARGE``) is received
into its own buffer, never copied again.

``send_frames`` writes frames with few system calls: small pieces joined into one write, big
payloads on their own.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import NamedTuple

import trio

from vpool.protocol.framing import (
    DEFAULT_MAX_HEADER,
    DEFAULT_MAX_PAYLOAD,
    LARGE,
    PREFIX_SIZE,
    Buffer,
    FrameScanner,
    Large,
    Small,
    decode_head,
)
from vpool.protocol.messages import Message

# A whole frame as received: (header length, the frame's bytes: prefix, header, payload).
RawFrame = tuple[int, bytes | bytearray]

# Small frames are joined into one write up to this size; bigger pieces go out alone.
JOIN_LIMIT = 256 * 1024


class WireFrame(NamedTuple):
    """A received frame with its message decoded (and checked against its payload)."""

    message: Message
    frame: bytes | bytearray  # the whole frame, to forward verbatim
    header_len: int
    payload_len: int

    @property
    def size(self) -> int:
        return len(self.frame)

    @property
    def parts(self) -> list[Buffer]:
        """The frame as the pieces of a scatter/gather write."""
        return [self.frame]


class FrameStream:
    """Whole frames off a trio stream, the limits checked on each prefix."""

    def __init__(
        self,
        stream: trio.abc.ReceiveStream,
        *,
        max_header: int = DEFAULT_MAX_HEADER,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
    ) -> None:
        self._stream = stream
        self.scanner = FrameScanner(max_header=max_header, max_payload=max_payload)
        sock = getattr(stream, "socket", None)
        self._recv_into = getattr(sock, "recv_into", None)
        self._ready: deque[RawFrame] = deque()
        # Called with a large frame's size once its prefix is in, before a buffer is taken for
        # it: the agent waits there until the rank's budget has room (``LocalRank.room_for``).
        self.admit: Callable[[int], Awaitable[None]] | None = None
        self._large: Large | None = None  # a large frame's prefix, held for ``admit``
        # trio's clock at the latest read that brought bytes (-inf before any): what a
        # liveness watch (``protocol.liveness``) counts as hearing from the peer.
        self.last_read = -math.inf

    async def receive_frames(self) -> list[RawFrame]:
        """At least one whole frame, or ``[]`` at a clean end of stream between frames."""
        scanner = self.scanner
        out: list[RawFrame] = []
        while True:
            while (event := self._large or scanner.next_event()) is not None:
                if type(event) is Small:
                    out.append((event.header_len, bytes(event.frame)))
                elif type(event) is Large:
                    size = event.head.nbytes + event.payload_len
                    if self.admit is not None:
                        self._large = event  # kept across a return or a cancellation
                        if out:
                            return out  # the frames before it go first
                        await self.admit(size)
                        self._large = None
                    scanner.claim(bytearray(size), whole=True)
                else:
                    target = event.target
                    assert isinstance(target, bytearray)
                    out.append((event.header_len, target))
            if out:
                return out
            buf = scanner.get_buffer()
            if self._recv_into is not None:
                try:
                    n = await self._recv_into(buf)
                except OSError as exc:  # as trio.SocketStream.receive_some reports it
                    raise trio.BrokenResourceError(f"{type(exc).__name__}: {exc}") from exc
            else:
                data = await self._stream.receive_some(len(buf))
                n = len(data)
                buf[:n] = data
            if not n:
                scanner.eof()
                return []
            self.last_read = trio.current_time()
            scanner.buffer_updated(n)

    async def receive_raw(self) -> RawFrame | None:
        """The next whole frame; None when the peer closed cleanly between frames."""
        if not self._ready:
            self._ready.extend(await self.receive_frames())
            if not self._ready:
                return None
        return self._ready.popleft()

    async def receive(self) -> WireFrame | None:
        """The next frame, decoded; None when the peer closed cleanly between frames."""
        raw = await self.receive_raw()
        if raw is None:
            return None
        header_len, frame = raw
        payload_len = len(frame) - PREFIX_SIZE - header_len
        return WireFrame(
            decode_head(frame, header_len, payload_len), frame, header_len, payload_len
        )


async def send_frames(stream: trio.abc.SendStream, parts: Sequence[Buffer]) -> None:
    """Send whole frames: small pieces joined into few writes, big ones on their own."""
    if len(parts) == 1:
        await stream.send_all(parts[0])
        return
    pending: list[Buffer] = []
    size = 0
    for part in parts:
        n = len(part)
        if n > LARGE:
            if pending:
                await stream.send_all(b"".join(pending))
                pending, size = [], 0
            await stream.send_all(part)
            continue
        pending.append(part)
        size += n
        if size >= JOIN_LIMIT:
            await stream.send_all(b"".join(pending))
            pending, size = [], 0
    if pending:
        await stream.send_all(pending[0] if len(pending) == 1 else b"".join(pending))
