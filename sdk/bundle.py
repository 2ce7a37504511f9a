"""Packing a program and its input files from disk into a job's bundle (``vpool.bundle``
says how a bundle is laid out)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from vpool import bundle
from vpool.bundle import Bundle
from vpool.sdk.errors import BundleError

__all__ = ["Bundle", "build"]


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise BundleError(f"{what} {path} does not exist") from None
    except IsADirectoryError:
        raise BundleError(f"{what} {path} is a directory, not a file") from None
    except OSError as exc:
        raise BundleError(f"cannot read {what} {path}: {exc.strerror or exc}") from exc


def build(program: Path, inputs: Sequence[Path] = (), *, entry: str | None = None) -> Bundle:
    """The bundle for ``program`` (a ``.py`` file or a ``.zip``) and its ``inputs``."""
    program = Path(program)
    files = [(Path(p).name, _read(Path(p), "input file")) for p in inputs]
    try:
        return bundle.pack(program.name, _read(program, "program"), files, entry=entry)
    except bundle.BundleError as exc:
        # Name the file as the user gave it, not only its base name.
        message = exc.message.replace(f"{program.name} ", f"{program} ", 1)
        raise BundleError(message) from exc
