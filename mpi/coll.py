"""Collective operations on Python objects (lower-case calls), built on point-to-point.

Every collective runs in the communicator's collective context (its p2p context + 1) with its
own tag (``sched.new_tag``), and every receive names its source: no ANY_SOURCE, so collectives
make no non-deterministic decision for message logging to record. Algorithms are O(log p)
rounds: binomial trees (bcast, reduce, gather, scatter), recursive doubling with the
non-power-of-two fold (allreduce, allgather), dissemination (barrier), recursive doubling
prefixes (scan). Reductions apply the operation in rank order (``op(lower, higher)``), so results
are the same on every run.

``h`` is always a communicator core (``comm._Core``): ``ctx``, ``group``, ``rank``, ``size``,
``w2c``, ``eng``, ``cseq``.
"""

from __future__ import annotations

from typing import Any

from vpool.mpi import errors
from vpool.mpi.envelope import as_rank
from vpool.mpi.sched import Algo, loads, new_tag, post_recv, run, send_bufs, send_obj


def recv_obj(h: Any, src: int, tag: int) -> Any:
    return run(h, _recv_obj(h, src, tag))


def _recv_obj(h: Any, src: int, tag: int) -> Algo:
    op = post_recv(h, src, tag, None)
    yield [op]
    return loads(op)


def check_root(h: Any, root: Any) -> int:
    root = as_rank(root)
    if not 0 <= root < h.size:
        raise errors.MPIException(errors.ERR_ROOT, f"root {root} of a {h.size}-rank communicator")
    return root


# ---- shapes shared with ``collbuf`` ---------------------------------------------------------


def tree_children(vrank: int, size: int) -> tuple[int, list[int]]:
    """Binomial tree over virtual ranks (root is 0): (parent or -1, children from the largest
    subtree down). Child ``c = vrank + mask`` roots the vranks ``[c, c + min(mask, size - c))``."""
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


def subtree(vrank: int, size: int) -> int:
    """How many vranks the binomial subtree rooted at ``vrank`` holds."""
    low = vrank & -vrank if vrank else 1 << max(size - 1, 0).bit_length()
    return min(low, size - vrank)


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


def first_rank(newrank: int, rem: int) -> int:
    """Lowest real rank whose data newrank ``newrank`` holds after the fold."""
    return 2 * newrank if newrank < rem else newrank + rem


# ---- algorithms ---------------------------------------------------------------------------


def barrier_algo(h: Any, tag: int) -> Algo:
    """Dissemination: ceil(log2 p) rounds of empty messages."""
    size, rank = h.size, h.rank
    mask = 1
    while mask < size:
        op = post_recv(h, (rank - mask) % size, tag, memoryview(b""))
        send_bufs(h, (rank + mask) % size, tag, [])
        yield [op]
        mask <<= 1


def barrier(h: Any) -> None:
    run(h, barrier_algo(h, new_tag(h)))


def bcast(h: Any, obj: Any, root: int) -> Any:
    """Binomial tree; the root pickles once and inner nodes forward the bytes unchanged."""
    root = check_root(h, root)
    tag = new_tag(h)
    size = h.size
    if size == 1:
        return obj
    vrank = (h.rank - root) % size
    parent, children = tree_children(vrank, size)
    if parent < 0:
        bufs, parts = _dumps(obj)
    else:
        op = run(h, _recv_raw(h, (parent + root) % size, tag))
        assert op.msg is not None
        parts, bufs = op.msg.parts, [op.payload]
    for child in children:
        _send_pickled(h, (child + root) % size, tag, parts, bufs)
    if parent < 0:
        return obj
    return loads(op)


def _dumps(obj: Any) -> tuple[list[Any], list[int]]:
    from vpool.mpi.serialization import pickle_

    return pickle_.dumps(obj)


def _send_pickled(h: Any, dst: int, tag: int, parts: list[int], bufs: list[Any]) -> None:
    from vpool.protocol.messages import KIND_PICKLE

    n = sum(parts) if parts else len(bufs[0])
    h.eng.send(h.group[dst], h.ctx + 1, tag, KIND_PICKLE, parts, bufs, n)


def _recv_raw(h: Any, src: int, tag: int) -> Algo:
    op = post_recv(h, src, tag, None)
    yield [op]
    return op


def reduce(h: Any, obj: Any, op: Any, root: int) -> Any:
    """Binomial tree towards rank 0 in rank order, then to the root (as mpi4py does)."""
    root = check_root(h, root)
    tag = new_tag(h)
    size, rank = h.size, h.rank
    result = obj
    mask = 1
    while mask < size:
        if rank & mask:
            send_obj(h, rank - mask, tag, result)
            break
        peer = rank | mask
        if peer < size:
            result = op(result, recv_obj(h, peer, tag))
        mask <<= 1
    if root != 0:
        if rank == 0:
            send_obj(h, root, tag, result)
        elif rank == root:
            result = recv_obj(h, 0, tag)
    return result if rank == root else None


def allreduce(h: Any, obj: Any, op: Any) -> Any:
    tag = new_tag(h)
    size, rank = h.size, h.rank
    if size == 1:
        return obj
    pof2, rem, newrank = fold_plan(rank, size)
    result = obj
    if rank < 2 * rem:
        if newrank < 0:
            send_obj(h, rank + 1, tag, result)
        else:
            result = op(recv_obj(h, rank - 1, tag), result)
    if newrank >= 0:
        mask = 1
        while mask < pof2:
            peer = real_rank(newrank ^ mask, rem)
            send_obj(h, peer, tag, result)
            other = recv_obj(h, peer, tag)
            result = op(other, result) if peer < rank else op(result, other)
            mask <<= 1
    if rank < 2 * rem:
        if newrank < 0:
            result = recv_obj(h, rank + 1, tag)
        else:
            send_obj(h, rank - 1, tag, result)
    return result


def gather(h: Any, obj: Any, root: int) -> list[Any] | None:
    """Binomial tree: each node forwards the list of its subtree's objects (vrank order)."""
    root = check_root(h, root)
    tag = new_tag(h)
    size, rank = h.size, h.rank
    vrank = (rank - root) % size
    items = [obj]
    mask = 1
    while mask < size:
        if vrank & mask:
            send_obj(h, (vrank - mask + root) % size, tag, items)
            return None
        child = vrank + mask
        if child < size:
            items.extend(recv_obj(h, (child + root) % size, tag))
        mask <<= 1
    # Root: items are in vrank order; rank r is vrank (r - root) % size.
    return items[size - root :] + items[: size - root]


def scatter(h: Any, objs: Any, root: int) -> Any:
    """Binomial tree: each node receives its subtree's objects and passes on the children's."""
    root = check_root(h, root)
    tag = new_tag(h)
    size, rank = h.size, h.rank
    vrank = (rank - root) % size
    if rank == root:
        items = list(objs) if objs is not None else None
        if items is None or len(items) != size:
            n = None if items is None else len(items)
            raise ValueError(f"expecting {size} items, got {n}")
        items = items[root:] + items[:root]  # vrank order
    else:
        parent, _ = tree_children(vrank, size)
        items = recv_obj(h, (parent + root) % size, tag)
    _, children = tree_children(vrank, size)
    for child in children:
        lo = child - vrank
        send_obj(h, (child + root) % size, tag, items[lo : lo + subtree(child, size)])
    return items[0]


def allgather(h: Any, obj: Any) -> list[Any]:
    """Recursive doubling; the first 2*rem ranks fold pairwise first and unfold at the end."""
    tag = new_tag(h)
    size, rank = h.size, h.rank
    if size == 1:
        return [obj]
    pof2, rem, newrank = fold_plan(rank, size)
    items: list[Any] = [None] * size
    items[rank] = obj
    if rank < 2 * rem:
        if newrank < 0:
            send_obj(h, rank + 1, tag, obj)
            return recv_obj(h, rank + 1, tag)  # type: ignore[no-any-return]
        items[rank - 1] = recv_obj(h, rank - 1, tag)
    mask = 1
    while mask < pof2:
        mine = newrank & ~(mask - 1)
        theirs = (newrank ^ mask) & ~(mask - 1)
        a, b = first_rank(mine, rem), first_rank(mine + mask, rem)
        peer = real_rank(newrank ^ mask, rem)
        send_obj(h, peer, tag, items[a:b])
        c, d = first_rank(theirs, rem), first_rank(theirs + mask, rem)
        items[c:d] = recv_obj(h, peer, tag)
        mask <<= 1
    if rank < 2 * rem:
        send_obj(h, rank - 1, tag, items)
    return items


def alltoall(h: Any, objs: Any) -> list[Any]:
    tag = new_tag(h)
    size, rank = h.size, h.rank
    items = list(objs) if objs is not None else None
    if items is None or len(items) != size:
        raise ValueError(f"expecting {size} items, got {None if items is None else len(items)}")
    result: list[Any] = [None] * size
    result[rank] = items[rank]
    for i in range(1, size):
        dst, src = (rank + i) % size, (rank - i) % size
        send_obj(h, dst, tag, items[dst])
        result[src] = recv_obj(h, src, tag)
    return result


def scan(h: Any, obj: Any, op: Any, exclusive: bool) -> Any:
    """Inclusive or exclusive prefix reduction by recursive doubling."""
    tag = new_tag(h)
    size, rank = h.size, h.rank
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
