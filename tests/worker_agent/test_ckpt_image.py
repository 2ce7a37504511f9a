"""Checkpoint image stream: round trip, and every way a bad image must be refused untouched."""

from __future__ import annotations

import hashlib
import io
import os
import random
import stat
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from vpool.protocol.ckptdigest import image_digest
from vpool.worker_agent import ckpt_tar
from vpool.worker_agent.ckpt_image import (
    APPEND,
    CHUNK,
    SAMPLE,
    SAMPLES,
    SKIP_AFTER,
    TAG_SIZE,
    ZSTD,
    ImageError,
    ImageReader,
    ImageWriter,
    Stream,
    from_channel,
)

KEY = bytes(range(32))
IDS = {"job": 7, "rank": 3, "ckpt": 2}
FRAME_OVERHEAD = 5 + TAG_SIZE


def make_trees(base: Path) -> tuple[Path, Path]:
    images, rank = base / "img", base / "rank"
    images.mkdir(parents=True)
    (images / "pages-1.img").write_bytes(random.Random(1).randbytes(3 * CHUNK + 12345))
    (images / "core-1.img").write_bytes(b"core" * 1000)
    (rank / "work" / "sub").mkdir(parents=True)
    (rank / "home").mkdir()
    (rank / "work" / "data.txt").write_text("hello\n" * 50_000)
    (rank / "work" / "empty").write_bytes(b"")
    tool = rank / "work" / "tool.sh"
    tool.write_text("#!/bin/sh\necho hi\n")
    tool.chmod(0o750)
    (rank / "work" / "link").symlink_to("data.txt")
    (rank / "home" / "up").symlink_to("../work/sub")
    os.mkfifo(rank / "work" / "fifo")
    os.utime(rank / "work" / "data.txt", ns=(1_600_000_000_123_456_789,) * 2)
    (rank / "work" / "sub").chmod(0o755)
    return images, rank


def snapshot(root: Path) -> dict[str, tuple[object, ...]]:
    found: dict[str, tuple[object, ...]] = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        rel = str(path.relative_to(root))
        if path.is_symlink():
            found[rel] = ("link", os.readlink(path))
        elif path.is_dir():
            found[rel] = ("dir", stat.S_IMODE(st.st_mode), st.st_mtime_ns)
        elif path.is_file():
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            found[rel] = ("file", stat.S_IMODE(st.st_mode), st.st_mtime_ns, digest)
    return found


def pack(images: Path, rank: Path, **kwargs: object) -> tuple[list[bytes], ImageWriter]:
    writer = ImageWriter(KEY, **IDS)
    pieces = list(writer.pack(images, rank, **kwargs))  # type: ignore[arg-type]
    return pieces, writer


def pieces_of(data: bytes, seed: int) -> Iterator[bytes]:
    """The stream cut at random places, as a network would deliver it."""
    rng = random.Random(seed)
    at = 0
    while at < len(data):
        n = rng.choice([1, 7, 4096, 65536, CHUNK, 3 * CHUNK])
        yield data[at : at + n]
        at += n


def reader(data: bytes, **overrides: object) -> ImageReader:
    args: dict[str, object] = {
        **IDS,
        "size": len(data),
        "digest": image_digest(data),
        **overrides,
    }
    key = args.pop("key", KEY)
    return ImageReader(key, **args)  # type: ignore[arg-type]


def test_round_trip(tmp_path: Path) -> None:
    images, rank = make_trees(tmp_path / "src")
    pieces, writer = pack(images, rank)
    data = b"".join(pieces)
    assert writer.size == len(data)
    assert writer.digest == image_digest(data)
    assert max(len(p) for p in pieces) <= CHUNK + FRAME_OVERHEAD
    assert len(pieces) >= 4  # the random file alone makes more than three chunks

    out_images, out_rank = tmp_path / "dst" / "img", tmp_path / "dst" / "rank"
    out_rank.mkdir(parents=True)
    (out_rank / "stale").write_text("replaced")
    reader(data).unpack(pieces_of(data, 1), out_images, out_rank)

    assert snapshot(out_rank) == snapshot(rank)
    assert not os.path.lexists(out_rank / "work" / "fifo")
    assert snapshot(out_images) == snapshot(images)
    assert (out_rank / "home" / "up" / ".." / "data.txt").read_text().startswith("hello")
    assert sorted(p.name for p in (tmp_path / "dst").iterdir()) == ["img", "rank"]


def reads_of(data: bytes, seed: int) -> Stream:
    """A Stream of ``data`` handing out reads of random sizes, as a pipe does."""
    rng = random.Random(seed)
    at = 0

    def read_into(view: memoryview) -> int:
        nonlocal at
        n = min(len(view), len(data) - at, rng.choice([1, 4096, 65536, CHUNK]))
        view[:n] = data[at : at + n]
        at += n
        return n

    return Stream("pages-1.img", read_into)


@pytest.mark.parametrize("size", [0, 1, CHUNK - 2048, CHUNK - 1, CHUNK, 3 * CHUNK + 513])
def test_stream_round_trip(tmp_path: Path, size: int) -> None:
    """A Stream (CRIU's pages through a pipe) comes out as the file it would have been; the
    file of that name in the directory is not archived again; ``then`` runs after the
    stream's end and before the trees."""
    images, rank = make_trees(tmp_path / "src")
    pages = random.Random(size).randbytes(size)
    stale = (images / "pages-1.img").read_bytes()
    order: list[str] = []
    stream = reads_of(pages, size)

    def read_into(view: memoryview) -> int:
        # The pipe is read straight into a chunk's buffer (no buffer of the stream's own).
        assert isinstance(view.obj, bytearray) and len(view.obj) == CHUNK
        n = stream.read_into(view)
        order.append("read" if n else "end")
        return n

    def then() -> None:
        order.append("then")
        (images / "late.img").write_bytes(b"written while the stream was read")

    writer = ImageWriter(KEY, **IDS)
    data = b"".join(
        writer.pack(images, rank, streams=[Stream("pages-1.img", read_into)], then=then)
    )
    assert order[-2:] == ["end", "then"] and "then" not in order[:-1]
    assert writer.size == len(data) and writer.digest == image_digest(data)
    out_images, out_rank = tmp_path / "dst" / "img", tmp_path / "dst" / "rank"
    reader(data).unpack(pieces_of(data, 2), out_images, out_rank)
    assert (out_images / "pages-1.img").read_bytes() == pages != stale
    assert (out_images / "late.img").read_bytes() == b"written while the stream was read"
    assert (out_images / "core-1.img").read_bytes() == b"core" * 1000
    assert snapshot(out_rank) == snapshot(rank)


def test_stream_error_ends_the_image(tmp_path: Path) -> None:
    images, rank = make_trees(tmp_path / "src")

    def broken(view: memoryview) -> int:
        raise OSError("the dump failed")

    with pytest.raises(OSError, match="the dump failed"):
        list(ImageWriter(KEY, **IDS).pack(images, rank, streams=[Stream("pages-1.img", broken)]))


def test_exclude_and_nonce_differ(tmp_path: Path) -> None:
    images, rank = make_trees(tmp_path / "src")
    first, _ = pack(images, rank, exclude=lambda name: name.startswith("criu/pages"))
    second, _ = pack(images, rank, exclude=lambda name: name.startswith("criu/pages"))
    assert first[0] != second[0]  # a fresh nonce prefix per image
    data = b"".join(first)
    out = tmp_path / "dst"
    reader(data).unpack(iter(first), out / "img", out / "rank")
    assert not (out / "img" / "pages-1.img").exists()
    assert (out / "img" / "core-1.img").exists()


@pytest.fixture
def image(tmp_path: Path) -> bytes:
    images, rank = make_trees(tmp_path / "src")
    pieces, _ = pack(images, rank)
    return b"".join(pieces)


@pytest.fixture
def target(tmp_path: Path) -> tuple[Path, Path]:
    out_images, out_rank = tmp_path / "dst" / "img", tmp_path / "dst" / "rank"
    out_rank.mkdir(parents=True)
    (out_rank / "mine").write_text("untouched")
    return out_images, out_rank


def assert_refused(data: bytes, target: tuple[Path, Path], match: str, **overrides: object) -> None:
    out_images, out_rank = target
    with pytest.raises(ImageError, match=match):
        reader(data, **overrides).unpack(pieces_of(data, 2), out_images, out_rank)
    assert [p.name for p in out_rank.iterdir()] == ["mine"]
    assert not out_images.exists()
    assert sorted(p.name for p in out_rank.parent.iterdir()) == ["rank"]


@pytest.mark.parametrize("where", [0.01, 0.3, 0.99, 1.0])
def test_corrupted_byte(image: bytes, target: tuple[Path, Path], where: float) -> None:
    data = bytearray(image)
    at = min(int(len(data) * where), len(data) - 1)
    data[at] ^= 0x40
    # Announced size and hash are the store's record of the original.
    assert_refused(
        bytes(data),
        target,
        "authentication failed: wrong key or corrupted",
        digest=image_digest(image),
    )


def test_not_an_image(image: bytes, target: tuple[Path, Path]) -> None:
    assert_refused(b"PK\x03\x04" + image[4:], target, "not a vpool checkpoint image")


def test_wrong_key_and_wrong_rank(image: bytes, target: tuple[Path, Path]) -> None:
    assert_refused(image, target, "authentication failed", key=bytes(32))
    assert_refused(image, target, "authentication failed", rank=4)
    assert_refused(image, target, "authentication failed", ckpt=1)


def test_truncated(image: bytes, target: tuple[Path, Path]) -> None:
    cut = image[: len(image) - 1000]
    assert_refused(cut, target, "truncated")
    # Announced the whole size, but the stream ends early.
    assert_refused(cut, target, "truncated", size=len(image))


def test_truncated_at_frame_boundary(tmp_path: Path, target: tuple[Path, Path]) -> None:
    images, rank = make_trees(tmp_path / "src")
    pieces, _ = pack(images, rank)
    cut = b"".join(pieces[:-1])  # every frame intact, the LAST one missing
    assert_refused(cut, target, "truncated")


def test_frame_length_corrupted(image: bytes, target: tuple[Path, Path]) -> None:
    data = bytearray(image)
    data[13 + 1] ^= 0x01  # the first frame's length, now past the end of the image
    assert_refused(bytes(data), target, "corrupted", digest=image_digest(image))


def test_hash_mismatch(image: bytes, target: tuple[Path, Path]) -> None:
    assert_refused(image, target, "hash mismatch", digest=bytes(32))
    # The image's SHA-256 (what a store recorded before BLAKE3) is no match either.
    assert_refused(image, target, "hash mismatch", digest=hashlib.sha256(image).digest())


def test_trailing_garbage(image: bytes, target: tuple[Path, Path]) -> None:
    assert_refused(image + b"x", target, "after the last chunk")


def frames(image: bytes) -> list[tuple[int, int, int]]:
    """(offset, length, flags) of each frame of an image."""
    out, at = [], 13
    while at < len(image):
        length, flags = int.from_bytes(image[at : at + 4], "big"), image[at + 4]
        out.append((at, length, flags))
        at += 5 + length
    assert at == len(image)
    return out


def test_chunks_compressed_only_where_it_pays(tmp_path: Path) -> None:
    """Random bytes (like a rank's floating-point arrays) travel as they are; text and zeros
    are compressed; both come back intact."""
    images, rank = tmp_path / "img", tmp_path / "rank"
    images.mkdir()
    rank.mkdir()
    noise = random.Random(5).randbytes(3 * CHUNK)
    (images / "a-noise.img").write_bytes(noise)
    (images / "b-zeros.img").write_bytes(bytes(3 * CHUNK))
    (images / "c-text.img").write_bytes(b"the quick brown fox\n" * (CHUNK // 10))
    pieces, writer = pack(images, rank)
    image = b"".join(pieces)
    found = frames(image)
    raw = [f for f in found if not f[2] & ZSTD]
    packed = [f for f in found if f[2] & ZSTD]
    # The noise chunks (the first three, less the tar header's share) are stored raw: their
    # ciphertext is CHUNK plus the tag; the zeros and the text shrink to a few KiB each.
    assert sum(1 for f in raw if f[1] == CHUNK + TAG_SIZE) >= 2
    assert len(packed) >= 4 and all(f[1] < CHUNK // 4 for f in packed[1:-1])
    assert len(image) < len(noise) + CHUNK
    out = tmp_path / "out"
    ImageReader(KEY, **IDS, size=writer.size, digest=writer.digest).unpack(
        [image], out / "img", out / "rank"
    )
    assert (out / "img" / "a-noise.img").read_bytes() == noise
    assert (out / "img" / "b-zeros.img").read_bytes() == bytes(3 * CHUNK)


def test_reused_buffer_and_sampling_after_a_run_of_noise(tmp_path: Path) -> None:
    """``reuse``: every frame is sealed into one buffer (a consumer copies or sends each piece
    before asking for the next); the image is as valid as one of fresh pieces. After a long
    run of chunks that did not shrink, one sample decides: zeros and text after it are
    compressed all the same, and an ordinary noise chunk is stored raw."""
    images, rank = tmp_path / "img", tmp_path / "rank"
    images.mkdir()
    rank.mkdir()
    noise = random.Random(6).randbytes((SKIP_AFTER + 4) * CHUNK)
    (images / "a-noise.img").write_bytes(noise)
    (images / "b-zeros.img").write_bytes(bytes(2 * CHUNK))
    (images / "c-text.img").write_bytes(b"the quick brown fox\n" * (CHUNK // 10))
    writer = ImageWriter(KEY, **IDS, reuse=True)
    samples: list[int] = []
    pays = writer._pays

    def counted(sample: bytes | memoryview) -> bool:
        samples.append(len(sample))
        return pays(sample)

    writer._pays = counted  # type: ignore[method-assign]
    copies, buffers = [], set()
    for piece in writer.pack(images, rank):
        if isinstance(piece, memoryview):
            buffers.add(id(piece.obj))
        copies.append(bytes(piece))
    assert len(buffers) == 1 and len(copies) > SKIP_AFTER + 6  # one buffer for every frame
    # The noise: full samples up to SKIP_AFTER chunks, then one slice each.
    assert samples[:SKIP_AFTER] == [SAMPLES * SAMPLE] * SKIP_AFTER
    assert samples[SKIP_AFTER : SKIP_AFTER + 3] == [SAMPLE] * 3
    image = b"".join(copies)
    assert (writer.size, writer.digest) == (len(image), image_digest(image))
    found = frames(image)
    raw = [f for f in found if not f[2] & ZSTD]
    packed = [f for f in found if f[2] & ZSTD]
    assert sum(1 for f in raw if f[1] == CHUNK + TAG_SIZE) >= SKIP_AFTER + 2
    assert len(packed) >= 3 and all(f[1] < CHUNK // 4 for f in packed[:-1])
    out = tmp_path / "out"
    ImageReader(KEY, **IDS, size=writer.size, digest=writer.digest).unpack(
        pieces_of(image, 3), out / "img", out / "rank"
    )
    assert (out / "img" / "a-noise.img").read_bytes() == noise
    assert (out / "img" / "c-text.img").read_bytes() == b"the quick brown fox\n" * (CHUNK // 10)


def test_compression_flag_is_authenticated(image: bytes, target: tuple[Path, Path]) -> None:
    """A frame's ZSTD flag flipped (say, so that a raw chunk is fed to zstd) fails its tag."""
    data = bytearray(image)
    at, _, _ = frames(image)[0]
    data[at + 4] ^= ZSTD
    assert_refused(bytes(data), target, "authentication failed", digest=image_digest(data))


def seal(tar_bytes: bytes) -> bytes:
    return b"".join(ImageWriter(KEY, **IDS).seal([tar_bytes]))


def tar_of(*members: tuple[tarfile.TarInfo, bytes | None]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, content in members:
            if content is not None:
                info.size = len(content)
            tar.addfile(info, io.BytesIO(content) if content is not None else None)
    return buffer.getvalue()


def info(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    member = tarfile.TarInfo(name)
    member.type = kind
    member.linkname = link
    member.mode = 0o644
    return member


def appended(name: str, value: str = "1") -> tarfile.TarInfo:
    member = info(name)
    member.pax_headers = {APPEND: value}
    return member


def test_appended_parts_make_one_file(tmp_path: Path) -> None:
    data = seal(
        tar_of(
            (info("rank/f"), b"ab"),
            (appended("rank/f"), b"cd"),
            (appended("rank/f"), b""),
            (appended("rank/f"), b"e"),
            (info("rank/g"), b"g"),
        )
    )
    out_images, out_rank = tmp_path / "img", tmp_path / "rank"
    reader(data).unpack([data], out_images, out_rank)
    assert (out_rank / "f").read_bytes() == b"abcde"
    assert (out_rank / "g").read_bytes() == b"g"


UNSAFE = {
    "absolute": [(info("/etc/evil"), b"x")],
    "dotdot": [(info("rank/../evil"), b"x")],
    "outside roots": [(info("other/file"), b"x")],
    "absolute link": [(info("rank/l", tarfile.SYMTYPE, "/etc/passwd"), None)],
    "link up": [(info("rank/l", tarfile.SYMTYPE, "../../etc"), None)],
    "link from criu to rank": [(info("criu/l", tarfile.SYMTYPE, "../rank"), None)],
    "link chain": [
        (info("rank/s", tarfile.SYMTYPE, "."), None),
        (info("rank/a", tarfile.SYMTYPE, "s/../x"), None),
    ],
    "file below link": [
        (info("rank/d", tarfile.SYMTYPE, "."), None),
        (info("rank/d/f"), b"x"),
    ],
    "hard link": [(info("rank/f"), b"x"), (info("rank/h", tarfile.LNKTYPE, "rank/f"), None)],
    "device": [(info("rank/dev", tarfile.CHRTYPE), None)],
    "fifo": [(info("rank/p", tarfile.FIFOTYPE), None)],
    "twice": [(info("rank/f"), b"x"), (info("rank/f"), b"y")],
    # A Stream's continuation extends the file just before it, and nothing else.
    "append first": [(appended("rank/f"), b"x")],
    "append to another": [(info("rank/f"), b"x"), (appended("rank/g"), b"y")],
    "append later": [(info("rank/f"), b"x"), (info("rank/g"), b"y"), (appended("rank/f"), b"z")],
    "append to a link": [(info("rank/l", tarfile.SYMTYPE, "f"), None), (appended("rank/l"), b"z")],
    "append other value": [(info("rank/f"), b"x"), (appended("rank/f", "yes"), b"y")],
}


@pytest.mark.parametrize("case", sorted(UNSAFE))
def test_unsafe_members_refused(case: str, target: tuple[Path, Path]) -> None:
    assert_refused(seal(tar_of(*UNSAFE[case])), target, "unsafe image")


def test_links_inside_allowed(tmp_path: Path) -> None:
    data = seal(
        tar_of(
            (info("rank/d", tarfile.DIRTYPE), None),
            (info("rank/d/f"), b"content"),
            (info("rank/s", tarfile.SYMTYPE, "d"), None),
            (info("rank/a", tarfile.SYMTYPE, "s/f"), None),
            (info("rank/d/back", tarfile.SYMTYPE, "../a"), None),
        )
    )
    out = tmp_path / "dst"
    reader(data).unpack([data], out / "img", out / "rank")
    assert (out / "rank" / "d" / "back").read_text() == "content"
    assert out / "img" in out.iterdir()


async def test_unpack_from_trio_channel(image: bytes, tmp_path: Path) -> None:
    send, receive = trio.open_memory_channel[bytes](4)
    out = tmp_path / "dst"

    async def feed(data: bytes) -> None:
        async with send:
            for piece in pieces_of(data, 3):
                await send.send(piece)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(feed, image)
        with receive:
            await trio.to_thread.run_sync(
                reader(image).unpack, from_channel(receive), out / "img", out / "rank"
            )
    assert (out / "rank" / "work" / "data.txt").exists()


async def test_bad_image_from_channel_does_not_block_sender(
    image: bytes, target: tuple[Path, Path]
) -> None:
    send, receive = trio.open_memory_channel[bytes](1)
    bad = bytearray(image)
    bad[len(bad) // 3] ^= 1

    async def feed() -> None:
        async with send:
            for piece in pieces_of(bytes(bad), 4):
                try:
                    await send.send(piece)
                except trio.BrokenResourceError:
                    return

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(feed)
            with receive, pytest.raises(ImageError, match="authentication failed"):
                await trio.to_thread.run_sync(reader(image).unpack, from_channel(receive), *target)
    assert [p.name for p in target[1].iterdir()] == ["mine"]


@pytest.mark.parametrize("seed", range(6))
def test_chunks_of_the_tar_stream(tmp_path: Path, seed: int) -> None:
    """The pieces ``pack`` seals are the tar stream cut at exact CHUNK boundaries, whatever
    the file sizes (padding that straddles a boundary, files ending on one), and a file that
    shrank after its header was made is zero-filled to its announced size."""
    rng = random.Random(seed)
    items: list[bytes | ckpt_tar._FileData] = []
    expected = bytearray()
    offset = 0
    for i in range(rng.randint(1, 6)):
        header = rng.randbytes(rng.choice([512, 1024, 1536]))
        # Sizes that put the end of the data, or of its padding, near a chunk boundary.
        to_boundary = (-(offset + len(header))) % CHUNK
        size = rng.choice([0, 1, 511, to_boundary, to_boundary - 5, to_boundary + 700, CHUNK + 3])
        size = max(size, 0)
        path = tmp_path / f"f{i}"
        content = rng.randbytes(size)
        shrunk = rng.random() < 0.2 and size > 10
        path.write_bytes(content[: size // 2] if shrunk else content)
        items += [header, ckpt_tar._FileData(path, size)]
        expected += header
        expected += (content[: size // 2] + bytes(size - size // 2)) if shrunk else content
        expected += bytes(-size % 512)
        offset = len(expected)
    items.append(bytes(1024))
    expected += bytes(1024)
    pieces = [bytes(p) for p in ckpt_tar.fill_chunks(items)]
    assert b"".join(pieces) == expected
    assert all(len(p) == CHUNK for p in pieces[:-1]) and 0 < len(pieces[-1]) <= CHUNK
