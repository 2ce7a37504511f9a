"""How a long-running vpool process says it serves: ``--ready-file`` and ``--ready-fd``.

Launchers wait for it instead of sleeping. Two ways, either or both:

- ``--ready-file PATH``: the process writes its details as JSON to PATH, atomically (a temp
  file, then a rename), so a reader sees all of it or nothing (the coordinator removes it
  when it stops cleanly). For operators' scripts, and for what reads the details later.
- ``--ready-fd N``: the process writes the same JSON as one line to file descriptor N, which
  its launcher gave it (the write end of a pipe), and closes it. ``vsdk local up`` waits this
  way: it hears of readiness the moment it happens, without polling, and a process that dies
  before it is ready closes the pipe, so the launcher hears that at once too (end of file with
  no line). The line is shorter than PIPE_BUF: one write, never interleaved.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])


def write_ready_file(path: Path, info: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(info))
    os.replace(tmp, path)


class Ready:
    """Where this process announces that it serves (nothing, a file, a pipe, or both)."""

    def __init__(self, file: Path | None = None, fd: int | None = None) -> None:
        self.file = file
        self.fd = fd
        if fd is not None:
            try:
                mode = os.fstat(fd).st_mode
            except OSError:
                raise ValueError(f"--ready-fd {fd} is not an open file descriptor") from None
            if not (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
                raise ValueError(f"--ready-fd {fd} is not a pipe or a socket")
            os.set_inheritable(fd, False)  # not passed on to what this process starts

    def announce(self, info: dict[str, Any]) -> None:
        """Say it: the file first (a launcher that heard the pipe may read it at once)."""
        if self.file is not None:
            write_ready_file(self.file, info)
        fd, self.fd = self.fd, None
        if fd is not None:
            try:
                os.write(fd, json.dumps(info).encode() + b"\n")
            except BrokenPipeError:
                pass  # the launcher has gone: the process serves all the same
            finally:
                os.close(fd)

    def withdraw(self) -> None:
        """On a clean stop: the ready file goes (the pipe was closed when announced)."""
        if self.file is not None:
            self.file.unlink(missing_ok=True)


def ready_options(what: str) -> Callable[[F], F]:
    """``--ready-file`` and ``--ready-fd`` for a command that takes ``ready: Ready``; ``what``
    says which details it writes."""

    def keep_file(ctx: click.Context, _param: click.Parameter, path: Path | None) -> None:
        ctx.meta["vpool.ready_file"] = path

    def to_ready(ctx: click.Context, _param: click.Parameter, fd: int | None) -> Ready:
        try:
            return Ready(ctx.meta.get("vpool.ready_file"), fd)
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from None

    def decorate(command: F) -> F:
        command = click.option(
            "--ready-fd",
            "ready",
            type=click.IntRange(min=0),
            callback=to_ready,
            help=f"Write {what} as one line of JSON to this inherited file descriptor (a pipe "
            "from the launcher) once ready, then close it.",
        )(command)
        return click.option(
            "--ready-file",
            type=click.Path(dir_okay=False, path_type=Path),
            is_eager=True,  # first: --ready-fd's callback takes it along
            expose_value=False,
            callback=keep_file,
            help=f"Write {what} as JSON here once ready.",
        )(command)

    return decorate
