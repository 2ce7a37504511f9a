"""Collective operations on Python objects (lower-case calls), built on point-to-point.

Every collective runs in the communicator's collective context (its p2p context + 1), so user
traffic never matches collective traffic, and every receive names its source: no ANY_SOURCE, so
collectives make no non-deterministic decision for message logging to record. Algorithms are
O(log p) where the data allows: binomial trees (bcast, reduce), recursive doubling with the
non-power-of-two fix-up (allreduce, scan), dissemination (barrier). Reductions apply the operation
in rank order (``op(lower, higher)``), so results are the same on every run.

The point-to-point helpers here (``send_obj``, ``recv_raw``, ...) are shared with ``collbuf``.
``h`` is always a communicator core (``comm._Core``): ``ctx``, ``group``, ``rank``, ``size``,
``w2c``, ``eng``.
"""

from __future__ import annotations

from typing import Any

from vpool.protocol.messages import KIND_BUFFER, KIND_PICKLE
from vpool.sdk.mpi import errors
from vpool.sdk.mpi.request import RecvOp
from vpool.sdk.mpi.serialization import pickle_

TAG_BARRIER = 1
TAG_BCAST = 2
TAG_REDUCE = 3
TAG_ALLREDUCE = 4
TAG_GATHER = 5
TAG_SCATTER = 6
TAG_ALLTOALL = 7
TAG_SCAN = 8
TAG_EXSCAN = 9


# ---- point-to-point in the collective context -----------------------------------------------


def send_obj(h: Any, dst: int, tag: int, obj: Any) -> None:
    bufs, parts = pickle_.dumps(obj)
    n = sum(parts) if parts else len(bufs[0])
    h.eng.send(h.group[dst], h.ctx + 1, tag, KIND_PICKLE, parts, bufs, n)


def send_raw(h: Any, dst: int, tag: int, parts: list[int], bufs: list[Any], n: int) -> None:
    """Forward an already pickled payload unchanged (trees pickle once, at the root)."""
    h.eng.send(h.group[dst], h.ctx + 1, tag, KIND_PICKLE, parts, bufs, n)


def send_bytes(h: Any, dst: int, tag: int, view: Any) -> None:
    n = len(view) if not isinstance(view, memoryview) else view.nbytes
    h.eng.send(h.group[dst], h.ctx + 1, tag, KIND_BUFFER, [], [view], n)


def post_recv(h: Any, src: int, tag: int, view: memoryview | None) -> RecvOp:
    op = RecvOp(h.ctx + 1, h.group[src], tag, view, h.w2c)
    h.eng.post(op)
    return op


def finish(h: Any, op: RecvOp) -> RecvOp:
    if not op.done:
        h.eng.wait(op)
    if op.error:
        raise errors.MPIException(op.error)
    return op


def recv_raw(h: Any, src: int, tag: int) -> RecvOp:
    return finish(h, post_recv(h, src, tag, None))


def recv_obj(h: Any, src: int, tag: int) -> Any:
    op = recv_raw(h, src, tag)
    assert op.msg is not None
    return pickle_.loads(op.payload, op.msg.parts)


def recv_into(h: Any, src: int, tag: int, view: memoryview) -> None:
    op = finish(h, post_recv(h, src, tag, view))
    if op.nbytes != view.nbytes:
        raise errors.MPIException(
            errors.ERR_TRUNCATE,
            f"collective expected {view.nbytes} bytes from rank {src}, got {op.nbytes}",
        )


def check_root(h: Any, root: int) -> None:
    if not 0 <= root < h.size:
        raise errors.MPIException(errors.ERR_ROOT, f"root {root} of a {h.size}-rank communicator")


# ---- algorithms ---------------------------------------------------------------------------


def barrier(h: Any) -> None:
    """Dissemination: ceil(log2 p) rounds of empty messages."""
    size, rank = h.size, h.rank
    mask = 1
    while mask < size:
        send_bytes(h, (rank + mask) % size, TAG_BARRIER, b"")
        recv_into(h, (rank - mask) % size, TAG_BARRIER, memoryview(b""))
        mask <<= 1


def tree_children(vrank: int, size: int) -> tuple[int, list[int]]:
    """Binomial tree over virtual ranks (root is 0): (parent or -1, children, nearest first
    from the largest subtree down)."""
    mask = 1
    parent = -1
    while mask < size:
        if vrank & mask:
            parent = vrank - mask
            break
        mask <<= 1
    children = []
    mask >>= 1
    while mask > 0:
        if vrank + mask < size:
            children.append(vrank + mask)
        mask >>= 1
    return parent, children


def bcast(h: Any, obj: Any, root: int) -> Any:
    check_root(h, root)
    size = h.size
    if size == 1:
        return obj
    vrank = (h.rank - root) % size
    parent, children = tree_children(vrank, size)
    if parent < 0:
        bufs, parts = pickle_.dumps(obj)
        n = sum(parts) if parts else len(bufs[0])
    else:
        op = recv_raw(h, (parent + root) % size, TAG_BCAST)
        assert op.msg is not None
        parts, bufs, n = op.msg.parts, [op.payload], op.nbytes
    for child in children:
        send_raw(h, (child + root) % size, TAG_BCAST, parts, bufs, n)
    if parent < 0:
        return obj
    return pickle_.loads(bufs[0], parts)


def reduce(h: Any, obj: Any, op: Any, root: int) -> Any:
    """Binomial tree towards rank 0 in rank order, then to the root (as mpi4py does)."""
    check_root(h, root)
    size, rank = h.size, h.rank
    result = obj
    mask = 1
    while mask < size:
        if rank & mask:
            send_obj(h, rank - mask, TAG_REDUCE, result)
            break
        peer = rank | mask
        if peer < size:
            result = op(result, recv_obj(h, peer, TAG_REDUCE))
        mask <<= 1
    if root != 0:
        if rank == 0:
            send_obj(h, root, TAG_REDUCE, result)
        elif rank == root:
            result = recv_obj(h, 0, TAG_REDUCE)
    return result if rank == root else None


def fold_plan(rank: int, size: int) -> tuple[int, int, int]:
    """Recursive doubling over a power of two: (pof2, rem, newrank); the first 2*rem ranks pair
    up, the even one of each pair sitting out (newrank -1) with its value folded into the odd."""
    pof2 = 1
    while pof2 * 2 <= size:
        pof2 *= 2
    rem = size - pof2
    if rank < 2 * rem:
        newrank = -1 if rank % 2 == 0 else rank // 2
    else:
        newrank = rank - rem
    return pof2, rem, newrank


def real_rank(newrank: int, rem: int) -> int:
    return newrank * 2 + 1 if newrank < rem else newrank + rem


def allreduce(h: Any, obj: Any, op: Any) -> Any:
    size, rank = h.size, h.rank
    if size == 1:
        return obj
    pof2, rem, newrank = fold_plan(rank, size)
    result = obj
    if rank < 2 * rem:
        if newrank < 0:
            send_obj(h, rank + 1, TAG_ALLREDUCE, result)
        else:
            result = op(recv_obj(h, rank - 1, TAG_ALLREDUCE), result)
    if newrank >= 0:
        mask = 1
        while mask < pof2:
            peer = real_rank(newrank ^ mask, rem)
            send_obj(h, peer, TAG_ALLREDUCE, result)
            other = recv_obj(h, peer, TAG_ALLREDUCE)
            result = op(other, result) if peer < rank else op(result, other)
            mask <<= 1
    if rank < 2 * rem:
        if newrank < 0:
            result = recv_obj(h, rank + 1, TAG_ALLREDUCE)
        else:
            send_obj(h, rank - 1, TAG_ALLREDUCE, result)
    return result


def gather(h: Any, obj: Any, root: int) -> list[Any] | None:
    check_root(h, root)
    size, rank = h.size, h.rank
    if rank != root:
        send_obj(h, root, TAG_GATHER, obj)
        return None
    pending = [post_recv(h, i, TAG_GATHER, None) if i != root else None for i in range(size)]
    result = []
    for op in pending:
        if op is None:
            result.append(obj)
        else:
            finish(h, op)
            assert op.msg is not None
            result.append(pickle_.loads(op.payload, op.msg.parts))
    return result


def scatter(h: Any, objs: Any, root: int) -> Any:
    check_root(h, root)
    size, rank = h.size, h.rank
    if rank != root:
        return recv_obj(h, root, TAG_SCATTER)
    items = list(objs) if objs is not None else None
    if items is None or len(items) != size:
        raise ValueError(f"expecting {size} items, got {None if items is None else len(items)}")
    for i in range(size):
        if i != root:
            send_obj(h, i, TAG_SCATTER, items[i])
    return items[root]


def allgather(h: Any, obj: Any) -> list[Any]:
    result = gather(h, obj, 0)
    return bcast(h, result, 0)  # type: ignore[no-any-return]


def alltoall(h: Any, objs: Any) -> list[Any]:
    size, rank = h.size, h.rank
    items = list(objs) if objs is not None else None
    if items is None or len(items) != size:
        raise ValueError(f"expecting {size} items, got {None if items is None else len(items)}")
    result: list[Any] = [None] * size
    result[rank] = items[rank]
    for i in range(1, size):
        dst, src = (rank + i) % size, (rank - i) % size
        send_obj(h, dst, TAG_ALLTOALL, items[dst])
        result[src] = recv_obj(h, src, TAG_ALLTOALL)
    return result


def scan(h: Any, obj: Any, op: Any, exclusive: bool) -> Any:
    """Inclusive or exclusive prefix reduction by recursive doubling."""
    size, rank = h.size, h.rank
    tag = TAG_EXSCAN if exclusive else TAG_SCAN
    partial = obj  # reduction over the aligned block of 2**k ranks holding this one
    result = _NOTHING if exclusive else obj
    mask = 1
    while mask < size:
        peer = rank ^ mask
        if peer < size:
            send_obj(h, peer, tag, partial)
            other = recv_obj(h, peer, tag)
            if peer < rank:
                partial = op(other, partial)
                result = other if result is _NOTHING else op(other, result)
            else:
                partial = op(partial, other)
        mask <<= 1
    return None if result is _NOTHING else result


_NOTHING = object()
