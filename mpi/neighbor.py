"""Neighborhood collectives on Python objects (``neighbor_allgather``, ``neighbor_alltoall``).

Like every collective they run on point-to-point in the communicator's collective context with
the collective's own tag (``sched.new_tag``), and every receive names its source. A rank sends
to its out-neighbours in their order and receives from its in-neighbours; PROC_NULL neighbours
(non-periodic Cartesian borders) give ``None``.

Several edges between two processes share source, destination and tag, so messages pair up
with receives in the order they were sent (non-overtaking). For graphs that is MPI's rule: the
k-th edge from a process matches the k-th message from it. For a Cartesian topology the message
a rank receives from its ``-1`` neighbour in a direction is the one that neighbour sent to its
``+1`` neighbour (and the reverse), so the receive of slot ``k`` pairs with the sender's slot
``k ^ 1``; posting receives in the order of those sender slots keeps the pairing right even
when both neighbours are the same process (a periodic dimension of size 1 or 2).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vpool.mpi.constants import PROC_NULL
from vpool.mpi.sched import Algo, loads, new_tag, post_recv, run, send_obj


def _exchange(
    h: Any, objs: Sequence[Any], sources: list[int], dests: list[int], order: list[int]
) -> Algo:
    tag = new_tag(h)
    for d, obj in zip(dests, objs, strict=True):
        if d != PROC_NULL:
            send_obj(h, d, tag, obj)
    ops = {}
    for k in order:
        if sources[k] != PROC_NULL:
            ops[k] = post_recv(h, sources[k], tag, None)
    yield list(ops.values())
    return [loads(ops[k]) if k in ops else None for k in range(len(sources))]


def _edges(comm: Any) -> tuple[Any, list[int], list[int], list[int]]:
    h = comm._core()
    sources, dests = comm.inoutedges
    return h, list(sources), list(dests), comm._recv_order(len(sources))


def allgather(comm: Any, sendobj: Any) -> list[Any]:
    h, sources, dests, order = _edges(comm)
    return run(h, _exchange(h, [sendobj] * len(dests), sources, dests, order))  # type: ignore[no-any-return]


def alltoall(comm: Any, sendobj: Sequence[Any]) -> list[Any]:
    h, sources, dests, order = _edges(comm)
    objs = list(sendobj)
    if len(objs) != len(dests):
        raise ValueError(f"expecting {len(dests)} items, got {len(objs)}")
    return run(h, _exchange(h, objs, sources, dests, order))  # type: ignore[no-any-return]
