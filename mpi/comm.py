"""Communicators: ``MPI.Comm``/``MPI.Intracomm``/``MPI.Intercomm`` with mpi4py's point-to-point
and collective API.

A communicator object holds a handle (``_Core``) that copies of it share: its contexts, its
group (world ranks, in communicator order) and the reverse map. Point-to-point calls translate
ranks and hand messages to the engine; collectives run the algorithms of ``coll`` (objects) and
``collbuf`` (buffers) in the collective context ``ctx + 1``.

An intercommunicator's handle also holds its remote group (``remote``, world ranks) and the core
of its local group (``local``), in which its collectives run their phases within one group;
point-to-point ranks name the remote group (``peers``, ``pw2c``: the group and map that
point-to-point uses, the local ones of an intracommunicator). ``intercomm`` builds and manages
them, ``intercoll``/``intercollbuf`` run their collectives.

New communicators get context ids agreed by all members (``agree_ctx``): the maximum of every
member's next free id, which all members then move past. Two communicators sharing a member never
share an id; disjoint ones may, harmlessly, since matching also names world ranks. An
intracommunicator takes two ids (point-to-point, collectives), an intercommunicator four (its
local group's core takes the other two). Constructors that only the new communicator's members
call (``Create_group``, ``Create_from_group``, ``Intercomm.Create_from_groups``) agree in a
parent's collective context under negative tags, which no collective of the parent uses.

The context id is also the communicator's integer handle (``toint``/``py2f``): unique among the
communicators a process belongs to.

A communicator of FT-MPI's blank mode (``blank``) keeps its failed members as holes: its size,
ranks and group (``Get_group``, ``Compare``) still count them, its ``Dup`` has the same holes, and
everything that communicates runs over the live members (``h.shadow``): context agreements,
``Split``/``Split_type``, and the rooted constructors (``Create_intercomm``, ``Spawn``). The
communicators made from one hold live members only: holes are in no ``Split``, ``Create`` or
``Create_group`` result, nor in a Cartesian or graph topology, which cannot be made over a hole.
"""

from __future__ import annotations

import math
import operator
import threading
import weakref
import zlib
from collections.abc import Sequence
from typing import Any

from vpool.mpi import blank, coll, errors, intercomm, ops
from vpool.mpi.commattr import CommAttributes
from vpool.mpi.commcoll import CommCollectives, InterCollectives, IntraCollectives
from vpool.mpi.constants import (
    CART,
    COMM_TYPE_HW_GUIDED,
    COMM_TYPE_HW_UNGUIDED,
    COMM_TYPE_RESOURCE_GUIDED,
    COMM_TYPE_SHARED,
    CONGRUENT,
    DIST_GRAPH,
    GRAPH,
    IDENT,
    SIMILAR,
    UNDEFINED,
    UNEQUAL,
)
from vpool.mpi.errhandler import CommErrhandlers
from vpool.mpi.group import Group
from vpool.mpi.outofscope import unsupported
from vpool.mpi.p2p import CommP2P
from vpool.mpi.persistcoll import PersistentCollectives, PersistentIntraCollectives
from vpool.mpi.request import DoneOp, Request
from vpool.mpi.serialization import pickle_
from vpool.mpi.ulfm import CommULFM

_dumps = pickle_.dumps


class _Core:
    __slots__ = (
        "__weakref__",
        "attrs",
        "buf",
        "cseq",
        "ctx",
        "eng",
        "errh",
        "group",
        "holes",
        "local",
        "locks",
        "name",
        "peers",
        "psize",
        "pw2c",
        "rank",
        "remote",
        "shadow",
        "size",
        "topo",
        "w2c",
    )

    def __init__(
        self,
        eng: Any,
        ctx: int,
        group: tuple[int, ...],
        name: str = "",
        remote: tuple[int, ...] | None = None,
    ) -> None:
        self.eng = eng
        self.ctx = ctx
        self.group = group
        self.size = len(group)
        self.rank = group.index(eng.rank)
        self.w2c = _reverse(group, eng.size)
        self.remote = remote  # an intercommunicator's remote group, else None
        if remote is None:
            self.peers, self.pw2c = group, self.w2c
            self.local: _Core | None = None
        else:
            self.peers, self.pw2c = remote, _reverse(remote, eng.size)
            self.local = _Core(eng, ctx + 2, group)
        self.psize = len(self.peers)
        self.name = name
        self.attrs: dict[int, Any] = {}
        self.topo: Any = None
        self.locks: dict[Any, Any] = {}  # mpi4py's per-communicator lock table (comm_lock)
        self.errh: Any = None  # error handler set on it (None: ERRORS_RETURN), see errhandler
        # Collectives started on this communicator: each one's messages carry its number as
        # their tag, so overlapping non-blocking collectives never match each other's messages.
        self.cseq = 0
        self.buf: Any = None  # buffer attached for buffered sends (MPI 4.1, per communicator)
        # FT-MPI's blank mode (``ftmpi``): the world ranks left as holes (failed members that
        # keep their place), and the core of the live members its collectives run over.
        self.holes: frozenset[int] = frozenset()
        self.shadow: _Core | None = None


def _reverse(group: tuple[int, ...], world: int) -> list[int]:
    """World rank -> rank in ``group`` (UNDEFINED for the others)."""
    w2c = [UNDEFINED] * world
    for i, w in enumerate(group):
        w2c[w] = i
    return w2c


def comm_lock(h: _Core, key: Any) -> Any:
    """The lock mpi4py takes around lower-case calls of ``key`` on a communicator, made on
    first use (``MPI._comm_lock``); threads calling them on one communicator take turns."""
    lock = h.locks.get(key)
    if lock is None:
        lock = h.locks[key] = threading.Lock()
    return lock


def live(h: _Core) -> _Core:
    """The core of ``h``'s live members, to communicate over: its shadow if it has holes."""
    if h.holes:
        assert h.shadow is not None
        return h.shadow
    return h


def agree_ctx(h: _Core, span: int = 2) -> int:
    """A context id free at every member (collective over the intracommunicator ``h``, its
    live members if it has holes); the new communicator takes ``span`` ids from it."""
    h = live(h)
    eng = h.eng
    ctx = coll.allreduce(h, eng.next_ctx, ops.MAX) if h.size > 1 else eng.next_ctx
    eng.next_ctx = ctx + span
    return int(ctx)


# Tag spaces (negative, below ANY_TAG) of the agreements among a new communicator's members.
_CREATE_GROUP_TAGS = -(1 << 40)
_FROM_GROUP_TAGS = -(1 << 41)
_FROM_GROUPS_TAGS = -(1 << 42)  # Intercomm.Create_from_groups (intercomm: Create_intercomm's)


def agree_ctx_among(eng: Any, ctx: int, members: tuple[int, ...], tag: int, span: int = 2) -> int:
    """``agree_ctx`` among ``members`` only, in context ``ctx``'s collective context with
    ``tag``: the members' own sequence, apart from every collective of that context."""
    sub = _Core(eng, ctx, members)
    sub.cseq = tag - 1  # the agreement's one collective takes the next number: ``tag``
    return agree_ctx(sub, span)


_by_handle: weakref.WeakValueDictionary[int, _Core] = weakref.WeakValueDictionary()

_SHARED_MEMORY = "mpi_shared_memory"
_PROCESS = "vpool://process"  # the level below a machine: each rank is its own process
_RESTYPE = "mpi_hw_resource_type"


def _split_color(split_type: int, info: Any, names: list[str], me: int) -> tuple[int, str]:
    """(color, resource type) of this rank for ``Split_type``: machines (by processor name) are
    the shared-memory domains; below them each process stands alone."""
    host = names.index(names[me])
    if split_type == UNDEFINED:
        return UNDEFINED, ""
    if split_type == COMM_TYPE_SHARED:
        return host, _SHARED_MEMORY
    if split_type in (COMM_TYPE_HW_GUIDED, COMM_TYPE_RESOURCE_GUIDED):
        wanted = info.Get(_RESTYPE) if info else None
        return (host, _SHARED_MEMORY) if wanted == _SHARED_MEMORY else (UNDEFINED, "")
    if split_type == COMM_TYPE_HW_UNGUIDED:
        # The first level that splits the communicator into smaller parts, if any.
        if len(set(names)) > 1:
            return host, _SHARED_MEMORY
        if len(names) > 1:
            return me, _PROCESS
        return UNDEFINED, ""
    raise errors.MPIException(errors.ERR_ARG, f"unknown split type {split_type}")


def _class_of(core: _Core) -> type:
    """The class ``fromint`` gives a handle: by its kind and topology, as mpi4py does."""
    if core.remote is not None:
        return Intercomm
    kind = None if core.topo is None else core.topo.kind
    if kind == CART or kind == GRAPH:
        from vpool.mpi import topology

        return topology.Cartcomm if kind == CART else topology.Graphcomm
    if kind == DIST_GRAPH:
        from vpool.mpi import distgraph

        return distgraph.Distgraphcomm
    return Intracomm


def _predefined(name: str) -> Any:
    """Unpickling of the predefined communicators: the object itself."""
    from vpool.mpi import MPI

    return getattr(MPI, name)


def _predefined_copy(cls: type, name: str) -> Any:
    return cls(_predefined(name))


class Comm(
    CommP2P, CommErrhandlers, CommAttributes, CommCollectives, PersistentCollectives, CommULFM
):
    """``MPI.Comm``."""

    _h: _Core | None

    def __new__(cls, comm: Comm | None = None) -> Any:
        # A handle copy, as in mpi4py: subclasses call ``super().__new__(cls, comm)``.
        if comm is not None and not isinstance(comm, Comm):
            raise TypeError(
                f"Argument 'comm' has incorrect type (expected mpi4py.MPI.Comm, got "
                f"{type(comm).__name__})"
            )
        obj = super().__new__(cls)
        obj._h = comm._h if comm is not None else None
        if obj._h is not None:
            cls._check_handle(obj._h)
        return obj

    @classmethod
    def _check_handle(cls, h: _Core) -> None:
        """Raise TypeError if a handle is not of this class's kind (mpi4py's ``__cinit__``)."""

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
        # The predefined communicators travel by name (the object itself, or a copy of it).
        from vpool.mpi import environment

        h = self._h
        name = None
        if h is None:
            name = "COMM_NULL"
        elif h is environment.COMM_WORLD._h:
            name = "COMM_WORLD"
        elif h is environment.COMM_SELF._h:
            name = "COMM_SELF"
        if name is None:
            raise ValueError(f"cannot serialize 'mpi4py.MPI.{type(self).__name__}' instance")
        if self is _predefined(name):
            return (_predefined, (name,))
        return (_predefined_copy, (type(self), name))

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
        if self._h is None:
            return "MPI_COMM_NULL"
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
        return self._core().remote is not None

    def Is_intra(self) -> bool:
        return self._core().remote is None

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

    @property
    def is_topo(self) -> bool:
        return self.Get_topology() != UNDEFINED

    def Compare(self, comm: Comm) -> int:
        a, b = self._core(), comm._core()
        if a is b:
            return IDENT
        if (a.remote is None) != (b.remote is None):
            return UNEQUAL
        ra, rb = a.remote or (), b.remote or ()
        if a.group == b.group and ra == rb:
            return CONGRUENT
        if set(a.group) == set(b.group) and set(ra) == set(rb):
            return SIMILAR
        return UNEQUAL

    @classmethod
    def Get_parent(cls) -> Intercomm:
        """The intercommunicator to the group that spawned this process (``spawn``);
        COMM_NULL if it was not spawned, or once that one was freed or disconnected."""
        from vpool.mpi import environment

        core = environment.engine().parent
        return Intercomm() if core is None else Intercomm._wrap(core)  # type: ignore[no-any-return]

    # ---- lifetime ------------------------------------------------------------------------

    def Free(self) -> None:
        h = self._core()
        if h.ctx < 4:  # contexts 0-3: COMM_WORLD and COMM_SELF
            raise errors.MPIException(errors.ERR_COMM, "cannot free a predefined communicator")
        _by_handle.pop(h.ctx, None)
        if h is h.eng.parent:
            h.eng.parent = None  # Get_parent is COMM_NULL from now on
        self._h = None

    def Disconnect(self) -> None:
        """Free once every member got here (MPI: after the pending communication completed;
        sends are eager, so the barrier is what is left to wait for)."""
        h = self._core()
        if h.ctx < 4:
            raise errors.MPIException(errors.ERR_COMM, "cannot free a predefined communicator")
        self.Barrier()
        self.Free()

    def Abort(self, errorcode: int = 0) -> None:
        from vpool.mpi import environment

        environment.abort(errorcode)

    def Clone(self) -> Any:
        return self.Dup()

    def Dup(self, info: Any = None) -> Any:
        h = self._core()
        if h.eng.strict and h.eng.failed:
            from vpool.mpi import ftmpi

            if ftmpi.recovering(h):  # FT-MPI: Dup of COMM_WORLD rebuilds it after failures
                return ftmpi.recover(self)
        ctx = agree_ctx(h)
        core = blank.blank_core(h.eng, ctx, h.group, h.holes)  # the same holes, if any
        core.topo = h.topo
        return type(self)._wrap(core)

    def Dup_with_info(self, info: Any) -> Any:
        return self.Dup()

    def Idup(self, info: Any = None) -> tuple[Any, Request]:
        return self.Dup(info), Request._of(DoneOp())

    def Idup_with_info(self, info: Any) -> tuple[Any, Request]:
        return self.Idup(info)

    def Split(self, color: int = 0, key: int = 0) -> Intracomm:
        h = live(self._core())
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
        from vpool.mpi import environment

        h = live(self._core())
        # Every member takes part in the same collectives, UNDEFINED ones too.
        name = environment.processor_name()
        names = coll.allgather(h, name) if h.size > 1 else [name]
        color, restype = _split_color(split_type, info, names, h.rank)
        comm = self.Split(color, key)
        if comm and split_type == COMM_TYPE_HW_UNGUIDED and info:
            info.Set(_RESTYPE, restype)  # MPI 4: tells the caller which level it got
        return comm

    def Create(self, group: Group) -> Any:
        h = self._core()
        ctx = agree_ctx(h)
        members = tuple(w for w in group._m() if w not in h.holes)
        if h.eng.rank not in members:
            return type(self)()
        return type(self)._wrap(_Core(h.eng, ctx, members))

    def Create_group(self, group: Group, tag: int = 0) -> Any:
        h = self._core()
        members = tuple(w for w in group._m() if w not in h.holes)
        if h.eng.rank not in members:
            return type(self)()
        # Only the group's members take part: agree among them, in the parent's contexts.
        ctx = agree_ctx_among(h.eng, h.ctx, members, _CREATE_GROUP_TAGS - (tag & 0x7FFFFFFF))
        return type(self)._wrap(_Core(h.eng, ctx, members))

    # ---- buffered sends (MPI 4.1: a buffer per communicator) -------------------------------

    def Attach_buffer(self, buf: Any) -> None:
        from vpool.mpi.buffers import BUFFER_AUTOMATIC, byte_view

        h = self._core()
        if h.buf is not None:
            raise errors.MPIException(errors.ERR_BUFFER, "a buffer is already attached")
        if buf is not BUFFER_AUTOMATIC:
            byte_view(buf, writable=True)  # BufferError if read-only, as in mpi4py
        h.buf = buf

    def Detach_buffer(self) -> Any:
        h = self._core()
        buf, h.buf = h.buf, None
        return buf

    def Flush_buffer(self) -> None:
        # Buffered sends leave at once (every send is eager): nothing is ever pending.
        self._core()

    def Iflush_buffer(self) -> Request:
        self._core()
        return Request._of(DoneOp())

    def py2f(self) -> int:
        h = self._h
        if h is None:
            return -1
        _by_handle[h.ctx] = h
        return h.ctx

    toint = py2f

    @classmethod
    def f2py(cls, arg: int) -> Any:
        h = _by_handle.get(arg)
        return Comm() if h is None else _class_of(h)._wrap(h)

    fromint = f2py


class Intracomm(IntraCollectives, PersistentIntraCollectives, Comm):
    """``MPI.Intracomm``: adds the prefix reductions and topology constructors."""

    @classmethod
    def _check_handle(cls, h: _Core) -> None:
        if h.remote is not None:
            raise TypeError("expecting an intracommunicator")

    @classmethod
    def Create_from_group(
        cls, group: Group, stringtag: str = "org.mpi4py", info: Any = None, errhandler: Any = None
    ) -> Intracomm:
        """MPI 4: a communicator of ``group``, made by its members alone. Members agree in
        COMM_WORLD's collective context, under a tag derived from ``stringtag`` (which tells
        concurrent creations apart, as MPI asks)."""
        from vpool.mpi import environment

        eng = environment.engine()
        members = tuple(group._m())
        if eng.rank not in members:
            raise errors.MPIException(errors.ERR_GROUP, "the calling process is not in the group")
        tag = _FROM_GROUP_TAGS - zlib.crc32(str(stringtag).encode())
        core = _Core(eng, agree_ctx_among(eng, 0, members, tag), members)
        if errhandler is not None:
            core.errh = errhandler
        return cls._wrap(core)  # type: ignore[no-any-return]

    def Create_intercomm(
        self, local_leader: int, peer_comm: Comm, remote_leader: int, tag: int = 0
    ) -> Intercomm:
        """An intercommunicator between this communicator's group and the remote leader's
        (``intercomm.from_leaders``); ``peer_comm`` matters only at the local leader."""
        h, leader = blank.live_root(self._core(), local_leader)
        peer = peer_comm._h if isinstance(peer_comm, Comm) else None
        ctx, remote = intercomm.from_leaders(h, leader, peer, remote_leader, tag)
        return Intercomm._wrap(_Core(h.eng, ctx, h.group, remote=remote))  # type: ignore[no-any-return]

    # Dynamic processes: spawning asks the pool for more ranks of the job (``spawn``); ports
    # and name publishing are out of scope.
    def Spawn(
        self,
        command: Any,
        args: Any = None,
        maxprocs: int = 1,
        info: Any = None,
        root: int = 0,
        errcodes: list[int] | None = None,
    ) -> Intercomm:
        from vpool.mpi import spawn

        h, root = blank.live_root(self._core(), root)
        made = spawn.spawn(h, root, lambda: spawn.ask_single(command, args, maxprocs, info))
        return _spawned(made, errcodes, False)

    def Spawn_multiple(
        self,
        command: Any,
        args: Any = None,
        maxprocs: Any = None,
        info: Any = None,
        root: int = 0,
        errcodes: list[list[int]] | None = None,
    ) -> Intercomm:
        from vpool.mpi import spawn

        h, root = blank.live_root(self._core(), root)
        made = spawn.spawn(h, root, lambda: spawn.ask_multiple(command, args, maxprocs, info))
        return _spawned(made, errcodes, True)

    def Accept(self, *args: Any, **kwargs: Any) -> Intercomm:
        unsupported("dynamic processes (Accept)")

    def Connect(self, *args: Any, **kwargs: Any) -> Intercomm:
        unsupported("dynamic processes (Connect)")

    # Topology constructors live with the topologies (``topology`` imports this module).

    def _no_holes(self, nodes: int, what: str) -> None:
        """A topology takes the first ``nodes`` ranks (no reordering): ``ERR_PROC_FAILED`` at
        every member alike if a hole is among them."""
        h = self._core()
        inside = sorted(h.w2c[w] for w in h.holes if h.w2c[w] < nodes)
        if inside:
            raise errors.MPIException(
                errors.ERR_PROC_FAILED,
                f"{what} of {nodes} ranks over holes (failed ranks {inside}) of the communicator",
            )

    def Create_cart(self, dims: Sequence[int], periods: Any = None, reorder: bool = False) -> Any:
        from vpool.mpi import topology

        dims = [operator.index(d) for d in dims]
        self._no_holes(math.prod(dims), "a Cartesian topology")
        return topology.create_cart(self, dims, periods, reorder)

    def Create_graph(
        self, index: Sequence[int], edges: Sequence[int], reorder: bool = False
    ) -> Any:
        from vpool.mpi import topology

        index, edges = list(index), list(edges)
        self._no_holes(len(topology.graph_arrays(index, edges)[0]), "a graph topology")
        return topology.create_graph(self, index, edges, reorder)

    def Create_dist_graph_adjacent(
        self,
        sources: Sequence[int] | None,
        destinations: Sequence[int] | None,
        sourceweights: Any = None,
        destweights: Any = None,
        info: Any = None,
        reorder: bool = False,
    ) -> Any:
        from vpool.mpi import distgraph

        self._no_holes(self.size, "a distributed graph")
        return distgraph.create_adjacent(self, sources, destinations, sourceweights, destweights)

    def Create_dist_graph(
        self,
        sources: Sequence[int],
        degrees: Sequence[int],
        destinations: Sequence[int],
        weights: Any = None,
        info: Any = None,
        reorder: bool = False,
    ) -> Any:
        from vpool.mpi import distgraph

        self._no_holes(self.size, "a distributed graph")
        return distgraph.create(self, sources, degrees, destinations, weights)

    def Cart_map(self, dims: Sequence[int], periods: Any = None) -> int:
        from vpool.mpi import topology

        dims = [int(d) for d in dims]
        topology.cart_periods(periods, len(dims))
        nodes = 1
        for d in dims:
            nodes *= d
        if nodes > self.size:
            raise errors.MPIException(errors.ERR_ARG, f"topology of {nodes} ranks in {self.size}")
        return topology.topo_map(nodes, self.rank)

    def Graph_map(self, index: Sequence[int], edges: Sequence[int]) -> int:
        from vpool.mpi import topology

        index, edges = topology.graph_arrays(index, edges)
        if len(index) > self.size:
            raise errors.MPIException(errors.ERR_ARG, f"graph of {len(index)} in {self.size}")
        return topology.topo_map(len(index), self.rank)


def _spawned(made: Any, errcodes: Any, multiple: bool) -> Intercomm:
    """What ``Spawn``/``Spawn_multiple`` return (``spawn.spawn``'s result), ``errcodes``
    filled as MPI says: one code per process asked for (a list per command, ``multiple``)."""
    from vpool.mpi import spawn

    core, ranks, counts, error = made
    if errcodes is not None:
        codes = spawn.errcodes_for(sum(counts), len(ranks), error)
        if not multiple:
            errcodes[:] = codes
        else:
            errcodes[:] = [[] for _ in counts]
            at = 0
            for i, n in enumerate(counts):
                errcodes[i][:] = codes[at : at + n]
                at += n
    if error:
        raise errors.MPIException(errors.ERR_SPAWN, error)
    return Intercomm._wrap(core)  # type: ignore[no-any-return]


class Intercomm(InterCollectives, Comm):
    """``MPI.Intercomm``: two disjoint groups; ranks of point-to-point calls and collectives'
    roots name the remote group (``intercomm``, ``intercoll``)."""

    @classmethod
    def _check_handle(cls, h: _Core) -> None:
        if h.remote is None:
            raise TypeError("expecting an intercommunicator")

    def _remote(self) -> tuple[int, ...]:
        remote = self._core().remote
        assert remote is not None
        return remote

    def Get_remote_group(self) -> Group:
        return Group._of(self._remote(), self._core().eng.rank)

    def Get_remote_size(self) -> int:
        return len(self._remote())

    @property
    def remote_group(self) -> Group:
        return self.Get_remote_group()

    @property
    def remote_size(self) -> int:
        return self.Get_remote_size()

    @classmethod
    def Create_from_groups(
        cls,
        local_group: Group,
        local_leader: int,
        remote_group: Group,
        remote_leader: int,
        stringtag: str = "org.mpi4py",
        info: Any = None,
        errhandler: Any = None,
    ) -> Intercomm:
        """MPI 4: an intercommunicator made by the members of both groups alone. Every member
        knows both groups, so the leaders have nothing to tell: all agree a context id in
        COMM_WORLD's collective context, under a tag derived from ``stringtag``."""
        from vpool.mpi import environment

        eng = environment.engine()
        local, remote = tuple(local_group._m()), tuple(remote_group._m())
        if eng.rank not in local:
            raise errors.MPIException(errors.ERR_GROUP, "the calling process is not in the group")
        for leader, group in ((local_leader, local), (remote_leader, remote)):
            if not 0 <= leader < len(group):
                raise errors.MPIException(errors.ERR_RANK, f"leader {leader}")
        members = intercomm.union(local, remote)
        tag = _FROM_GROUPS_TAGS - zlib.crc32(str(stringtag).encode())
        ctx = agree_ctx_among(eng, 0, members, tag, intercomm.SPAN)
        core = _Core(eng, ctx, local, remote=remote)
        if errhandler is not None:
            core.errh = errhandler
        return cls._wrap(core)  # type: ignore[no-any-return]

    def Dup(self, info: Any = None) -> Any:
        h = self._core()
        return type(self)._wrap(_Core(h.eng, intercomm.dup(h), h.group, remote=h.remote))

    def Split(self, color: int = 0, key: int = 0) -> Intercomm:  # type: ignore[override]
        made = intercomm.split(self._core(), color, key)
        return self._made(made)

    def Split_type(self, split_type: int, key: int = 0, info: Any = None) -> Intercomm:  # type: ignore[override]
        """As on an intracommunicator, over the processes of both groups: each member's color
        is its machine's place among the machines of both."""
        from vpool.mpi import environment

        h = self._core()
        names, me = intercomm.both_in_order(h, *intercomm.everyone(h, environment.processor_name()))
        color, restype = _split_color(split_type, info, names, me)
        comm = self.Split(color, key)
        if comm and split_type == COMM_TYPE_HW_UNGUIDED and info:
            info.Set(_RESTYPE, restype)
        return comm

    def Create(self, group: Group) -> Intercomm:
        made = intercomm.subset(self._core(), tuple(group._m()))
        return self._made(made)

    def Create_group(self, group: Group, tag: int = 0) -> Any:
        self._core()
        raise errors.MPIException(errors.ERR_COMM, "Create_group needs an intracommunicator")

    def _made(self, made: intercomm.Groups | None) -> Intercomm:
        if made is None:
            return Intercomm()
        ctx, local, remote = made
        return Intercomm._wrap(_Core(self._core().eng, ctx, local, remote=remote))  # type: ignore[no-any-return]

    def Merge(self, high: bool = False) -> Intracomm:
        h = self._core()
        ctx, members = intercomm.merge(h, high)
        return Intracomm._wrap(_Core(h.eng, ctx, members))  # type: ignore[no-any-return]
