"""Packing a program and its input files into the zip a job runs from.

- ``app.py``: a zip with ``app.py`` (its basename) as the entry, plus each input file at the zip
  root under its basename; the rank's working directory is the extracted zip, so the program
  opens its inputs by bare name, as it would next to itself.
- ``app.zip``: uploaded as is; the entry defaults to ``__main__.py`` (as ``python app.zip`` would
  run); inputs are added to a copy at its root.

Zips are built deterministically (fixed timestamps, sorted names) so the same files give the
same sha256 and an unchanged bundle is never uploaded twice.
"""

from __future__ import annotations

import io
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from vpool.sdk.errors import BundleError

_EPOCH = (1980, 1, 1, 0, 0, 0)


@dataclass(frozen=True)
class Bundle:
    data: bytes
    entry: str


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise BundleError(f"{what} {path} does not exist") from None
    except IsADirectoryError:
        raise BundleError(f"{what} {path} is a directory, not a file") from None
    except OSError as exc:
        raise BundleError(f"cannot read {what} {path}: {exc.strerror or exc}") from exc


def _add(zf: zipfile.ZipFile, name: str, data: bytes) -> None:
    info = zipfile.ZipInfo(name, date_time=_EPOCH)
    info.compress_type = zipfile.ZIP_DEFLATED
    info.external_attr = 0o644 << 16
    zf.writestr(info, data)


def build(program: Path, inputs: Sequence[Path] = (), *, entry: str | None = None) -> Bundle:
    """The bundle for ``program`` (a ``.py`` file or a ``.zip``) and its ``inputs``."""
    program = Path(program)
    files: dict[str, bytes] = {}
    for path in inputs:
        path = Path(path)
        if path.name in files:
            raise BundleError(f"two input files are named {path.name!r}")
        files[path.name] = _read(path, "input file")

    if program.suffix == ".zip":
        raw = _read(program, "program")
        try:
            with zipfile.ZipFile(io.BytesIO(raw)) as zf:
                names = set(zf.namelist())
                bad = zf.testzip()
        except (zipfile.BadZipFile, OSError) as exc:
            raise BundleError(f"{program} is not a valid zip file: {exc}") from exc
        if bad is not None:
            raise BundleError(f"{program}: member {bad!r} is corrupt")
        entry = entry or "__main__.py"
        if entry not in names:
            raise BundleError(f"{program} has no {entry!r} (choose the program with --entry)")
        if not files:
            return Bundle(raw, entry)
        clash = sorted(names & set(files))
        if clash:
            raise BundleError(f"{program} already holds {', '.join(clash)}")
        buf = io.BytesIO(raw)
        with zipfile.ZipFile(buf, "a") as zf:
            for name in sorted(files):
                _add(zf, name, files[name])
        return Bundle(buf.getvalue(), entry)

    if entry is not None and entry != program.name:
        raise BundleError("--entry is only for .zip programs")
    source = _read(program, "program")
    if program.name in files:
        raise BundleError(f"an input file has the program's name {program.name!r}")
    files[program.name] = source
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name in sorted(files):
            _add(zf, name, files[name])
    return Bundle(buf.getvalue(), program.name)
