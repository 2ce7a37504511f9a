"""Content-addressed files: ``state_dir/blobs/ab/cdef...`` named by their sha256.

Writes stream to a temporary file and are renamed into place only once the hash is known, so a
blob file is either whole or absent. Disk work runs on worker threads.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
import warnings
import zipfile
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from pathlib import Path, PurePosixPath
from typing import IO

import trio

from vpool.coordinator.errors import BadRequest, HashMismatch, TooLarge

SHA256_RE = re.compile(r"[0-9a-f]{64}")
MAX_ENTRY_BYTES = 16 << 20
_FLUSH_BYTES = 1 << 20


def check_sha256(text: str) -> str:
    if not SHA256_RE.fullmatch(text):
        raise BadRequest(f"{text[:80]!r} is not a sha256 (64 lower-case hex digits)")
    return text


class BlobFiles:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.tmp = root / "tmp"
        self.tmp.mkdir(parents=True, exist_ok=True)
        self._limiter = trio.CapacityLimiter(4)

    def path(self, sha256: str) -> Path:
        return self.root / sha256[:2] / sha256[2:]

    async def exists(self, sha256: str) -> bool:
        return await trio.to_thread.run_sync(self.path(sha256).is_file, limiter=self._limiter)

    async def write(
        self,
        chunks: AsyncIterator[bytes],
        *,
        expected: str | None,
        max_bytes: int,
        admit: Callable[[str, int], Awaitable[None]] | None = None,
    ) -> tuple[str, int]:
        """Store a streamed body; return ``(sha256, size)``. ``admit(sha256, size)``, when
        given, may refuse it (by raising) once it is read and before it is stored."""
        fd, tmp_name = await trio.to_thread.run_sync(
            lambda: tempfile.mkstemp(dir=self.tmp), limiter=self._limiter
        )
        tmp = Path(tmp_name)
        try:
            with os.fdopen(fd, "wb") as out:
                digest, size = await self._copy(chunks, out, max_bytes)
            if expected is not None and digest != expected:
                raise HashMismatch(f"the body's sha256 is {digest}, not the {expected} of the URL")
            if admit is not None:
                await admit(digest, size)
            await trio.to_thread.run_sync(self._install, tmp, digest, limiter=self._limiter)
        finally:
            # Gone already when it was installed; otherwise a failed upload's leftovers.
            with trio.move_on_after(10, shield=True):
                await trio.to_thread.run_sync(partial(tmp.unlink, missing_ok=True))
        return digest, size

    async def _copy(
        self, chunks: AsyncIterator[bytes], out: IO[bytes], max_bytes: int
    ) -> tuple[str, int]:
        hasher = hashlib.sha256()
        size = 0
        pending = bytearray()
        async for chunk in chunks:
            size += len(chunk)
            if size > max_bytes:
                raise TooLarge(f"the body is larger than max_blob_bytes ({max_bytes} bytes)")
            hasher.update(chunk)
            pending += chunk
            if len(pending) >= _FLUSH_BYTES:
                data, pending = bytes(pending), bytearray()
                await trio.to_thread.run_sync(out.write, data, limiter=self._limiter)
        if pending:
            await trio.to_thread.run_sync(out.write, bytes(pending), limiter=self._limiter)
        return hasher.hexdigest(), size

    def _install(self, tmp: Path, sha256: str) -> None:
        final = self.path(sha256)
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, final)

    async def check_bundle(self, sha256: str, entry: str, *, max_members: int = 0) -> None:
        """Refuse (``BadRequest``) a bundle that is not a safe zip, holds more than
        ``max_members`` members (0: any number), or whose entry is not Python source."""
        await trio.to_thread.run_sync(
            _check_bundle, self.path(sha256), entry, max_members, limiter=self._limiter
        )

    async def check_zip(self, sha256: str) -> None:
        await trio.to_thread.run_sync(_check_zip, self.path(sha256), limiter=self._limiter)


def safe_member(name: str) -> bool:
    """A zip member name that stays inside the directory it is extracted to."""
    path = PurePosixPath(name)
    return bool(name) and not path.is_absolute() and ".." not in path.parts and "\\" not in name


def _check_zip(path: Path) -> None:
    try:
        with zipfile.ZipFile(path) as zf:
            bad = [n for n in zf.namelist() if not safe_member(n)]
    except (zipfile.BadZipFile, OSError) as exc:
        raise BadRequest(f"not a valid zip file: {exc}", code="bad_bundle") from exc
    if bad:
        raise BadRequest(f"zip member {bad[0]!r} would escape its directory", code="bad_bundle")


def _check_bundle(path: Path, entry: str, max_members: int = 0) -> None:
    _check_zip(path)
    if not safe_member(entry):
        raise BadRequest(
            f"entry {entry!r} is not a relative path inside the bundle", code="bad_bundle"
        )
    with zipfile.ZipFile(path) as zf:
        names = zf.namelist()
        if max_members and len(names) > max_members:
            raise BadRequest(
                f"the bundle has {len(names)} members, more than this pool's limit of "
                f"{max_members} (max_bundle_members)",
                code="bad_bundle",
            )
        if entry not in names:
            shown = ", ".join(n for n in names[:10] if not n.endswith("/")) or "nothing"
            raise BadRequest(
                f"entry {entry!r} is not in the bundle (it holds: {shown})", code="bad_bundle"
            )
        info = zf.getinfo(entry)
        if info.file_size > MAX_ENTRY_BYTES:
            raise BadRequest(
                f"entry {entry!r} is larger than {MAX_ENTRY_BYTES} bytes", code="not_python"
            )
        try:
            source = zf.read(entry)
        except (zipfile.BadZipFile, OSError, RuntimeError, NotImplementedError) as exc:
            raise BadRequest(
                f"cannot read {entry!r} from the bundle: {exc}", code="bad_bundle"
            ) from exc
    try:
        # A program's own warnings (e.g. an invalid escape) are not ours to raise.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compile(source, entry, "exec", dont_inherit=True)
    except SyntaxError as exc:
        raise BadRequest(
            f"entry {entry!r} is not Python source: {exc.msg} (line {exc.lineno})",
            code="not_python",
        ) from exc
    except ValueError as exc:
        raise BadRequest(f"entry {entry!r} is not Python source: {exc}", code="not_python") from exc
    except (RecursionError, MemoryError) as exc:
        # An expression nested too deep for the compiler ("1+1+...+1", 200,000 terms).
        raise BadRequest(
            f"entry {entry!r} cannot be compiled: {type(exc).__name__}: {exc}",
            code="not_python",
        ) from exc
