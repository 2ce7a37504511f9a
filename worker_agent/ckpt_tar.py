"""The tar stream inside a checkpoint image (``ckpt_image``): the CRIU images directory and the
rank directory under ``criu/`` and ``rank/``, made with one copy per byte and no memory
allocated per piece, and ``Stream``s: files archived while they are being made (CRIU's pages,
read from a pipe while CRIU writes them), as members of one chunk each, the second and later
carrying the PAX record ``APPEND`` (the reader appends those to the member just before).

A stream member fills a chunk exactly: the pipe is read straight into the chunk's buffer
behind room for the member's header, which is written in front once the bytes are counted
(a tar header's length does not depend on the size it holds). So CRIU's pages are copied once,
pipe to chunk, and sealed from there while they are still in the cache; with members of 4 MiB
read into a buffer of their own they were copied twice (200 MB more memory traffic per
checkpoint, on a machine whose ranks are bound by memory bandwidth).
"""

from __future__ import annotations

import os
import stat
import tarfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

CHUNK = 1 << 20  # plaintext bytes per sealed frame of an image: the pieces ``fill_chunks`` makes
APPEND = "VPOOL.append"
_BLOCK = tarfile.BLOCKSIZE


@dataclass(frozen=True)
class Stream:
    """A file archived while it is being made: ``read_into(view)`` fills the start of ``view``
    and returns how many bytes it put there, 0 at the end (it may block, or raise)."""

    name: str  # under the criu/ root
    read_into: Callable[[memoryview], int]


def rechunk(pieces: Iterable[bytes], size: int) -> Iterator[bytes]:
    """The bytes of ``pieces`` again, as pieces of exactly ``size`` bytes (the last: at most)."""
    buf = bytearray()
    for piece in pieces:
        if not buf and len(piece) == size:
            yield piece
            continue
        buf += piece
        while len(buf) >= size:
            yield bytes(buf[:size])
            del buf[:size]
    if buf:
        yield bytes(buf)


@dataclass(frozen=True)
class _StreamData:
    """A ``Stream``'s members in the tar stream (``fill_chunks`` reads it into its chunks)."""

    name: str
    stream: Stream


@dataclass(frozen=True)
class _FileData:
    """A regular file's content in the tar stream: ``size`` bytes, then padding to a block."""

    path: Path
    size: int


def tar_items(
    roots: dict[str, Path],
    exclude: Callable[[str], bool] | None,
    streams: Sequence[Stream] = (),
    then: Callable[[], None] | None = None,
) -> Iterator[bytes | _StreamData | _FileData]:
    """A tar archive of each root under its name: headers (bytes) and file contents; the
    ``streams`` first, under criu/."""
    streamed = {f"criu/{s.name}" for s in streams}
    if streams:
        yield _header("criu", os.lstat(roots["criu"]))
    for stream in streams:
        yield _StreamData(f"criu/{stream.name}", stream)
    if then is not None:
        then()

    def skip(name: str) -> bool:
        return name in streamed or (exclude is not None and exclude(name))

    for name, root in roots.items():
        yield from _tar_entry(name, root, skip, top=True, header=not (streams and name == "criu"))
    yield b"\0" * (2 * _BLOCK)


def _member_header(name: str, size: int, *, appended: bool) -> bytes:
    """The tar header of a stream member of ``size`` bytes (its length does not depend on
    ``size``: the ustar field is fixed, and no PAX size record is needed below 8 GiB)."""
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, 0o600, int(time.time())
    if appended:
        info.pax_headers = {APPEND: "1"}
    return info.tobuf(tarfile.PAX_FORMAT)


def _header(name: str, st: os.stat_result) -> bytes:
    info = tarfile.TarInfo(name)
    info.mode = stat.S_IMODE(st.st_mode)
    info.mtime = st.st_mtime_ns // 1_000_000_000
    info.pax_headers = {"mtime": f"{info.mtime}.{st.st_mtime_ns % 1_000_000_000:09d}"}
    info.type = tarfile.DIRTYPE
    return info.tobuf(tarfile.PAX_FORMAT)


def _tar_entry(
    name: str,
    path: Path,
    exclude: Callable[[str], bool] | None,
    *,
    top: bool = False,
    header: bool = True,
) -> Iterator[bytes | _FileData]:
    if not top and exclude is not None and exclude(name):
        return
    st = os.lstat(path)
    info = tarfile.TarInfo(name)
    info.mode = stat.S_IMODE(st.st_mode)
    # Exact to the nanosecond: tarfile's float mtime is not.
    info.mtime = st.st_mtime_ns // 1_000_000_000
    info.pax_headers = {"mtime": f"{info.mtime}.{st.st_mtime_ns % 1_000_000_000:09d}"}
    if stat.S_ISDIR(st.st_mode):
        if header:
            yield _header(name, st)
        for entry in sorted(os.listdir(path)):
            yield from _tar_entry(f"{name}/{entry}", path / entry, exclude)
    elif stat.S_ISLNK(st.st_mode):
        info.type = tarfile.SYMTYPE
        info.linkname = os.readlink(path)
        yield info.tobuf(tarfile.PAX_FORMAT)
    elif stat.S_ISREG(st.st_mode):
        info.size = st.st_size
        yield info.tobuf(tarfile.PAX_FORMAT)
        yield _FileData(path, st.st_size)
    # Sockets, FIFOs and devices cannot travel: a restored program meets their absence.


def fill_chunks(items: Iterable[bytes | _StreamData | _FileData]) -> Iterator[memoryview]:
    """The tar stream of ``items`` as CHUNK-byte pieces (the last one shorter, and the one
    before a stream's first member, which starts a chunk of its own), file contents read
    straight into two buffers used in turn: a piece stays intact until the one after the
    next is asked for. One copy per byte, and no memory allocated per piece (fresh pages cost
    more than the copy on this kind of machine)."""
    buffers = (bytearray(CHUNK), bytearray(CHUNK))
    views = (memoryview(buffers[0]), memoryview(buffers[1]))
    which, fill = 0, 0
    for item in items:
        if isinstance(item, _StreamData):
            if fill:
                yield views[which][:fill]
                which, fill = which ^ 1, 0
            appended = False
            while True:
                view = views[which]
                head = len(_member_header(item.name, 0, appended=appended))
                n = 0
                while head + n < CHUNK and (got := item.stream.read_into(view[head + n :])):
                    n += got
                if n == 0 and appended:
                    break  # the stream ended with its last member
                header = _member_header(item.name, n, appended=appended)
                assert len(header) == head
                view[:head] = header
                fill = head + n
                if fill < CHUNK:  # the stream's end: the rest of the chunk is for what follows
                    pad = -n % _BLOCK
                    view[fill : fill + pad] = bytes(pad)
                    fill += pad
                    break
                yield view
                which, fill = which ^ 1, 0
                appended = True
            if fill == CHUNK:
                yield views[which]
                which, fill = which ^ 1, 0
            continue
        if not isinstance(item, _FileData):
            data = memoryview(item)
            while data:
                n = min(len(data), CHUNK - fill)
                views[which][fill : fill + n] = data[:n]
                fill += n
                data = data[n:]
                if fill == CHUNK:
                    yield views[which]
                    which, fill = which ^ 1, 0
            continue
        left = item.size
        with open(item.path, "rb", buffering=0) as f:
            while left > 0:
                want = min(left, CHUNK - fill)
                n = f.readinto(views[which][fill : fill + want])
                if not n:  # the file shrank meanwhile: zero-filled to its announced size
                    views[which][fill : fill + want] = bytes(want)
                    n = want
                fill += n
                left -= n
                if fill == CHUNK:
                    yield views[which]
                    which, fill = which ^ 1, 0
        if item.size % _BLOCK:
            pad = _BLOCK - item.size % _BLOCK
            # A block's padding never spans more than the rest of the buffer plus one piece.
            first = min(pad, CHUNK - fill)
            views[which][fill : fill + first] = bytes(first)
            fill += first
            if fill == CHUNK:
                yield views[which]
                which, fill = which ^ 1, 0
                views[which][: pad - first] = bytes(pad - first)
                fill = pad - first
    if fill:
        yield views[which][:fill]
