from __future__ import annotations

import hashlib
import io
import os
import stat
import zipfile
from pathlib import Path

import pytest
import trio

from vpool.worker_agent.bundle import (
    BlobCache,
    DiskRoom,
    extract_bundle,
    extracted_size,
    results_zip,
    snapshot,
)
from vpool.worker_agent.errors import BundleError, BundleRejected, NoRoom

from .conftest import make_bundle


def _zip(tmp_path: Path, files: dict[str, bytes | str]) -> Path:
    path = tmp_path / "b.zip"
    path.write_bytes(make_bundle(files))
    return path


@pytest.mark.parametrize(
    "name", ["../evil.py", "a/../../evil.py", "/etc/evil", "a/..", "C:/evil", "a\\..\\b"]
)
def test_extract_rejects_escaping_paths(tmp_path: Path, name: str) -> None:
    dest = tmp_path / "out"
    dest.mkdir()
    with pytest.raises(BundleError):
        extract_bundle(_zip(tmp_path, {"ok.py": "", name: "x"}), dest, max_bytes=1 << 20)
    assert list(dest.iterdir()) == []  # checked before anything is written


def test_extract_rejects_symlinks(tmp_path: Path) -> None:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        info = zipfile.ZipInfo("link")
        info.external_attr = (stat.S_IFLNK | 0o777) << 16
        zf.writestr(info, "/etc/passwd")
    (tmp_path / "b.zip").write_bytes(buf.getvalue())
    (tmp_path / "out").mkdir()
    with pytest.raises(BundleError, match="symbolic link"):
        extract_bundle(tmp_path / "b.zip", tmp_path / "out", max_bytes=1 << 20)


def test_extract_enforces_size_limit(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    with pytest.raises(BundleError, match="more than the limit"):
        extract_bundle(_zip(tmp_path, {"big": "x" * 5000}), tmp_path / "out", max_bytes=4000)


def test_extract_enforces_member_limit(tmp_path: Path) -> None:
    zip_path = tmp_path / "b.zip"
    with zipfile.ZipFile(zip_path, "w") as zf:
        for i in range(11):
            zf.writestr(f"f{i}.txt", "x")
    with pytest.raises(BundleRejected, match="11 members, more than the limit of 10"):
        extract_bundle(zip_path, tmp_path / "out", max_bytes=1 << 20, max_members=10)
    extract_bundle(zip_path, tmp_path / "ok", max_bytes=1 << 20, max_members=11)
    assert len(list((tmp_path / "ok").iterdir())) == 11


def test_extractions_keep_the_volunteers_disk_free_all_ranks_together(tmp_path: Path) -> None:
    """Issue 35: extraction was bounded per rank only; two ranks of one job extracted a 1 GiB
    bomb each. The agent's ``DiskRoom`` holds every extraction under way against what the
    volunteer keeps free."""
    free = [10 << 30]  # what the file system says is free

    def statvfs(_: Path) -> os.statvfs_result:
        return os.statvfs_result((4096, 1, 0, 0, free[0], 0, 0, 0, 0, 255))

    room = DiskRoom(keep_free=2 << 30, statvfs=statvfs)
    with room.reserve(tmp_path, 5 << 30):
        assert room.reserved == 5 << 30
        # 10 GiB free, 5 being written, 2 kept free: 3 GiB left for another extraction.
        with pytest.raises(NoRoom, match=r"no room for its bundle here: it extracts to 3\.5 GiB"):
            with room.reserve(tmp_path, 7 << 29):
                pass
        with room.reserve(tmp_path, 3 << 30):
            assert room.reserved == 8 << 30
    assert room.reserved == 0  # released when done, whatever happened
    free[0] = 1 << 30
    with pytest.raises(NoRoom, match="keeps 2 GiB of this disk free \\(1 GiB free\\)"):
        with room.reserve(tmp_path, 1):
            pass
    with DiskRoom(keep_free=0, statvfs=statvfs).reserve(tmp_path, 1 << 40):
        pass  # 0: no agent-wide bound
    # The size an extraction reserves is the members' total, checked as extraction checks it.
    path = _zip(tmp_path, {"a": "x" * 1000, "d/b": "y" * 24})
    assert extracted_size(path, max_bytes=1024) == 1024
    with pytest.raises(BundleRejected, match="more than the limit"):
        extracted_size(path, max_bytes=1023)


def test_extract_and_results(tmp_path: Path) -> None:
    dest = tmp_path / "out"
    dest.mkdir()
    extract_bundle(
        _zip(tmp_path, {"app.py": "print()", "d/in.txt": "a", "d/same": "s"}),
        dest,
        max_bytes=1 << 20,
    )
    assert (dest / "d" / "in.txt").read_text() == "a"
    before = snapshot(dest)
    (dest / "d" / "in.txt").write_text("changed!")
    (dest / "new.txt").write_text("new")
    (dest / "__pycache__").mkdir()
    (dest / "__pycache__" / "x.pyc").write_bytes(b"")
    data, skipped = results_zip(dest, before, max_bytes=1 << 20)
    assert data is not None and skipped == []
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        assert sorted(zf.namelist()) == ["d/in.txt", "new.txt"]
    data, skipped = results_zip(dest, before, max_bytes=5)
    assert skipped == ["d/in.txt"]
    assert results_zip(dest, snapshot(dest), max_bytes=1 << 20) == (None, [])


async def test_blob_cache_verifies_hash(tmp_path: Path) -> None:
    good = b"bundle bytes"
    sha = hashlib.sha256(good).hexdigest()
    served = {"data": good + b"tampered"}
    fetches = []

    async def fetch(name: str, dest: Path) -> str:
        fetches.append(name)
        await trio.Path(dest).write_bytes(served["data"])
        return hashlib.sha256(served["data"]).hexdigest()

    cache = BlobCache(tmp_path / "blobs", fetch)
    with pytest.raises(BundleError, match=f"blob {sha} from the coordinator hashes to"):
        await cache.get(sha)
    assert not (tmp_path / "blobs" / sha).exists()
    served["data"] = good
    path = await cache.get(sha)
    assert path.read_bytes() == good
    assert await cache.get(sha) == path
    assert len(fetches) == 2  # the second get was served from the cache
    path.write_bytes(b"damaged on disk")
    assert (await cache.get(sha)).read_bytes() == good  # re-fetched, never used damaged
    with pytest.raises(BundleError, match="not a sha256"):
        await cache.get("../../etc/passwd")
