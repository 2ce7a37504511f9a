"""Reading and writing frames on trio streams, for forwarding without re-encoding.

Every message the agent proxies passes through here, so the reader keeps per-frame work small:
it reads the 8-byte prefix, checks the limits, then exactly the body. A small frame comes back
as one ``bytes`` object holding the whole frame (prefix, header, payload) so it can be forwarded
with a single write; a large one as ``[prefix+header, payload]`` where the payload was read
straight into its own buffer (``recv_into`` on plain sockets), never copied again.
"""

from __future__ import annotations

from typing import NamedTuple

import trio

from vpool.protocol.errors import RemoteProtocolError
from vpool.protocol.framing import (
    DEFAULT_MAX_HEADER,
    DEFAULT_MAX_PAYLOAD,
    PREFIX_SIZE,
    parse_prefix,
)
from vpool.protocol.messages import Data, Message, decode, encode

Buffer = bytes | bytearray | memoryview

# Frames up to this size are read into, and forwarded as, one bytes object.
SMALL_FRAME = 64 * 1024
# receive_some() size: below glibc's mmap threshold so each read is a cheap malloc.
_CHUNK = 64 * 1024
# receive_some() size inside a large payload (TLS streams, which have no recv_into): fewer,
# larger reads; the payload buffer is allocated already, so no malloc per read to keep cheap.
_PAYLOAD_CHUNK = 1024 * 1024


class WireFrame(NamedTuple):
    message: Message
    parts: list[Buffer]  # the frame exactly as received: [whole] or [prefix+header, payload]
    size: int  # bytes of the whole frame, prefix included (what Credit counts)
    payload_len: int


class FrameReader:
    """Pulls whole frames off a trio stream, enforcing the size limits on the prefix."""

    def __init__(
        self,
        stream: trio.abc.ReceiveStream,
        *,
        max_header: int = DEFAULT_MAX_HEADER,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
    ) -> None:
        self._stream = stream
        self._buf = bytearray()
        self.max_header = max_header
        self.max_payload = max_payload
        sock = getattr(stream, "socket", None)
        self._recv_into = getattr(sock, "recv_into", None)

    async def _fill(self, n: int) -> bool:
        """Make at least ``n`` bytes available; False at end of stream with nothing buffered."""
        buf = self._buf
        while len(buf) < n:
            chunk = await self._stream.receive_some(max(_CHUNK, n - len(buf)))
            if not chunk:
                if buf:
                    raise RemoteProtocolError(
                        f"connection closed inside a frame ({len(buf)} of {n} bytes)"
                    )
                return False
            buf += chunk
        return True

    async def receive(self) -> WireFrame | None:
        """The next frame, or None when the peer closed cleanly between frames."""
        if not await self._fill(PREFIX_SIZE):
            return None
        buf = self._buf
        header_len, payload_len = parse_prefix(
            buf[:PREFIX_SIZE], max_header=self.max_header, max_payload=self.max_payload
        )
        head_end = PREFIX_SIZE + header_len
        total = head_end + payload_len
        if total <= SMALL_FRAME:
            await self._fill(total)
            frame = _take(buf, total)
            msg = decode(memoryview(frame)[PREFIX_SIZE:head_end])
            parts: list[Buffer] = [frame]
        else:
            await self._fill(head_end)
            head = _take(buf, head_end)
            msg = decode(memoryview(head)[PREFIX_SIZE:])
            parts = [head, await self._read_payload(payload_len)]
        if payload_len and not isinstance(msg, Data):
            raise RemoteProtocolError(f"{type(msg).__name__} frame must not carry a payload")
        return WireFrame(msg, parts, total, payload_len)

    async def _read_payload(self, n: int) -> bytearray:
        payload = bytearray(n)
        view = memoryview(payload)
        have = min(n, len(self._buf))
        view[:have] = self._buf[:have]
        del self._buf[:have]
        while have < n:
            if self._recv_into is not None:
                got = await self._recv_into(view[have:])
            else:
                chunk = await self._stream.receive_some(min(n - have, _PAYLOAD_CHUNK))
                got = len(chunk)
                view[have : have + got] = chunk
            if not got:
                raise RemoteProtocolError(f"connection closed inside a payload ({have} of {n})")
            have += got
        return payload


def _take(buf: bytearray, n: int) -> bytes:
    """Remove and return the first ``n`` bytes of ``buf`` with a single copy."""
    with memoryview(buf) as view:
        out = view[:n].tobytes()
    # Cheap: a bytearray deletes from the front by moving its start pointer.
    del buf[:n]
    return out


def encode_small(msg: Message) -> bytes:
    """One payload-less frame as bytes."""
    header = encode(msg)
    return len(header).to_bytes(4, "big") + b"\0\0\0\0" + header


async def send_parts(stream: trio.abc.SendStream, items: list[list[Buffer]]) -> None:
    """Write several frames: small pieces are joined into one write, big payloads go alone."""
    small: list[Buffer] = []
    for parts in items:
        for part in parts:
            if len(part) > SMALL_FRAME:
                if small:
                    await stream.send_all(b"".join(small))
                    small = []
                await stream.send_all(part)
            else:
                small.append(part)
    if small:
        await stream.send_all(small[0] if len(small) == 1 else b"".join(small))
