"""Collective operations on typed buffers (upper-case calls) of intercommunicators, blocking and
non-blocking.

Each call reads its buffer specs as mpi4py does for an intercommunicator: counts of the blocks
that travel between the groups are per remote rank, a root's group ignores what only the other
group sends (``ROOT``: the send or the receive buffer, as the direction goes; ``PROC_NULL``:
both), and ``IN_PLACE`` is refused (MPI has none between groups). The algorithms are schedules
(see ``sched``) built from the intracommunicator ones of ``collalg`` run on the local group's
core (``h.local``) and the leaders' messages of ``intercoll``: with ``nb`` one becomes the
request of a non-blocking call, without it runs to the end in the call (``collbuf.launch``).

Every call takes the next number of both sequences, the intercommunicator's (``h.cseq``, the tag
of messages between the groups) and the local core's (the tag of the phases within a group),
whatever this process's part in it, so that both agree at every member of each group.
"""

from __future__ import annotations

from typing import Any

from vpool.mpi import coll, collalg
from vpool.mpi.buffers import VMsg, block, parse, parse_blocks, parse_v, parse_w, w_block
from vpool.mpi.collbuf import launch, same_shape
from vpool.mpi.constants import PROC_NULL, ROOT
from vpool.mpi.intercoll import check_root, rotation
from vpool.mpi.sched import Algo, new_tag, post_recv, send_bufs


def _tags(h: Any) -> tuple[int, int]:
    return new_tag(h), new_tag(h.local)


# ---- schedules -----------------------------------------------------------------------------


def _idle() -> Algo:
    yield from ()


def _send(h: Any, dst: int, tag: int, bufs: list[Any]) -> Algo:
    send_bufs(h, dst, tag, bufs)
    yield from ()


def _recv(h: Any, src: int, tag: int, view: memoryview) -> Algo:
    yield [post_recv(h, src, tag, view)]


def _bcast(h: Any, view: memoryview, root: int, tag: int, ltag: int) -> Algo:
    """From the remote root to the leader, then down the local tree."""
    local = h.local
    if local.rank == 0:
        yield [post_recv(h, root, tag, view)]
    yield from collalg.bcast(local, view, 0, ltag)


def _reduce_to(h: Any, src: memoryview, dt: Any, op: Any, ltag: int) -> Algo:
    """Reduce the local group's buffers to the leader; returns the result there, else None."""
    local = h.local
    acc = collalg.scratch(src.nbytes) if local.rank == 0 else None
    yield from collalg.reduce(local, src, acc, dt, op, 0, ltag)
    return acc


def _reduce(h: Any, src: memoryview, dt: Any, op: Any, root: int, tag: int, ltag: int) -> Algo:
    acc = yield from _reduce_to(h, src, dt, op, ltag)
    if acc is not None:
        send_bufs(h, root, tag, [acc])


def _swap(h: Any, mine: memoryview | None, out: memoryview | None, tag: int) -> Algo:
    """The leaders trade their group's data (``mine`` out, ``out`` in); others do nothing."""
    if mine is not None and out is not None:
        pending = post_recv(h, 0, tag, out)
        send_bufs(h, 0, tag, [mine])
        yield [pending]


def _allreduce(
    h: Any, src: memoryview, out: memoryview, dt: Any, op: Any, tag: int, ltag: int
) -> Algo:
    acc = yield from _reduce_to(h, src, dt, op, ltag)
    yield from _swap(h, acc, out, tag)
    yield from collalg.bcast(h.local, out, 0, ltag)


def _gather_to(h: Any, mine: memoryview, ltag: int) -> Algo:
    """Gather the local group's equal blocks to the leader; returns them there, else None."""
    local = h.local
    bs = mine.nbytes
    whole = collalg.scratch(local.size * bs) if local.rank == 0 else None
    yield from collalg.gather(local, mine, whole, bs, 0, ltag)
    return whole


def _gather(h: Any, mine: memoryview, root: int, tag: int, ltag: int) -> Algo:
    whole = yield from _gather_to(h, mine, ltag)
    if whole is not None:
        send_bufs(h, root, tag, [whole])


def _allgather(h: Any, mine: memoryview, out: memoryview, tag: int, ltag: int) -> Algo:
    whole = yield from _gather_to(h, mine, ltag)
    yield from _swap(h, whole, out, tag)
    yield from collalg.bcast(h.local, out, 0, ltag)


def _scatter(h: Any, out: memoryview, root: int, tag: int, ltag: int) -> Algo:
    """The remote root's blocks come whole to the leader, then down the local tree."""
    local = h.local
    bs = out.nbytes
    whole = None
    if local.rank == 0:
        whole = collalg.scratch(local.size * bs)
        yield [post_recv(h, root, tag, whole)]
    yield from collalg.scatter(local, whole, out, bs, 0, ltag)


def _pairs(h: Any, sblocks: list[memoryview], rblocks: list[memoryview], tag: int) -> Algo:
    """Block ``i`` to and from remote rank ``i``."""
    ops = [post_recv(h, i, tag, rblocks[i]) for i in range(h.psize)]
    for i in rotation(h):
        send_bufs(h, i, tag, [sblocks[i]])
    yield ops


def _reduce_scatter(
    h: Any,
    src: memoryview,
    dt: Any,
    op: Any,
    sizes: list[int],
    out: memoryview,
    tag: int,
    ltag: int,
) -> Algo:
    """The local group's reduction goes to the remote leader; the remote group's comes to the
    local leader, which scatters it in pieces of ``sizes`` bytes."""
    acc = yield from _reduce_to(h, src, dt, op, ltag)
    total = collalg.scratch(sum(sizes)) if acc is not None else None
    yield from _swap(h, acc, total, tag)
    yield from collalg.scatter_sizes(h.local, total, out, sizes, ltag)


# ---- calls ---------------------------------------------------------------------------------


def Bcast(h: Any, buf: Any, root: int, nb: bool = False) -> Any:
    root = check_root(h, root)
    tag, ltag = _tags(h)
    if root == PROC_NULL:
        return launch(h, _idle(), nb)
    if root == ROOT:
        return launch(h, _send(h, 0, tag, [parse(buf, writable=False).view]), nb)
    m = parse(buf, writable=True)
    return launch(h, _bcast(h, m.view, root, tag, ltag), nb, m)


def Reduce(h: Any, sendbuf: Any, recvbuf: Any, op: Any, root: int, nb: bool = False) -> Any:
    root = check_root(h, root)
    tag, ltag = _tags(h)
    if root == PROC_NULL:
        return launch(h, _idle(), nb)
    if root == ROOT:
        r = parse(recvbuf, writable=True)
        return launch(h, _recv(h, 0, tag, r.view), nb, r)
    s = parse(sendbuf, writable=False)
    return launch(h, _reduce(h, s.view, s.datatype, op, root, tag, ltag), nb)


def Allreduce(h: Any, sendbuf: Any, recvbuf: Any, op: Any, nb: bool = False) -> Any:
    tag, ltag = _tags(h)
    r = parse(recvbuf, writable=True)
    s = parse(sendbuf, writable=False)
    same_shape(s, r)
    return launch(h, _allreduce(h, s.view, r.view, s.datatype, op, tag, ltag), nb, r)


def Gather(h: Any, sendbuf: Any, recvbuf: Any, root: int, nb: bool = False) -> Any:
    root = check_root(h, root)
    tag, ltag = _tags(h)
    if root == PROC_NULL:
        return launch(h, _idle(), nb)
    if root == ROOT:
        r = parse_blocks(recvbuf, h.psize, writable=True)
        return launch(h, _recv(h, 0, tag, r.view), nb, r)
    s = parse(sendbuf, writable=False)
    return launch(h, _gather(h, s.view, root, tag, ltag), nb)


def Gatherv(h: Any, sendbuf: Any, recvbuf: Any, root: int, nb: bool = False) -> Any:
    """Blocks of different sizes, which only the root knows: each remote rank sends its own
    straight to the root."""
    root = check_root(h, root)
    tag, _ = _tags(h)
    if root == PROC_NULL:
        return launch(h, _idle(), nb)
    if root == ROOT:
        r = parse_v(recvbuf, h.psize, writable=True)
        ops = [post_recv(h, i, tag, block(r, i)) for i in range(h.psize)]
        return launch(h, _wait(ops), nb)
    return launch(h, _send(h, root, tag, [parse(sendbuf, writable=False).view]), nb)


def _wait(ops: list[Any]) -> Algo:
    if ops:
        yield ops


def Scatter(h: Any, sendbuf: Any, recvbuf: Any, root: int, nb: bool = False) -> Any:
    root = check_root(h, root)
    tag, ltag = _tags(h)
    if root == PROC_NULL:
        return launch(h, _idle(), nb)
    if root == ROOT:
        s = parse_blocks(sendbuf, h.psize, writable=False)
        return launch(h, _send(h, 0, tag, [s.view]), nb)
    r = parse(recvbuf, writable=True)
    return launch(h, _scatter(h, r.view, root, tag, ltag), nb, r)


def Scatterv(h: Any, sendbuf: Any, recvbuf: Any, root: int, nb: bool = False) -> Any:
    """The root sends each remote rank its block straight."""
    root = check_root(h, root)
    tag, _ = _tags(h)
    if root == PROC_NULL:
        return launch(h, _idle(), nb)
    if root == ROOT:
        s = parse_v(sendbuf, h.psize, writable=False)
        for i in rotation(h):
            send_bufs(h, i, tag, [block(s, i)])
        return launch(h, _idle(), nb)
    r = parse(recvbuf, writable=True)
    return launch(h, _recv(h, root, tag, r.view), nb, r)


def Allgather(h: Any, sendbuf: Any, recvbuf: Any, nb: bool = False) -> Any:
    tag, ltag = _tags(h)
    r = parse_blocks(recvbuf, h.psize, writable=True)
    s = parse(sendbuf, writable=False)
    return launch(h, _allgather(h, s.view, r.view, tag, ltag), nb, r)


def Allgatherv(h: Any, sendbuf: Any, recvbuf: Any, nb: bool = False) -> Any:
    """Every member sends its block to every remote one: the sizes are known only where they
    are received."""
    tag, _ = _tags(h)
    r: VMsg = parse_v(recvbuf, h.psize, writable=True)
    mine = parse(sendbuf, writable=False).view
    rblocks = [block(r, i) for i in range(h.psize)]
    return launch(h, _pairs(h, [mine] * h.psize, rblocks, tag), nb)


def Alltoall(h: Any, sendbuf: Any, recvbuf: Any, nb: bool = False) -> Any:
    tag, _ = _tags(h)
    n = h.psize
    r = parse_blocks(recvbuf, n, writable=True)
    s = parse_blocks(sendbuf, n, writable=False)
    rbs, sbs = r.view.nbytes // n, s.view.nbytes // n
    rblocks = [r.view[i * rbs : (i + 1) * rbs] for i in range(n)]
    sblocks = [s.view[i * sbs : (i + 1) * sbs] for i in range(n)]
    return launch(h, _pairs(h, sblocks, rblocks, tag), nb, r)


def Alltoallv(h: Any, sendbuf: Any, recvbuf: Any, nb: bool = False) -> Any:
    tag, _ = _tags(h)
    n = h.psize
    r = parse_v(recvbuf, n, writable=True)
    s = parse_v(sendbuf, n, writable=False)
    rblocks = [block(r, i) for i in range(n)]
    sblocks = [block(s, i) for i in range(n)]
    return launch(h, _pairs(h, sblocks, rblocks, tag), nb)


def Alltoallw(h: Any, sendbuf: Any, recvbuf: Any, nb: bool = False) -> Any:
    """Per-peer counts, byte displacements and datatypes; blocks travel packed."""
    tag, _ = _tags(h)
    n = h.psize
    rv, rcounts, rdispls, rtypes = parse_w(recvbuf, n, writable=True)
    sv, scounts, sdispls, stypes = parse_w(sendbuf, n, writable=False)
    sblocks = [w_block(sv, scounts[i], sdispls[i], stypes[i], False).view for i in range(n)]
    rmsgs = [w_block(rv, rcounts[i], rdispls[i], rtypes[i], True) for i in range(n)]
    return launch(h, _pairs(h, sblocks, [m.view for m in rmsgs], tag), nb, *rmsgs)


def Reduce_scatter_block(h: Any, sendbuf: Any, recvbuf: Any, op: Any, nb: bool = False) -> Any:
    """Send buffers hold one block per member of the local group (MPI: the reduction of the
    other group's buffers is what is scattered over this one)."""
    tag, ltag = _tags(h)
    size = h.local.size
    s = parse_blocks(sendbuf, size, writable=False)
    r = parse(recvbuf, writable=True)
    if s.items != r.items or s.view.nbytes != r.view.nbytes * size:
        raise ValueError(f"mismatch in send count {s.items} and receive count {r.items}")
    sizes = [r.view.nbytes] * size
    return launch(h, _reduce_scatter(h, s.view, s.datatype, op, sizes, r.view, tag, ltag), nb, r)


def Reduce_scatter(
    h: Any, sendbuf: Any, recvbuf: Any, recvcounts: Any, op: Any, nb: bool = False
) -> Any:
    """``recvcounts`` has one count per member of the local group."""
    tag, ltag = _tags(h)
    local = h.local
    s = parse(sendbuf, writable=False)
    r = parse(recvbuf, writable=True)
    if recvcounts is None:
        recvcounts = coll.allgather(local, r.items)
    counts = [int(c) for c in recvcounts]
    if len(counts) != local.size:
        raise ValueError(f"expecting {local.size} receive counts, got {len(counts)}")
    ext = s.datatype.extent
    if s.view.nbytes != sum(counts) * ext:
        raise ValueError(f"mismatch in send count and sum(counts) {sum(counts)}")
    if r.items != counts[local.rank]:
        raise ValueError(f"mismatch in receive count {r.items} and counts[{local.rank}]")
    sizes = [c * ext for c in counts]
    return launch(h, _reduce_scatter(h, s.view, s.datatype, op, sizes, r.view, tag, ltag), nb, r)
