"""Packing a program and its input files into the zip a job runs from (``JobSubmit.bundle``).

- ``app.py``: a zip with ``app.py`` as the entry, plus each input file at the zip root under its
  name; the rank's working directory is the extracted zip, so the program opens its inputs by
  bare name, as it would next to itself.
- ``app.zip``: used as is; the entry defaults to ``__main__.py`` (as ``python app.zip`` would
  run); inputs are added to a copy at its root.

Zips are built deterministically (fixed timestamps, sorted names) so the same files give the
same sha256 and an unchanged bundle is never uploaded twice. ``vsdk submit`` packs files from
disk (``sdk.bundle``), the web portal packs uploads; both call ``pack`` and so give the same
errors. ``BundleError.field`` says which input was wrong, for a form to show it there.
"""

from __future__ import annotations

import io
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

_EPOCH = (1980, 1, 1, 0, 0, 0)
Field = Literal["program", "inputs", "entry"]


class BundleError(Exception):
    def __init__(self, message: str, field: Field) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


@dataclass(frozen=True)
class Bundle:
    data: bytes
    entry: str


def _add(zf: zipfile.ZipFile, name: str, data: bytes) -> None:
    info = zipfile.ZipInfo(name, date_time=_EPOCH)
    info.compress_type = zipfile.ZIP_DEFLATED
    info.external_attr = 0o644 << 16
    zf.writestr(info, data)


def check_name(name: str, what: str, field: Field) -> str:
    """A file name as a bundle member: a plain name, no directories."""
    if not name or name in (".", "..") or any(c in name for c in "/\\\0"):
        raise BundleError(f"{what} name {name!r} is not a plain file name", field)
    return name


def pack(
    program_name: str,
    program: bytes,
    inputs: Sequence[tuple[str, bytes]] = (),
    *,
    entry: str | None = None,
) -> Bundle:
    """The bundle for ``program`` (the bytes of a ``.py`` file or a ``.zip`` named
    ``program_name``) and its ``inputs`` (name, bytes)."""
    check_name(program_name, "the program's", "program")
    files: dict[str, bytes] = {}
    for name, data in inputs:
        check_name(name, "an input file's", "inputs")
        if name in files:
            raise BundleError(f"two input files are named {name!r}", "inputs")
        files[name] = data

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
        if not files:
            return Bundle(program, entry)
        clash = sorted(names & set(files))
        if clash:
            raise BundleError(f"{program_name} already holds {', '.join(clash)}", "inputs")
        buf = io.BytesIO(program)
        with zipfile.ZipFile(buf, "a") as zf:
            for name in sorted(files):
                _add(zf, name, files[name])
        return Bundle(buf.getvalue(), entry)

    if entry is not None and entry != program_name:
        raise BundleError("--entry is only for .zip programs", "entry")
    if program_name in files:
        raise BundleError(f"an input file has the program's name {program_name!r}", "inputs")
    files[program_name] = program
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name in sorted(files):
            _add(zf, name, files[name])
    return Bundle(buf.getvalue(), program_name)
