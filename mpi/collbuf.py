"""Collective operations on typed buffers (upper-case calls), blocking and non-blocking.

Each call reads its buffer specs as mpi4py does (which arguments a rank ignores, ``None`` as
``IN_PLACE`` where mpi4py takes it so, ``ValueError`` for mismatched counts) and hands flat byte
views to an algorithm of ``collalg``. With ``nb`` the algorithm becomes the schedule behind the
returned request (``sched.Schedule``); without, it runs to the end in the call.
"""

from __future__ import annotations

from typing import Any

from vpool.mpi import collalg
from vpool.mpi.buffers import (
    IN_PLACE,
    Msg,
    VMsg,
    block,
    parse,
    parse_blocks,
    parse_v,
    parse_w,
    w_block,
)
from vpool.mpi.coll import check_root
from vpool.mpi.sched import Algo, new_tag, run, start


def launch(h: Any, algo: Algo, nb: bool, *msgs: Msg | None) -> Any:
    """Run ``algo`` to its end in the call, or (``nb``) start it behind a request; receive
    buffers of packed datatypes are unpacked once it is done (also for ``intercollbuf``)."""
    unpacks = [m.unpack for m in msgs if m is not None and m.unpack is not None]
    if unpacks:
        algo = _then(algo, unpacks)
    return start(h, algo) if nb else run(h, algo)


def _then(algo: Algo, unpacks: list[Any]) -> Algo:
    """Run ``algo``, then scatter packed receive buffers back into their datatypes' layout."""
    result = yield from algo
    for unpack in unpacks:
        unpack()
    return result


def in_place(spec: Any) -> bool:
    return spec is None or spec is IN_PLACE


def same_shape(src: Any, dst: Any) -> None:
    """A reduction's send and receive buffers must match (mpi4py's check)."""
    if src.datatype != dst.datatype and src.datatype.size != dst.datatype.size:
        raise ValueError("mismatch in send and receive MPI datatypes")
    if src.view.nbytes != dst.view.nbytes:
        raise ValueError(f"mismatch in send count {src.items} and receive count {dst.items}")


def Bcast(h: Any, buf: Any, root: int, nb: bool = False) -> Any:
    root = check_root(h, root)
    m = parse(buf, writable=h.rank != root)
    return launch(h, collalg.bcast(h, m.view, root, new_tag(h)), nb, m)


def Reduce(h: Any, sendbuf: Any, recvbuf: Any, op: Any, root: int, nb: bool = False) -> Any:
    root = check_root(h, root)
    out = r = None
    if h.rank == root:
        r = parse(recvbuf, writable=True)
        out = r.view
        if in_place(sendbuf):
            src, dt = r.view, r.datatype
        else:
            s = parse(sendbuf, writable=False)
            same_shape(s, r)
            src, dt = s.view, s.datatype
    else:
        s = parse(sendbuf, writable=False)
        src, dt = s.view, s.datatype
    return launch(h, collalg.reduce(h, src, out, dt, op, root, new_tag(h)), nb, r)


def Allreduce(h: Any, sendbuf: Any, recvbuf: Any, op: Any, nb: bool = False) -> Any:
    r = parse(recvbuf, writable=True)
    if not in_place(sendbuf):
        s = parse(sendbuf, writable=False)
        same_shape(s, r)
        r.view[:] = s.view
    return launch(h, collalg.allreduce(h, r.view, r.datatype, op, new_tag(h)), nb, r)


def Gather(h: Any, sendbuf: Any, recvbuf: Any, root: int, nb: bool = False) -> Any:
    root = check_root(h, root)
    size, rank = h.size, h.rank
    whole = mine = r = None
    if rank == root:
        r = parse_blocks(recvbuf, size, writable=True)
        whole = r.view
        bs = r.view.nbytes // size
        if not in_place(sendbuf):
            s = parse(sendbuf, writable=False)
            if s.view.nbytes != bs:
                raise ValueError(f"mismatch in send count {s.items} and receive count {r.items}")
            mine = s.view
    else:
        mine = parse(sendbuf, writable=False).view
        bs = mine.nbytes
    return launch(h, collalg.gather(h, mine, whole, bs, root, new_tag(h)), nb, r)


def Gatherv(h: Any, sendbuf: Any, recvbuf: Any, root: int, nb: bool = False) -> Any:
    root = check_root(h, root)
    size, rank = h.size, h.rank
    blocks: list[memoryview] = []
    mine = None
    if rank == root:
        r = parse_v(recvbuf, size, writable=True)
        blocks = [block(r, i) for i in range(size)]
        if not in_place(sendbuf):
            mine = parse(sendbuf, writable=False).view
    else:
        mine = parse(sendbuf, writable=False).view
    return launch(h, collalg.linear_gatherv(h, mine, blocks, root, new_tag(h)), nb)


def Scatter(h: Any, sendbuf: Any, recvbuf: Any, root: int, nb: bool = False) -> Any:
    root = check_root(h, root)
    size, rank = h.size, h.rank
    whole = out = r = None
    if rank == root:
        s = parse_blocks(sendbuf, size, writable=False)
        whole = s.view
        bs = s.view.nbytes // size
        if not in_place(recvbuf):
            r = parse(recvbuf, writable=True)
            if r.view.nbytes != bs:
                raise ValueError(f"mismatch in send count {s.items} and receive count {r.items}")
            out = r.view
    else:
        r = parse(recvbuf, writable=True)
        out = r.view
        bs = out.nbytes
    return launch(h, collalg.scatter(h, whole, out, bs, root, new_tag(h)), nb, r)


def Scatterv(h: Any, sendbuf: Any, recvbuf: Any, root: int, nb: bool = False) -> Any:
    root = check_root(h, root)
    size, rank = h.size, h.rank
    blocks: list[memoryview] = []
    out = r = None
    if rank == root:
        s = parse_v(sendbuf, size, writable=False)
        blocks = [block(s, i) for i in range(size)]
        if not in_place(recvbuf):
            r = parse(recvbuf, writable=True)
    else:
        r = parse(recvbuf, writable=True)
    if r is not None:
        out = r.view
    return launch(h, collalg.linear_scatterv(h, blocks, out, root, new_tag(h)), nb, r)


def Allgather(h: Any, sendbuf: Any, recvbuf: Any, nb: bool = False) -> Any:
    size = h.size
    r = parse_blocks(recvbuf, size, writable=True)
    bs = r.view.nbytes // size
    if not in_place(sendbuf):
        s = parse(sendbuf, writable=False)
        if s.view.nbytes != bs:
            raise ValueError(f"mismatch in send count {s.items} and receive count {r.items}")
        r.view[h.rank * bs : (h.rank + 1) * bs] = s.view
    offsets = [i * bs for i in range(size + 1)]
    return launch(h, collalg.allgather(h, r.view, offsets, new_tag(h)), nb, r)


def Allgatherv(h: Any, sendbuf: Any, recvbuf: Any, nb: bool = False) -> Any:
    size, rank = h.size, h.rank
    r: VMsg = parse_v(recvbuf, size, writable=True)
    blocks = [block(r, i) for i in range(size)]
    if not in_place(sendbuf):
        blocks[rank][:] = parse(sendbuf, writable=False).view
    ext = r.datatype.extent
    offsets = [d * ext for d in r.displs] + [(r.displs[-1] + r.counts[-1]) * ext]
    if all(offsets[i] + blocks[i].nbytes == offsets[i + 1] for i in range(size)):
        whole = r.view
        algo = collalg.allgather(h, whole, offsets, new_tag(h))
        return launch(h, algo, nb)
    # Blocks with gaps or out of order: gather them back to back in scratch, then spread.
    packed = [0]
    for b in blocks:
        packed.append(packed[-1] + b.nbytes)
    tmp = collalg.scratch(packed[-1])
    tmp[packed[rank] : packed[rank + 1]] = blocks[rank]
    tag = new_tag(h)

    def algo() -> Algo:
        yield from collalg.allgather(h, tmp, packed, tag)
        for i, b in enumerate(blocks):
            b[:] = tmp[packed[i] : packed[i + 1]]

    return launch(h, algo(), nb)


def Alltoall(h: Any, sendbuf: Any, recvbuf: Any, nb: bool = False) -> Any:
    size = h.size
    r = parse_blocks(recvbuf, size, writable=True)
    bs = r.view.nbytes // size
    rblocks = [r.view[i * bs : (i + 1) * bs] for i in range(size)]
    if in_place(sendbuf):
        copy = collalg.scratch(r.view.nbytes)
        copy[:] = r.view
        sblocks = [copy[i * bs : (i + 1) * bs] for i in range(size)]
    else:
        s = parse_blocks(sendbuf, size, writable=False)
        n = s.view.nbytes // size
        sblocks = [s.view[i * n : (i + 1) * n] for i in range(size)]
    return launch(h, collalg.pairwise(h, sblocks, rblocks, new_tag(h)), nb, r)


def Alltoallv(h: Any, sendbuf: Any, recvbuf: Any, nb: bool = False) -> Any:
    size = h.size
    r = parse_v(recvbuf, size, writable=True)
    rblocks = [block(r, i) for i in range(size)]
    if in_place(sendbuf):
        copy = collalg.scratch(r.view.nbytes)
        copy[:] = r.view
        cm = VMsg(copy, r.counts, r.displs, r.datatype)
        sblocks = [block(cm, i) for i in range(size)]
    else:
        s = parse_v(sendbuf, size, writable=False)
        sblocks = [block(s, i) for i in range(size)]
    return launch(h, collalg.pairwise(h, sblocks, rblocks, new_tag(h)), nb)


def Alltoallw(h: Any, sendbuf: Any, recvbuf: Any, nb: bool = False) -> Any:
    """Per-peer counts, byte displacements and datatypes; blocks travel packed."""
    size = h.size
    rv, rcounts, rdispls, rtypes = parse_w(recvbuf, size, writable=True)
    if in_place(sendbuf):
        sv = collalg.scratch(rv.nbytes)
        sv[:] = rv
        scounts, sdispls, stypes = rcounts, rdispls, rtypes
    else:
        sv, scounts, sdispls, stypes = parse_w(sendbuf, size, writable=False)
    sblocks = [w_block(sv, scounts[i], sdispls[i], stypes[i], False).view for i in range(size)]
    rmsgs = [w_block(rv, rcounts[i], rdispls[i], rtypes[i], True) for i in range(size)]
    rblocks = [m.view for m in rmsgs]
    return launch(h, collalg.pairwise(h, sblocks, rblocks, new_tag(h)), nb, *rmsgs)


def Scan(h: Any, sendbuf: Any, recvbuf: Any, op: Any, exclusive: bool, nb: bool = False) -> Any:
    r = parse(recvbuf, writable=True)
    if in_place(sendbuf):
        src, dt = r.view, r.datatype
    else:
        s = parse(sendbuf, writable=False)
        same_shape(s, r)
        src, dt = s.view, s.datatype
    return launch(h, collalg.scan(h, src, r.view, dt, op, exclusive, new_tag(h)), nb, r)


def reduce_scatter_block_buffers(size: int, sendbuf: Any, recvbuf: Any) -> tuple[Any, ...]:
    """``Reduce_scatter_block``'s buffers, checked: (what is reduced, its datatype, where this
    rank's block goes)."""
    if in_place(sendbuf):
        whole = parse_blocks(recvbuf, size, writable=True)
        return whole.view, whole.datatype, whole.view[: whole.items * whole.datatype.extent]
    s = parse_blocks(sendbuf, size, writable=False)
    r = parse(recvbuf, writable=True)
    if s.items != r.items or s.view.nbytes != r.view.nbytes * size:
        raise ValueError(f"mismatch in send count {s.items} and receive count {r.items}")
    return s.view, s.datatype, r.view


def reduce_scatter_buffers(
    size: int, rank: int, sendbuf: Any, recvbuf: Any, recvcounts: Any, gather_counts: Any
) -> tuple[Any, ...]:
    """``Reduce_scatter``'s buffers, checked: (what is reduced, its datatype, the count of
    each rank's block, where this rank's block goes). ``gather_counts(items)``: every rank's
    receive count, for ``recvcounts`` None."""
    r = parse(recvbuf, writable=True)
    dt = r.datatype
    if in_place(sendbuf):
        if recvcounts is None:
            raise ValueError("Reduce_scatter in place needs recvcounts")
        src = r.view
    else:
        s = parse(sendbuf, writable=False)
        src, dt = s.view, s.datatype
        if recvcounts is None:
            recvcounts = gather_counts(r.items)
    counts = [int(c) for c in recvcounts]
    if len(counts) != size:
        raise ValueError(f"expecting {size} receive counts, got {len(counts)}")
    ext = dt.extent
    if in_place(sendbuf):
        if r.items != sum(counts):
            raise ValueError(f"mismatch in receive count {r.items} and sum(counts) {sum(counts)}")
        out = r.view[: counts[rank] * ext]
    else:
        if src.nbytes != sum(counts) * ext:
            raise ValueError(f"mismatch in send count and sum(counts) {sum(counts)}")
        if r.items != counts[rank]:
            raise ValueError(f"mismatch in receive count {r.items} and counts[{rank}]")
        out = r.view
    return src, dt, counts, out


def Reduce_scatter_block(h: Any, sendbuf: Any, recvbuf: Any, op: Any, nb: bool = False) -> Any:
    src, dt, out = reduce_scatter_block_buffers(h.size, sendbuf, recvbuf)
    n = src.nbytes // h.size
    return _reduce_then_scatter(h, src, dt, op, [n] * h.size, out, nb)


def Reduce_scatter(
    h: Any, sendbuf: Any, recvbuf: Any, recvcounts: Any, op: Any, nb: bool = False
) -> Any:
    from vpool.mpi import coll

    src, dt, counts, out = reduce_scatter_buffers(
        h.size, h.rank, sendbuf, recvbuf, recvcounts, lambda items: coll.allgather(h, items)
    )
    return _reduce_then_scatter(h, src, dt, op, [c * dt.extent for c in counts], out, nb)


def _reduce_then_scatter(
    h: Any, src: memoryview, dt: Any, op: Any, sizes: list[int], out: memoryview, nb: bool
) -> Any:
    """Reduce to rank 0 (rank order, pipelined), then scatter the pieces from there."""
    tag = new_tag(h)
    total = collalg.scratch(src.nbytes) if h.rank == 0 else None

    def algo() -> Algo:
        yield from collalg.reduce(h, src, total, dt, op, 0, tag)
        yield from collalg.scatter_sizes(h, total, out, sizes, tag)

    return launch(h, algo(), nb)
