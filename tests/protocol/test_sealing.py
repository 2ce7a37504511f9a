"""Sealed message payloads (``protocol.sealing``): relays hold ciphertext, re-sends seal to the
same bytes (the relay's determinism check works on them), and nothing changed on the way
opens."""

from __future__ import annotations

import secrets

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from vpool.protocol.framing import PREFIX_SIZE, encode_frame, frames_in
from vpool.protocol.messages import KIND_PICKLE, Data, decode
from vpool.protocol.sealing import TAG_SIZE, Sealer, SealError, message_key, nonce
from vpool.relay.log import digest

KEY = message_key("c2VjcmV0LWpvYi1rZXktb2YtMzItYnl0ZXMtZm9yLXRlc3Q")


def _frame(msg: Data, payload: bytes) -> tuple[bytes, int]:
    frame = encode_frame(msg, payload)
    [(_, header_len, _)] = _heads(frame)
    return frame, header_len


def _heads(frame: bytes) -> list[tuple[int, int, int]]:
    """(offset, header length, payload length) of each frame."""
    return list(frames_in(frame))


def _msg(**kw: object) -> Data:
    base = {"job": 7, "src": 1, "dst": 2, "seq": 5, "ctx": 3, "tag": 11}
    return Data(**{**base, **kw})  # type: ignore[arg-type]


@given(payload=st.binary(max_size=4096), seq=st.integers(1, (1 << 48) - 1))
def test_open_gives_back_the_frame_that_was_sealed(payload: bytes, seq: int) -> None:
    msg = _msg(seq=seq, kind=KIND_PICKLE, parts=[len(payload)])
    frame, header_len = _frame(msg, payload)
    sealer = Sealer(KEY)
    sealed_msg, sealed = sealer.seal(msg, frame, header_len)
    assert sealed_msg.sealed and len(sealed) == len(encode_frame(sealed_msg)) + len(payload) + 16
    [(_, h, p)] = _heads(bytes(sealed))
    assert p == len(payload) + TAG_SIZE
    header = decode(bytes(sealed[PREFIX_SIZE : PREFIX_SIZE + h]))
    assert header == sealed_msg
    plain_msg, plain = Sealer(KEY).open(sealed_msg, sealed, h)
    assert plain_msg == msg and bytes(plain) == frame


def test_sealing_is_deterministic_so_the_relay_digest_still_finds_divergence() -> None:
    msg = _msg()
    frame, h = _frame(msg, b"the same content")
    _, one = Sealer(KEY).seal(msg, frame, h)
    _, two = Sealer(KEY).seal(msg, frame, h)
    assert one == two and digest(one) == digest(two)
    other, h2 = _frame(msg, b"another content!")
    _, three = Sealer(KEY).seal(msg, other, h2)
    assert digest(three) != digest(one)


def test_the_relay_sees_no_plaintext() -> None:
    marker = b"MARKER-" + secrets.token_hex(8).encode()
    msg = _msg()
    frame, h = _frame(msg, marker * 100)
    _, sealed = Sealer(KEY).seal(msg, frame, h)
    assert marker not in sealed and marker[:8] not in sealed[PREFIX_SIZE + h :]


@pytest.mark.parametrize(
    "change",
    [
        {"seq": 6},
        {"src": 0},
        {"dst": 3},
        {"ctx": 4},
        {"tag": 12},
        {"job": 8},
        {"kind": KIND_PICKLE},
        {"parts": [3]},
    ],
)
def test_an_envelope_changed_on_the_way_does_not_open(change: dict[str, object]) -> None:
    msg = _msg()
    frame, h = _frame(msg, b"payload")
    sealed_msg, sealed = Sealer(KEY).seal(msg, frame, h)
    [(_, sh, _)] = _heads(bytes(sealed))
    payload = bytes(sealed[PREFIX_SIZE + sh :])
    same, h = _frame(sealed_msg, payload)
    assert Sealer(KEY).open(sealed_msg, same, h)[0] == msg  # the envelope as it was opens
    moved = msgspec.structs.replace(sealed_msg, **change)
    forged, fh = _frame(moved, payload)
    with pytest.raises(SealError, match="does not open"):
        Sealer(KEY).open(moved, forged, fh)


def test_a_flipped_bit_or_another_key_does_not_open() -> None:
    msg = _msg()
    frame, h = _frame(msg, b"payload bytes")
    sealed_msg, sealed = Sealer(KEY).seal(msg, frame, h)
    [(_, sh, _)] = _heads(bytes(sealed))
    for i in range(PREFIX_SIZE + sh, len(sealed)):
        bad = bytearray(sealed)
        bad[i] ^= 0x01
        with pytest.raises(SealError):
            Sealer(KEY).open(sealed_msg, bad, sh)
    with pytest.raises(SealError):
        Sealer(message_key("b3RoZXItam9iLWtleS1vZi0zMi1ieXRlcy1mb3ItdGVzdA")).open(
            sealed_msg, sealed, sh
        )
    with pytest.raises(SealError, match="not sealed"):
        Sealer(KEY).open(msg, frame, h)
    with pytest.raises(ValueError, match="sealed already"):
        Sealer(KEY).seal(sealed_msg, sealed, sh)


def test_nonces_are_distinct_per_message_and_bounded() -> None:
    seen = {nonce(s, d, q) for s in range(4) for d in range(4) for q in range(1, 50)}
    assert len(seen) == 4 * 4 * 49
    for bad in ((1 << 24, 0, 1), (0, 1 << 24, 1), (0, 0, 0), (0, 0, 1 << 48), (-1, 0, 1)):
        with pytest.raises(ValueError, match="nonce space"):
            nonce(*bad)
    with pytest.raises(ValueError, match="128 bits"):
        message_key("c2hvcnQ")
