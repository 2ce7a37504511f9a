"""Process topologies: Cartesian (``Cartcomm``) and graph (``Graphcomm``) communicators.

A topology is a communicator (fresh contexts, agreed like ``Dup``) plus a description that maps
ranks to coordinates or neighbours. Ranks are never reordered: ``reorder`` is accepted and
ignored, which MPI allows.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

from vpool.mpi import errors
from vpool.mpi.comm import Intracomm, _Core, agree_ctx
from vpool.mpi.constants import CART, DIST_GRAPH, GRAPH, PROC_NULL, UNDEFINED


def compute_dims(nnodes: int, dims: Any) -> list[int]:
    """``MPI.Compute_dims``: fill the zero entries of ``dims`` as evenly as possible,
    in non-increasing order."""
    if isinstance(dims, int):
        dims = [0] * dims
    out = [int(d) for d in dims]
    fixed = 1
    for d in out:
        if d < 0:
            raise errors.MPIException(errors.ERR_DIMS)
        if d:
            fixed *= d
    free = [i for i, d in enumerate(out) if d == 0]
    if nnodes % fixed:
        raise errors.MPIException(errors.ERR_DIMS, f"{nnodes} nodes do not fit {dims}")
    rest = nnodes // fixed
    if not free:
        if rest != 1:
            raise errors.MPIException(errors.ERR_DIMS)
        return out
    primes = []
    n, p = rest, 2
    while p * p <= n:
        while n % p == 0:
            primes.append(p)
            n //= p
        p += 1
    if n > 1:
        primes.append(n)
    sizes = [1] * len(free)
    for prime in sorted(primes, reverse=True):
        sizes[sizes.index(min(sizes))] *= prime
    for i, size in zip(free, sorted(sizes, reverse=True), strict=True):
        out[i] = size
    return out


class _Cart:
    kind = CART

    def __init__(self, dims: Sequence[int], periods: Sequence[bool]) -> None:
        self.dims = [int(d) for d in dims]
        self.periods = [bool(p) for p in periods]

    def coords(self, rank: int) -> list[int]:
        out = []
        for d in reversed(self.dims):
            out.append(rank % d)
            rank //= d
        return out[::-1]

    def rank(self, coords: Sequence[int]) -> int:
        rank = 0
        for c, d, periodic in zip(coords, self.dims, self.periods, strict=True):
            if periodic:
                c %= d
            elif not 0 <= c < d:
                raise errors.MPIException(errors.ERR_ARG, f"coordinate {c} outside 0..{d - 1}")
            rank = rank * d + c
        return rank


class _Graph:
    kind = GRAPH

    def __init__(self, index: Sequence[int], edges: Sequence[int]) -> None:
        self.index = [int(i) for i in index]
        self.edges = [int(e) for e in edges]
        nnodes = len(self.index)
        if (
            any(not 0 <= e < nnodes for e in self.edges)
            or any(b < a for a, b in zip([0, *self.index], self.index, strict=False))
            or (self.index and self.index[-1] != len(self.edges))
        ):
            raise errors.MPIException(errors.ERR_ARG, "invalid graph index or edges")

    def neighbors(self, rank: int) -> list[int]:
        if not 0 <= rank < len(self.index):
            raise errors.MPIException(errors.ERR_RANK, f"rank {rank} not in the graph")
        start = self.index[rank - 1] if rank else 0
        return self.edges[start : self.index[rank]]


def graph_arrays(index: Sequence[int], edges: Sequence[int]) -> tuple[list[int], list[int]]:
    """mpi4py's extension: an index that starts with 0 and ends with the edge count (the
    "standard" adjacency arrays, one entry longer) loses its first entry."""
    index = [operator.index(i) for i in index]
    edges = [operator.index(e) for e in edges]
    if index and index[0] == 0 and index[-1] == len(edges):
        index = index[1:]
    return index, edges


def _topo_comm(cls: type, comm: Any, nodes: int, topo: Any) -> Any:
    h = comm._core()
    if nodes > h.size:
        raise errors.MPIException(errors.ERR_ARG, f"topology of {nodes} ranks in {h.size}")
    ctx = agree_ctx(h)
    if h.rank >= nodes:
        return cls()
    core = _Core(h.eng, ctx, h.group[:nodes])
    core.topo = topo
    return cls._wrap(core)


class Topocomm(Intracomm):
    """``MPI.Topocomm``: what Cartesian, graph and distributed graph communicators share."""

    _kinds: tuple[int, ...] = (CART, GRAPH, DIST_GRAPH)
    _expecting = "a topology communicator"

    @classmethod
    def _check_handle(cls, h: Any) -> None:
        if h.topo is None or h.topo.kind not in cls._kinds:
            raise TypeError(f"expecting {cls._expecting}")

    def _inout(self) -> tuple[list[int], list[int]]:
        raise TypeError("expecting a topology communicator")

    def _recv_order(self, n: int) -> list[int]:
        return list(range(n))

    @property
    def degrees(self) -> tuple[int, int]:
        ins, outs = self._inout()
        return (len(ins), len(outs))

    @property
    def indegree(self) -> int:
        return self.degrees[0]

    @property
    def outdegree(self) -> int:
        return self.degrees[1]

    @property
    def inoutedges(self) -> tuple[list[int], list[int]]:
        return self._inout()

    @property
    def inedges(self) -> list[int]:
        return self.inoutedges[0]

    @property
    def outedges(self) -> list[int]:
        return self.inoutedges[1]

    def neighbor_allgather(self, sendobj: Any) -> list[Any]:
        """Objects from every in-neighbour, in neighbour order."""
        from vpool.mpi import neighbor

        return neighbor.allgather(self, sendobj)

    def neighbor_alltoall(self, sendobj: Sequence[Any]) -> list[Any]:
        """The i-th object to the i-th out-neighbour; objects from every in-neighbour."""
        from vpool.mpi import neighbor

        return neighbor.alltoall(self, sendobj)


class Cartcomm(Topocomm):
    """``MPI.Cartcomm``."""

    _kinds = (CART,)
    _expecting = "a Cartesian communicator"

    def _cart(self) -> _Cart:
        topo = self._core().topo
        if not isinstance(topo, _Cart):
            raise errors.MPIException(errors.ERR_TOPOLOGY)
        return topo

    def Get_dim(self) -> int:
        return len(self._cart().dims)

    @property
    def dim(self) -> int:
        return self.Get_dim()

    @property
    def ndim(self) -> int:
        return self.Get_dim()

    def Get_topo(self) -> tuple[list[int], list[int], list[int]]:
        cart = self._cart()
        return (list(cart.dims), [int(p) for p in cart.periods], cart.coords(self.rank))

    @property
    def topo(self) -> tuple[list[int], list[int], list[int]]:
        return self.Get_topo()

    @property
    def dims(self) -> list[int]:
        return list(self._cart().dims)

    @property
    def periods(self) -> list[int]:
        return [int(p) for p in self._cart().periods]

    @property
    def coords(self) -> list[int]:
        return self._cart().coords(self.rank)

    def Get_cart_rank(self, coords: Sequence[int]) -> int:
        return self._cart().rank(coords)

    def Get_coords(self, rank: int) -> list[int]:
        if not 0 <= rank < self.size:
            raise errors.MPIException(errors.ERR_RANK)
        return self._cart().coords(rank)

    def Shift(self, direction: int, disp: int) -> tuple[int, int]:
        cart = self._cart()
        if not 0 <= direction < len(cart.dims):
            raise errors.MPIException(errors.ERR_ARG, f"direction {direction}")
        me = cart.coords(self.rank)

        def moved(step: int) -> int:
            c = list(me)
            c[direction] += step
            d = cart.dims[direction]
            if not cart.periods[direction] and not 0 <= c[direction] < d:
                return PROC_NULL
            return cart.rank(c)

        return moved(-disp), moved(disp)

    def Sub(self, remain_dims: Sequence[bool]) -> Cartcomm:
        cart = self._cart()
        me = cart.coords(self.rank)
        dropped = [c for c, keep in zip(me, remain_dims, strict=True) if not keep]
        color = 0
        for c, d in zip(
            dropped, [d for d, k in zip(cart.dims, remain_dims, strict=True) if not k], strict=True
        ):
            color = color * d + c
        sub = self.Split(color, self.rank)
        dims = [d for d, k in zip(cart.dims, remain_dims, strict=True) if k]
        periods = [p for p, k in zip(cart.periods, remain_dims, strict=True) if k]
        result = Cartcomm._wrap(sub._h)
        assert result._h is not None
        result._h.topo = _Cart(dims, periods)
        return result  # type: ignore[no-any-return]

    def _inout(self) -> tuple[list[int], list[int]]:
        out = []
        for direction in range(self.Get_dim()):
            src, dst = self.Shift(direction, 1)
            out += [src, dst]
        return (out, list(out))

    def _recv_order(self, n: int) -> list[int]:
        # See ``neighbor``: slot k receives what the neighbour sent from its slot k ^ 1.
        return [k ^ 1 for k in range(n)]


class Graphcomm(Topocomm):
    """``MPI.Graphcomm``."""

    _kinds = (GRAPH,)
    _expecting = "a general graph communicator"

    def _graph(self) -> _Graph:
        topo = self._core().topo
        if not isinstance(topo, _Graph):
            raise errors.MPIException(errors.ERR_TOPOLOGY)
        return topo

    def Get_dims(self) -> tuple[int, int]:
        g = self._graph()
        return (len(g.index), len(g.edges))

    def Get_topo(self) -> tuple[list[int], list[int]]:
        g = self._graph()
        return (list(g.index), list(g.edges))

    @property
    def topo(self) -> tuple[list[int], list[int]]:
        return self.Get_topo()

    def Get_neighbors_count(self, rank: int) -> int:
        return len(self._graph().neighbors(rank))

    def Get_neighbors(self, rank: int) -> list[int]:
        return self._graph().neighbors(rank)

    @property
    def neighbors(self) -> list[int]:
        return self.Get_neighbors(self.rank)

    @property
    def nneighbors(self) -> int:
        return len(self.neighbors)

    @property
    def dims(self) -> tuple[int, int]:
        return self.Get_dims()

    @property
    def nnodes(self) -> int:
        return self.Get_dims()[0]

    @property
    def nedges(self) -> int:
        return self.Get_dims()[1]

    @property
    def index(self) -> list[int]:
        return self.Get_topo()[0]

    @property
    def edges(self) -> list[int]:
        return self.Get_topo()[1]

    def _inout(self) -> tuple[list[int], list[int]]:
        n = self.neighbors
        return (n, list(n))


def cart_periods(periods: Any, ndims: int) -> list[bool]:
    """``periods`` as mpi4py takes it: None (none periodic), one bool for all, or one per
    dimension (ValueError otherwise)."""
    if periods is None:
        periods = False
    if isinstance(periods, bool):
        return [periods] * ndims
    out = [bool(operator.index(p)) for p in periods]
    if len(out) != ndims:
        raise ValueError(f"expecting {ndims} items, got {len(out)}")
    return out


def create_cart(comm: Any, dims: Sequence[int], periods: Any, reorder: bool) -> Cartcomm:
    dims = [operator.index(d) for d in dims]
    periods = cart_periods(periods, len(dims))
    if any(d <= 0 for d in dims):
        raise errors.MPIException(errors.ERR_DIMS, f"invalid dimensions {dims}")
    nodes = 1
    for d in dims:
        nodes *= d
    return _topo_comm(Cartcomm, comm, nodes, _Cart(dims, periods))  # type: ignore[no-any-return]


def create_graph(comm: Any, index: Sequence[int], edges: Sequence[int], reorder: bool) -> Graphcomm:
    index, edges = graph_arrays(index, edges)
    return _topo_comm(Graphcomm, comm, len(index), _Graph(index, edges))  # type: ignore[no-any-return]


def topo_map(nodes: int, rank: int) -> int:
    """``Cart_map``/``Graph_map``: no reordering, so the first ``nodes`` ranks keep theirs."""
    return rank if rank < nodes else UNDEFINED
