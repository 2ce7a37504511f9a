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
import warnings
from collections.abc import Sequence
from typing import Any

from vpool.protocol.messages import KIND_BUFFER, KIND_PICKLE
from vpool.sdk.mpi import coll, errors, ops
from vpool.sdk.mpi.buffers import view_of
from vpool.sdk.mpi.commattr import CommAttributes
from vpool.sdk.mpi.commcoll import CommCollectives, IntraCollectives
from vpool.sdk.mpi.constants import (
    ANY_SOURCE,
    ANY_TAG,
    CONGRUENT,
    IDENT,
    PROC_NULL,
    SIMILAR,
    TAG_UB_VALUE,
    UNDEFINED,
    UNEQUAL,
)
from vpool.sdk.mpi.group import Group
from vpool.sdk.mpi.request import PROC_NULL_RECV, DoneOp, Prequest, RecvOp, Request
from vpool.sdk.mpi.serialization import pickle_
from vpool.sdk.mpi.status import Status

_dumps = pickle_.dumps


class _Core:
    __slots__ = (
        "attrs", "cseq", "ctx", "eng", "group", "locks", "name", "rank", "size", "topo", "w2c"
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


def _rank_error(rank: int, h: _Core) -> errors.MPIException:
    return errors.MPIException(errors.ERR_RANK, f"rank {rank} of a {h.size}-rank communicator")


def _dst(h: _Core, dest: int) -> int:
    """World rank of a destination, or -1 for PROC_NULL."""
    if 0 <= dest < h.size:
        return h.group[dest]
    if dest == PROC_NULL:
        return -1
    raise _rank_error(dest, h)


def _src(h: _Core, source: int) -> int:
    """World rank of a source, ANY_SOURCE or PROC_NULL."""
    if 0 <= source < h.size:
        return h.group[source]
    if source == ANY_SOURCE or source == PROC_NULL:
        return source
    raise _rank_error(source, h)


def _send_tag(tag: int) -> None:
    if not 0 <= tag <= TAG_UB_VALUE:
        raise errors.MPIException(errors.ERR_TAG, f"tag {tag}")


def _recv_tag(tag: int) -> None:
    if not (0 <= tag <= TAG_UB_VALUE or tag == ANY_TAG):
        raise errors.MPIException(errors.ERR_TAG, f"tag {tag}")


def agree_ctx(h: _Core) -> int:
    """A context id free at every member (collective over ``h``)."""
    eng = h.eng
    ctx = coll.allreduce(h, eng.next_ctx, ops.MAX) if h.size > 1 else eng.next_ctx
    eng.next_ctx = ctx + 2
    return int(ctx)


class Comm(CommAttributes, CommCollectives):
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
        self._core()
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
        if split_type == UNDEFINED:
            return self.Split(UNDEFINED, key)
        name = environment.processor_name()
        names = coll.allgather(h, name) if h.size > 1 else [name]
        return self.Split(names.index(name), key)

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

    # ---- point-to-point: buffers -----------------------------------------------------------

    def Send(self, buf: Any, dest: int, tag: int = 0) -> None:
        h = self._h or self._core()
        w = _dst(h, dest)
        _send_tag(tag)
        if w < 0:
            return
        view = view_of(buf, writable=False)
        h.eng.send(w, h.ctx, tag, KIND_BUFFER, [], [view], view.nbytes)

    Bsend = Send
    Rsend = Send

    def Ssend(self, buf: Any, dest: int, tag: int = 0) -> None:
        self.Issend(buf, dest, tag).Wait()

    def Isend(self, buf: Any, dest: int, tag: int = 0) -> Request:
        self.Send(buf, dest, tag)
        return Request._of(DoneOp())

    Ibsend = Isend
    Irsend = Isend

    def Issend(self, buf: Any, dest: int, tag: int = 0) -> Request:
        h = self._h or self._core()
        w = _dst(h, dest)
        _send_tag(tag)
        if w < 0:
            return Request._of(DoneOp())
        view = view_of(buf, writable=False)
        return Request._of(h.eng.ssend(w, h.ctx, tag, KIND_BUFFER, [], [view], view.nbytes))

    def Send_init(self, buf: Any, dest: int, tag: int = 0) -> Prequest:
        return Prequest._persistent(lambda: self.Isend(buf, dest, tag)._op)

    def Ssend_init(self, buf: Any, dest: int, tag: int = 0) -> Prequest:
        return Prequest._persistent(lambda: self.Issend(buf, dest, tag)._op)

    Bsend_init = Send_init
    Rsend_init = Send_init

    def _post_recv(self, buf: Any, source: int, tag: int) -> Any:
        h = self._h or self._core()
        w = _src(h, source)
        _recv_tag(tag)
        if w == PROC_NULL:
            return PROC_NULL_RECV
        op = RecvOp(h.ctx, w, tag, view_of(buf, writable=True), h.w2c)
        h.eng.post(op)
        return op

    def Recv(
        self,
        buf: Any,
        source: int = ANY_SOURCE,
        tag: int = ANY_TAG,
        status: Status | None = None,
    ) -> None:
        op = self._post_recv(buf, source, tag)
        if not op.done:
            self._h.eng.wait(op)  # type: ignore[union-attr]
        op.finish(status)

    def Irecv(self, buf: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Request:
        return Request._of(self._post_recv(buf, source, tag))

    def Recv_init(self, buf: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Prequest:
        return Prequest._persistent(lambda: self._post_recv(buf, source, tag))

    def Sendrecv(
        self,
        sendbuf: Any,
        dest: int,
        sendtag: int = 0,
        recvbuf: Any = None,
        source: int = ANY_SOURCE,
        recvtag: int = ANY_TAG,
        status: Status | None = None,
    ) -> None:
        op = self._post_recv(recvbuf, source, recvtag)
        self.Send(sendbuf, dest, sendtag)
        if not op.done:
            self._h.eng.wait(op)  # type: ignore[union-attr]
        op.finish(status)

    def Sendrecv_replace(
        self,
        buf: Any,
        dest: int,
        sendtag: int = 0,
        source: int = ANY_SOURCE,
        recvtag: int = ANY_TAG,
        status: Status | None = None,
    ) -> None:
        # Sends are eager: once Send returns the bytes are gone, the buffer may be received into.
        self.Send(buf, dest, sendtag)
        self.Recv(buf, source, recvtag, status)

    def Isendrecv(
        self,
        sendbuf: Any,
        dest: int,
        sendtag: int = 0,
        recvbuf: Any = None,
        source: int = ANY_SOURCE,
        recvtag: int = ANY_TAG,
    ) -> Request:
        op = self._post_recv(recvbuf, source, recvtag)
        self.Send(sendbuf, dest, sendtag)
        return Request._of(op)

    def Isendrecv_replace(
        self,
        buf: Any,
        dest: int,
        sendtag: int = 0,
        source: int = ANY_SOURCE,
        recvtag: int = ANY_TAG,
    ) -> Request:
        view_of(buf, writable=True)  # a bad receive buffer must fail before anything is sent
        self.Send(buf, dest, sendtag)  # eager: the bytes are out before the receive is posted
        return Request._of(self._post_recv(buf, source, recvtag))

    # ---- point-to-point: objects -----------------------------------------------------------

    def send(self, obj: Any, dest: int, tag: int = 0) -> None:
        h = self._h or self._core()
        if 0 <= dest < h.size and 0 <= tag <= TAG_UB_VALUE:
            w = h.group[dest]
        else:
            w = _dst(h, dest)
            _send_tag(tag)
            if w < 0:
                return
        bufs, parts = _dumps(obj)
        h.eng.send(w, h.ctx, tag, KIND_PICKLE, parts, bufs, sum(parts) if parts else len(bufs[0]))

    bsend = send

    def ssend(self, obj: Any, dest: int, tag: int = 0) -> None:
        self.issend(obj, dest, tag).wait()

    def isend(self, obj: Any, dest: int, tag: int = 0) -> Request:
        self.send(obj, dest, tag)
        return Request._of(DoneOp())

    ibsend = isend

    def issend(self, obj: Any, dest: int, tag: int = 0) -> Request:
        h = self._h or self._core()
        w = _dst(h, dest)
        _send_tag(tag)
        if w < 0:
            return Request._of(DoneOp())
        bufs, parts = _dumps(obj)
        n = sum(parts) if parts else len(bufs[0])
        return Request._of(h.eng.ssend(w, h.ctx, tag, KIND_PICKLE, parts, bufs, n))

    def _post_obj(self, source: int, tag: int) -> Any:
        h = self._h or self._core()
        if 0 <= source < h.size:
            w = h.group[source]
        else:
            w = _src(h, source)
            if w == PROC_NULL:
                return PROC_NULL_RECV
        if tag < 0 and tag != ANY_TAG:
            _recv_tag(tag)
        op = RecvOp(h.ctx, w, tag, None, h.w2c)
        h.eng.post(op)
        return op

    def recv(
        self,
        buf: Any = None,
        source: int = ANY_SOURCE,
        tag: int = ANY_TAG,
        status: Status | None = None,
    ) -> Any:
        if buf is not None:
            warnings.warn("the 'buf' argument is deprecated", UserWarning, stacklevel=2)
        op = self._post_obj(source, tag)
        if not op.done:
            self._h.eng.wait(op)  # type: ignore[union-attr]
        return op.finish(status)

    def irecv(self, buf: Any = None, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Request:
        return Request._of(self._post_obj(source, tag))

    def sendrecv(
        self,
        sendobj: Any,
        dest: int,
        sendtag: int = 0,
        recvbuf: Any = None,
        source: int = ANY_SOURCE,
        recvtag: int = ANY_TAG,
        status: Status | None = None,
    ) -> Any:
        op = self._post_obj(source, recvtag)
        self.send(sendobj, dest, sendtag)
        if not op.done:
            self._h.eng.wait(op)  # type: ignore[union-attr]
        return op.finish(status)

    # ---- probes ----------------------------------------------------------------------------

    def _probe(self, source: int, tag: int, block: bool) -> Any:
        h = self._core()
        w = _src(h, source)
        _recv_tag(tag)
        if w == PROC_NULL:
            return PROC_NULL
        matcher = h.eng.matcher
        entry = matcher.probe(h.ctx, w, tag)
        if entry is None:
            h.eng.poke()
            entry = matcher.probe(h.ctx, w, tag)
            while entry is None and block:
                h.eng.block()
                entry = matcher.probe(h.ctx, w, tag)
        return entry

    def _probe_status(self, entry: Any, status: Status | None) -> None:
        if status is None:
            return
        if entry is PROC_NULL:
            status._fill(PROC_NULL, ANY_TAG, 0)
        else:
            msg, payload = entry
            status._fill(self._core().w2c[msg.src], msg.tag, len(payload))

    def Probe(
        self, source: int = ANY_SOURCE, tag: int = ANY_TAG, status: Status | None = None
    ) -> bool:
        self._probe_status(self._probe(source, tag, True), status)
        return True

    def Iprobe(
        self, source: int = ANY_SOURCE, tag: int = ANY_TAG, status: Status | None = None
    ) -> bool:
        entry = self._probe(source, tag, False)
        if entry is None:
            return False
        self._probe_status(entry, status)
        return True

    probe = Probe
    iprobe = Iprobe

    def _mprobe(self, source: int, tag: int, block: bool, status: Status | None) -> Any:
        from vpool.sdk.mpi.message import MESSAGE_NO_PROC, Message

        entry = self._probe(source, tag, block)
        if entry is None:
            return None
        self._probe_status(entry, status)
        if entry is PROC_NULL:
            return Message(MESSAGE_NO_PROC)
        h = self._core()
        h.eng.claim(entry)
        return Message._of(entry, h.w2c)

    def Mprobe(
        self, source: int = ANY_SOURCE, tag: int = ANY_TAG, status: Status | None = None
    ) -> Any:
        return self._mprobe(source, tag, True, status)

    def Improbe(
        self, source: int = ANY_SOURCE, tag: int = ANY_TAG, status: Status | None = None
    ) -> Any:
        return self._mprobe(source, tag, False, status)

    mprobe = Mprobe
    improbe = Improbe


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
