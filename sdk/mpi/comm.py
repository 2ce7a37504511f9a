"""Communicators: ``MPI.Comm``/``MPI.Intracomm`` with mpi4py's point-to-point and collective API.

A communicator object holds a handle (``_Core``) that copies of it share: its contexts, its
group (world ranks, in communicator order) and the reverse map. Point-to-point calls translate
ranks and hand messages to the engine; collectives run the algorithms of ``coll`` (objects) and
``collbuf`` (buffers) in the collective context ``ctx + 1``.

New communicators get context ids agreed by all members (``agree_ctx``): the maximum of every
member's next free id, which all members then move past. Two communicators sharing a member never
share an id; disjoint ones may, harmlessly, since matching also names world ranks.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from vpool.sdk.mpi import coll, errors, ops
from vpool.sdk.mpi.commattr import CommAttributes
from vpool.sdk.mpi.commcoll import CommCollectives, IntraCollectives
from vpool.sdk.mpi.constants import (
    CONGRUENT,
    IDENT,
    SIMILAR,
    UNDEFINED,
    UNEQUAL,
)
from vpool.sdk.mpi.errhandler import CommErrhandlers
from vpool.sdk.mpi.group import Group
from vpool.sdk.mpi.p2p import CommP2P
from vpool.sdk.mpi.request import DoneOp, Request
from vpool.sdk.mpi.serialization import pickle_

_dumps = pickle_.dumps


class _Core:
    __slots__ = (
        "attrs", "cseq", "ctx", "eng", "errh", "group", "locks", "name", "rank", "size", "topo",
        "w2c",
    )

    def __init__(self, eng: Any, ctx: int, group: tuple[int, ...], name: str = "") -> None:
        self.eng = eng
        self.ctx = ctx
        self.group = group
        self.size = len(group)
        self.rank = group.index(eng.rank)
        w2c = [UNDEFINED] * eng.size
        for i, w in enumerate(group):
            w2c[w] = i
        self.w2c = w2c
        self.name = name
        self.attrs: dict[int, Any] = {}
        self.topo: Any = None
        self.locks: dict[Any, Any] = {}  # mpi4py's per-communicator lock table (comm_lock)
        self.errh: Any = None  # error handler set on it (None: ERRORS_RETURN), see errhandler
        # Collectives started on this communicator: each one's messages carry its number as
        # their tag, so overlapping non-blocking collectives never match each other's messages.
        self.cseq = 0


def comm_lock(h: _Core, key: Any) -> Any:
    """The lock mpi4py takes around lower-case calls of ``key`` on a communicator, made on
    first use (``MPI._comm_lock``); threads calling them on one communicator take turns."""
    lock = h.locks.get(key)
    if lock is None:
        lock = h.locks[key] = threading.Lock()
    return lock


def agree_ctx(h: _Core) -> int:
    """A context id free at every member (collective over ``h``)."""
    eng = h.eng
    ctx = coll.allreduce(h, eng.next_ctx, ops.MAX) if h.size > 1 else eng.next_ctx
    eng.next_ctx = ctx + 2
    return int(ctx)


class Comm(CommP2P, CommErrhandlers, CommAttributes, CommCollectives):
    """``MPI.Comm``."""

    _h: _Core | None

    def __new__(cls, comm: Comm | None = None) -> Any:
        # A handle copy, as in mpi4py: subclasses call ``super().__new__(cls, comm)``.
        obj = super().__new__(cls)
        obj._h = comm._h if comm is not None else None
        return obj

    @classmethod
    def _wrap(cls, core: _Core | None) -> Any:
        obj = object.__new__(cls)
        obj._h = core
        return obj

    def _core(self) -> _Core:
        h = self._h
        if h is None:
            raise errors.MPIException(errors.ERR_COMM, "null communicator")
        return h

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Comm):
            return NotImplemented
        return self._h is other._h

    def __hash__(self) -> int:
        return id(self._h)

    def __bool__(self) -> bool:
        return self._h is not None

    def __repr__(self) -> str:
        h = self._h
        if h is None:
            return f"<mpi4py.MPI.{type(self).__name__} COMM_NULL>"
        return f"<mpi4py.MPI.{type(self).__name__} {h.name or 'comm'} rank {h.rank}/{h.size}>"

    def __reduce__(self) -> Any:
        raise TypeError(f"cannot pickle {type(self).__name__} instances")

    # ---- identity ------------------------------------------------------------------------

    def Get_rank(self) -> int:
        return self._core().rank

    def Get_size(self) -> int:
        return self._core().size

    @property
    def rank(self) -> int:
        return self._core().rank

    @property
    def size(self) -> int:
        return self._core().size

    def Get_group(self) -> Group:
        h = self._core()
        return Group._of(h.group, h.eng.rank)

    @property
    def group(self) -> Group:
        return self.Get_group()

    def Get_name(self) -> str:
        return self._core().name

    def Set_name(self, name: str) -> None:
        self._core().name = name

    @property
    def name(self) -> str:
        return self.Get_name()

    @name.setter
    def name(self, value: str) -> None:
        self.Set_name(value)

    def Is_inter(self) -> bool:
        return False

    def Is_intra(self) -> bool:
        return True

    @property
    def is_inter(self) -> bool:
        return self.Is_inter()

    @property
    def is_intra(self) -> bool:
        return self.Is_intra()

    def Get_topology(self) -> int:
        h = self._core()
        return UNDEFINED if h.topo is None else h.topo.kind

    @property
    def topology(self) -> int:
        return self.Get_topology()

    def Compare(self, comm: Comm) -> int:
        a, b = self._core(), comm._core()
        if a is b:
            return IDENT
        if a.group == b.group:
            return CONGRUENT
        if set(a.group) == set(b.group):
            return SIMILAR
        return UNEQUAL

    @classmethod
    def Get_parent(cls) -> Intercomm:
        return Intercomm()

    # ---- lifetime ------------------------------------------------------------------------

    def Free(self) -> None:
        if self._core().ctx < 4:  # contexts 0-3: COMM_WORLD and COMM_SELF
            raise errors.MPIException(errors.ERR_COMM, "cannot free a predefined communicator")
        self._h = None

    def Disconnect(self) -> None:
        self.Free()

    def Abort(self, errorcode: int = 0) -> None:
        from vpool.sdk.mpi import environment

        environment.abort(errorcode)

    def Clone(self) -> Any:
        return self.Dup()

    def Dup(self, info: Any = None) -> Any:
        h = self._core()
        ctx = agree_ctx(h)
        core = _Core(h.eng, ctx, h.group)
        core.topo = h.topo
        return type(self)._wrap(core)

    def Dup_with_info(self, info: Any) -> Any:
        return self.Dup()

    def Idup(self, info: Any = None) -> tuple[Any, Request]:
        return self.Dup(), Request._of(DoneOp())

    def Split(self, color: int = 0, key: int = 0) -> Intracomm:
        h = self._core()
        eng = h.eng
        if h.size > 1:
            triples = coll.allgather(h, (color, key, eng.next_ctx))
        else:
            triples = [(color, key, eng.next_ctx)]
        ctx = max(t[2] for t in triples)
        eng.next_ctx = ctx + 2
        if color == UNDEFINED:
            return Intracomm()
        order = sorted((k, i) for i, (c, k, _) in enumerate(triples) if c == color)
        return Intracomm._wrap(_Core(eng, ctx, tuple(h.group[i] for _, i in order)))

    def Split_type(self, split_type: int, key: int = 0, info: Any = None) -> Intracomm:
        from vpool.sdk.mpi import environment

        h = self._core()
        # Every member takes part in the same collectives, UNDEFINED ones too.
        name = environment.processor_name()
        names = coll.allgather(h, name) if h.size > 1 else [name]
        return self.Split(UNDEFINED if split_type == UNDEFINED else names.index(name), key)

    def Create(self, group: Group) -> Any:
        h = self._core()
        ctx = agree_ctx(h)
        members = group._m()
        if h.eng.rank not in members:
            return type(self)()
        return type(self)._wrap(_Core(h.eng, ctx, tuple(members)))

    def Create_group(self, group: Group, tag: int = 0) -> Any:
        h = self._core()
        members = tuple(group._m())
        if h.eng.rank not in members:
            return type(self)()
        # Only the group's members take part: agree among them, in the parent's contexts.
        sub = _Core(h.eng, h.ctx, members)
        ctx = agree_ctx(sub)
        return type(self)._wrap(_Core(h.eng, ctx, members))

    def py2f(self) -> int:
        h = self._h
        return -1 if h is None else h.ctx


class Intracomm(IntraCollectives, Comm):
    """``MPI.Intracomm``: adds the prefix reductions and topology constructors."""

    # Topology constructors live with the topologies (``topology`` imports this module).

    def Create_cart(
        self, dims: Sequence[int], periods: Sequence[bool] | None = None, reorder: bool = False
    ) -> Any:
        from vpool.sdk.mpi import topology

        return topology.create_cart(self, dims, periods, reorder)

    def Create_graph(
        self, index: Sequence[int], edges: Sequence[int], reorder: bool = False
    ) -> Any:
        from vpool.sdk.mpi import topology

        return topology.create_graph(self, index, edges, reorder)

    def Cart_map(self, dims: Sequence[int], periods: Any = None) -> int:
        from vpool.sdk.mpi import topology

        return self.rank if self.rank < topology.cart_map(dims, self.size) else UNDEFINED


class Intercomm(Comm):
    """``MPI.Intercomm``: only the null one exists (no dynamic processes)."""

    def Is_inter(self) -> bool:
        return True

    def Is_intra(self) -> bool:
        return False
