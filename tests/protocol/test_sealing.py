"""Sealed message payloads (``protocol.sealing``): relays hold ciphertext, re-sends seal to the
same bytes (the relay's determinism check works on them), and nothing changed on the way
opens."""

from __future__ import annotations

import secrets

import msgspec
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from vpool.protocol.framing import PREFIX_SIZE, encode_frame, frames_in
from vpool.protocol.messages import KIND_PICKLE, Data, decode
from vpool.protocol.sealing import (
    IN_PLACE_MIN,
    SCRATCH,
    TAG_SIZE,
    Sealer,
    SealError,
    message_key,
    nonce,
)
from vpool.relay.log import digest

KEY = message_key("c2VjcmV0LWpvYi1rZXktb2YtMzItYnl0ZXMtZm9yLXRlc3Q")


def _heads(frame: bytes | bytearray) -> list[tuple[int, int, int]]:
    """(offset, header length, payload length) of each frame."""
    return list(frames_in(frame))


def _frame(msg: Data, payload: bytes) -> tuple[bytes, int]:
    frame = encode_frame(msg, payload)
    [(_, header_len, _)] = _heads(frame)
    return frame, header_len


def _msg(**kw: object) -> Data:
    base = {"job": 7, "src": 1, "dst": 2, "seq": 5, "ctx": 3, "tag": 11}
    return Data(**{**base, **kw})  # type: ignore[arg-type]


def _sealed(msg: Data, payload: bytes) -> tuple[Data, bytearray, int]:
    frame, h = _frame(msg, payload)
    sealed = Sealer(KEY).seal(msg, frame, h)
    [(_, sh, _)] = _heads(sealed)
    header = decode(bytes(sealed[PREFIX_SIZE : PREFIX_SIZE + sh]))
    assert isinstance(header, Data)
    return header, sealed, sh


def _pattern(size: int) -> bytes:
    """``size`` bytes that are not all alike (a shifted block would not open to them)."""
    return (bytes(range(251)) * (size // 251 + 1))[:size]


# The sizes cryptography 51 broke (it refuses overlapping buffers; frames of 64 KiB and more
# arrive in a buffer the agent owns, which it opened in place), either way of opening.
_SIZES = (100, 70_000, 1 << 20, IN_PLACE_MIN - 1, IN_PLACE_MIN, IN_PLACE_MIN + SCRATCH + 1)


@given(payload=st.binary(max_size=4096), seq=st.integers(1, (1 << 48) - 1), in_place=st.booleans())
@example(payload=_pattern(100), seq=1, in_place=True)
@example(payload=_pattern(100), seq=1, in_place=False)
@example(payload=_pattern(70_000), seq=1, in_place=True)
@example(payload=_pattern(70_000), seq=1, in_place=False)
@example(payload=_pattern(1 << 20), seq=1, in_place=True)
@example(payload=_pattern(1 << 20), seq=1, in_place=False)
def test_open_gives_back_the_frame_that_was_sealed(
    payload: bytes, seq: int, in_place: bool
) -> None:
    msg = _msg(seq=seq, kind=KIND_PICKLE, parts=[len(payload)])
    frame, _ = _frame(msg, payload)
    header, sealed, sh = _sealed(msg, payload)
    assert header == msgspec.structs.replace(msg, sealed=True)
    assert len(sealed) == len(frame) + TAG_SIZE
    assert _heads(sealed)[0][2] == len(payload) + TAG_SIZE
    given_frame = sealed if in_place else bytes(sealed)  # owned, or read-only (opened as copy)
    plain = Sealer(KEY).open(header, given_frame, sh)
    assert bytes(plain) == frame


@pytest.mark.parametrize("size", _SIZES)
def test_one_sealer_opens_frames_of_every_size_in_place_and_not(size: int) -> None:
    """One agent's sealer, reused (its scratch buffer with it) across sizes and both ways."""
    sealer = Sealer(KEY)
    for seq in (1, 2):
        msg = _msg(seq=seq, parts=[size])
        payload = _pattern(size)[::-1] if seq == 2 else _pattern(size)
        frame, _ = _frame(msg, payload)
        header, sealed, sh = _sealed(msg, payload)
        assert bytes(sealer.open(header, bytes(sealed), sh)) == frame
        assert bytes(sealer.open(header, sealed, sh)) == frame


@pytest.mark.parametrize("size", [100, IN_PLACE_MIN + SCRATCH + 1])
@pytest.mark.parametrize("where", ["first", "middle", "last", "tag"])
def test_a_changed_byte_anywhere_in_a_large_payload_does_not_open(size: int, where: str) -> None:
    """In place, the tag is checked only after the last chunk: a change in any chunk (or the
    tag) still fails, in place and not."""
    msg = _msg(parts=[size])
    header, sealed, sh = _sealed(msg, _pattern(size))
    start = PREFIX_SIZE + sh
    at = {"first": start, "middle": start + size // 2, "last": start + size - 1}.get(
        where, len(sealed) - 1
    )
    sealed[at] ^= 0x01
    with pytest.raises(SealError, match="does not open"):
        Sealer(KEY).open(header, bytes(sealed), sh)
    with pytest.raises(SealError, match="does not open"):
        Sealer(KEY).open(header, sealed, sh)


def test_sealing_is_deterministic_so_the_relay_digest_still_finds_divergence() -> None:
    msg = _msg()
    _, one, _ = _sealed(msg, b"the same content")
    _, two, _ = _sealed(msg, b"the same content")
    assert one == two and digest(one) == digest(two)
    _, three, _ = _sealed(msg, b"another content!")
    assert digest(three) != digest(one)


def test_the_relay_sees_no_plaintext() -> None:
    marker = b"MARKER-" + secrets.token_hex(8).encode()
    _, sealed, sh = _sealed(_msg(), marker * 100)
    assert marker not in sealed and marker[:8] not in sealed[PREFIX_SIZE + sh :]


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
    header, sealed, sh = _sealed(_msg(), b"payload")
    payload = bytes(sealed[PREFIX_SIZE + sh :])
    same, h = _frame(header, payload)
    assert bytes(Sealer(KEY).open(header, same, h)) == _frame(_msg(), b"payload")[0]
    moved = msgspec.structs.replace(header, **change)
    forged, fh = _frame(moved, payload)
    with pytest.raises(SealError, match="does not open"):
        Sealer(KEY).open(moved, forged, fh)


def test_a_flipped_bit_or_another_key_does_not_open() -> None:
    msg = _msg()
    frame, h = _frame(msg, b"payload bytes")
    header, sealed, sh = _sealed(msg, b"payload bytes")
    for i in range(PREFIX_SIZE + sh, len(sealed)):
        bad = bytearray(sealed)
        bad[i] ^= 0x01
        with pytest.raises(SealError):
            Sealer(KEY).open(header, bad, sh)
    with pytest.raises(SealError):
        other = message_key("b3RoZXItam9iLWtleS1vZi0zMi1ieXRlcy1mb3ItdGVzdA")
        Sealer(other).open(header, bytes(sealed), sh)
    with pytest.raises(SealError, match="sealed flag"):
        Sealer(KEY).open(msg, frame, h)  # plaintext
    with pytest.raises(SealError, match="sealed flag"):
        Sealer(KEY).seal(header, bytes(sealed), sh)  # sealed already


def test_nonces_are_distinct_per_message_and_bounded() -> None:
    seen = {nonce(s, d, q) for s in range(4) for d in range(4) for q in range(1, 50)}
    assert len(seen) == 4 * 4 * 49
    for bad in ((1 << 24, 0, 1), (0, 1 << 24, 1), (0, 0, 0), (0, 0, 1 << 48), (-1, 0, 1)):
        with pytest.raises(ValueError, match="nonce space"):
            nonce(*bad)
    with pytest.raises(ValueError, match="128 bits"):
        message_key("c2hvcnQ")
