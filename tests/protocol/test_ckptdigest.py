"""The image digest (``protocol.ckptdigest``): the skeleton of a real image, in any pieces."""

from __future__ import annotations

import itertools
import os
import struct

from hypothesis import given, settings
from hypothesis import strategies as st

from vpool.protocol.ckptdigest import FRAME_HEADER, IMAGE_HEADER, TAG, ImageDigest, image_digest
from vpool.worker_agent.ckpt_image import ImageWriter

KEY = bytes(range(32))


def real_image(size: int) -> bytes:
    """An image as the agent makes it, of ``size`` bytes of incompressible tar content."""
    writer = ImageWriter(KEY, job=1, rank=0, ckpt=1)
    image = b"".join(writer.seal([os.urandom(size)]))
    assert writer.digest == image_digest(image)
    return image


def frames(image: bytes) -> list[tuple[int, int]]:
    """(start, length) of each frame's body."""
    out, pos = [], IMAGE_HEADER
    while pos < len(image):
        (length,) = struct.unpack_from(">I", image, pos)
        out.append((pos + FRAME_HEADER, length))
        pos += FRAME_HEADER + length
    assert pos == len(image)
    return out


IMAGE = real_image(3 * (1 << 20) + 12345)


@settings(max_examples=50)
@given(st.lists(st.integers(min_value=0, max_value=len(IMAGE)), max_size=12))
def test_any_pieces_give_the_digest_of_the_whole(cuts: list[int]) -> None:
    points = [0, *sorted(cuts), len(IMAGE)]
    d = ImageDigest()
    for a, b in itertools.pairwise(points):
        d.update(memoryview(IMAGE)[a:b])
    assert d.size == len(IMAGE)
    assert d.digest() == image_digest(IMAGE)


def test_the_skeleton_counts_the_ciphertext_does_not() -> None:
    """Every byte of the header, of each frame header and of each tag changes the digest (and
    so does the size); a byte of ciphertext does not: its frame's GCM tag binds it for whoever
    holds the key, and the transport MAC does on the way to a store."""
    whole = image_digest(IMAGE)
    skeleton = list(range(IMAGE_HEADER))
    body = []
    for start, length in frames(IMAGE):
        skeleton += range(start - FRAME_HEADER, start)
        skeleton += range(start + length - TAG, start + length)
        body += [start, start + length // 2, start + length - TAG - 1]
    for pos in skeleton[:40] + skeleton[-40:]:
        changed = bytearray(IMAGE)
        changed[pos] ^= 0x01
        assert image_digest(changed) != whole, pos
    for pos in body:
        changed = bytearray(IMAGE)
        changed[pos] ^= 0x01
        assert image_digest(changed) == whole, pos
    assert image_digest(IMAGE[:-1]) != whole
    assert image_digest(IMAGE + b"\0") != whole


def test_bytes_after_a_frame_too_short_for_a_tag_all_count() -> None:
    """Not an image: a frame header whose length cannot hold a tag ends the framing, and every
    byte after it is digested."""
    head = b"H" * IMAGE_HEADER + struct.pack(">IB", TAG - 1, 0)
    tail = bytearray(os.urandom(5000))
    base = image_digest(head + tail)
    for pos in (0, 2500, 4999):
        tail[pos] ^= 0x80
        assert image_digest(head + tail) != base
        tail[pos] ^= 0x80
    assert image_digest(head + tail) == base
    d = ImageDigest()
    for i in range(0, len(head + tail), 7):
        d.update((head + tail)[i : i + 7])
    assert d.digest() == base


def test_digest_is_a_snapshot() -> None:
    d = ImageDigest()
    d.update(IMAGE[:1000])
    early = d.digest()
    assert early == image_digest(IMAGE[:1000]) and d.digest() == early
    d.update(IMAGE[1000:])
    assert d.digest() == image_digest(IMAGE)
