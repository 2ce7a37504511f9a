"""One zip of a job's results: ``rank-N/`` holds the files rank N left behind (the zip its agent
uploaded), ``rank-N.stdout`` and ``rank-N.stderr`` its output streams."""

from __future__ import annotations

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
