"""FT-MPI's blank mode: a communicator that keeps a failed member's place as a hole.

After a recovery in a job run with ``--on-failure blank`` (``ftmpi``), ``COMM_WORLD`` keeps its
size and every survivor its rank; the failed ranks are holes. Point-to-point with a hole raises
``ERR_PROC_FAILED`` at once (the engine: a hole is a failed rank, acknowledged on the
communicator so that ``ANY_SOURCE`` and the communicator's other operations go on).

Collectives skip the holes, as FT-MPI's do. A blank core's collectives run over its ``shadow``
(the core of the live members, in the same order, sharing the blank core's context ids; the
blank core itself never sends in its collective context) and their results are laid out in the
blank communicator's numbering:

- a root is named by its rank in the blank communicator; a hole as root raises
  ``ERR_PROC_FAILED`` at every live member (all know the holes: no communication needed);
- reductions and prefix reductions combine the live members' values in rank order (an exclusive
  scan leaves the first live member without a value: ``None``, or its buffer untouched);
- per-rank objects: ``gather``, ``allgather`` and ``alltoall`` give a list of the blank size with
  ``None`` at the holes; the items ``scatter`` and ``alltoall`` would send to a hole are skipped;
- per-rank buffer blocks: a buffer laid out for the blank size (``size * count`` elements, or
  counts and displacements per blank rank) gets each live member's block at its place and the
  holes' blocks are left untouched, whatever counts the holes are given; the blocks a hole
  would send are skipped;
- ``Reduce_scatter(_block)``: the holes' blocks of the result are reduced for no one; each live
  member gets its own. ``recvcounts`` lay out the send buffer, so a hole's count still says how
  many elements to skip; without ``recvcounts`` a hole counts for nothing.

The functions take the blank core with the signatures of ``coll`` (objects, lower case) and
``collbuf`` (buffers, upper case), which ``commcoll`` calls in their place when the core has
holes. Per-rank blocks are read by the parsers of ``buffers`` at the blank size, and the live
members' blocks handed to the algorithms of ``collalg`` over the shadow: gathers and scatters
go linear (``linear_gatherv``/``linear_scatterv``), as for their ``v`` forms.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vpool.mpi import coll, collalg, collbuf, errors
from vpool.mpi.buffers import VMsg, block, parse, parse_blocks, parse_v, parse_w, w_block
from vpool.mpi.collbuf import (
    in_place,
    launch,
    reduce_scatter_block_buffers,
    reduce_scatter_buffers,
)
from vpool.mpi.datatypes import Datatype
from vpool.mpi.sched import Algo, new_tag

if TYPE_CHECKING:  # not at run time: ``comm`` imports this module (through ``commcoll``)
    from vpool.mpi.comm import _Core

_BLANKED_TAG = -(1 << 44)
"""The tag of ``blanked``'s agreement, below the other agreements' tag spaces (``comm``,
``intercomm``)."""


def blank_core(eng: Any, ctx: int, group: tuple[int, ...], holes: frozenset[int]) -> _Core:
    """The core of a communicator of ``group`` (world ranks) whose members ``holes`` are
    failed: its collectives run over ``shadow``, the core of the live members, which shares
    its context ids (the blank core itself never runs a collective)."""
    from vpool.mpi.comm import _Core

    core = _Core(eng, ctx, group)
    core.holes = frozenset(holes) & frozenset(group)
    if core.holes:
        core.shadow = _Core(eng, ctx, tuple(w for w in group if w not in core.holes))
        eng.acked.setdefault(ctx, set()).update(core.holes)
    return core


def blanked(comm: Any, holes: Iterable[int]) -> Any:
    """A copy of the intracommunicator ``comm`` whose ranks ``holes`` are holes: FT-MPI's blank
    mode without a failure, for tests. Collective over the live members only (the holes'
    processes do not call it): they agree a context id among themselves. The holes are not
    marked failed in the engine: point-to-point with them, ``Agree`` and ``Shrink`` need
    ``eng.apply_failed`` first, as after a real failure."""
    from vpool.mpi.comm import agree_ctx_among

    h = comm._core()
    gone = frozenset(h.group[r] for r in holes)
    live = tuple(w for w in h.group if w not in gone)
    ctx = agree_ctx_among(h.eng, h.ctx, live, _BLANKED_TAG)
    core = blank_core(h.eng, ctx, h.group, gone)
    core.errh = h.errh
    return type(comm)._wrap(core)


def live_root(b: Any, root: Any) -> tuple[Any, int]:
    """The core to run a rooted operation on and the root's rank there: the shadow, if ``b``
    has holes (for constructors that take a root, such as ``Spawn``)."""
    if not b.holes:
        return b, root
    return b.shadow, _root(b, root)


def _root(b: Any, root: Any) -> int:
    """The shadow rank of the blank rank ``root``; ``ERR_PROC_FAILED`` if it is a hole."""
    root = coll.check_root(b, root)
    w = b.group[root]
    if w in b.holes:
        raise errors.MPIException(
            errors.ERR_PROC_FAILED, f"root {root} is a hole of the communicator (failed)"
        )
    return int(b.shadow.w2c[w])


def _live(b: Any) -> list[int]:
    """The blank ranks of the live members, in order: shadow rank i is blank rank ``[i]``."""
    w2c = b.w2c
    return [w2c[w] for w in b.shadow.group]


def _spread(b: Any, items: list[Any]) -> list[Any]:
    """The live members' items (shadow order) at their blank ranks, ``None`` at the holes."""
    out: list[Any] = [None] * b.size
    for r, item in zip(_live(b), items, strict=True):
        out[r] = item
    return out


def _live_items(b: Any, objs: Any) -> list[Any]:
    """The items for the live members out of a list of the blank size."""
    items = list(objs) if objs is not None else None
    if items is None or len(items) != b.size:
        raise ValueError(f"expecting {b.size} items, got {None if items is None else len(items)}")
    return [items[r] for r in _live(b)]


# ---- objects (``coll``'s signatures) ---------------------------------------------------------


def barrier(b: Any) -> None:
    coll.barrier(b.shadow)


def bcast(b: Any, obj: Any, root: int) -> Any:
    return coll.bcast(b.shadow, obj, _root(b, root))


def reduce(b: Any, obj: Any, op: Any, root: int) -> Any:
    return coll.reduce(b.shadow, obj, op, _root(b, root))


def allreduce(b: Any, obj: Any, op: Any) -> Any:
    return coll.allreduce(b.shadow, obj, op)


def scan(b: Any, obj: Any, op: Any, exclusive: bool) -> Any:
    return coll.scan(b.shadow, obj, op, exclusive)


def gather(b: Any, obj: Any, root: int) -> list[Any] | None:
    items = coll.gather(b.shadow, obj, _root(b, root))
    return None if items is None else _spread(b, items)


def scatter(b: Any, objs: Any, root: int) -> Any:
    s = b.shadow
    sroot = _root(b, root)
    return coll.scatter(s, _live_items(b, objs) if s.rank == sroot else None, sroot)


def allgather(b: Any, obj: Any) -> list[Any]:
    return _spread(b, coll.allgather(b.shadow, obj))


def alltoall(b: Any, objs: Any) -> list[Any]:
    return _spread(b, coll.alltoall(b.shadow, _live_items(b, objs)))


# ---- buffers (``collbuf``'s signatures) ------------------------------------------------------


def Bcast(b: Any, buf: Any, root: int, nb: bool = False) -> Any:
    return collbuf.Bcast(b.shadow, buf, _root(b, root), nb)


def Reduce(b: Any, sendbuf: Any, recvbuf: Any, op: Any, root: int, nb: bool = False) -> Any:
    return collbuf.Reduce(b.shadow, sendbuf, recvbuf, op, _root(b, root), nb)


def Allreduce(b: Any, sendbuf: Any, recvbuf: Any, op: Any, nb: bool = False) -> Any:
    return collbuf.Allreduce(b.shadow, sendbuf, recvbuf, op, nb)


def Scan(b: Any, sendbuf: Any, recvbuf: Any, op: Any, exclusive: bool, nb: bool = False) -> Any:
    return collbuf.Scan(b.shadow, sendbuf, recvbuf, op, exclusive, nb)


def _equal_blocks(b: Any, view: memoryview, bs: int) -> list[memoryview]:
    """The live members' blocks of a buffer of ``b.size`` blocks of ``bs`` bytes."""
    return [view[r * bs : (r + 1) * bs] for r in _live(b)]


def _v_blocks(b: Any, vm: VMsg) -> list[memoryview]:
    """The live members' blocks of a vector buffer (counts and displacements per blank rank)."""
    return [block(vm, r) for r in _live(b)]


def _check_block(whole: Any, part: Any, size: int) -> None:
    """ValueError unless ``part`` is the size of one of the ``size`` blocks of ``whole``."""
    if part.view.nbytes * size != whole.view.nbytes:
        raise ValueError(f"mismatch in send count {part.items} and receive count {whole.items}")


def Gather(b: Any, sendbuf: Any, recvbuf: Any, root: int, nb: bool = False) -> Any:
    s = b.shadow
    sroot = _root(b, root)
    blocks: list[memoryview] = []
    mine = r = None
    if s.rank == sroot:
        r = parse_blocks(recvbuf, b.size, writable=True)
        if not in_place(sendbuf):
            m = parse(sendbuf, writable=False)
            _check_block(r, m, b.size)
            mine = m.view
        blocks = _equal_blocks(b, r.view, r.view.nbytes // b.size)
    else:
        mine = parse(sendbuf, writable=False).view
    return launch(s, collalg.linear_gatherv(s, mine, blocks, sroot, new_tag(s)), nb, r)


def Gatherv(b: Any, sendbuf: Any, recvbuf: Any, root: int, nb: bool = False) -> Any:
    s = b.shadow
    sroot = _root(b, root)
    blocks: list[memoryview] = []
    mine = None
    if s.rank == sroot:
        blocks = _v_blocks(b, parse_v(recvbuf, b.size, writable=True))
        if not in_place(sendbuf):
            mine = parse(sendbuf, writable=False).view
    else:
        mine = parse(sendbuf, writable=False).view
    return launch(s, collalg.linear_gatherv(s, mine, blocks, sroot, new_tag(s)), nb)


def Scatter(b: Any, sendbuf: Any, recvbuf: Any, root: int, nb: bool = False) -> Any:
    s = b.shadow
    sroot = _root(b, root)
    blocks: list[memoryview] = []
    out = r = None
    if s.rank == sroot:
        whole = parse_blocks(sendbuf, b.size, writable=False)
        if not in_place(recvbuf):
            r = parse(recvbuf, writable=True)
            _check_block(whole, r, b.size)
            out = r.view
        blocks = _equal_blocks(b, whole.view, whole.view.nbytes // b.size)
    else:
        r = parse(recvbuf, writable=True)
        out = r.view
    return launch(s, collalg.linear_scatterv(s, blocks, out, sroot, new_tag(s)), nb, r)


def Scatterv(b: Any, sendbuf: Any, recvbuf: Any, root: int, nb: bool = False) -> Any:
    s = b.shadow
    sroot = _root(b, root)
    blocks: list[memoryview] = []
    out = r = None
    if s.rank == sroot:
        blocks = _v_blocks(b, parse_v(sendbuf, b.size, writable=False))
    if s.rank != sroot or not in_place(recvbuf):
        r = parse(recvbuf, writable=True)
        out = r.view
    return launch(s, collalg.linear_scatterv(s, blocks, out, sroot, new_tag(s)), nb, r)


def _allgather(s: Any, blocks: list[memoryview], tag: int) -> Algo:
    """Allgather of the live members' blocks (``blocks[i]``: shadow rank i's, this rank's
    already there), which holes keep apart: back to back in scratch, then each to its place."""
    offsets = [0]
    for v in blocks:
        offsets.append(offsets[-1] + v.nbytes)
    tmp = collalg.scratch(offsets[-1])
    me = s.rank
    tmp[offsets[me] : offsets[me + 1]] = blocks[me]
    yield from collalg.allgather(s, tmp, offsets, tag)
    for i, v in enumerate(blocks):
        if i != me:
            v[:] = tmp[offsets[i] : offsets[i + 1]]


def Allgather(b: Any, sendbuf: Any, recvbuf: Any, nb: bool = False) -> Any:
    s = b.shadow
    r = parse_blocks(recvbuf, b.size, writable=True)
    blocks = _equal_blocks(b, r.view, r.view.nbytes // b.size)
    if not in_place(sendbuf):
        m = parse(sendbuf, writable=False)
        _check_block(r, m, b.size)
        blocks[s.rank][:] = m.view
    return launch(s, _allgather(s, blocks, new_tag(s)), nb, r)


def Allgatherv(b: Any, sendbuf: Any, recvbuf: Any, nb: bool = False) -> Any:
    s = b.shadow
    blocks = _v_blocks(b, parse_v(recvbuf, b.size, writable=True))
    if not in_place(sendbuf):
        blocks[s.rank][:] = parse(sendbuf, writable=False).view
    return launch(s, _allgather(s, blocks, new_tag(s)), nb)


def Alltoall(b: Any, sendbuf: Any, recvbuf: Any, nb: bool = False) -> Any:
    s = b.shadow
    r = parse_blocks(recvbuf, b.size, writable=True)
    bs = r.view.nbytes // b.size
    rblocks = _equal_blocks(b, r.view, bs)
    if in_place(sendbuf):
        copy = collalg.scratch(r.view.nbytes)
        copy[:] = r.view
        sblocks = _equal_blocks(b, copy, bs)
    else:
        m = parse_blocks(sendbuf, b.size, writable=False)
        sblocks = _equal_blocks(b, m.view, m.view.nbytes // b.size)
    return launch(s, collalg.pairwise(s, sblocks, rblocks, new_tag(s)), nb, r)


def Alltoallv(b: Any, sendbuf: Any, recvbuf: Any, nb: bool = False) -> Any:
    s = b.shadow
    r = parse_v(recvbuf, b.size, writable=True)
    rblocks = _v_blocks(b, r)
    if in_place(sendbuf):
        copy = collalg.scratch(r.view.nbytes)
        copy[:] = r.view
        sblocks = _v_blocks(b, VMsg(copy, r.counts, r.displs, r.datatype))
    else:
        sblocks = _v_blocks(b, parse_v(sendbuf, b.size, writable=False))
    return launch(s, collalg.pairwise(s, sblocks, rblocks, new_tag(s)), nb)


def Alltoallw(b: Any, sendbuf: Any, recvbuf: Any, nb: bool = False) -> Any:
    s = b.shadow
    live = _live(b)
    rv, rcounts, rdispls, rtypes = parse_w(recvbuf, b.size, writable=True)
    if in_place(sendbuf):
        sv = collalg.scratch(rv.nbytes)
        sv[:] = rv
        scounts, sdispls, stypes = rcounts, rdispls, rtypes
    else:
        sv, scounts, sdispls, stypes = parse_w(sendbuf, b.size, writable=False)
    sblocks = [w_block(sv, scounts[i], sdispls[i], stypes[i], False).view for i in live]
    rmsgs = [w_block(rv, rcounts[i], rdispls[i], rtypes[i], True) for i in live]
    algo = collalg.pairwise(s, sblocks, [m.view for m in rmsgs], new_tag(s))
    return launch(s, algo, nb, *rmsgs)


def Reduce_scatter_block(b: Any, sendbuf: Any, recvbuf: Any, op: Any, nb: bool = False) -> Any:
    src, dt, out = reduce_scatter_block_buffers(b.size, sendbuf, recvbuf)
    return _reduce_scatter(b, _equal_blocks(b, src, src.nbytes // b.size), dt, op, out, nb)


def Reduce_scatter(
    b: Any, sendbuf: Any, recvbuf: Any, recvcounts: Any, op: Any, nb: bool = False
) -> Any:
    src, dt, counts, out = reduce_scatter_buffers(
        b.size,
        b.rank,
        sendbuf,
        recvbuf,
        recvcounts,
        lambda items: [0 if c is None else c for c in allgather(b, items)],  # holes: none
    )
    ext = dt.extent
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c * ext)
    parts = [src[starts[i] : starts[i + 1]] for i in _live(b)]
    return _reduce_scatter(b, parts, dt, op, out, nb)


def _reduce_scatter(
    b: Any, parts: list[memoryview], dt: Datatype, op: Any, out: memoryview, nb: bool
) -> Any:
    """Reduce the live members' blocks (``parts``, shadow order), back to back, to shadow
    rank 0, then scatter them from there: the holes' blocks are neither reduced nor sent."""
    s = b.shadow
    sizes = [p.nbytes for p in parts]
    mine = collalg.scratch(sum(sizes))
    pos = 0
    for p in parts:
        mine[pos : pos + p.nbytes] = p
        pos += p.nbytes
    total = collalg.scratch(mine.nbytes) if s.rank == 0 else None
    tag = new_tag(s)

    def algo() -> Algo:
        yield from collalg.reduce(s, mine, total, dt, op, 0, tag)
        yield from collalg.scatter_sizes(s, total, out, sizes, tag)

    return launch(s, algo(), nb)
