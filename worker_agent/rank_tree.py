"""A rank's directory as the agent reads and removes it: a stranger's tree.

A rank may make its directory as deep and as wide as its disk limit allows: 300,000 empty
files, or directories nested 1,100 deep, on which ``os.walk`` and ``shutil.rmtree`` (recursive
in Python 3.11) raise ``RecursionError``, and a deep enough path passes ``PATH_MAX``. Here
nothing recurses and no path is longer than one name: a walk goes down by descriptors (one per
level), links are never followed, and

- ``walk`` yields every entry with its ``lstat``, parents before children;
- ``usage`` adds up what the tree takes of the disk, each entry counted at least
  ``INODE_BYTES`` (so that many empty files count), and stops early once past a bound;
- ``remove`` deletes the tree, whatever its depth: a directory deeper than ``MAX_DEPTH`` is
  first moved up to the top, so that no more than ``MAX_DEPTH`` descriptors are ever open.

A tree deeper than ``MAX_DEPTH`` cannot be walked (``TooDeep``): the agent counts it past the
rank's disk limit.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

MAX_DEPTH = 1024  # directory levels below the root a walk goes down (descriptors open at once)
INODE_BYTES = 4096  # the least an entry counts against a disk limit (an inode, a block)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class TooDeep(Exception):
    """The tree nests directories deeper than ``MAX_DEPTH``."""


@dataclass(frozen=True)
class Usage:
    bytes: int  # blocks allocated to the entries (sparse files count what they take)
    entries: int  # files, directories, links...

    @property
    def charged(self) -> int:
        """What the tree counts against a disk limit: its blocks, and at least
        ``INODE_BYTES`` per entry."""
        return max(self.bytes, 0) + self.entries * INODE_BYTES


def walk(
    root: Path, *, skip_dirs: frozenset[str] = frozenset()
) -> Iterator[tuple[str, os.stat_result]]:
    """Every entry under ``root`` (not ``root`` itself) as (relative POSIX path, lstat),
    depth first, without following links; directories named in ``skip_dirs`` are neither
    yielded nor entered. Raises ``TooDeep``; an entry that vanishes meanwhile is left out."""
    try:
        top = os.open(root, _DIR_FLAGS)
    except FileNotFoundError:
        return
    # Per level: its descriptor, its relative path, and its subdirectories still to enter.
    stack: list[tuple[int, str, list[str]]] = []
    try:
        stack.append((top, "", []))
        pending = stack[-1][2]
        yield from _list(top, "", pending, skip_dirs)
        while stack:
            fd, rel, pending = stack[-1]
            if not pending:
                os.close(fd)
                stack.pop()
                continue
            name = pending.pop()
            try:
                child = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError:
                continue  # gone, or replaced by something that is not a directory
            if len(stack) > MAX_DEPTH:
                os.close(child)
                raise TooDeep(f"directories nested deeper than {MAX_DEPTH} levels")
            child_rel = f"{rel}{name}/"
            stack.append((child, child_rel, []))
            yield from _list(child, child_rel, stack[-1][2], skip_dirs)
    finally:
        for fd, _, _ in stack:
            os.close(fd)


def _list(
    fd: int, rel: str, subdirs: list[str], skip_dirs: frozenset[str]
) -> Iterator[tuple[str, os.stat_result]]:
    try:
        with os.scandir(fd) as entries:
            found = list(entries)
    except OSError:
        return
    for entry in found:
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode):
            if entry.name in skip_dirs:
                continue
            subdirs.append(entry.name)
        yield rel + entry.name, st


def usage(root: Path, *, stop_past: int = 0) -> Usage:
    """What the tree under ``root`` takes; with ``stop_past``, the walk stops as soon as the
    charge (``Usage.charged``) is past it (the rest is not looked at). Raises ``TooDeep``."""
    total = entries = 0
    for _, st in walk(root):
        total += st.st_blocks * 512
        entries += 1
        if stop_past and total + entries * INODE_BYTES > stop_past:
            break
    return Usage(total, entries)


def remove(root: Path) -> None:
    """Delete ``root`` and everything under it, however deep, never following a link.
    Entries that cannot be removed are left (as ``shutil.rmtree(ignore_errors=True)``)."""
    try:
        top = os.open(root, _DIR_FLAGS)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(root)  # a file or a link where the directory was
        return
    moved = 0
    # Per level: descriptor, its name in the level above, its subdirectories left to empty.
    stack: list[tuple[int, str, list[str]]] = [(top, "", _clear(top))]
    try:
        while stack:
            fd, name, pending = stack[-1]
            if not pending:
                os.close(fd)
                stack.pop()
                if stack:
                    with contextlib.suppress(OSError):
                        os.rmdir(name, dir_fd=stack[-1][0])
                continue
            sub = pending.pop()
            if len(stack) > MAX_DEPTH:
                # Too deep to keep a descriptor per level: up to the top with it, emptied
                # from there later.
                moved += 1
                flat = f".vpool-deep-{moved}"
                try:
                    os.rename(sub, flat, src_dir_fd=fd, dst_dir_fd=top)
                except OSError:
                    continue
                stack[0][2].append(flat)
                continue
            try:
                child = os.open(sub, _DIR_FLAGS, dir_fd=fd)
            except OSError:
                with contextlib.suppress(OSError):
                    os.unlink(sub, dir_fd=fd)
                continue
            stack.append((child, sub, _clear(child)))
    finally:
        for fd, _, _ in stack:
            os.close(fd)
    with contextlib.suppress(OSError):
        os.rmdir(root)


def _clear(fd: int) -> list[str]:
    """Unlink every entry of directory ``fd`` that is not a directory; the subdirectories."""
    subdirs = []
    try:
        with os.scandir(fd) as entries:
            found = list(entries)
    except OSError:
        return subdirs
    for entry in found:
        try:
            is_dir = entry.is_dir(follow_symlinks=False)
        except OSError:
            continue
        if is_dir:
            subdirs.append(entry.name)
        else:
            with contextlib.suppress(OSError):
                os.unlink(entry.name, dir_fd=fd)
    return subdirs
