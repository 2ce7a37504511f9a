"""Packing a program, its project and its input files into the zip a job runs from
(``JobSubmit.bundle``). The rank's working directory is the extracted zip.

- ``app.py``: a zip with ``app.py`` as the entry, plus each input file at the path it is given
  (``data/x.csv`` stays ``data/x.csv``), so the program opens its inputs as it would next to
  itself. ``vsdk`` also adds the local modules a single-file program imports (``sdk.bundle``).
- a project directory: every file under it at its place, the entry named (``--entry``).
- ``app.zip``: used as is; the entry defaults to ``__main__.py`` (as ``python app.zip`` would
  run); inputs are added to a copy.

Zips are built deterministically (fixed timestamps, sorted names) so the same files give the
same sha256 and an unchanged bundle is never uploaded twice. ``vsdk submit`` packs files from
disk (``sdk.bundle``), the web portal packs uploads; both call ``pack`` and so give the same
errors. ``BundleError.field`` says which input was wrong, for a form to show it there.
"""

from __future__ import annotations

import io
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Literal

_EPOCH = (1980, 1, 1, 0, 0, 0)
Field = Literal["program", "inputs", "entry"]
MAX_FILES = 20_000  # files in a bundle (agents refuse more than their max_bundle_members)
MAX_BYTES = 1 << 30  # bytes of files in a bundle, before compression
# Directories of a project a job never needs (also: virtual environments, *.pyc).
SKIPPED_DIRS = frozenset(
    {
        ".git",
        ".hg",
        ".svn",
        "__pycache__",
        ".mypy_cache",
        ".pytest_cache",
        ".ruff_cache",
        ".ipynb_checkpoints",
        ".tox",
        ".nox",
        "node_modules",
    }
)


class BundleError(Exception):
    def __init__(self, message: str, field: Field) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


@dataclass(frozen=True)
class Bundle:
    data: bytes
    entry: str
    files: int = 0  # how many files it holds
    added: tuple[str, ...] = ()  # local modules found next to a single-file program


def _add(zf: zipfile.ZipFile, name: str, data: bytes) -> None:
    info = zipfile.ZipInfo(name, date_time=_EPOCH)
    info.compress_type = zipfile.ZIP_DEFLATED
    info.external_attr = 0o644 << 16
    zf.writestr(info, data)


def member_path(name: str, what: str, field: Field) -> str:
    """``name`` as a bundle member: a relative path that stays inside the rank's directory
    (``data/x.csv``; not ``/etc/x``, ``../x``, ``a\\b`` or empty)."""
    path = PurePosixPath(name)
    if (
        not name
        or "\\" in name
        or "\0" in name
        or path.is_absolute()
        or any(part in ("", ".", "..") for part in name.split("/"))
    ):
        raise BundleError(
            f"{what} {name!r} is not a relative path inside the job's directory", field
        )
    return str(path)


def check_name(name: str, what: str, field: Field) -> str:
    """A plain file name (no directories)."""
    if "/" in name:
        raise BundleError(f"{what} {name!r} is not a plain file name", field)
    return member_path(name, what, field)


def _check_size(files: Mapping[str, bytes]) -> None:
    if len(files) > MAX_FILES:
        raise BundleError(
            f"the job has {len(files)} files, more than {MAX_FILES}; leave out what the "
            "program does not read (caches, virtual environments, outputs)",
            "inputs",
        )
    total = sum(len(d) for d in files.values())
    if total > MAX_BYTES:
        raise BundleError(
            f"the job's files are {total} bytes, more than {MAX_BYTES}; leave out what the "
            "program does not read, or have it fetch large data itself",
            "inputs",
        )


def _zip(files: Mapping[str, bytes], entry: str) -> Bundle:
    _check_size(files)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name in sorted(files):
            _add(zf, name, files[name])
    return Bundle(buf.getvalue(), entry, len(files))


def _merge(into: dict[str, bytes], inputs: Sequence[tuple[str, bytes]], what: str) -> None:
    for name, data in inputs:
        name = member_path(name, "an input file's path", "inputs")
        if name in into:
            raise BundleError(f"two {what} are put at {name!r}", "inputs")
        into[name] = data
    dirs = {str(p) for name in into for p in PurePosixPath(name).parents if str(p) != "."}
    clash = sorted(dirs & set(into))
    if clash:
        raise BundleError(f"{clash[0]!r} is both a file and a directory of the job", "inputs")


def pack_tree(
    files: Mapping[str, bytes], entry: str, inputs: Sequence[tuple[str, bytes]] = ()
) -> Bundle:
    """A project: ``files`` (relative path -> bytes) at their places, plus ``inputs``, run as
    ``python entry``."""
    entry = member_path(entry, "the entry point", "entry")
    tree: dict[str, bytes] = {}
    _merge(
        tree,
        [(member_path(n, "a project file's path", "program"), d) for n, d in files.items()],
        "project files",
    )
    if entry not in tree:
        py = sorted(n for n in tree if n.endswith(".py") and "/" not in n)[:8]
        hint = f" (top-level programs: {', '.join(py)})" if py else ""
        raise BundleError(f"the project has no {entry!r}{hint}; choose it with --entry", "entry")
    _merge(tree, inputs, "input files")
    return _zip(tree, entry)


def pack(
    program_name: str,
    program: bytes,
    inputs: Sequence[tuple[str, bytes]] = (),
    *,
    entry: str | None = None,
) -> Bundle:
    """The bundle for ``program`` (the bytes of a ``.py`` file or a ``.zip`` named
    ``program_name``) and its ``inputs`` (path in the job's directory, bytes)."""
    check_name(program_name, "the program's name", "program")
    if program_name.endswith(".zip"):
        try:
            with zipfile.ZipFile(io.BytesIO(program)) as zf:
                names = set(zf.namelist())
                bad = zf.testzip()
        except (zipfile.BadZipFile, OSError, EOFError) as exc:
            raise BundleError(f"{program_name} is not a valid zip file: {exc}", "program") from exc
        if bad is not None:
            raise BundleError(f"{program_name}: member {bad!r} is corrupt", "program")
        entry = entry or "__main__.py"
        if entry not in names:
            raise BundleError(
                f"{program_name} has no {entry!r} (choose the program with --entry)", "entry"
            )
        added: dict[str, bytes] = {}
        _merge(added, inputs, "input files")
        if not added:
            return Bundle(program, entry, len(names))
        clash = sorted(names & set(added))
        if clash:
            raise BundleError(f"{program_name} already holds {', '.join(clash)}", "inputs")
        buf = io.BytesIO(program)
        with zipfile.ZipFile(buf, "a") as zf:
            for name in sorted(added):
                _add(zf, name, added[name])
        return Bundle(buf.getvalue(), entry, len(names) + len(added))

    if entry is not None and entry != program_name:
        raise BundleError("--entry is only for .zip programs and project directories", "entry")
    files = {program_name: program}
    try:
        _merge(files, inputs, "input files")
    except BundleError as exc:
        if f"at {program_name!r}" in exc.message:
            raise BundleError(
                f"an input file has the program's name {program_name!r}", "inputs"
            ) from exc
        raise
    return _zip(files, program_name)
