"""Checkpoint images on the wire: tar, zstd, AES-256-GCM chunks, streamed both ways.

An image is the CRIU images directory (archived under ``criu/``) and the rank directory (under
``rank/``) as one stream, made and read with bounded memory and no temporary file::

    image  = MAGIC (5 bytes) | nonce prefix (8 random bytes) | frame* (the last has LAST set)
    frame  = length (4 bytes, big-endian) | flags (1 byte: LAST = 1, ZSTD = 2) | ciphertext

The plaintext is a POSIX tar stream (PAX headers: directories, regular files, symlinks, with
modes and mtimes; sockets, FIFOs and devices are left out; made by ``ckpt_tar``) cut into
``CHUNK``-byte pieces.
A file whose size is not known when it is archived (``Stream``: CRIU's pages, read from a pipe
while CRIU writes them) is a regular member that fills one piece followed by more of the same
name, each with the PAX record ``VPOOL.append=1``: the reader appends those to the member just
before them, and to nothing else.
Each piece is compressed on its own with zstd (flag ZSTD) when a sample of it shows that
pays, and stored as it is otherwise: a rank's big arrays of floating-point numbers gain about
5% at level 1 for 0.3 s of CPU per 200 MB, while the interpreter's heap and zero pages shrink
a lot. After ``SKIP_AFTER`` pieces in a row that did not pay, one sample slice decides (a
quarter of the sampling), until a piece pays again. Piece n is sealed with AES-256-GCM under
the job's checkpoint key, nonce = prefix | n (4 bytes, big-endian), associated data =
``b"vpool-ckpt"`` | job | rank | ckpt | n | flags: a frame moved, dropped, taken from another
image or rank, flagged differently, or a stream cut after a frame fails its tag or the LAST
check. ``size`` is the image's bytes, ``digest`` its skeleton digest
(``protocol.ckptdigest``: BLAKE3-256 of the header, each frame's header and tag, and the
size): with every tag checked, it binds every byte.

Reading checks everything (announced size and digest, each tag, the order, the LAST frame)
and extracts into staging directories next to the targets, moved into place only once the
whole image checked out: a bad image never touches the rank directory. Extraction refuses
absolute or ``..`` paths, links that point outside their tree, hard links and device files.

Errors: ``ImageError`` (the image is unusable; the message says why).
"""

from __future__ import annotations

import os
import secrets
import shutil
import stat
import struct
import tarfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path, PurePosixPath
from typing import IO

import trio
import zstandard
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from vpool.protocol.ckptdigest import FRAME_HEADER, IMAGE_HEADER, TAG, ImageDigest
from vpool.worker_agent.ckpt_tar import APPEND, CHUNK, Stream, fill_chunks, rechunk, tar_items
from vpool.worker_agent.errors import AgentError

MAGIC = b"VPCK\x03"  # 3: the digest is the skeleton's (``protocol.ckptdigest``)
LAST = 1
ZSTD = 2
# A piece is compressed when these samples of it (SAMPLES slices of SAMPLE bytes, spread over
# it) shrink below SAMPLE_RATIO of their size; each costs 1/16 of compressing the whole piece.
SAMPLE = 16 * 1024
SAMPLES = 4
SAMPLE_RATIO = 0.9
SKIP_AFTER = 8  # pieces in a row that did not pay, after which one slice is sampled
TAG_SIZE = TAG  # the layout is ``protocol.ckptdigest``'s, which a store parses too
_FRAME = struct.Struct(">IB")
_AAD = struct.Struct(">qqqIB")
_HEADER_SIZE = IMAGE_HEADER
assert _FRAME.size == FRAME_HEADER and len(MAGIC) + 8 == IMAGE_HEADER
_ROOTS = ("criu", "rank")


class ImageError(AgentError):
    """A checkpoint image is unusable (tampered, truncated, wrong key, unsafe content)."""


def _aad(job: int, rank: int, ckpt: int, number: int, flags: int) -> bytes:
    return b"vpool-ckpt" + _AAD.pack(job, rank, ckpt, number, flags)


def _cipher(key: bytes) -> AESGCM:
    if len(key) != 32:
        raise ValueError(f"a checkpoint key is 32 bytes, not {len(key)}")
    return AESGCM(key)


# -- writing ------------------------------------------------------------------------------


Piece = bytes | bytearray | memoryview


class ImageWriter:
    """Makes one image: ``pack`` yields its bytes; ``size``/``digest`` are final after it.

    ``reuse``: every frame is sealed into one buffer allocated once, and what ``pack`` yields
    stays intact only until the next piece is asked for (a consumer that sends each piece at
    once saves an allocation and its page faults per megabyte); otherwise each is its own."""

    def __init__(
        self, key: bytes, *, job: int, rank: int, ckpt: int, level: int = 1, reuse: bool = False
    ) -> None:
        self._aead = _cipher(key)
        self._ids = (job, rank, ckpt)
        self._zstd = zstandard.ZstdCompressor(level=level)
        self._prefix = secrets.token_bytes(8)
        self._hasher = ImageDigest()
        self._buffer = bytearray(_FRAME.size + CHUNK + TAG_SIZE) if reuse else None
        self._plain_run = 0  # pieces in a row whose compression did not pay
        self.size = 0
        self.digest = b""

    def pack(
        self,
        images_dir: Path,
        rank_dir: Path,
        *,
        exclude: Callable[[str], bool] | None = None,
        streams: Sequence[Stream] = (),
        then: Callable[[], None] | None = None,
    ) -> Iterator[Piece]:
        """The image's bytes, a header then one frame at a time (CPU bound: run in a thread).

        ``exclude(name)`` gets each archive name (``criu/...``, ``rank/...``) and leaves the
        entry (a directory: with its contents) out when it returns true. ``streams`` come
        first, read to their end (their names in ``images_dir`` are not archived again); then
        ``then()`` is called (it may wait for the rest of ``images_dir`` to be written, or
        raise) and the trees are archived.
        """
        items = tar_items({"criu": images_dir, "rank": rank_dir}, exclude, streams, then)
        return self._seal_chunks(fill_chunks(items))

    def seal(self, tar_pieces: Iterable[bytes]) -> Iterator[Piece]:
        """The image of an archive given as pieces (``pack`` with the tar stream made)."""
        return self._seal_chunks(rechunk(tar_pieces, CHUNK))

    def _seal_chunks(self, chunks: Iterable[bytes | memoryview]) -> Iterator[Piece]:
        """The image of the archive cut into ``chunks`` (each CHUNK bytes but the last; a
        chunk need stay intact only until the next one is asked for)."""
        yield self._count(MAGIC + self._prefix)
        # One piece is held back: only the end of the stream says which piece is the last.
        held: bytes | memoryview | None = None
        number = 0
        for piece in chunks:
            if held is not None:
                yield self._count(self._seal(number, held, last=False))
                number += 1
            held = piece
        yield self._count(self._seal(number, held or b"", last=True))
        self.digest = self._hasher.digest()

    def _seal(self, number: int, plain: bytes | memoryview, *, last: bool) -> Piece:
        """Frame ``number``: its header, then ``plain`` (maybe compressed) sealed right after
        it in the same buffer (``encrypt_into``: no copy to join them)."""
        body, flags = self._compress(plain)
        flags |= LAST if last else 0
        nonce = self._prefix + number.to_bytes(4, "big")
        sealed = len(body) + TAG_SIZE
        end = _FRAME.size + sealed
        frame = memoryview(self._buffer if self._buffer is not None else bytearray(end))[:end]
        _FRAME.pack_into(frame, 0, sealed, flags)
        self._aead.encrypt_into(nonce, body, _aad(*self._ids, number, flags), frame[_FRAME.size :])
        return frame

    def _compress(self, plain: bytes | memoryview) -> tuple[bytes | memoryview, int]:
        """``(zstd frame, ZSTD)`` when compressing ``plain`` pays, else ``(plain, 0)``."""
        if len(plain) > SAMPLES * SAMPLE:
            if self._plain_run >= SKIP_AFTER:
                middle = (len(plain) - SAMPLE) // 2
                if not self._pays(plain[middle : middle + SAMPLE]):
                    self._plain_run += 1
                    return plain, 0
            step = (len(plain) - SAMPLE) // (SAMPLES - 1)
            sample = b"".join(plain[i * step : i * step + SAMPLE] for i in range(SAMPLES))
            if not self._pays(sample):
                self._plain_run += 1
                return plain, 0
        packed = self._zstd.compress(plain)
        if len(packed) >= len(plain):
            self._plain_run += 1
            return plain, 0
        self._plain_run = 0
        return packed, ZSTD

    def _pays(self, sample: bytes | memoryview) -> bool:
        return len(self._zstd.compress(sample)) <= SAMPLE_RATIO * len(sample)

    def _count(self, data: Piece) -> Piece:
        self.size += len(data)
        self._hasher.update(data)
        return data


# -- reading ------------------------------------------------------------------------------


class ImageReader:
    """Checks and unpacks one image whose store record says ``size`` bytes, ``digest``."""

    def __init__(
        self, key: bytes, *, job: int, rank: int, ckpt: int, size: int, digest: bytes
    ) -> None:
        self._aead = _cipher(key)
        self._ids = (job, rank, ckpt)
        self._size = size
        self._digest = digest

    def unpack(self, source: Iterable[bytes], images_dir: Path, rank_dir: Path) -> None:
        """Consume the image's bytes (pieces of any size) and put its trees at ``images_dir``
        and ``rank_dir`` (whatever was there is replaced). Blocking: run in a thread; raises
        ImageError, leaving both targets untouched."""
        opener = _Opener(self._aead, self._ids, source, self._size)
        staging = {
            "criu": _staging_dir(images_dir),
            "rank": _staging_dir(rank_dir),
        }
        try:
            try:
                with tarfile.open(fileobj=opener, mode="r|") as archive:
                    _Extractor(staging).run(archive)
                while opener.read(CHUNK):
                    pass
                opener.finish()
            except ImageError:
                raise
            except (tarfile.TarError, zstandard.ZstdError, OSError, ValueError) as exc:
                # The opener's own verdict comes first: it is why the layers above failed.
                if opener.error is not None:
                    raise opener.error from exc
                raise ImageError(f"unusable image content: {exc}") from exc
            if opener.hasher.digest() != self._digest:
                raise ImageError("hash mismatch: the image is not the one the store recorded")
            _replace(staging["criu"], images_dir)
            _replace(staging["rank"], rank_dir)
        finally:
            for path in staging.values():
                shutil.rmtree(path, ignore_errors=True)


def from_channel(receive: trio.MemoryReceiveChannel[bytes]) -> Iterator[bytes]:
    """The pieces arriving on a trio channel, as ``unpack``'s source when ``unpack`` runs in
    ``trio.to_thread.run_sync``. Close the channel once ``unpack`` is done (it may stop early,
    on a bad image), so the sender is not left blocked."""
    while True:
        try:
            yield trio.from_thread.run(receive.receive)
        except trio.EndOfChannel:
            return


def _staging_dir(target: Path) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    path = target.parent / f".{target.name}.unpack-{secrets.token_hex(4)}"
    path.mkdir(mode=0o700)
    return path


def _replace(staged: Path, target: Path) -> None:
    if target.exists() or target.is_symlink():
        aside = target.parent / f".{target.name}.old-{secrets.token_hex(4)}"
        target.rename(aside)
        shutil.rmtree(aside, ignore_errors=True)
    staged.rename(target)


class _Opener:
    """File-like ``read`` of the archive, checking the frames as they pass."""

    def __init__(
        self,
        aead: AESGCM,
        ids: tuple[int, int, int],
        source: Iterable[bytes],
        size: int,
    ) -> None:
        self._aead = aead
        self._ids = ids
        self._source = iter(source)
        self._size = size
        self._received = 0
        self._buffer = bytearray()
        self._plain = b""
        self._offset = 0
        self._prefix = b""
        self._number = 0
        self._last = False
        self._unzstd = zstandard.ZstdDecompressor()
        self.hasher = ImageDigest()
        self.error: ImageError | None = None

    def read(self, n: int = -1) -> bytes:
        try:
            while self._offset >= len(self._plain):
                if self._last:
                    return b""
                self._plain, self._offset = self._next_frame(), 0
        except ImageError as exc:
            self.error = exc
            raise
        end = len(self._plain) if n < 0 else self._offset + n
        data = self._plain[self._offset : end]
        self._offset += len(data)
        return data

    def finish(self) -> None:
        """After the archive: the LAST frame came, and nothing follows it."""
        while not self._last:
            self._plain, self._offset = self._next_frame(), 0
        if self._buffer or self._pull():
            raise ImageError("corrupted: data after the last chunk")
        if self._received != self._size:
            raise ImageError(f"truncated: {self._received} of {self._size} bytes")

    def _next_frame(self) -> bytes:
        if not self._prefix:
            header = self._take(_HEADER_SIZE)
            if header[: len(MAGIC)] != MAGIC:
                raise ImageError("not a vpool checkpoint image (bad magic)")
            self._prefix = header[len(MAGIC) :]
        if not self._buffer and not self._pull():
            raise ImageError(
                f"truncated: the image ends before its last chunk ({self._received} bytes)"
            )
        length, flags = _FRAME.unpack(self._take(_FRAME.size))
        if length > CHUNK + TAG_SIZE or length < TAG_SIZE or flags & ~(LAST | ZSTD):
            raise ImageError(f"corrupted: bad frame header at chunk {self._number}")
        sealed = self._take(length)
        nonce = self._prefix + self._number.to_bytes(4, "big")
        try:
            plain = self._aead.decrypt(nonce, sealed, _aad(*self._ids, self._number, flags))
        except InvalidTag:
            raise ImageError(
                f"authentication failed: wrong key or corrupted (chunk {self._number})"
            ) from None
        if flags & ZSTD:
            plain = self._unpack_chunk(plain)
        self._number += 1
        self._last = bool(flags & LAST)
        return plain

    def _unpack_chunk(self, packed: bytes) -> bytes:
        """A ZSTD chunk's plaintext: one zstd frame that says its size, at most CHUNK bytes."""
        try:
            size = zstandard.frame_content_size(packed)
            if size < 0 or size > CHUNK:
                raise ImageError(f"corrupted: chunk {self._number} unpacks to {size} bytes")
            return self._unzstd.decompress(packed, max_output_size=CHUNK)
        except zstandard.ZstdError as exc:
            raise ImageError(f"corrupted: chunk {self._number} does not unpack: {exc}") from None

    def _take(self, n: int) -> bytes:
        while len(self._buffer) < n:
            if self._pull():
                continue
            if self._received < self._size:
                raise ImageError(
                    f"truncated: the image ends after {self._received} of {self._size} bytes"
                )
            raise ImageError(
                f"truncated or corrupted: chunk {self._number} runs past the end of the image"
            )
        data = bytes(self._buffer[:n])
        del self._buffer[:n]
        return data

    def _pull(self) -> bool:
        """One more piece from the source into the buffer; False at its end."""
        for piece in self._source:
            if not piece:
                continue
            self._received += len(piece)
            if self._received > self._size:
                raise ImageError(f"corrupted: longer than its recorded {self._size} bytes")
            self.hasher.update(piece)
            self._buffer += piece
            return True
        return False


class _Extractor:
    """Writes archive members into the staging roots, refusing anything that could escape."""

    def __init__(self, roots: dict[str, Path]) -> None:
        self._roots = roots
        # Relative paths (root name first) extracted so far, and whether each is a directory.
        self._kinds: dict[PurePosixPath, bool] = {PurePosixPath(r): True for r in roots}
        self._dirs: list[tuple[Path, int, int]] = []
        self._links: dict[PurePosixPath, tuple[str, int]] = {}
        self._last_file: PurePosixPath | None = None  # the one an APPEND member may extend

    def run(self, archive: tarfile.TarFile) -> None:
        for member in archive:
            self._extract(archive, member)
        for rel, (linkname, mtime_ns) in self._links.items():
            if self._resolve(list(rel.parent.parts), linkname, 0) is None:
                raise ImageError(f"unsafe image: link {str(rel)!r} points outside ({linkname!r})")
            os.symlink(linkname, self._target(rel))
            os.utime(self._target(rel), ns=(mtime_ns, mtime_ns), follow_symlinks=False)
        # Directories last, deepest first: their mtimes and (maybe read-only) modes.
        for path, mode, mtime_ns in reversed(self._dirs):
            os.chmod(path, mode)
            os.utime(path, ns=(mtime_ns, mtime_ns))

    def _extract(self, archive: tarfile.TarFile, member: tarfile.TarInfo) -> None:
        rel = _safe_name(member.name)
        if APPEND in member.pax_headers:
            self._append(archive, member, rel)
            return
        self._last_file = None
        for parent in list(reversed(rel.parents))[1:]:
            kind = self._kinds.get(parent)
            if kind is None:
                self._kinds[parent] = True
                self._target(parent).mkdir(mode=0o700)
            elif not kind:
                raise ImageError(f"unsafe image: {member.name!r} is below a non-directory")
        if rel in self._kinds and not (member.isdir() and self._kinds[rel]):
            raise ImageError(f"unsafe image: {member.name!r} appears twice")
        target = self._target(rel)
        mtime_ns = _mtime_ns(member)
        mode = member.mode & 0o777 | (member.mode & stat.S_ISVTX)
        if member.isdir():
            if rel not in self._kinds:
                target.mkdir(mode=0o700)
            self._kinds[rel] = True
            self._dirs.append((target, mode, mtime_ns))
            return
        if member.issym():
            # Made once every member is known, so where a link leads can be followed.
            self._kinds[rel] = False
            self._links[rel] = (member.linkname, mtime_ns)
            return
        if not member.isreg():
            raise ImageError(f"unsafe image: {member.name!r} is not a file, link or directory")
        self._kinds[rel] = False
        data = archive.extractfile(member)
        assert data is not None  # a regular member always has data
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as out:
            _copy(data, out)
        os.chmod(target, mode)
        os.utime(target, ns=(mtime_ns, mtime_ns))
        self._last_file = rel

    def _append(
        self, archive: tarfile.TarFile, member: tarfile.TarInfo, rel: PurePosixPath
    ) -> None:
        """More of the regular file extracted just before (``Stream``), and of no other."""
        if not member.isreg() or rel != self._last_file or member.pax_headers[APPEND] != "1":
            raise ImageError(f"unsafe image: {member.name!r} appends to what it may not")
        data = archive.extractfile(member)
        assert data is not None
        target = self._target(rel)
        mtime_ns = os.stat(target).st_mtime_ns
        fd = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW)
        with os.fdopen(fd, "wb") as out:
            _copy(data, out)
        os.utime(target, ns=(mtime_ns, mtime_ns))

    def _resolve(self, where: list[str], linkname: str, depth: int) -> list[str] | None:
        """Where ``linkname`` leads from directory ``where`` (root name first), following
        the image's own links; None when it leaves the root (or loops)."""
        if depth > 40 or not linkname or linkname.startswith("/") or "\0" in linkname:
            return None
        stack = list(where)
        for part in linkname.split("/"):
            if part in ("", "."):
                continue
            if part == "..":
                if len(stack) == 1:
                    return None
                stack.pop()
                continue
            stack.append(part)
            inner = self._links.get(PurePosixPath(*stack))
            if inner is not None:
                resolved = self._resolve(stack[:-1], inner[0], depth + 1)
                if resolved is None:
                    return None
                stack = resolved
        return stack

    def _target(self, rel: PurePosixPath) -> Path:
        return self._roots[rel.parts[0]].joinpath(*rel.parts[1:])


def _safe_name(name: str) -> PurePosixPath:
    rel = PurePosixPath(name)
    if (
        not name
        or "\0" in name
        or rel.is_absolute()
        or rel.parts[0] not in _ROOTS
        or any(part in ("..", ".") for part in name.split("/"))
    ):
        raise ImageError(f"unsafe image: member name {name!r}")
    return rel


def _mtime_ns(member: tarfile.TarInfo) -> int:
    exact = member.pax_headers.get("mtime", "")
    seconds, _, fraction = exact.partition(".")
    if seconds.isdigit() and (fraction.isdigit() or not fraction):
        return int(seconds) * 1_000_000_000 + int(fraction[:9].ljust(9, "0") or 0)
    return int(member.mtime * 1_000_000_000)


def _copy(source: IO[bytes], out: IO[bytes]) -> None:
    while data := source.read(CHUNK):
        out.write(data)
