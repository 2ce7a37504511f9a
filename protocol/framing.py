"""Length-prefixed frames: ``[u32 header_len][u32 payload_len][header][payload]``.

The header is one MessagePack-encoded ``Message``; the payload is raw bytes (only ``Data`` and
``CkptChunk`` have one). Both lengths are checked against the limits the moment the 8-byte
prefix is complete, before a single byte of the body is buffered (like h11's
``max_incomplete_event_size``).

``FrameScanner`` is the one reader of frames: every shell (relay, agent, store, checkpoint
store client, rank runtime, ``vsdk mpiexec``) feeds it the bytes it receives and takes whole
frames out, so the tests that split a stream at every byte cover the code that runs. It is
sans-IO and zero-copy in the style of asyncio's ``BufferedProtocol``: the shell receives into
``get_buffer()`` (``recv_into``) or copies what a stream handed it with ``feed``, reports
``buffer_updated(n)``, then calls ``next_event()`` until it returns None:

- ``Small(header_len, payload_len, frame)``: a whole frame (prefix, header, payload) as a view
  of the scanner's buffer, valid until the next ``get_buffer``/``feed``;
- ``Large(header_len, payload_len, head)``: the prefix and header of a frame whose payload is
  above ``large``; before anything else the shell calls ``claim(target)`` with a writable
  buffer of ``payload_len`` bytes (the user's receive buffer, a file chunk...) or of the whole
  frame's size (``whole=True``: the head is copied in first, for relays that log and forward
  frames verbatim); the payload then lands there, ``get_buffer`` handing out its unfilled rest.
  Or ``take_payload()``: the shell reads the payload itself (into file buffers, from beneath
  TLS), reading no more than ``needed()`` before it;
- ``Payload(header_len, payload_len, target)``: the claimed buffer is full.

``FrameDecoder`` is the convenience on top for tests and simple readers: bytes in, decoded
``Frame``s out.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Final, NamedTuple

import msgspec

from vpool.protocol.errors import ErrorCode, LocalProtocolError, RemoteProtocolError
from vpool.protocol.messages import CkptChunk, Data, Message, decode, encode

PREFIX: Final = struct.Struct("!II")
_struct_encoder = msgspec.msgpack.Encoder()
PREFIX_SIZE: Final = PREFIX.size
DEFAULT_MAX_HEADER: Final = 64 * 1024
DEFAULT_MAX_PAYLOAD: Final = 1024 * 1024 * 1024


class Small(NamedTuple):
    header_len: int
    payload_len: int
    frame: memoryview  # the whole frame; a view of the scanner's buffer


class Large(NamedTuple):
    header_len: int
    payload_len: int
    head: memoryview  # prefix and header; a view of the scanner's buffer


class Payload(NamedTuple):
    header_len: int
    payload_len: int
    target: Buffer  # what ``claim`` was given, now filled


Event = Small | Large | Payload
Buffer = bytes | bytearray | memoryview

# Payloads above this go into a buffer the shell claims instead of the scanner's own.
LARGE: Final = 64 * 1024


class FrameScanner:
    """Finds whole frames in received bytes, with few copies (see the module docstring)."""

    __slots__ = (
        "_broken",
        "_buf",
        "_claim",
        "_end",
        "_fill",
        "_head",
        "_pos",
        "_target",
        "_view",
        "large",
        "max_header",
        "max_payload",
    )

    def __init__(
        self,
        *,
        max_header: int = DEFAULT_MAX_HEADER,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
        large: int = LARGE,
        buffer_size: int = 0,
    ) -> None:
        self.max_header = max_header
        self.max_payload = max_payload
        self.large = large
        # Room for the largest frame kept in the buffer (prefix, header, a payload up to
        # ``large``), twice, so reads stay big while a partial frame waits at the end.
        size = max(buffer_size, 2 * (PREFIX_SIZE + max_header + large))
        self._buf = bytearray(size)
        self._view = memoryview(self._buf)
        self._pos = 0  # first byte not yet scanned
        self._end = 0  # end of the received bytes
        self._claim: tuple[int, int] | None = None  # a Large given out, not yet claimed
        self._target: memoryview | None = None  # where a claimed payload goes
        self._fill = 0  # bytes of the target filled
        self._head: tuple[int, int, Buffer] | None = None  # header/payload len, target object
        self._broken = False

    def set_limits(self, *, max_header: int, max_payload: int) -> None:
        """New limits for the frames to come (a server raises them once a peer has
        authenticated); the buffer grows when the largest small frame no longer fits twice."""
        self.max_header = max_header
        self.max_payload = max_payload
        size = 2 * (PREFIX_SIZE + max_header + self.large)
        if size > len(self._buf):
            n = self._end - self._pos
            buf = bytearray(size)
            buf[:n] = self._view[self._pos : self._end]
            self._buf, self._view = buf, memoryview(buf)
            self._pos, self._end = 0, n

    @property
    def pending(self) -> int:
        """Bytes of a frame received but not yet given out (0: between frames)."""
        n = self._end - self._pos
        if self._target is not None:
            n += self._fill or 1
        return n

    def get_buffer(self) -> memoryview:
        """Where the next received bytes go (never empty)."""
        if self._broken:
            raise LocalProtocolError("the scanner failed: the connection must be closed")
        target = self._target
        if target is not None and self._fill < len(target):
            return target[self._fill :]
        if self._claim is not None:
            raise LocalProtocolError("a Large frame must be claimed before reading on")
        pos, end = self._pos, self._end
        if pos == end:
            self._pos = self._end = pos = end = 0
        elif len(self._buf) - end < PREFIX_SIZE + self.max_header + self.large:
            n = end - pos
            self._view[:n] = self._view[pos:end]
            self._pos, self._end = 0, n
            end = n
        return self._view[end:]

    def buffer_updated(self, n: int) -> None:
        """``n`` bytes were written at the start of the last ``get_buffer()``."""
        target = self._target
        if target is not None and self._fill < len(target):
            self._fill += n
        else:
            self._end += n

    def feed(self, data: Buffer) -> None:
        """Copy received bytes in (for streams that hand out bytes: TLS). Read at most
        ``len(get_buffer())`` bytes at a time and take the events before the next read."""
        view = memoryview(data).cast("B")
        while len(view):
            buf = self.get_buffer()
            k = min(len(buf), len(view))
            if k == 0:
                raise LocalProtocolError("fed more than the scanner can hold: take events first")
            buf[:k] = view[:k]
            self.buffer_updated(k)
            view = view[k:]

    def next_event(self) -> Event | None:
        """The next frame (or part of a large one), or None when more bytes are needed."""
        if self._claim is not None:
            raise LocalProtocolError("a Large frame must be claimed before the next event")
        target = self._target
        if target is not None:
            if self._fill < len(target):
                return None
            head = self._head
            assert head is not None
            self._target = self._head = None
            self._fill = 0
            target.release()
            return Payload(head[0], head[1], head[2])
        pos, end = self._pos, self._end
        if end - pos < PREFIX_SIZE:
            return None
        try:
            hlen, plen = parse_prefix(
                self._view[pos : pos + PREFIX_SIZE],
                max_header=self.max_header,
                max_payload=self.max_payload,
            )
        except RemoteProtocolError:
            self._broken = True
            raise
        body = pos + PREFIX_SIZE + hlen
        if plen > self.large:
            if body > end:
                return None
            self._claim = (hlen, plen)
            return Large(hlen, plen, self._view[pos:body])
        fend = body + plen
        if fend > end:
            return None
        self._pos = fend
        return Small(hlen, plen, self._view[pos:fend])

    def claim(self, target: Buffer, *, whole: bool = False) -> None:
        """Where the payload of the ``Large`` just given out goes: ``target`` holds exactly the
        payload, or (``whole``) the whole frame, whose head is then copied in first."""
        if self._claim is None:
            raise LocalProtocolError("nothing to claim")
        hlen, plen = self._claim
        view = memoryview(target).cast("B")
        head = PREFIX_SIZE + hlen
        want = head + plen if whole else plen
        if view.readonly or len(view) != want:
            view.release()
            raise LocalProtocolError(f"a claimed buffer must be writable and hold {want} bytes")
        self._claim = None
        pos = self._pos
        fill = 0
        if whole:
            view[:head] = self._view[pos : pos + head]
            fill = head
        pos += head
        have = min(self._end - pos, plen)
        view[fill : fill + have] = self._view[pos : pos + have]
        self._pos = pos + have
        self._target = view
        self._fill = fill + have
        self._head = (hlen, plen, target)

    def needed(self) -> int:
        """How many more bytes make the next event (for shells that must not read past a
        frame's head: a store reads a chunk's payload from beneath TLS). At least 1."""
        target = self._target
        if target is not None and self._fill < len(target):
            return len(target) - self._fill
        have = self._end - self._pos
        if have < PREFIX_SIZE:
            return PREFIX_SIZE - have
        hlen, plen = PREFIX.unpack_from(self._view, self._pos)
        want: int = PREFIX_SIZE + hlen + (0 if plen > self.large else plen)
        return max(1, want - have)

    def take_payload(self) -> memoryview:
        """Instead of ``claim``: the shell reads the payload of the ``Large`` just given out
        itself. Returns the part of it received already (empty when the shell read no more
        than ``needed()``); the rest is the shell's to read before the next frame."""
        if self._claim is None:
            raise LocalProtocolError("no payload to take")
        hlen, plen = self._claim
        self._claim = None
        start = self._pos + PREFIX_SIZE + hlen
        have = min(self._end - start, plen)
        self._pos = start + have
        return self._view[start : start + have]

    def eof(self) -> None:
        """The peer closed its end: fine between frames, an error inside one."""
        if self.pending or self._claim is not None:
            raise RemoteProtocolError(
                f"connection closed in the middle of a frame ({self.pending} bytes in)"
            )


def frames_in(
    buf: Buffer, *, max_header: int = DEFAULT_MAX_HEADER, max_payload: int = DEFAULT_MAX_PAYLOAD
) -> Iterator[tuple[int, int, int]]:
    """The whole frames of a complete buffer (a log file read back), as (offset, header
    length, payload length), stopping before the first torn one or one with a bad prefix."""
    pos, size = 0, len(buf)
    while size - pos >= PREFIX_SIZE:
        try:
            hlen, plen = parse_prefix(
                buf[pos : pos + PREFIX_SIZE], max_header=max_header, max_payload=max_payload
            )
        except RemoteProtocolError:
            return
        end = pos + PREFIX_SIZE + hlen + plen
        if end > size:
            return
        yield pos, hlen, plen
        pos = end


def check_payload(msg: Message, payload_len: int) -> Message:
    """``msg`` when it may carry ``payload_len`` bytes of payload (only ``Data`` and
    ``CkptChunk`` carry one)."""
    if payload_len and not isinstance(msg, (Data, CkptChunk)):
        raise RemoteProtocolError(f"{type(msg).__name__} frame must not carry a payload")
    return msg


def decode_head(frame: Buffer, header_len: int, payload_len: int) -> Message:
    """The message of a frame (or of its head), checked against its payload."""
    with memoryview(frame) as view:
        return check_payload(decode(view[PREFIX_SIZE : PREFIX_SIZE + header_len]), payload_len)


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


def encode_struct(msg: msgspec.Struct) -> bytes:
    """A payload-less frame of any msgspec struct: the wire format of the internal links
    (the agent and its checkpoint workers), read by the same ``FrameScanner``."""
    header = _struct_encoder.encode(msg)
    return PREFIX.pack(len(header), 0) + header


def raw_frame_parts(
    raw_header: bytes, payload: bytes | bytearray | memoryview
) -> list[bytes | bytearray | memoryview]:
    """Frame pieces re-using already-encoded header bytes (forwarding without re-encoding)."""
    head = PREFIX.pack(len(raw_header), len(payload)) + raw_header
    return [head, payload] if len(payload) else [head]


class FrameDecoder:
    """Bytes in, decoded ``Frame``s out: ``FrameScanner`` for tests and simple readers."""

    def __init__(
        self, *, max_header: int = DEFAULT_MAX_HEADER, max_payload: int = DEFAULT_MAX_PAYLOAD
    ) -> None:
        self.max_header = max_header
        self.max_payload = max_payload
        self._scanner = FrameScanner(max_header=max_header, max_payload=max_payload)
        self._raw: list[tuple[bytes, bytes]] = []  # (header, payload) of whole frames
        self._large_header = b""
        self._failed: RemoteProtocolError | None = None

    @property
    def buffered(self) -> int:
        return self._scanner.pending + sum(len(h) + len(p) for h, p in self._raw)

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        if self._failed is not None:
            raise LocalProtocolError("decoder already failed; the connection must be closed")
        view = memoryview(data).cast("B")
        try:
            while len(view):
                buf = self._scanner.get_buffer()
                k = min(len(buf), len(view))
                buf[:k] = view[:k]
                self._scanner.buffer_updated(k)
                view = view[k:]
                self._drain()
        except RemoteProtocolError as exc:
            self._failed = exc
            raise

    def _drain(self) -> None:
        # Prefixes are checked here (on receipt); headers are decoded by next_frame.
        scanner = self._scanner
        while (event := scanner.next_event()) is not None:
            if type(event) is Small:
                head = PREFIX_SIZE + event.header_len
                self._raw.append((bytes(event.frame[PREFIX_SIZE:head]), bytes(event.frame[head:])))
            elif type(event) is Large:
                self._large_header = bytes(event.head[PREFIX_SIZE:])
                scanner.claim(bytearray(event.payload_len))
            else:
                assert type(event) is Payload
                self._raw.append((self._large_header, bytes(event.target)))

    def next_frame(self) -> Frame | None:
        """The next complete frame, or None when more bytes are needed."""
        if self._failed is not None:
            raise LocalProtocolError("decoder already failed; the connection must be closed")
        if not self._raw:
            return None
        raw_header, payload = self._raw.pop(0)
        try:
            msg = check_payload(decode(raw_header), len(payload))
        except RemoteProtocolError as exc:
            self._failed = exc
            raise
        return Frame(msg, payload, raw_header)
