"""Collective operations on typed buffers (upper-case calls).

Same algorithms, contexts and ordering rules as ``coll`` (see there), moving raw bytes: received
data goes straight into the user's buffer when it is the final destination, reductions work on
two scratch buffers swapped between steps. ``IN_PLACE`` follows MPI: the root's (or every
rank's, for the all-* calls) input is taken from the receive buffer.
"""

from __future__ import annotations

from typing import Any

from vpool.sdk.mpi import errors
from vpool.sdk.mpi.buffers import IN_PLACE, VMsg, block, parse, parse_blocks, parse_v
from vpool.sdk.mpi.coll import (
    TAG_ALLREDUCE,
    TAG_ALLTOALL,
    TAG_BCAST,
    TAG_EXSCAN,
    TAG_GATHER,
    TAG_REDUCE,
    TAG_SCAN,
    TAG_SCATTER,
    check_root,
    finish,
    fold_plan,
    post_recv,
    real_rank,
    recv_into,
    send_bytes,
    tree_children,
)
from vpool.sdk.mpi.datatypes import Datatype


def _scratch(n: int) -> memoryview:
    return memoryview(bytearray(n))


def _copy(view: memoryview) -> memoryview:
    return memoryview(bytearray(view))


def _same_size(a: memoryview, b: memoryview) -> None:
    if a.nbytes != b.nbytes:
        raise errors.MPIException(
            errors.ERR_COUNT, f"send buffer has {a.nbytes} bytes, receive buffer {b.nbytes}"
        )


def tree_bcast(h: Any, view: memoryview, root: int) -> None:
    size = h.size
    if size == 1:
        return
    vrank = (h.rank - root) % size
    parent, children = tree_children(vrank, size)
    if parent >= 0:
        recv_into(h, (parent + root) % size, TAG_BCAST, view)
    for child in children:
        send_bytes(h, (child + root) % size, TAG_BCAST, view)


def Bcast(h: Any, buf: Any, root: int) -> None:
    check_root(h, root)
    tree_bcast(h, parse(buf, writable=h.rank != root).view, root)


def reduce_views(
    h: Any, src: memoryview, out: memoryview | None, dt: Datatype, op: Any, root: int
) -> None:
    """Reduce ``src`` of every rank into ``out`` at ``root``: binomial tree to rank 0 in rank
    order, then to the root."""
    size, rank = h.size, h.rank
    acc = _copy(src)
    tmp: memoryview | None = None
    mask = 1
    while mask < size:
        if rank & mask:
            send_bytes(h, rank - mask, TAG_REDUCE, acc)
            break
        peer = rank | mask
        if peer < size:
            if tmp is None:
                tmp = _scratch(acc.nbytes)
            recv_into(h, peer, TAG_REDUCE, tmp)
            op.reduce_bytes(acc, tmp, dt)  # tmp = acc op tmp: lower ranks first
            acc, tmp = tmp, acc
        mask <<= 1
    if rank == root:
        assert out is not None
        if root == 0:
            out[:] = acc
        else:
            recv_into(h, 0, TAG_REDUCE, out)
    elif rank == 0:
        send_bytes(h, root, TAG_REDUCE, acc)


def Reduce(h: Any, sendbuf: Any, recvbuf: Any, op: Any, root: int) -> None:
    check_root(h, root)
    out = None
    if sendbuf is IN_PLACE:
        r = parse(recvbuf, writable=True)
        src, dt = r.view, r.datatype
        if h.rank == root:
            out = r.view
    else:
        s = parse(sendbuf, writable=False)
        src, dt = s.view, s.datatype
        if h.rank == root:
            out = parse(recvbuf, writable=True).view
            _same_size(src, out)
    reduce_views(h, src, out, dt, op, root)


def Allreduce(h: Any, sendbuf: Any, recvbuf: Any, op: Any) -> None:
    r = parse(recvbuf, writable=True)
    if sendbuf is IN_PLACE:
        acc, dt = _copy(r.view), r.datatype
    else:
        s = parse(sendbuf, writable=False)
        _same_size(s.view, r.view)
        acc, dt = _copy(s.view), s.datatype
    size = h.size
    if size > 1:
        acc = _recursive_doubling(h, acc, dt, op)
    r.view[:] = acc


def _recursive_doubling(h: Any, acc: memoryview, dt: Datatype, op: Any) -> memoryview:
    size, rank = h.size, h.rank
    pof2, rem, newrank = fold_plan(rank, size)
    tmp = _scratch(acc.nbytes)
    if rank < 2 * rem:
        if newrank < 0:
            send_bytes(h, rank + 1, TAG_ALLREDUCE, acc)
        else:
            recv_into(h, rank - 1, TAG_ALLREDUCE, tmp)
            op.reduce_bytes(tmp, acc, dt)  # acc = lower op acc
    if newrank >= 0:
        mask = 1
        while mask < pof2:
            peer = real_rank(newrank ^ mask, rem)
            pending = post_recv(h, peer, TAG_ALLREDUCE, tmp)
            send_bytes(h, peer, TAG_ALLREDUCE, acc)
            finish(h, pending)
            if peer < rank:
                op.reduce_bytes(tmp, acc, dt)
            else:
                op.reduce_bytes(acc, tmp, dt)
                acc, tmp = tmp, acc
            mask <<= 1
    if rank < 2 * rem:
        if newrank < 0:
            recv_into(h, rank + 1, TAG_ALLREDUCE, acc)
        else:
            send_bytes(h, rank - 1, TAG_ALLREDUCE, acc)
    return acc


def _gather_views(h: Any, mine: memoryview | None, blocks: list[memoryview], root: int) -> None:
    """Root receives block i from rank i (its own from ``mine`` unless None: in place)."""
    rank = h.rank
    if rank != root:
        assert mine is not None
        send_bytes(h, root, TAG_GATHER, mine)
        return
    pending = [
        (post_recv(h, i, TAG_GATHER, view), view) for i, view in enumerate(blocks) if i != root
    ]
    if mine is not None:
        _same_size(mine, blocks[root])
        blocks[root][:] = mine
    for op, view in pending:
        finish(h, op)
        if op.nbytes != view.nbytes:
            raise errors.MPIException(errors.ERR_TRUNCATE, "gather block of the wrong size")


def _blocks(view: memoryview, n: int, size: int) -> list[memoryview]:
    return [view[i * n : (i + 1) * n] for i in range(size)]


def Gather(h: Any, sendbuf: Any, recvbuf: Any, root: int) -> None:
    check_root(h, root)
    size, rank = h.size, h.rank
    blocks: list[memoryview] = []
    if rank == root:
        r = parse_blocks(recvbuf, size, writable=True)
        blocks = _blocks(r.view, r.items * r.datatype.extent, size)
    mine = None if sendbuf is IN_PLACE else parse(sendbuf, writable=False).view
    _gather_views(h, mine, blocks, root)


def Gatherv(h: Any, sendbuf: Any, recvbuf: Any, root: int) -> None:
    check_root(h, root)
    size, rank = h.size, h.rank
    blocks: list[memoryview] = []
    if rank == root:
        r = parse_v(recvbuf, size, writable=True)
        blocks = [block(r, i) for i in range(size)]
    mine = None if sendbuf is IN_PLACE else parse(sendbuf, writable=False).view
    _gather_views(h, mine, blocks, root)


def _scatter_views(h: Any, blocks: list[memoryview], out: memoryview | None, root: int) -> None:
    if h.rank != root:
        assert out is not None
        recv_into(h, root, TAG_SCATTER, out)
        return
    for i, view in enumerate(blocks):
        if i != root:
            send_bytes(h, i, TAG_SCATTER, view)
    if out is not None:
        _same_size(blocks[root], out)
        out[:] = blocks[root]


def Scatter(h: Any, sendbuf: Any, recvbuf: Any, root: int) -> None:
    check_root(h, root)
    size, rank = h.size, h.rank
    blocks: list[memoryview] = []
    if rank == root:
        s = parse_blocks(sendbuf, size, writable=False)
        blocks = _blocks(s.view, s.items * s.datatype.extent, size)
    out = None if recvbuf is IN_PLACE else parse(recvbuf, writable=True).view
    _scatter_views(h, blocks, out, root)


def Scatterv(h: Any, sendbuf: Any, recvbuf: Any, root: int) -> None:
    check_root(h, root)
    size, rank = h.size, h.rank
    blocks: list[memoryview] = []
    if rank == root:
        s = parse_v(sendbuf, size, writable=False)
        blocks = [block(s, i) for i in range(size)]
    out = None if recvbuf is IN_PLACE else parse(recvbuf, writable=True).view
    _scatter_views(h, blocks, out, root)


def Allgather(h: Any, sendbuf: Any, recvbuf: Any) -> None:
    size = h.size
    r = parse_blocks(recvbuf, size, writable=True)
    blocks = _blocks(r.view, r.items * r.datatype.extent, size)
    _allgather(h, sendbuf, r.view, blocks)


def Allgatherv(h: Any, sendbuf: Any, recvbuf: Any) -> None:
    r: VMsg = parse_v(recvbuf, h.size, writable=True)
    blocks = [block(r, i) for i in range(h.size)]
    _allgather(h, sendbuf, r.view, blocks)


def _allgather(h: Any, sendbuf: Any, whole: memoryview, blocks: list[memoryview]) -> None:
    rank = h.rank
    if sendbuf is IN_PLACE:
        mine = None if rank == 0 else blocks[rank]
    else:
        mine = parse(sendbuf, writable=False).view
    _gather_views(h, mine, blocks, 0)
    tree_bcast(h, whole, 0)


def Alltoall(h: Any, sendbuf: Any, recvbuf: Any) -> None:
    size = h.size
    r = parse_blocks(recvbuf, size, writable=True)
    rblocks = _blocks(r.view, r.items * r.datatype.extent, size)
    if sendbuf is IN_PLACE:
        sblocks = _blocks(_copy(r.view), r.items * r.datatype.extent, size)
    else:
        s = parse_blocks(sendbuf, size, writable=False)
        sblocks = _blocks(s.view, s.items * s.datatype.extent, size)
    _pairwise(h, sblocks, rblocks)


def Alltoallv(h: Any, sendbuf: Any, recvbuf: Any) -> None:
    size = h.size
    r = parse_v(recvbuf, size, writable=True)
    rblocks = [block(r, i) for i in range(size)]
    if sendbuf is IN_PLACE:
        copy = VMsg(_copy(r.view), r.counts, r.displs, r.datatype)
        sblocks = [block(copy, i) for i in range(size)]
    else:
        s = parse_v(sendbuf, size, writable=False)
        sblocks = [block(s, i) for i in range(size)]
    _pairwise(h, sblocks, rblocks)


def _pairwise(h: Any, sblocks: list[memoryview], rblocks: list[memoryview]) -> None:
    size, rank = h.size, h.rank
    _same_size(sblocks[rank], rblocks[rank])
    rblocks[rank][:] = sblocks[rank]
    for i in range(1, size):
        dst, src = (rank + i) % size, (rank - i) % size
        pending = post_recv(h, src, TAG_ALLTOALL, rblocks[src])
        send_bytes(h, dst, TAG_ALLTOALL, sblocks[dst])
        finish(h, pending)


def Scan(h: Any, sendbuf: Any, recvbuf: Any, op: Any, exclusive: bool) -> None:
    """Prefix reduction by recursive doubling; ``exclusive`` leaves rank 0's buffer alone."""
    size, rank = h.size, h.rank
    r = parse(recvbuf, writable=True)
    if sendbuf is IN_PLACE:
        src, dt = r.view, r.datatype
    else:
        s = parse(sendbuf, writable=False)
        _same_size(s.view, r.view)
        src, dt = s.view, s.datatype
    partial = _copy(src)
    if not exclusive and sendbuf is not IN_PLACE:
        r.view[:] = src
    tmp = _scratch(partial.nbytes)
    have = not exclusive
    tag = TAG_EXSCAN if exclusive else TAG_SCAN
    mask = 1
    while mask < size:
        peer = rank ^ mask
        if peer < size:
            pending = post_recv(h, peer, tag, tmp)
            send_bytes(h, peer, tag, partial)
            finish(h, pending)
            if peer < rank:
                if have:
                    op.reduce_bytes(tmp, r.view, dt)
                else:
                    r.view[:] = tmp
                    have = True
                op.reduce_bytes(tmp, partial, dt)
            else:
                op.reduce_bytes(partial, tmp, dt)
                partial, tmp = tmp, partial
        mask <<= 1


def Reduce_scatter_block(h: Any, sendbuf: Any, recvbuf: Any, op: Any) -> None:
    size = h.size
    if sendbuf is IN_PLACE:
        whole = parse_blocks(recvbuf, size, writable=True)
        src, dt, out = whole.view, whole.datatype, whole.view[: whole.items * whole.datatype.extent]
    else:
        s = parse_blocks(sendbuf, size, writable=False)
        src, dt = s.view, s.datatype
        out = parse(recvbuf, writable=True).view
    n = src.nbytes // size
    total = _scratch(src.nbytes) if h.rank == 0 else None
    reduce_views(h, src, total, dt, op, 0)
    blocks = _blocks(total, n, size) if total is not None else []
    _scatter_views(h, blocks, out, 0)


def Reduce_scatter(h: Any, sendbuf: Any, recvbuf: Any, recvcounts: Any, op: Any) -> None:
    size = h.size
    if sendbuf is IN_PLACE:
        s = parse(recvbuf, writable=True)
    else:
        s = parse(sendbuf, writable=False)
    dt = s.datatype
    if recvcounts is None:
        raise ValueError("Reduce_scatter needs recvcounts")
    counts = [int(c) for c in recvcounts]
    if len(counts) != size:
        raise ValueError(f"expecting {size} receive counts")
    offsets = [sum(counts[:i]) * dt.extent for i in range(size)]
    src = s.view[: sum(counts) * dt.extent]
    out = s.view[: counts[h.rank] * dt.extent] if sendbuf is IN_PLACE else None
    if out is None:
        out = parse(recvbuf, writable=True).view[: counts[h.rank] * dt.extent]
    total = _scratch(src.nbytes) if h.rank == 0 else None
    reduce_views(h, src, total, dt, op, 0)
    blocks: list[memoryview] = []
    if total is not None:
        blocks = [total[offsets[i] : offsets[i] + counts[i] * dt.extent] for i in range(size)]
    _scatter_views(h, blocks, out, 0)
