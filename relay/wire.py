"""Reading and writing whole frames on a trio stream with few copies.

``FrameReader`` returns every frame complete in what arrived, each as one buffer holding the
whole frame (prefix, header, payload) so the relay can log and forward it verbatim. Limits
are checked on the 8-byte prefix (``protocol.framing.parse_prefix``) before the body is read.
A frame larger than ``BIG`` gets its own buffer, filled in place, instead of growing the
shared one.
"""

from __future__ import annotations

from collections.abc import Sequence

import trio

from vpool.protocol.errors import RemoteProtocolError
from vpool.protocol.framing import PREFIX_SIZE, parse_prefix

Buffer = bytes | bytearray | memoryview
# A received frame: (header length, the whole frame's bytes).
RawFrame = tuple[int, bytes | bytearray]

RECEIVE_SIZE = 256 * 1024
BIG = 64 * 1024
# Small frames are joined into one write up to this size; bigger ones go out alone.
JOIN_LIMIT = 256 * 1024


class FrameReader:
    def __init__(self, stream: trio.abc.ReceiveStream, *, max_header: int, max_payload: int):
        self._stream = stream
        self.max_header = max_header
        self.max_payload = max_payload
        self._buf = bytearray()
        # A big frame being filled: its buffer, header length and how much is in.
        self._big: bytearray | None = None
        self._big_header = 0
        self._big_fill = 0

    async def read_frames(self) -> list[RawFrame]:
        """At least one frame, or ``[]`` at a clean end of stream between frames."""
        while True:
            if self._big is not None:
                frame = await self._fill_big()
                if frame is not None:
                    return [frame]
                continue
            data = await self._stream.receive_some(RECEIVE_SIZE)
            if not data:
                if self._buf:
                    raise RemoteProtocolError("connection closed in the middle of a frame")
                return []
            frames = self._parse(data)
            if frames:
                return frames

    def _parse(self, data: bytes | bytearray) -> list[RawFrame]:
        # Frames are cut straight out of ``data`` when nothing is pending, so a receive holding
        # exactly one frame costs no copy at all.
        if self._buf:
            self._buf += data
            src: bytes | bytearray = self._buf
        else:
            src = data
        out: list[RawFrame] = []
        pos, n = 0, len(src)
        while n - pos >= PREFIX_SIZE:
            header_len, payload_len = parse_prefix(
                src[pos : pos + PREFIX_SIZE],
                max_header=self.max_header,
                max_payload=self.max_payload,
            )
            size = PREFIX_SIZE + header_len + payload_len
            end = pos + size
            if end > n:
                if size > BIG:
                    big = bytearray(size)
                    have = n - pos
                    big[:have] = src[pos:n]
                    self._big, self._big_header, self._big_fill = big, header_len, have
                    pos = n
                break
            if pos == 0 and end == n and type(src) is bytes:
                out.append((header_len, src))
            else:
                out.append((header_len, bytes(src[pos:end])))
            pos = end
        if src is self._buf:
            del self._buf[:pos]
        elif pos < n:
            self._buf = bytearray(src[pos:])
        return out

    async def _fill_big(self) -> RawFrame | None:
        big = self._big
        assert big is not None
        view = memoryview(big)
        while self._big_fill < len(big):
            data = await self._stream.receive_some(min(RECEIVE_SIZE, len(big) - self._big_fill))
            if not data:
                raise RemoteProtocolError("connection closed in the middle of a frame")
            view[self._big_fill : self._big_fill + len(data)] = data
            self._big_fill += len(data)
        view.release()
        self._big = None
        return self._big_header, big


async def send_frames(stream: trio.abc.SendStream, parts: Sequence[Buffer]) -> None:
    """Send whole frames: small ones joined into few writes, big ones on their own."""
    if len(parts) == 1:
        await stream.send_all(parts[0])
        return
    pending: list[Buffer] = []
    size = 0
    for part in parts:
        n = len(part)
        if n >= BIG:
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
