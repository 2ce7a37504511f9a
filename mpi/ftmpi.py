"""FT-MPI's failure modes on top of ULFM (seed 003): blank, shrink and rebuild."""

from __future__ import annotations

from typing import Any

FT_MODES = frozenset({"blank", "shrink", "rebuild"})


def recovering(h: Any) -> bool:
    """Whether a ``Dup`` of ``h`` is FT-MPI's recovery: ``h`` is COMM_WORLD with failures."""
    return False


def recover(comm: Any) -> Any:
    raise NotImplementedError
