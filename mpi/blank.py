"""FT-MPI's blank mode: a communicator that keeps a failed member's place as a hole.

After a recovery in a job run with ``--on-failure blank`` (``ftmpi``), ``COMM_WORLD`` keeps its
size and every survivor its rank; the failed ranks are holes. Point-to-point with a hole raises
``ERR_PROC_FAILED`` at once (the engine: a hole is a failed rank, acknowledged on the
communicator so that ``ANY_SOURCE`` and the communicator's other operations go on).
"""

from __future__ import annotations

from typing import Any

from vpool.mpi.comm import _Core


def blank_core(eng: Any, ctx: int, group: tuple[int, ...], holes: frozenset[int]) -> _Core:
    """The core of a communicator of ``group`` (world ranks) whose members ``holes`` are
    failed: its collectives run over ``shadow``, the core of the live members, which shares
    its context ids (the blank core itself never runs a collective)."""
    core = _Core(eng, ctx, group)
    core.holes = frozenset(holes) & frozenset(group)
    if core.holes:
        core.shadow = _Core(eng, ctx, tuple(w for w in group if w not in core.holes))
        eng.acked.setdefault(ctx, set()).update(core.holes)
    return core
