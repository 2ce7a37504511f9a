"""App bundles and results: content-addressed blob cache, safe extraction, results zips.

Blobs are fetched from the coordinator into ``<work_dir>/blobs/<sha256>`` and their hash is
checked every time before use: a bundle that does not hash to its name never runs. Extraction
refuses, rather than silently rewrites, any member that would land outside the work directory.
The blocking parts (hashing, unzipping, zipping) run in worker threads.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import re
import stat
import zipfile
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path, PurePosixPath

import trio

from vpool import sizes
from vpool.worker_agent import rank_tree
from vpool.worker_agent.errors import BundleError, BundleRejected, NoRoom

_SHA256 = re.compile(r"[0-9a-f]{64}")
_FILE_LIMITER = trio.CapacityLimiter(4)

Snapshot = dict[str, tuple[int, int]]  # relative path -> (size, mtime_ns)
Fetch = Callable[[str, Path], Awaitable[str]]


def check_sha256(sha: str) -> str:
    if not _SHA256.fullmatch(sha):
        raise BundleError(f"{sha!r} is not a sha256 blob name")
    return sha


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1024 * 1024):
            digest.update(chunk)
    return digest.hexdigest()


class BlobCache:
    """Verified blobs by sha256; ``fetch(sha, dest) -> sha of what arrived`` downloads one."""

    def __init__(self, directory: Path, fetch: Fetch) -> None:
        self.directory = directory
        self._fetch = fetch
        self._locks: dict[str, trio.Lock] = {}

    async def get(self, sha: str) -> Path:
        check_sha256(sha)
        lock = self._locks.setdefault(sha, trio.Lock())
        async with lock:
            path = self.directory / sha
            if path.exists():
                actual = await trio.to_thread.run_sync(file_sha256, path, limiter=_FILE_LIMITER)
                if actual == sha:
                    return path
                # A damaged cache entry is not the bundle's fault: fetch it again.
                path.unlink(missing_ok=True)
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            tmp = self.directory / f".{sha}.{os.getpid()}.part"
            try:
                actual = await self._fetch(sha, tmp)
                if actual != sha:
                    raise BundleError(
                        f"blob {sha} from the coordinator hashes to {actual}: refusing to use it"
                    )
                tmp.rename(path)
            finally:
                tmp.unlink(missing_ok=True)
            return path


def safe_member_path(name: str) -> PurePosixPath:
    """The relative path of a zip member, or BundleError if it could escape the directory."""
    if "\\" in name or "\0" in name:
        raise BundleRejected(f"bundle member {name!r} has a backslash or NUL in its name")
    path = PurePosixPath(name)
    if path.is_absolute() or re.match(r"[A-Za-z]:", name):
        raise BundleRejected(f"bundle member {name!r} has an absolute path")
    if ".." in path.parts:
        raise BundleRejected(f"bundle member {name!r} has '..' in its path")
    return path


def extracted_size(zip_path: Path, *, max_bytes: int, max_members: int = 100_000) -> int:
    """What ``zip_path`` extracts to, in bytes, its members checked (raises
    ``BundleRejected``: the same bundle would fail the same way on any agent)."""
    zf = _open_zip(zip_path)
    with zf:
        return _checked_size(zf.infolist(), max_bytes=max_bytes, max_members=max_members)


def _open_zip(zip_path: Path) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(zip_path)
    except (zipfile.BadZipFile, OSError) as exc:
        raise BundleRejected(f"the bundle is not a zip file: {exc}") from exc


def _checked_size(members: list[zipfile.ZipInfo], *, max_bytes: int, max_members: int) -> int:
    if len(members) > max_members:
        raise BundleRejected(
            f"the bundle has {len(members)} members, more than the limit of {max_members}"
        )
    total = 0
    for info in members:
        safe_member_path(info.filename)
        if stat.S_ISLNK(info.external_attr >> 16):
            raise BundleRejected(f"bundle member {info.filename!r} is a symbolic link")
        total += info.file_size
    if total > max_bytes:
        raise BundleRejected(
            f"the bundle extracts to {total} bytes, more than the limit of {max_bytes}"
        )
    return total


class DiskRoom:
    """What the agent's extractions may take of the volunteer's disk, all ranks together:
    a bundle is extracted only if the file system would keep ``keep_free`` bytes free after
    it and after every extraction under way (each reserves its size until it is done);
    otherwise ``NoRoom``, and the rank runs on another agent (a per-rank bound alone let two
    ranks of one job extract 1 GiB each). ``keep_free`` 0: no bound beyond the per-rank
    ones."""

    def __init__(
        self, keep_free: int = 0, statvfs: Callable[[Path], os.statvfs_result] = os.statvfs
    ) -> None:
        self.keep_free = keep_free
        self.reserved = 0
        self._statvfs = statvfs

    def free(self, where: Path) -> int:
        st = self._statvfs(where)
        return st.f_bavail * st.f_frsize

    @contextlib.contextmanager
    def reserve(self, where: Path, nbytes: int) -> Iterator[None]:
        """Hold ``nbytes`` of ``where``'s file system while they are written (raises
        ``NoRoom``)."""
        if self.keep_free:
            free = self.free(where) - self.reserved
            if free - nbytes < self.keep_free:
                raise NoRoom(
                    f"no room for its bundle here: it extracts to {sizes.format_size(nbytes)} and "
                    f"the volunteer keeps {sizes.format_size(self.keep_free)} of this disk free "
                    f"({sizes.format_size(max(free, 0))} free)"
                )
        self.reserved += nbytes
        try:
            yield
        finally:
            self.reserved -= nbytes


def extract_bundle(
    zip_path: Path, dest: Path, *, max_bytes: int, max_members: int = 100_000
) -> None:
    """Extract ``zip_path`` into the (existing, empty) directory ``dest`` (raises
    ``BundleRejected``: the same bundle would fail the same way on any agent)."""
    zf = _open_zip(zip_path)
    with zf:
        members = zf.infolist()
        _checked_size(members, max_bytes=max_bytes, max_members=max_members)
        try:
            for info in members:
                target = dest.joinpath(*safe_member_path(info.filename).parts)
                if info.is_dir():
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                with zf.open(info) as src, target.open("wb") as out:
                    written = 0
                    # Count what really comes out: a lying header does not beat the limit.
                    while chunk := src.read(1024 * 1024):
                        written += len(chunk)
                        if written > info.file_size:
                            raise BundleRejected(
                                f"bundle member {info.filename!r} is larger than its header says"
                            )
                        out.write(chunk)
                mode = (info.external_attr >> 16) & 0o777
                if mode & 0o100:
                    target.chmod(0o700)
        except (zipfile.BadZipFile, OSError, EOFError, RuntimeError) as exc:
            raise BundleRejected(f"the bundle cannot be extracted: {exc}") from exc


def snapshot(root: Path) -> Snapshot:
    """Size and mtime of every regular file under ``root``, to tell what a rank changed
    (``rank_tree.walk``: however deep the rank made it; ``TooDeep`` past ``MAX_DEPTH``)."""
    out: Snapshot = {}
    for rel, st in rank_tree.walk(root, skip_dirs=frozenset({"__pycache__"})):
        if stat.S_ISREG(st.st_mode):
            out[rel] = (st.st_size, st.st_mtime_ns)
    return out


def results_zip(root: Path, before: Snapshot, *, max_bytes: int) -> tuple[bytes | None, list[str]]:
    """Zip of the files created or modified since ``before``; ``(None, [])`` when none were.

    Files that would take the zip past ``max_bytes`` are left out and listed in the result."""
    changed = sorted(p for p, sig in snapshot(root).items() if before.get(p) != sig)
    if not changed:
        return None, []
    skipped: list[str] = []
    total = 0
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
        for rel in changed:
            full = root / rel
            try:
                size = full.stat().st_size
            except OSError:
                continue
            # Sizes before compression: a conservative bound, checked before reading the file.
            if total + size > max_bytes:
                skipped.append(rel)
                continue
            total += size
            zf.write(full, rel)
    return buf.getvalue(), skipped
