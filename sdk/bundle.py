"""Packing a program and its files from disk into a job's bundle (``vpool.bundle`` says how a
bundle is laid out).

- ``PROGRAM`` is a ``.py`` file, a ``.zip``, or a project directory (every file under it
  keeps its place; caches, version control and virtual environments are left out).
- A single ``.py`` program gets the local modules it imports: ``import helper`` with
  ``helper.py`` (or a ``helper/`` package) next to it packs that too, and what it imports in
  turn, as Python would find them there (``Bundle.added`` says which).
- ``--input PATH`` keeps PATH as given when it is relative and inside the current directory
  (``data/x.csv`` lands at ``data/x.csv``); an absolute or ``..`` path lands under its own
  name; ``SRC:DEST`` puts SRC at DEST. A directory brings every file under it.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator, Sequence
from pathlib import Path, PurePosixPath

from vpool import bundle
from vpool.bundle import SKIPPED_DIRS, Bundle
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


def _walk(root: Path) -> Iterator[tuple[str, Path]]:
    """(path relative to ``root``, file) of every file a job may need under ``root``."""
    for current, dirs, files in os.walk(root):
        here = Path(current)
        dirs[:] = sorted(
            d for d in dirs if d not in SKIPPED_DIRS and not (here / d / "pyvenv.cfg").exists()
        )
        for name in sorted(files):
            if name.endswith((".pyc", ".pyo")):
                continue
            path = here / name
            if path.is_file():
                yield path.relative_to(root).as_posix(), path


def _place(spec: Path | str) -> tuple[Path, str]:
    """Where an ``--input`` lands: (source on disk, path in the job's directory)."""
    text = str(spec)
    if ":" in text and not Path(text).exists():
        src, _, dest = text.rpartition(":")
        return Path(src), dest
    source = Path(text)
    if not source.is_absolute():
        inside = PurePosixPath(os.path.normpath(source.as_posix()))
        if inside.parts and inside.parts[0] != ".." and str(inside) != ".":
            return source, str(inside)
    return source, source.resolve().name


def _inputs(specs: Sequence[Path | str]) -> list[tuple[str, bytes]]:
    out: list[tuple[str, bytes]] = []
    for spec in specs:
        source, dest = _place(spec)
        if source.is_dir():
            found = list(_walk(source))
            if not found:
                raise BundleError(f"input directory {source} holds no file")
            out += [(f"{dest}/{rel}", _read(path, "input file")) for rel, path in found]
        else:
            out.append((dest, _read(source, "input file")))
    return out


def _imports(source: bytes) -> set[str]:
    """Top-level names of the modules ``source`` imports (absolute imports only)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return set()  # the coordinator says what is wrong with it
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _local_modules(program: Path, source: bytes) -> dict[str, Path]:
    """The modules next to ``program`` it imports, directly or through each other: relative
    path in the job's directory -> file (a package brings all its files)."""
    home = program.parent
    found: dict[str, Path] = {}
    todo, seen = [source], set[str]()
    while todo:
        for name in _imports(todo.pop()) - seen:
            seen.add(name)
            module, package = home / f"{name}.py", home / name
            if module.is_file() and module != program:
                found[module.name] = module
                todo.append(_read(module, "module"))
            elif package.is_dir() and (package / "__init__.py").is_file():
                for rel, path in _walk(package):
                    found[f"{name}/{rel}"] = path
                    if rel.endswith(".py"):
                        todo.append(_read(path, "module"))
    return found


def project_requirements(program: Path) -> list[str]:
    """The dependencies a project directory's ``pyproject.toml`` declares ([project]
    dependencies), normalized; [] when it declares none."""
    from vpool import requirements

    path = program / "pyproject.toml"
    if not program.is_dir() or not path.is_file():
        return []
    try:
        return requirements.from_pyproject(path.read_text(), str(path))
    except (OSError, UnicodeDecodeError) as exc:
        raise BundleError(f"cannot read {path}: {exc}") from exc
    except requirements.RequirementsError as exc:
        raise BundleError(str(exc)) from exc


def build(program: Path, inputs: Sequence[Path | str] = (), *, entry: str | None = None) -> Bundle:
    """The bundle for ``program`` (a ``.py`` file, a ``.zip`` or a project directory) and its
    ``inputs``."""
    program = Path(program)
    files = _inputs(inputs)
    try:
        if program.is_dir():
            tree = {rel: _read(path, "project file") for rel, path in _walk(program)}
            return bundle.pack_tree(tree, entry or "__main__.py", files)
        source = _read(program, "program")
        if program.suffix == ".zip":
            return bundle.pack(program.name, source, files, entry=entry)
        local = _local_modules(program, source)
        given = {name for name, _ in files}
        extra = [
            (rel, _read(path, "module")) for rel, path in sorted(local.items()) if rel not in given
        ]
        packed = bundle.pack(program.name, source, [*extra, *files], entry=entry)
        added = sorted({rel.split("/")[0] + ("/" if "/" in rel else "") for rel, _ in extra})
        return Bundle(packed.data, packed.entry, packed.files, tuple(added))
    except bundle.BundleError as exc:
        # Name the program as the user gave it, not only its base name.
        message = exc.message.replace(f"{program.name} ", f"{program} ", 1)
        raise BundleError(message) from exc
