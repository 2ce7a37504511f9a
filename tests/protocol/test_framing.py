from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vpool.protocol import messages as m
from vpool.protocol.errors import LocalProtocolError, RemoteProtocolError
from vpool.protocol.framing import (
    PREFIX_SIZE,
    FrameDecoder,
    encode_frame,
    frame_parts,
    parse_prefix,
    raw_frame_parts,
)

ints = st.integers(min_value=-(2**31), max_value=2**31)
nat = st.integers(min_value=0, max_value=2**40)
text = st.text(max_size=40)

messages = st.one_of(
    st.builds(m.Hello, version=nat, role=text, token=text, software=text),
    st.builds(m.Welcome, version=nat, relay=text, max_payload=nat),
    st.builds(m.Error, code=text, message=text, job=ints, rank=ints),
    st.builds(m.Attach, token=text, home=st.booleans(), received=st.dictionaries(nat, nat)),
    st.builds(m.Attached, job=nat, rank=nat, incarnation=nat, stored=st.dictionaries(nat, nat)),
    st.builds(m.Detach, job=nat, rank=nat),
    st.builds(
        m.Data,
        job=nat,
        src=nat,
        dst=nat,
        seq=nat,
        ctx=nat,
        tag=ints,
        kind=nat,
        parts=st.lists(nat, max_size=4),
    ),
    st.builds(m.Ack, job=nat, src=nat, dst=nat, seq=nat),
    st.builds(m.Credit, job=nat, rank=nat, nbytes=nat),
    st.builds(m.Stop, job=nat, rank=nat, incarnation=nat, reason=text),
    st.builds(m.RankHello, version=nat, secret=text),
    st.builds(m.RankWelcome, job=nat, rank=nat, size=nat, incarnation=nat, processor=text),
    st.builds(m.Abort, code=ints, message=text),
    st.builds(m.Finalize),
)


@st.composite
def frames(draw: st.DrawFn) -> tuple[m.Message, bytes]:
    msg = draw(messages)
    payload = draw(st.binary(max_size=300)) if isinstance(msg, m.Data) else b""
    return msg, payload


@given(messages)
def test_message_round_trip(msg: m.Message) -> None:
    assert m.decode(m.encode(msg)) == msg


@given(st.lists(frames(), min_size=1, max_size=6), st.data())
def test_frames_split_at_any_boundary(
    items: list[tuple[m.Message, bytes]], data: st.DataObject
) -> None:
    stream = b"".join(encode_frame(msg, payload) for msg, payload in items)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=8)))
    dec = FrameDecoder()
    got = []
    start = 0
    for cut in [*cuts, len(stream)]:
        dec.receive_data(stream[start:cut])
        start = cut
        while (frame := dec.next_frame()) is not None:
            got.append((frame.message, frame.payload))
    assert got == items
    assert dec.buffered == 0


def test_every_single_byte_boundary() -> None:
    msg = m.Data(job=7, src=1, dst=2, seq=3, ctx=0, tag=9)
    stream = encode_frame(msg, b"payload!") + encode_frame(m.Ack(job=7, src=1, dst=2, seq=3))
    for cut in range(len(stream) + 1):
        dec = FrameDecoder()
        dec.receive_data(stream[:cut])
        out = []
        while (f := dec.next_frame()) is not None:
            out.append(f.message)
        dec.receive_data(stream[cut:])
        while (f := dec.next_frame()) is not None:
            out.append(f.message)
        assert out == [msg, m.Ack(job=7, src=1, dst=2, seq=3)]


def test_oversized_payload_rejected_on_prefix_alone() -> None:
    dec = FrameDecoder(max_payload=1000)
    with pytest.raises(RemoteProtocolError) as info:
        dec.receive_data(struct.pack("!II", 10, 1001))
    assert info.value.code == "frame_too_large"
    with pytest.raises(LocalProtocolError):
        dec.receive_data(b"more")


def test_oversized_header_rejected() -> None:
    with pytest.raises(RemoteProtocolError, match="header"):
        parse_prefix(struct.pack("!II", 70_000, 0))
    with pytest.raises(RemoteProtocolError, match="empty header"):
        parse_prefix(struct.pack("!II", 0, 5))


def test_limit_is_checked_before_the_body_arrives() -> None:
    # 4 GiB announced: the decoder must refuse before buffering anything of it.
    dec = FrameDecoder()
    with pytest.raises(RemoteProtocolError):
        dec.receive_data(struct.pack("!II", 16, 2**32 - 1))


@given(st.binary(min_size=1, max_size=64))
def test_garbage_header_is_a_remote_error(garbage: bytes) -> None:
    dec = FrameDecoder()
    frame = struct.pack("!II", len(garbage), 0) + garbage
    try:
        dec.receive_data(frame)
        f = dec.next_frame()
    except RemoteProtocolError:
        return
    # Garbage that happens to decode must be a real message.
    assert f is not None and isinstance(f.message, tuple(messages_types()))


def messages_types() -> list[type]:
    return list(m.Message.__args__)  # type: ignore[attr-defined]


def test_payload_on_a_message_without_one_is_rejected() -> None:
    header = m.encode(m.Ack(job=1, src=0, dst=1, seq=1))
    dec = FrameDecoder()
    dec.receive_data(struct.pack("!II", len(header), 3) + header + b"abc")
    with pytest.raises(RemoteProtocolError, match="must not carry a payload"):
        dec.next_frame()
    with pytest.raises(LocalProtocolError):
        frame_parts(m.Ack(job=1, src=0, dst=1, seq=1), b"x")


def test_raw_forwarding_keeps_header_bytes() -> None:
    msg = m.Data(job=1, src=0, dst=1, seq=5, ctx=2, tag=3, kind=m.KIND_PICKLE, parts=[3, 2])
    dec = FrameDecoder()
    dec.receive_data(encode_frame(msg, b"abcde"))
    frame = dec.next_frame()
    assert frame is not None
    forwarded = b"".join(bytes(p) for p in raw_frame_parts(frame.raw_header, frame.payload))
    assert forwarded == encode_frame(msg, b"abcde")
    assert len(forwarded) == PREFIX_SIZE + len(frame.raw_header) + 5
