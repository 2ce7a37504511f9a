"""Distributed graph topologies: ``MPI.Distgraphcomm``, made by ``Create_dist_graph_adjacent``
(each rank names its own in- and out-neighbours) or ``Create_dist_graph`` (any rank may name
any edges; one all-to-all tells every rank the edges that touch it).

Each rank keeps only its own adjacency, as MPI's distributed graphs do. Edge order is
deterministic: for ``Create_dist_graph`` a rank's edges come ordered by the rank that named
them, then in the order that rank listed them. Ranks are never reordered.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

from vpool.mpi import coll, errors
from vpool.mpi.constants import DIST_GRAPH
from vpool.mpi.topology import Topocomm, _topo_comm


class _Weights:
    """``MPI.UNWEIGHTED`` and ``MPI.WEIGHTS_EMPTY``: told apart by identity, as mpi4py does."""

    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        self._name = name

    def __repr__(self) -> str:
        return self._name

    def __reduce__(self) -> str:
        return self._name


UNWEIGHTED = _Weights("UNWEIGHTED")
WEIGHTS_EMPTY = _Weights("WEIGHTS_EMPTY")


class _DistGraph:
    kind = DIST_GRAPH

    def __init__(
        self,
        sources: list[int],
        destinations: list[int],
        weights: tuple[list[int], list[int]] | None,
    ) -> None:
        self.sources = sources
        self.destinations = destinations
        self.weights = weights


def _ints(seq: Sequence[int]) -> list[int]:
    return [operator.index(x) for x in seq]


def _counted(seq: Sequence[int], n: int) -> list[int]:
    out = _ints(seq)
    if len(out) != n:
        raise ValueError(f"expecting {n} items, got {len(out)}")
    return out


def _weights(weights: Any, n: int) -> list[int] | None:
    """None for an unweighted graph; a list (maybe empty) otherwise. Checked as mpi4py does."""
    if weights is None or weights is UNWEIGHTED:
        return None
    if weights is WEIGHTS_EMPTY:
        if n > 0:
            raise ValueError("empty weights but nonzero degree")
        return []
    return _counted(weights, n)


def _check_ranks(ranks: list[int], size: int) -> None:
    for r in ranks:
        if not 0 <= r < size:
            raise errors.MPIException(errors.ERR_RANK, f"rank {r} in a {size}-rank graph")


class Distgraphcomm(Topocomm):
    """``MPI.Distgraphcomm``."""

    _kinds = (DIST_GRAPH,)
    _expecting = "a distributed graph communicator"

    def _dist(self) -> _DistGraph:
        topo = self._core().topo
        if not isinstance(topo, _DistGraph):
            raise errors.MPIException(errors.ERR_TOPOLOGY)
        return topo

    def Get_dist_neighbors_count(self) -> tuple[int, int, bool]:
        g = self._dist()
        return (len(g.sources), len(g.destinations), g.weights is not None)

    def Get_dist_neighbors(
        self,
    ) -> tuple[list[int], list[int], tuple[list[int], list[int]] | None]:
        g = self._dist()
        weights = None if g.weights is None else (list(g.weights[0]), list(g.weights[1]))
        return (list(g.sources), list(g.destinations), weights)

    def _inout(self) -> tuple[list[int], list[int]]:
        g = self._dist()
        return (list(g.sources), list(g.destinations))


def create_adjacent(
    comm: Any,
    sources: Sequence[int] | None,
    destinations: Sequence[int] | None,
    sourceweights: Any,
    destweights: Any,
) -> Distgraphcomm:
    srcs = _ints(sources) if sources is not None else []
    dsts = _ints(destinations) if destinations is not None else []
    sw = _weights(sourceweights, len(srcs))
    dw = _weights(destweights, len(dsts))
    size = comm._core().size
    _check_ranks(srcs, size)
    _check_ranks(dsts, size)
    # Weighted or not follows the source weights, as in MPICH; missing ones read as 1.
    weights = None if sw is None else (sw, dw if dw is not None else [1] * len(dsts))
    return _topo_comm(Distgraphcomm, comm, size, _DistGraph(srcs, dsts, weights))  # type: ignore[no-any-return]


def create(
    comm: Any,
    sources: Sequence[int],
    degrees: Sequence[int],
    destinations: Sequence[int],
    weights: Any,
) -> Distgraphcomm:
    h = comm._core()
    srcs = _ints(sources)
    degs = _counted(degrees, len(srcs))
    dsts = _counted(destinations, sum(degs))
    ws = _weights(weights, len(dsts))
    _check_ranks(srcs, h.size)
    _check_ranks(dsts, h.size)
    # For every rank, the edges this rank names that leave it (out) and that reach it (in).
    outgoing: list[list[tuple[int, int]]] = [[] for _ in range(h.size)]
    incoming: list[list[tuple[int, int]]] = [[] for _ in range(h.size)]
    pos = 0
    for s, d in zip(srcs, degs, strict=True):
        for _ in range(d):
            w = ws[pos] if ws else 1
            outgoing[s].append((dsts[pos], w))
            incoming[dsts[pos]].append((s, w))
            pos += 1
    send = list(zip(outgoing, incoming, strict=True))
    got = coll.alltoall(h, send) if h.size > 1 else send
    outs = [e for o, _ in got for e in o]
    ins = [e for _, i in got for e in i]
    # Whether weights were given is the same at every rank (MPI's rule): this rank's word holds.
    graph_weights = None if ws is None else ([w for _, w in ins], [w for _, w in outs])
    topo = _DistGraph([s for s, _ in ins], [d for d, _ in outs], graph_weights)
    return _topo_comm(Distgraphcomm, comm, h.size, topo)  # type: ignore[no-any-return]
