"""A rank's directory as the agent reads and removes it (``rank_tree``): the hostile trees of
issue 35 (1,100 directories deep: ``RecursionError`` in ``os.walk`` and ``shutil.rmtree``,
the rank counted lost, 51 directories left on the agent's disk; 300,000 empty files
counted as nothing against the disk limit)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from vpool.worker_agent import bundle, rank_tree


def _deep(root: Path, depth: int, name: str = "d" * 200) -> Path:
    """``depth`` nested directories ``name`` under ``root``, made by descriptors (with long
    names the deepest path passes PATH_MAX after 20 levels); a file at the bottom."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir(name, dir_fd=fd)
            child = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
        with os.fdopen(os.open("bottom.txt", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd), "w") as f:
            f.write("x" * 5000)
    finally:
        os.close(fd)
    return root


def test_the_recursive_standard_library_fails_on_what_a_rank_can_make(tmp_path: Path) -> None:
    """Why this module exists: on Python 3.11 os.walk recurses, and with long names it loses
    whatever lies past PATH_MAX without a word (a rank hiding its files from the disk limit)."""
    short, long = tmp_path / "short", tmp_path / "long"
    short.mkdir()
    long.mkdir()
    _deep(short, 1100, "d")
    _deep(long, 100)
    seen = sum(len(files) for _, _, files in os.walk(long))
    assert seen == 0  # bottom.txt is past PATH_MAX: not seen, no error
    assert any(rel.endswith("bottom.txt") for rel, _ in rank_tree.walk(long))
    try:
        if sys.version_info < (3, 12):  # os.walk no longer recurses from Python 3.12
            with pytest.raises(RecursionError):
                for _ in os.walk(short):
                    pass
    finally:
        # Not left to pytest, whose clean-up of old temporary directories recurses too.
        rank_tree.remove(short)
        rank_tree.remove(long)
    assert not short.exists() and not long.exists()


def test_a_deep_tree_is_walked_measured_and_removed(tmp_path: Path) -> None:
    root = tmp_path / "rank"
    root.mkdir()
    _deep(root, 1000)
    (root / "top.txt").write_text("hello")
    (root / "link").symlink_to("/etc")  # never followed
    seen = dict(rank_tree.walk(root))
    assert len(seen) == 1000 + 3
    assert "link" in seen and "top.txt" in seen
    used = rank_tree.usage(root)
    assert used.entries == 1003 and used.charged >= 1003 * rank_tree.INODE_BYTES
    assert bundle.snapshot(root)["top.txt"][0] == 5
    rank_tree.remove(root)
    assert not root.exists()
    assert os.path.isdir("/etc")  # the link was removed, not what it named


def test_a_tree_too_deep_to_walk_still_goes(tmp_path: Path) -> None:
    root = tmp_path / "rank"
    root.mkdir()
    _deep(root, rank_tree.MAX_DEPTH + 300)
    with pytest.raises(rank_tree.TooDeep):
        rank_tree.usage(root)
    with pytest.raises(rank_tree.TooDeep):
        bundle.snapshot(root)
    rank_tree.remove(root)  # moved up and emptied in pieces
    assert not root.exists()


def test_many_empty_files_count_against_the_disk(tmp_path: Path) -> None:
    root = tmp_path / "rank"
    (root / "many").mkdir(parents=True)
    for i in range(3000):
        (root / "many" / str(i)).touch()
    used = rank_tree.usage(root)
    assert used.bytes < 100_000  # they take next to no blocks...
    assert used.charged >= 3001 * rank_tree.INODE_BYTES  # ...but each counts
    # Stopping early: a walk past the bound does not go on counting.
    bound = 100 * rank_tree.INODE_BYTES
    early = rank_tree.usage(root, stop_past=bound)
    assert early.charged > bound and early.entries < 200


def test_remove_leaves_what_links_point_to(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    root = tmp_path / "rank"
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "b" / "to-outside").symlink_to(outside)
    (root / "a" / "file").write_text("x")
    rank_tree.remove(root)
    assert not root.exists()
    assert (outside / "keep.txt").read_text() == "mine"
    rank_tree.remove(root)  # gone already: nothing to do
    shutil.rmtree(outside)
