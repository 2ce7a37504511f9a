"""Length-prefixed frames: ``[u32 header_len][u32 payload_len][header][payload]``.

The header is one MessagePack-encoded ``Message``; the payload is raw bytes (only ``Data`` and
``CkptChunk`` have one). Both lengths are checked against the limits the moment the 8-byte
prefix is complete, before a single byte of the body is buffered (like h11's
``max_incomplete_event_size``).

``FrameDecoder`` is the sans-IO reader: feed it bytes with ``receive_data`` and pull ``Frame``s
with ``next_frame``. Hot paths that read straight into buffers use ``parse_prefix`` directly.
"""

from __future__ import annotations

import struct
from typing import Final, NamedTuple

from vpool.protocol.errors import ErrorCode, LocalProtocolError, RemoteProtocolError
from vpool.protocol.messages import CkptChunk, Data, Message, decode, encode

PREFIX: Final = struct.Struct("!II")
PREFIX_SIZE: Final = PREFIX.size
DEFAULT_MAX_HEADER: Final = 64 * 1024
DEFAULT_MAX_PAYLOAD: Final = 1024 * 1024 * 1024


class Frame(NamedTuple):
    message: Message
    payload: bytes
    raw_header: bytes


def parse_prefix(
    prefix: bytes | bytearray | memoryview,
    *,
    max_header: int = DEFAULT_MAX_HEADER,
    max_payload: int = DEFAULT_MAX_PAYLOAD,
) -> tuple[int, int]:
    """Return ``(header_len, payload_len)`` of a frame prefix, enforcing the limits."""
    header_len, payload_len = PREFIX.unpack(prefix)
    if header_len == 0:
        raise RemoteProtocolError("frame with an empty header")
    if header_len > max_header:
        raise RemoteProtocolError(
            f"frame header of {header_len} bytes exceeds the limit of {max_header}",
            code=ErrorCode.FRAME_TOO_LARGE,
        )
    if payload_len > max_payload:
        raise RemoteProtocolError(
            f"frame payload of {payload_len} bytes exceeds the limit of {max_payload}",
            code=ErrorCode.FRAME_TOO_LARGE,
        )
    return header_len, payload_len


def frame_prefix(header_len: int, payload_len: int) -> bytes:
    return PREFIX.pack(header_len, payload_len)


def encode_frame(msg: Message, payload: bytes | bytearray | memoryview = b"") -> bytes:
    """One frame as bytes. For large payloads prefer ``frame_parts`` (no payload copy)."""
    return b"".join(frame_parts(msg, payload))


def frame_parts(
    msg: Message, payload: bytes | bytearray | memoryview = b""
) -> list[bytes | bytearray | memoryview]:
    """The pieces of one frame for a scatter/gather write: prefix+header, then payload."""
    if payload and not isinstance(msg, (Data, CkptChunk)):
        raise LocalProtocolError(f"{type(msg).__name__} carries no payload")
    header = encode(msg)
    head = PREFIX.pack(len(header), len(payload)) + header
    return [head, payload] if len(payload) else [head]


def raw_frame_parts(
    raw_header: bytes, payload: bytes | bytearray | memoryview
) -> list[bytes | bytearray | memoryview]:
    """Frame pieces re-using already-encoded header bytes (forwarding without re-encoding)."""
    head = PREFIX.pack(len(raw_header), len(payload)) + raw_header
    return [head, payload] if len(payload) else [head]


class FrameDecoder:
    """Sans-IO frame reader with limits checked before the body is read."""

    def __init__(
        self, *, max_header: int = DEFAULT_MAX_HEADER, max_payload: int = DEFAULT_MAX_PAYLOAD
    ) -> None:
        self.max_header = max_header
        self.max_payload = max_payload
        self._buf = bytearray()
        self._need: tuple[int, int] | None = None
        self._broken = False

    @property
    def buffered(self) -> int:
        return len(self._buf)

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        if self._broken:
            raise LocalProtocolError("decoder already failed; the connection must be closed")
        self._buf += data
        if self._need is None and len(self._buf) >= PREFIX_SIZE:
            self._check_prefix()

    def _check_prefix(self) -> None:
        try:
            self._need = parse_prefix(
                self._buf[:PREFIX_SIZE], max_header=self.max_header, max_payload=self.max_payload
            )
        except RemoteProtocolError:
            self._broken = True
            raise

    def wanted(self) -> int:
        """How many more bytes complete the current frame (at least 1 when nothing is known)."""
        if self._need is None:
            return max(1, PREFIX_SIZE - len(self._buf))
        return max(0, PREFIX_SIZE + self._need[0] + self._need[1] - len(self._buf))

    def next_frame(self) -> Frame | None:
        """The next complete frame, or None when more bytes are needed."""
        if self._need is None:
            if len(self._buf) < PREFIX_SIZE:
                return None
            self._check_prefix()
        assert self._need is not None
        header_len, payload_len = self._need
        end = PREFIX_SIZE + header_len + payload_len
        if len(self._buf) < end:
            return None
        raw_header = bytes(self._buf[PREFIX_SIZE : PREFIX_SIZE + header_len])
        payload = bytes(self._buf[PREFIX_SIZE + header_len : end])
        del self._buf[:end]
        self._need = None
        try:
            msg = decode(raw_header)
        except RemoteProtocolError:
            self._broken = True
            raise
        if payload_len and not isinstance(msg, (Data, CkptChunk)):
            self._broken = True
            raise RemoteProtocolError(f"{type(msg).__name__} frame must not carry a payload")
        if len(self._buf) >= PREFIX_SIZE:
            self._check_prefix()
        return Frame(msg, payload, raw_header)
