"""``FrameScanner``, the one reader of frames: split anywhere, fed either way, it gives back
exactly the frames that were sent, and refuses bad prefixes before buffering a body."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vpool.protocol import messages as m
from vpool.protocol.errors import LocalProtocolError, RemoteProtocolError
from vpool.protocol.framing import (
    PREFIX_SIZE,
    FrameScanner,
    Large,
    Payload,
    Small,
    decode_head,
    encode_frame,
    frames_in,
)

SMALL_LARGE = 32  # payloads above this take the Large path in these tests


def data_frame(seq: int, payload: bytes) -> bytes:
    return encode_frame(m.Data(job=1, src=0, dst=1, seq=seq, ctx=0, tag=0), payload)


def take(scanner: FrameScanner, out: list[bytes], *, whole: bool) -> None:
    """Every event the scanner has now, rebuilt into whole frames in ``out``."""
    while (event := scanner.next_event()) is not None:
        if type(event) is Small:
            assert event.frame.nbytes == PREFIX_SIZE + event.header_len + event.payload_len
            decode_head(event.frame, event.header_len, event.payload_len)
            out.append(bytes(event.frame))
        elif type(event) is Large:
            assert event.payload_len > SMALL_LARGE
            size = event.head.nbytes + event.payload_len
            head = bytes(event.head)
            scanner.claim(bytearray(size if whole else event.payload_len), whole=whole)
            out.append(head)  # completed by the Payload below
        else:
            assert type(event) is Payload
            body = bytes(event.target)
            out[-1] = body if whole else out[-1] + body


payloads = st.lists(st.binary(max_size=100), min_size=1, max_size=6)


@given(payloads, st.data(), st.booleans(), st.booleans())
def test_split_anywhere_fed_either_way(
    items: list[bytes], data: st.DataObject, into: bool, whole: bool
) -> None:
    frames = [data_frame(i + 1, p) for i, p in enumerate(items)]
    stream = b"".join(frames)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=10)))
    scanner = FrameScanner(max_header=256, large=SMALL_LARGE)
    out: list[bytes] = []
    start = 0
    for cut in [*cuts, len(stream)]:
        chunk = stream[start:cut]
        start = cut
        while chunk:
            if into:  # recv_into: the shell writes into the scanner's buffer (or a claim)
                buf = scanner.get_buffer()
                n = min(len(buf), len(chunk))
                buf[:n] = chunk[:n]
                scanner.buffer_updated(n)
            else:  # a stream that hands out bytes: at most what get_buffer() can take
                n = min(len(scanner.get_buffer()), len(chunk))
                scanner.feed(chunk[:n])
            chunk = chunk[n:]
            take(scanner, out, whole=whole)
    scanner.eof()
    assert out == frames
    assert scanner.pending == 0


def test_every_single_byte_boundary_and_every_read_size() -> None:
    frames = [data_frame(1, b"x" * 5), data_frame(2, b"y" * 200), data_frame(3, b"")]
    stream = b"".join(frames)
    for step in (1, 2, 3, 7, 64, len(stream)):
        for whole in (False, True):
            scanner = FrameScanner(max_header=256, large=SMALL_LARGE)
            out: list[bytes] = []
            for i in range(0, len(stream), step):
                scanner.feed(stream[i : i + step])
                take(scanner, out, whole=whole)
            assert out == frames, (step, whole)


def test_the_buffer_compacts_and_never_runs_dry() -> None:
    # Many small frames, read in big gulps: the scanner's own buffer is reused.
    scanner = FrameScanner(max_header=256, large=SMALL_LARGE)
    frames = [data_frame(i, bytes([i % 256]) * 30) for i in range(1, 2000)]
    stream = b"".join(frames)
    out: list[bytes] = []
    pos = 0
    while pos < len(stream):
        buf = scanner.get_buffer()
        assert len(buf) > 0
        n = min(len(buf), len(stream) - pos)
        buf[:n] = stream[pos : pos + n]
        scanner.buffer_updated(n)
        pos += n
        take(scanner, out, whole=False)
    assert out == frames


def test_a_large_payload_lands_in_the_claimed_buffer_without_the_scanners() -> None:
    payload = bytes(range(256)) * 1000
    frame = data_frame(1, payload)
    scanner = FrameScanner()
    scanner.feed(frame[:1000])
    event = scanner.next_event()
    assert type(event) is Large and event.payload_len == len(payload)
    target = bytearray(len(payload))
    scanner.claim(target)
    rest = memoryview(frame)[1000:]
    while len(rest):
        buf = scanner.get_buffer()
        assert buf.obj is target  # received straight into the claimed buffer
        n = min(len(buf), 4096)
        buf[:n] = rest[:n]
        scanner.buffer_updated(n)
        rest = rest[n:]
    done = scanner.next_event()
    assert type(done) is Payload and done.target is target and target == payload
    assert scanner.next_event() is None and scanner.pending == 0


def test_limits_refuse_on_the_prefix_and_break_the_scanner() -> None:
    scanner = FrameScanner(max_payload=1000)
    scanner.feed(struct.pack("!II", 10, 1001))
    with pytest.raises(RemoteProtocolError) as info:
        scanner.next_event()
    assert info.value.code == "frame_too_large"
    with pytest.raises(LocalProtocolError):
        scanner.get_buffer()
    empty = FrameScanner()
    empty.feed(struct.pack("!II", 0, 0))
    with pytest.raises(RemoteProtocolError, match="empty header"):
        empty.next_event()


def test_a_large_frame_must_be_claimed_with_the_right_size() -> None:
    scanner = FrameScanner(large=SMALL_LARGE)
    scanner.feed(data_frame(1, b"z" * 100)[:60])
    assert type(scanner.next_event()) is Large
    with pytest.raises(LocalProtocolError):
        scanner.next_event()
    with pytest.raises(LocalProtocolError):
        scanner.get_buffer()
    with pytest.raises(LocalProtocolError):
        scanner.claim(bytearray(99))
    with pytest.raises(LocalProtocolError):
        scanner.claim(b"z" * 100)  # read-only
    scanner.claim(bytearray(100))
    assert scanner.next_event() is None


def test_end_of_stream_inside_a_frame_is_an_error() -> None:
    frame = data_frame(1, b"abc")
    for cut in range(1, len(frame)):
        scanner = FrameScanner()
        scanner.feed(frame[:cut])
        assert scanner.next_event() is None
        with pytest.raises(RemoteProtocolError, match="middle of a frame"):
            scanner.eof()
    scanner = FrameScanner()
    scanner.eof()  # nothing at all: a clean end


def test_payload_on_a_message_without_one_is_refused() -> None:
    header = m.encode(m.Ack(job=1, src=0, dst=1, seq=1))
    raw = struct.pack("!II", len(header), 3) + header + b"abc"
    with pytest.raises(RemoteProtocolError, match="must not carry a payload"):
        decode_head(raw, len(header), 3)


def test_limits_can_be_raised_between_frames() -> None:
    # A server reads the Hello under small limits, then raises them for the peer.
    hello = encode_frame(m.Hello(version=1, role="agent", token="t"))
    big_header = encode_frame(m.Attach(token="x" * 5000))
    scanner = FrameScanner(max_header=256, max_payload=0, large=SMALL_LARGE)
    scanner.feed(hello + big_header[:100])
    first = scanner.next_event()
    assert type(first) is Small and bytes(first.frame) == hello
    scanner.set_limits(max_header=65536, max_payload=1 << 20)
    rest = big_header[100:]
    while rest:
        n = min(len(scanner.get_buffer()), len(rest))
        scanner.feed(rest[:n])
        rest = rest[n:]
    second = scanner.next_event()
    assert type(second) is Small and bytes(second.frame) == big_header


@given(payloads)
def test_exact_reads_stop_at_each_head(items: list[bytes]) -> None:
    # A shell that reads only needed() bytes never reads into a payload it takes itself.
    frames = [data_frame(i + 1, p) for i, p in enumerate(items)]
    stream = memoryview(b"".join(frames))
    scanner = FrameScanner(max_header=256, large=0)
    out = []
    while len(stream):
        while (event := scanner.next_event()) is None:
            n = scanner.needed()
            assert 1 <= n <= len(stream)
            scanner.feed(stream[:n])
            stream = stream[n:]
        if type(event) is Small:
            assert event.payload_len == 0
            out.append(bytes(event.frame))
            continue
        assert type(event) is Large and scanner.take_payload().nbytes == 0
        out.append(bytes(event.head) + bytes(stream[: event.payload_len]))
        stream = stream[event.payload_len :]
    assert out == frames and scanner.pending == 0


def test_take_payload_gives_what_was_read_ahead() -> None:
    scanner = FrameScanner(large=0)
    frame = data_frame(1, b"abcdef")
    scanner.feed(frame[:-2])
    event = scanner.next_event()
    assert type(event) is Large
    assert bytes(scanner.take_payload()) == b"abcd"
    with pytest.raises(LocalProtocolError):
        scanner.take_payload()
    scanner.feed(data_frame(2, b""))
    assert type(scanner.next_event()) is Small


@given(payloads, st.integers(0, 50))
def test_frames_in_a_log_read_back_stop_at_a_torn_tail(items: list[bytes], cut: int) -> None:
    frames = [data_frame(i + 1, p) for i, p in enumerate(items)]
    data = b"".join(frames)
    torn = data[: max(0, len(data) - cut)]
    found = list(frames_in(torn))
    whole = [f for i, f in enumerate(frames) if sum(map(len, frames[: i + 1])) <= len(torn)]
    assert len(found) == len(whole)
    for (pos, hlen, plen), frame in zip(found, whole, strict=True):
        assert torn[pos : pos + PREFIX_SIZE + hlen + plen] == frame


def test_frames_in_stop_at_a_bad_prefix() -> None:
    good = data_frame(1, b"ok")
    assert list(frames_in(good + struct.pack("!II", 0, 0) + good)) == [(0, len(good) - 10, 2)]
    assert list(frames_in(good, max_payload=1)) == []
