"""The abstract MPI the model's simulated programs are written against (see ``ftmodel``).

A program is a generator function ``program(rank, size)`` that yields these operations and
returns the rank's output.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

ANY = -1


@dataclass(frozen=True)
class Send:
    dst: int
    payload: Any


@dataclass(frozen=True)
class Recv:
    src: int


@dataclass(frozen=True)
class RecvAny:
    pass


@dataclass(frozen=True)
class Poll:
    src: int  # a rank or ANY


@dataclass(frozen=True)
class Env:
    """Read something from the environment that is not logged (here: the incarnation)."""


Op = Send | Recv | RecvAny | Poll | Env
Program = Callable[[int, int], Generator[Op, Any, Any]]
