"""Collective algorithms on flat byte views, as schedules (generators, see ``sched``).

Data is received straight into the user's buffer wherever that is its final place, and sent
straight from it (several views travel as one message without being joined); scratch memory is
used only where the algorithm must combine or forward data the user's layout cannot hold.
Large payloads (above ``SEGMENT``) go through bcast and reduce trees in segments, each node
forwarding a segment as soon as it has it, so the tree works as a pipeline.
"""

from __future__ import annotations

from typing import Any

from vpool.mpi.coll import first_rank, fold_plan, real_rank, subtree, tree_children
from vpool.mpi.datatypes import Datatype
from vpool.mpi.sched import SEGMENT, Algo, post_recv, send_bufs

ALLREDUCE_PIPELINE = 4 * SEGMENT
"""From this size on allreduce is a pipelined reduce then bcast instead of recursive doubling."""


def scratch(n: int) -> memoryview:
    return memoryview(bytearray(n))


def segments(n: int) -> list[tuple[int, int]]:
    if n <= SEGMENT:
        return [(0, n)]
    return [(a, min(a + SEGMENT, n)) for a in range(0, n, SEGMENT)]


def bcast(h: Any, view: memoryview, root: int, tag: int) -> Algo:
    """Segmented binomial tree; every segment is received in place in the user's buffer."""
    size = h.size
    if size == 1:
        return
    vrank = (h.rank - root) % size
    parent, children = tree_children(vrank, size)
    dsts = [(c + root) % size for c in children]
    segs = segments(view.nbytes)
    if parent < 0:
        for a, b in segs:
            for dst in dsts:
                send_bufs(h, dst, tag, [view[a:b]])
        return
    src = (parent + root) % size
    ops = [post_recv(h, src, tag, view[a:b]) for a, b in segs]
    for op, (a, b) in zip(ops, segs, strict=True):
        yield [op]
        for dst in dsts:
            send_bufs(h, dst, tag, [view[a:b]])


def reduce(
    h: Any, src: memoryview, out: memoryview | None, dt: Datatype, op: Any, root: int, tag: int
) -> Algo:
    """Segmented binomial tree. Commutative ops use the tree rooted at ``root``; others the one
    rooted at rank 0, combining in rank order (``lower op higher``), then rank 0 hands over."""
    size, rank = h.size, h.rank
    commute = op.Is_commutative()
    base = root if commute else 0
    vrank = (rank - base) % size
    parent, children = tree_children(vrank, size)
    children.reverse()  # nearest (lowest ranks) first: rank order
    srcs = [(c + base) % size for c in children]
    n = src.nbytes
    segs = segments(n)
    if children:
        if out is not None and rank == base:
            acc = out
            if src is not out:
                acc[:] = src
        else:
            acc = scratch(n)
            acc[:] = src
        seg = segs[0][1] - segs[0][0]
        tmps = [scratch(seg) for _ in children]
    else:
        acc = src
    dst = (parent + base) % size if parent >= 0 else -1
    for a, b in segs:
        if children:
            ops = [post_recv(h, s, tag, t[: b - a]) for s, t in zip(srcs, tmps, strict=True)]
            yield ops
            part = acc[a:b]
            for t in tmps:
                t = t[: b - a]
                if commute:
                    op.reduce_bytes(t, part, dt)
                else:
                    op.reduce_bytes(part, t, dt)
                    part[:] = t
        if dst >= 0:
            send_bufs(h, dst, tag, [acc[a:b]])
    if base == root:
        if rank == root and acc is not out and out is not None:
            out[:] = acc
        return
    if rank == 0:
        for a, b in segs:
            send_bufs(h, root, tag, [acc[a:b]])
    elif rank == root:
        assert out is not None
        ops = [post_recv(h, 0, tag, out[a:b]) for a, b in segs]
        yield ops


def allreduce(h: Any, acc: memoryview, dt: Datatype, op: Any, tag: int) -> Algo:
    """``acc`` holds this rank's contribution and receives the result."""
    if h.size == 1:
        return
    if acc.nbytes >= ALLREDUCE_PIPELINE:
        yield from reduce(h, acc, acc, dt, op, 0, tag)
        yield from bcast(h, acc, 0, tag)
        return
    yield from recursive_doubling(h, acc, dt, op, tag)


def recursive_doubling(h: Any, acc: memoryview, dt: Datatype, op: Any, tag: int) -> Algo:
    size, rank = h.size, h.rank
    pof2, rem, newrank = fold_plan(rank, size)
    out = acc
    tmp = scratch(acc.nbytes)
    if rank < 2 * rem:
        if newrank < 0:
            send_bufs(h, rank + 1, tag, [acc])
            yield [post_recv(h, rank + 1, tag, out)]
            return
        yield [post_recv(h, rank - 1, tag, tmp)]
        op.reduce_bytes(tmp, acc, dt)  # acc = lower op acc
    mask = 1
    while mask < pof2:
        peer = real_rank(newrank ^ mask, rem)
        pending = post_recv(h, peer, tag, tmp)
        send_bufs(h, peer, tag, [acc])
        yield [pending]
        if peer < rank:
            op.reduce_bytes(tmp, acc, dt)
        else:
            op.reduce_bytes(acc, tmp, dt)
            acc, tmp = tmp, acc
        mask <<= 1
    if rank < 2 * rem:
        send_bufs(h, rank - 1, tag, [acc])
    if acc is not out:
        out[:] = acc


def _wrapped(whole: memoryview, first: int, count: int, bs: int, size: int) -> list[memoryview]:
    """Blocks of ranks first, first+1, ... (count of them, modulo size) as at most two views."""
    end = first + count
    if end <= size:
        return [whole[first * bs : end * bs]]
    return [whole[first * bs :], whole[: (end - size) * bs]]


def gather(
    h: Any, mine: memoryview | None, whole: memoryview | None, bs: int, root: int, tag: int
) -> Algo:
    """Binomial tree of equal blocks (``bs`` bytes). Inner nodes collect their subtree's blocks in
    vrank order in scratch; the root receives each child's blocks in place when they do not wrap
    around the end of its buffer. ``mine`` None at the root: in place."""
    size, rank = h.size, h.rank
    vrank = (rank - root) % size
    parent, children = tree_children(vrank, size)
    children.reverse()
    if rank == root:
        assert whole is not None
        if mine is not None:
            whole[root * bs : (root + 1) * bs] = mine
        ops, copies = [], []
        for c in children:
            parts = _wrapped(whole, (c + root) % size, subtree(c, size), bs, size)
            if len(parts) == 1:
                ops.append(post_recv(h, (c + root) % size, tag, parts[0]))
            else:
                tmp = scratch(sum(p.nbytes for p in parts))
                ops.append(post_recv(h, (c + root) % size, tag, tmp))
                copies.append((tmp, parts))
        if ops:
            yield ops
        for tmp, parts in copies:
            pos = 0
            for p in parts:
                p[:] = tmp[pos : pos + p.nbytes]
                pos += p.nbytes
        return
    assert mine is not None
    dst = (parent + root) % size
    if not children:
        send_bufs(h, dst, tag, [mine])
        return
    buf = scratch(subtree(vrank, size) * bs)
    buf[:bs] = mine
    ops = []
    for c in children:
        lo = (c - vrank) * bs
        ops.append(post_recv(h, (c + root) % size, tag, buf[lo : lo + subtree(c, size) * bs]))
    yield ops
    send_bufs(h, dst, tag, [buf])


def scatter(
    h: Any, whole: memoryview | None, out: memoryview | None, bs: int, root: int, tag: int
) -> Algo:
    """Binomial tree of equal blocks, the reverse of ``gather``; the root sends each child's
    blocks straight from its buffer. ``out`` None at the root: in place."""
    size, rank = h.size, h.rank
    vrank = (rank - root) % size
    parent, children = tree_children(vrank, size)
    if rank == root:
        assert whole is not None
        for c in children:
            parts = _wrapped(whole, (c + root) % size, subtree(c, size), bs, size)
            send_bufs(h, (c + root) % size, tag, parts)
        if out is not None:
            out[:] = whole[root * bs : (root + 1) * bs]
        return
    assert out is not None
    src = (parent + root) % size
    if not children:
        yield [post_recv(h, src, tag, out)]
        return
    buf = scratch(subtree(vrank, size) * bs)
    yield [post_recv(h, src, tag, buf)]
    out[:] = buf[:bs]
    for c in children:
        lo = (c - vrank) * bs
        send_bufs(h, (c + root) % size, tag, [buf[lo : lo + subtree(c, size) * bs]])


def allgather(h: Any, whole: memoryview, offsets: list[int], tag: int) -> Algo:
    """Recursive doubling over blocks laid out back to back: block ``r`` is
    ``whole[offsets[r]:offsets[r+1]]`` and already holds this rank's data. Every exchange moves
    a contiguous run of blocks, received in place. Non-powers of two fold the first 2*rem ranks
    in pairs first and unfold them at the end."""
    size, rank = h.size, h.rank
    if size == 1:
        return
    pof2, rem, newrank = fold_plan(rank, size)

    def span(lo: int, hi: int) -> memoryview:
        return whole[offsets[lo] : offsets[hi]]

    if rank < 2 * rem:
        if newrank < 0:
            send_bufs(h, rank + 1, tag, [span(rank, rank + 1)])
            yield [post_recv(h, rank + 1, tag, whole[: offsets[size]])]
            return
        yield [post_recv(h, rank - 1, tag, span(rank - 1, rank))]
    mask = 1
    while mask < pof2:
        mine = newrank & ~(mask - 1)
        theirs = (newrank ^ mask) & ~(mask - 1)
        peer = real_rank(newrank ^ mask, rem)
        pending = post_recv(
            h, peer, tag, span(first_rank(theirs, rem), first_rank(theirs + mask, rem))
        )
        send_bufs(h, peer, tag, [span(first_rank(mine, rem), first_rank(mine + mask, rem))])
        yield [pending]
        mask <<= 1
    if rank < 2 * rem:
        send_bufs(h, rank - 1, tag, [whole[: offsets[size]]])


def linear_gatherv(
    h: Any, mine: memoryview | None, blocks: list[memoryview], root: int, tag: int
) -> Algo:
    """Blocks of different sizes: only the root knows them, so every rank sends to it directly
    (as MPICH does)."""
    if h.rank != root:
        assert mine is not None
        send_bufs(h, root, tag, [mine])
        return
    ops = [post_recv(h, i, tag, v) for i, v in enumerate(blocks) if i != root]
    if mine is not None:
        blocks[root][:] = mine
    if ops:
        yield ops


def linear_scatterv(
    h: Any, blocks: list[memoryview], out: memoryview | None, root: int, tag: int
) -> Algo:
    if h.rank != root:
        assert out is not None
        yield [post_recv(h, root, tag, out)]
        return
    for i, view in enumerate(blocks):
        if i != root:
            send_bufs(h, i, tag, [view])
    if out is not None:
        out[:] = blocks[root]


def scatter_sizes(
    h: Any, total: memoryview | None, out: memoryview | None, sizes: list[int], tag: int
) -> Algo:
    """Rank 0's ``total`` cut into blocks of ``sizes`` bytes, one to each rank's ``out``:
    a tree when the blocks are equal, else one send each (``Reduce_scatter``'s second half)."""
    if len(set(sizes)) == 1:
        yield from scatter(h, total, out, sizes[0], 0, tag)
        return
    blocks: list[memoryview] = []
    if total is not None:
        pos = 0
        for n in sizes:
            blocks.append(total[pos : pos + n])
            pos += n
    yield from linear_scatterv(h, blocks, out, 0, tag)


def pairwise(h: Any, sblocks: list[memoryview], rblocks: list[memoryview], tag: int) -> Algo:
    """All-to-all: in round i send to rank+i, receive from rank-i."""
    size, rank = h.size, h.rank
    rblocks[rank][:] = sblocks[rank]
    ops = []
    for i in range(1, size):
        dst, src = (rank + i) % size, (rank - i) % size
        ops.append(post_recv(h, src, tag, rblocks[src]))
        send_bufs(h, dst, tag, [sblocks[dst]])
    if ops:
        yield ops


def scan(
    h: Any, src: memoryview, out: memoryview, dt: Datatype, op: Any, exclusive: bool, tag: int
) -> Algo:
    """Prefix reduction by recursive doubling; ``exclusive`` leaves rank 0's buffer alone."""
    size, rank = h.size, h.rank
    partial = scratch(src.nbytes)
    partial[:] = src
    if not exclusive and src is not out:
        out[:] = src
    tmp = scratch(partial.nbytes)
    have = not exclusive
    mask = 1
    while mask < size:
        peer = rank ^ mask
        if peer < size:
            pending = post_recv(h, peer, tag, tmp)
            send_bufs(h, peer, tag, [partial])
            yield [pending]
            if peer < rank:
                if have:
                    op.reduce_bytes(tmp, out, dt)
                else:
                    out[:] = tmp
                    have = True
                op.reduce_bytes(tmp, partial, dt)
            else:
                op.reduce_bytes(partial, tmp, dt)
                partial, tmp = tmp, partial
        mask <<= 1
