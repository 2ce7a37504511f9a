"""Collective operations on intercommunicators, for Python objects (lower-case calls), and the
messages between the two groups that the buffer collectives (``intercollbuf``) share.

``h`` is an intercommunicator's core (``comm._Core`` with ``remote``): ranks of ``h`` name the
remote group, and ``h.local`` is the core of the local group. Every collective takes the next
number of ``h.cseq`` as the tag of its messages between the groups, in the collective context
``ctx + 1``; members of both groups call the collectives in the same order (MPI's rule), so the
numbers agree. Phases within one group run the intracommunicator algorithms of ``coll`` and
``collalg`` on ``h.local``, whose own contexts and sequence keep them apart from both.

Roots follow MPI: in the root's group the root passes ``ROOT`` and the others ``PROC_NULL``; the
other group passes the root's rank in the remote group. Data between the groups goes from leader
to leader (rank 0 of each group) and through a tree within the group, as MPICH does, except
where every member must hear from or speak to every remote one (alltoall). Receives always name
their source: nothing here makes a timing-dependent choice.
"""

from __future__ import annotations

from typing import Any

from vpool.mpi import coll, collalg, errors
from vpool.mpi.coll import recv_obj
from vpool.mpi.constants import PROC_NULL, ROOT
from vpool.mpi.envelope import as_rank
from vpool.mpi.sched import Algo, loads, new_tag, post_recv, run, send_bufs, send_obj

# ---- messages between the groups: ``sched``'s, whose ranks name a core's peers (the remote
# group of an intercommunicator's core) -------------------------------------------------------


def check_root(h: Any, root: Any) -> int:
    """``ROOT``, ``PROC_NULL`` or the root's rank in the remote group; ERR_ROOT otherwise."""
    root = as_rank(root)
    if root == ROOT or root == PROC_NULL or 0 <= root < h.psize:
        return int(root)
    raise errors.MPIException(
        errors.ERR_ROOT, f"root {root} of an intercommunicator with {h.psize} remote ranks"
    )


# ---- algorithms ----------------------------------------------------------------------------


def barrier_algo(h: Any, tag: int, ltag: int) -> Algo:
    """A barrier in each group, the leaders' handshake, then a release within each group."""
    local = h.local
    yield from coll.barrier_algo(local, ltag)
    if local.rank == 0:
        op = post_recv(h, 0, tag, memoryview(b""))
        send_bufs(h, 0, tag, [])
        yield [op]
    yield from collalg.bcast(local, memoryview(bytearray(0)), 0, ltag)


def barrier(h: Any) -> None:
    run(h, barrier_algo(h, new_tag(h), new_tag(h.local)))


def bcast(h: Any, obj: Any, root: int) -> Any:
    """The root sends to the remote leader, which broadcasts in its group; the root's group
    gets None."""
    root = check_root(h, root)
    tag = new_tag(h)
    if root == ROOT:
        send_obj(h, 0, tag, obj)
        return None
    if root == PROC_NULL:
        return None
    local = h.local
    obj = recv_obj(h, root, tag) if local.rank == 0 else None
    return coll.bcast(local, obj, 0)


def reduce(h: Any, obj: Any, op: Any, root: int) -> Any:
    """Reduced in the other group (rank order) to its leader, which sends to the root."""
    root = check_root(h, root)
    tag = new_tag(h)
    if root == ROOT:
        return recv_obj(h, 0, tag)
    if root == PROC_NULL:
        return None
    value = coll.reduce(h.local, obj, op, 0)
    if h.local.rank == 0:
        send_obj(h, root, tag, value)
    return None


def allreduce(h: Any, obj: Any, op: Any) -> Any:
    """Each group gets the reduction of the other's values: reduced to each leader, swapped
    between the leaders, broadcast in each group."""
    tag = new_tag(h)
    local = h.local
    value = coll.reduce(local, obj, op, 0)
    if local.rank == 0:
        send_obj(h, 0, tag, value)
        value = recv_obj(h, 0, tag)
    return coll.bcast(local, value, 0)


def gather(h: Any, obj: Any, root: int) -> list[Any] | None:
    """The other group gathers to its leader, which sends the list to the root."""
    root = check_root(h, root)
    tag = new_tag(h)
    if root == ROOT:
        return recv_obj(h, 0, tag)  # type: ignore[no-any-return]
    if root == PROC_NULL:
        return None
    items = coll.gather(h.local, obj, 0)
    if h.local.rank == 0:
        send_obj(h, root, tag, items)
    return None


def scatter(h: Any, objs: Any, root: int) -> Any:
    """The root sends the list to the remote leader, which scatters it in its group."""
    root = check_root(h, root)
    tag = new_tag(h)
    if root == ROOT:
        items = list(objs) if objs is not None else None
        if items is None or len(items) != h.psize:
            n = None if items is None else len(items)
            raise ValueError(f"expecting {h.psize} items, got {n}")
        send_obj(h, 0, tag, items)
        return None
    if root == PROC_NULL:
        return None
    local = h.local
    items = recv_obj(h, root, tag) if local.rank == 0 else None
    return coll.scatter(local, items, 0)


def allgather(h: Any, obj: Any) -> list[Any]:
    """The remote group's objects, in rank order: gathered to each leader, swapped, broadcast."""
    tag = new_tag(h)
    local = h.local
    items = coll.gather(local, obj, 0)
    if local.rank == 0:
        send_obj(h, 0, tag, items)
        items = recv_obj(h, 0, tag)
    return coll.bcast(local, items, 0)  # type: ignore[no-any-return]


def alltoall(h: Any, objs: Any) -> list[Any]:
    """Item ``i`` to remote rank ``i``, and one item from each remote rank."""
    tag = new_tag(h)
    items = list(objs) if objs is not None else None
    if items is None or len(items) != h.psize:
        raise ValueError(f"expecting {h.psize} items, got {None if items is None else len(items)}")
    return run(h, _alltoall(h, items, tag))  # type: ignore[no-any-return]


def _alltoall(h: Any, items: list[Any], tag: int) -> Algo:
    ops = [post_recv(h, i, tag, None) for i in range(h.psize)]
    for i in rotation(h):
        send_obj(h, i, tag, items[i])
    yield ops
    return [loads(op) for op in ops]


def rotation(h: Any) -> list[int]:
    """Remote ranks starting at this rank's own number, so that not every member sends to
    remote rank 0 first."""
    n = h.psize
    return [(h.rank + i) % n for i in range(n)]
