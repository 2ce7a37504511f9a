"""One zip of a job's results: ``rank-N/`` holds the files rank N left behind (the zip its agent
uploaded), ``rank-N.stdout`` and ``rank-N.stderr`` its output streams."""

from __future__ import annotations

import hashlib
import shutil
import tempfile
import zipfile
from pathlib import Path

from vpool.coordinator.blobs import safe_member


def build_results_zip(
    tmp_dir: Path,
    ranks: int,
    rank_zips: dict[int, Path],
    streams: dict[tuple[int, str], bytes],
) -> Path:
    """Write the job's results zip to a new file in ``tmp_dir`` and return its path."""
    fd, name = tempfile.mkstemp(dir=tmp_dir, suffix=".zip")
    path = Path(name)
    try:
        with open(fd, "wb") as raw, zipfile.ZipFile(raw, "w", zipfile.ZIP_DEFLATED) as out:
            for rank in range(ranks):
                for stream in ("stdout", "stderr"):
                    out.writestr(f"rank-{rank}.{stream}", streams.get((rank, stream), b""))
                if rank in rank_zips:
                    _copy_members(rank_zips[rank], out, f"rank-{rank}/")
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return path


def _copy_members(source: Path, out: zipfile.ZipFile, prefix: str) -> None:
    try:
        src = zipfile.ZipFile(source)
    except (zipfile.BadZipFile, OSError):
        return  # checked on upload; a vanished or damaged blob just leaves the folder empty
    with src:
        for info in src.infolist():
            if info.is_dir() or not safe_member(info.filename):
                continue
            with src.open(info) as member, out.open(prefix + info.filename, "w") as dst:
                shutil.copyfileobj(member, dst, 1 << 20)


def files_digest(path: Path) -> str:
    """What a rank's results zip holds, as validation compares it: a digest of every file's
    name and content (not the zip's own bytes, whose timestamps and compression differ between
    two runs of the same program). "" for a zip that cannot be read."""
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(path) as zf:
            for info in sorted(zf.infolist(), key=lambda i: i.filename):
                if info.is_dir():
                    continue
                content = hashlib.sha256()
                with zf.open(info) as f:
                    while chunk := f.read(1 << 20):
                        content.update(chunk)
                digest.update(info.filename.encode() + b"\0" + content.digest())
    except (zipfile.BadZipFile, OSError, RuntimeError, NotImplementedError):
        return ""
    return digest.hexdigest()
