"""Collective methods of communicators, kept apart from ``comm`` (identity, management,
point-to-point) by concern: each forwards to the algorithms of ``coll`` (objects) and
``collbuf`` (buffers) with the communicator's core, or for an intercommunicator to those of
``intercoll`` and ``intercollbuf`` (``InterCollectives``, ahead of ``CommCollectives`` in
``Intercomm``'s bases).

Non-blocking collectives return a request whose schedule (``sched.Schedule``) advances each
time the request is tested or waited on.

A communicator with holes (FT-MPI's blank mode: ``h.holes`` not empty) runs the functions of
``blank`` instead, which have the signatures of ``coll``'s and ``collbuf``'s and skip the holes;
the choice is the one test of an attribute, so other communicators pay nothing more.
Intercommunicators never have holes.
"""

from __future__ import annotations

from typing import Any

from vpool.mpi import blank, coll, collbuf, intercoll, intercollbuf, ops, sched
from vpool.mpi.request import Request


class CommCollectives:
    """Collectives of every communicator (mixed into ``Comm``)."""

    _core: Any

    # ---- collectives: objects --------------------------------------------------------------

    def barrier(self) -> None:
        h = self._core()
        (blank if h.holes else coll).barrier(h)

    def bcast(self, obj: Any, root: int = 0) -> Any:
        from vpool.mpi.comm import comm_lock  # mpi4py's lock table (MPI._comm_lock_table)

        h = self._core()
        with comm_lock(h, "bcast"):
            return (blank if h.holes else coll).bcast(h, obj, root)

    def reduce(self, sendobj: Any, op: Any = ops.SUM, root: int = 0) -> Any:
        h = self._core()
        return (blank if h.holes else coll).reduce(h, sendobj, op, root)

    def allreduce(self, sendobj: Any, op: Any = ops.SUM) -> Any:
        h = self._core()
        return (blank if h.holes else coll).allreduce(h, sendobj, op)

    def gather(self, sendobj: Any, root: int = 0) -> Any:
        h = self._core()
        return (blank if h.holes else coll).gather(h, sendobj, root)

    def scatter(self, sendobj: Any, root: int = 0) -> Any:
        h = self._core()
        return (blank if h.holes else coll).scatter(h, sendobj, root)

    def allgather(self, sendobj: Any) -> list[Any]:
        h = self._core()
        return (blank if h.holes else coll).allgather(h, sendobj)  # type: ignore[no-any-return]

    def alltoall(self, sendobj: Any) -> list[Any]:
        h = self._core()
        return (blank if h.holes else coll).alltoall(h, sendobj)  # type: ignore[no-any-return]

    # ---- collectives: buffers --------------------------------------------------------------

    def Barrier(self) -> None:
        h = self._core()
        (blank if h.holes else coll).barrier(h)

    def Bcast(self, buf: Any, root: int = 0) -> None:
        h = self._core()
        (blank if h.holes else collbuf).Bcast(h, buf, root)

    def Reduce(self, sendbuf: Any, recvbuf: Any, op: Any = ops.SUM, root: int = 0) -> None:
        h = self._core()
        (blank if h.holes else collbuf).Reduce(h, sendbuf, recvbuf, op, root)

    def Allreduce(self, sendbuf: Any, recvbuf: Any, op: Any = ops.SUM) -> None:
        h = self._core()
        (blank if h.holes else collbuf).Allreduce(h, sendbuf, recvbuf, op)

    def Gather(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> None:
        h = self._core()
        (blank if h.holes else collbuf).Gather(h, sendbuf, recvbuf, root)

    def Gatherv(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> None:
        h = self._core()
        (blank if h.holes else collbuf).Gatherv(h, sendbuf, recvbuf, root)

    def Scatter(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> None:
        h = self._core()
        (blank if h.holes else collbuf).Scatter(h, sendbuf, recvbuf, root)

    def Scatterv(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> None:
        h = self._core()
        (blank if h.holes else collbuf).Scatterv(h, sendbuf, recvbuf, root)

    def Allgather(self, sendbuf: Any, recvbuf: Any) -> None:
        h = self._core()
        (blank if h.holes else collbuf).Allgather(h, sendbuf, recvbuf)

    def Allgatherv(self, sendbuf: Any, recvbuf: Any) -> None:
        h = self._core()
        (blank if h.holes else collbuf).Allgatherv(h, sendbuf, recvbuf)

    def Alltoall(self, sendbuf: Any, recvbuf: Any) -> None:
        h = self._core()
        (blank if h.holes else collbuf).Alltoall(h, sendbuf, recvbuf)

    def Alltoallv(self, sendbuf: Any, recvbuf: Any) -> None:
        h = self._core()
        (blank if h.holes else collbuf).Alltoallv(h, sendbuf, recvbuf)

    def Alltoallw(self, sendbuf: Any, recvbuf: Any) -> None:
        h = self._core()
        (blank if h.holes else collbuf).Alltoallw(h, sendbuf, recvbuf)

    def Reduce_scatter_block(self, sendbuf: Any, recvbuf: Any, op: Any = ops.SUM) -> None:
        h = self._core()
        (blank if h.holes else collbuf).Reduce_scatter_block(h, sendbuf, recvbuf, op)

    def Reduce_scatter(
        self, sendbuf: Any, recvbuf: Any, recvcounts: Any = None, op: Any = ops.SUM
    ) -> None:
        h = self._core()
        (blank if h.holes else collbuf).Reduce_scatter(h, sendbuf, recvbuf, recvcounts, op)

    # ---- non-blocking: the request's schedule advances whenever it is tested or waited on --

    def Ibarrier(self) -> Request:
        h = self._core()
        if h.holes:
            h = h.shadow  # a blank communicator's barrier is its live members'
        return sched.start(h, coll.barrier_algo(h, sched.new_tag(h)))  # type: ignore[no-any-return]

    def Ibcast(self, buf: Any, root: int = 0) -> Request:
        h = self._core()
        algos = blank if h.holes else collbuf
        return algos.Bcast(h, buf, root, nb=True)  # type: ignore[no-any-return]

    def Ireduce(self, sendbuf: Any, recvbuf: Any, op: Any = ops.SUM, root: int = 0) -> Request:
        h = self._core()
        algos = blank if h.holes else collbuf
        return algos.Reduce(h, sendbuf, recvbuf, op, root, nb=True)  # type: ignore[no-any-return]

    def Iallreduce(self, sendbuf: Any, recvbuf: Any, op: Any = ops.SUM) -> Request:
        h = self._core()
        algos = blank if h.holes else collbuf
        return algos.Allreduce(h, sendbuf, recvbuf, op, nb=True)  # type: ignore[no-any-return]

    def Igather(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> Request:
        h = self._core()
        algos = blank if h.holes else collbuf
        return algos.Gather(h, sendbuf, recvbuf, root, nb=True)  # type: ignore[no-any-return]

    def Igatherv(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> Request:
        h = self._core()
        algos = blank if h.holes else collbuf
        return algos.Gatherv(h, sendbuf, recvbuf, root, nb=True)  # type: ignore[no-any-return]

    def Iscatter(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> Request:
        h = self._core()
        algos = blank if h.holes else collbuf
        return algos.Scatter(h, sendbuf, recvbuf, root, nb=True)  # type: ignore[no-any-return]

    def Iscatterv(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> Request:
        h = self._core()
        algos = blank if h.holes else collbuf
        return algos.Scatterv(h, sendbuf, recvbuf, root, nb=True)  # type: ignore[no-any-return]

    def Iallgather(self, sendbuf: Any, recvbuf: Any) -> Request:
        h = self._core()
        algos = blank if h.holes else collbuf
        return algos.Allgather(h, sendbuf, recvbuf, nb=True)  # type: ignore[no-any-return]

    def Iallgatherv(self, sendbuf: Any, recvbuf: Any) -> Request:
        h = self._core()
        algos = blank if h.holes else collbuf
        return algos.Allgatherv(h, sendbuf, recvbuf, nb=True)  # type: ignore[no-any-return]

    def Ialltoall(self, sendbuf: Any, recvbuf: Any) -> Request:
        h = self._core()
        algos = blank if h.holes else collbuf
        return algos.Alltoall(h, sendbuf, recvbuf, nb=True)  # type: ignore[no-any-return]

    def Ialltoallv(self, sendbuf: Any, recvbuf: Any) -> Request:
        h = self._core()
        algos = blank if h.holes else collbuf
        return algos.Alltoallv(h, sendbuf, recvbuf, nb=True)  # type: ignore[no-any-return]

    def Ialltoallw(self, sendbuf: Any, recvbuf: Any) -> Request:
        h = self._core()
        algos = blank if h.holes else collbuf
        return algos.Alltoallw(h, sendbuf, recvbuf, nb=True)  # type: ignore[no-any-return]

    def Ireduce_scatter_block(self, sendbuf: Any, recvbuf: Any, op: Any = ops.SUM) -> Request:
        h = self._core()
        algos = blank if h.holes else collbuf
        return algos.Reduce_scatter_block(h, sendbuf, recvbuf, op, nb=True)  # type: ignore[no-any-return]

    def Ireduce_scatter(
        self, sendbuf: Any, recvbuf: Any, recvcounts: Any = None, op: Any = ops.SUM
    ) -> Request:
        h = self._core()
        algos = blank if h.holes else collbuf
        return algos.Reduce_scatter(h, sendbuf, recvbuf, recvcounts, op, nb=True)  # type: ignore[no-any-return]

    def ibarrier(self) -> Request:
        return self.Ibarrier()


class IntraCollectives:
    """Prefix reductions, only on intra-communicators (mixed into ``Intracomm``)."""

    _core: Any

    def scan(self, sendobj: Any, op: Any = ops.SUM) -> Any:
        h = self._core()
        return (blank if h.holes else coll).scan(h, sendobj, op, exclusive=False)

    def exscan(self, sendobj: Any, op: Any = ops.SUM) -> Any:
        h = self._core()
        return (blank if h.holes else coll).scan(h, sendobj, op, exclusive=True)

    def Scan(self, sendbuf: Any, recvbuf: Any, op: Any = ops.SUM) -> None:
        h = self._core()
        (blank if h.holes else collbuf).Scan(h, sendbuf, recvbuf, op, exclusive=False)

    def Exscan(self, sendbuf: Any, recvbuf: Any, op: Any = ops.SUM) -> None:
        h = self._core()
        (blank if h.holes else collbuf).Scan(h, sendbuf, recvbuf, op, exclusive=True)

    def Iscan(self, sendbuf: Any, recvbuf: Any, op: Any = ops.SUM) -> Request:
        h = self._core()
        algos = blank if h.holes else collbuf
        return algos.Scan(h, sendbuf, recvbuf, op, exclusive=False, nb=True)  # type: ignore[no-any-return]

    def Iexscan(self, sendbuf: Any, recvbuf: Any, op: Any = ops.SUM) -> Request:
        h = self._core()
        algos = blank if h.holes else collbuf
        return algos.Scan(h, sendbuf, recvbuf, op, exclusive=True, nb=True)  # type: ignore[no-any-return]


class InterCollectives:
    """Collectives of intercommunicators (mixed into ``Intercomm``): MPI's root convention
    (``ROOT``, ``PROC_NULL``, or the root's rank in the remote group), results from the remote
    group. No prefix reductions: MPI has none on intercommunicators."""

    _core: Any

    # ---- objects ---------------------------------------------------------------------------

    def barrier(self) -> None:
        intercoll.barrier(self._core())

    def bcast(self, obj: Any, root: int = 0) -> Any:
        from vpool.mpi.comm import comm_lock

        h = self._core()
        with comm_lock(h, "bcast"):
            return intercoll.bcast(h, obj, root)

    def reduce(self, sendobj: Any, op: Any = ops.SUM, root: int = 0) -> Any:
        return intercoll.reduce(self._core(), sendobj, op, root)

    def allreduce(self, sendobj: Any, op: Any = ops.SUM) -> Any:
        return intercoll.allreduce(self._core(), sendobj, op)

    def gather(self, sendobj: Any, root: int = 0) -> Any:
        return intercoll.gather(self._core(), sendobj, root)

    def scatter(self, sendobj: Any, root: int = 0) -> Any:
        return intercoll.scatter(self._core(), sendobj, root)

    def allgather(self, sendobj: Any) -> list[Any]:
        return intercoll.allgather(self._core(), sendobj)

    def alltoall(self, sendobj: Any) -> list[Any]:
        return intercoll.alltoall(self._core(), sendobj)

    # ---- buffers ---------------------------------------------------------------------------

    def Barrier(self) -> None:
        intercoll.barrier(self._core())

    def Bcast(self, buf: Any, root: int = 0) -> None:
        intercollbuf.Bcast(self._core(), buf, root)

    def Reduce(self, sendbuf: Any, recvbuf: Any, op: Any = ops.SUM, root: int = 0) -> None:
        intercollbuf.Reduce(self._core(), sendbuf, recvbuf, op, root)

    def Allreduce(self, sendbuf: Any, recvbuf: Any, op: Any = ops.SUM) -> None:
        intercollbuf.Allreduce(self._core(), sendbuf, recvbuf, op)

    def Gather(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> None:
        intercollbuf.Gather(self._core(), sendbuf, recvbuf, root)

    def Gatherv(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> None:
        intercollbuf.Gatherv(self._core(), sendbuf, recvbuf, root)

    def Scatter(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> None:
        intercollbuf.Scatter(self._core(), sendbuf, recvbuf, root)

    def Scatterv(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> None:
        intercollbuf.Scatterv(self._core(), sendbuf, recvbuf, root)

    def Allgather(self, sendbuf: Any, recvbuf: Any) -> None:
        intercollbuf.Allgather(self._core(), sendbuf, recvbuf)

    def Allgatherv(self, sendbuf: Any, recvbuf: Any) -> None:
        intercollbuf.Allgatherv(self._core(), sendbuf, recvbuf)

    def Alltoall(self, sendbuf: Any, recvbuf: Any) -> None:
        intercollbuf.Alltoall(self._core(), sendbuf, recvbuf)

    def Alltoallv(self, sendbuf: Any, recvbuf: Any) -> None:
        intercollbuf.Alltoallv(self._core(), sendbuf, recvbuf)

    def Alltoallw(self, sendbuf: Any, recvbuf: Any) -> None:
        intercollbuf.Alltoallw(self._core(), sendbuf, recvbuf)

    def Reduce_scatter_block(self, sendbuf: Any, recvbuf: Any, op: Any = ops.SUM) -> None:
        intercollbuf.Reduce_scatter_block(self._core(), sendbuf, recvbuf, op)

    def Reduce_scatter(
        self, sendbuf: Any, recvbuf: Any, recvcounts: Any = None, op: Any = ops.SUM
    ) -> None:
        intercollbuf.Reduce_scatter(self._core(), sendbuf, recvbuf, recvcounts, op)

    # ---- non-blocking ----------------------------------------------------------------------

    def Ibarrier(self) -> Request:
        h = self._core()
        algo = intercoll.barrier_algo(h, sched.new_tag(h), sched.new_tag(h.local))
        return sched.start(h, algo)  # type: ignore[no-any-return]

    def ibarrier(self) -> Request:
        return self.Ibarrier()

    def Ibcast(self, buf: Any, root: int = 0) -> Request:
        return intercollbuf.Bcast(self._core(), buf, root, nb=True)  # type: ignore[no-any-return]

    def Ireduce(self, sendbuf: Any, recvbuf: Any, op: Any = ops.SUM, root: int = 0) -> Request:
        h = self._core()
        return intercollbuf.Reduce(h, sendbuf, recvbuf, op, root, nb=True)  # type: ignore[no-any-return]

    def Iallreduce(self, sendbuf: Any, recvbuf: Any, op: Any = ops.SUM) -> Request:
        h = self._core()
        return intercollbuf.Allreduce(h, sendbuf, recvbuf, op, nb=True)  # type: ignore[no-any-return]

    def Igather(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> Request:
        h = self._core()
        return intercollbuf.Gather(h, sendbuf, recvbuf, root, nb=True)  # type: ignore[no-any-return]

    def Igatherv(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> Request:
        h = self._core()
        return intercollbuf.Gatherv(h, sendbuf, recvbuf, root, nb=True)  # type: ignore[no-any-return]

    def Iscatter(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> Request:
        h = self._core()
        return intercollbuf.Scatter(h, sendbuf, recvbuf, root, nb=True)  # type: ignore[no-any-return]

    def Iscatterv(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> Request:
        h = self._core()
        return intercollbuf.Scatterv(h, sendbuf, recvbuf, root, nb=True)  # type: ignore[no-any-return]

    def Iallgather(self, sendbuf: Any, recvbuf: Any) -> Request:
        h = self._core()
        return intercollbuf.Allgather(h, sendbuf, recvbuf, nb=True)  # type: ignore[no-any-return]

    def Iallgatherv(self, sendbuf: Any, recvbuf: Any) -> Request:
        h = self._core()
        return intercollbuf.Allgatherv(h, sendbuf, recvbuf, nb=True)  # type: ignore[no-any-return]

    def Ialltoall(self, sendbuf: Any, recvbuf: Any) -> Request:
        h = self._core()
        return intercollbuf.Alltoall(h, sendbuf, recvbuf, nb=True)  # type: ignore[no-any-return]

    def Ialltoallv(self, sendbuf: Any, recvbuf: Any) -> Request:
        h = self._core()
        return intercollbuf.Alltoallv(h, sendbuf, recvbuf, nb=True)  # type: ignore[no-any-return]

    def Ialltoallw(self, sendbuf: Any, recvbuf: Any) -> Request:
        h = self._core()
        return intercollbuf.Alltoallw(h, sendbuf, recvbuf, nb=True)  # type: ignore[no-any-return]

    def Ireduce_scatter_block(self, sendbuf: Any, recvbuf: Any, op: Any = ops.SUM) -> Request:
        h = self._core()
        return intercollbuf.Reduce_scatter_block(h, sendbuf, recvbuf, op, nb=True)  # type: ignore[no-any-return]

    def Ireduce_scatter(
        self, sendbuf: Any, recvbuf: Any, recvcounts: Any = None, op: Any = ops.SUM
    ) -> Request:
        h = self._core()
        return intercollbuf.Reduce_scatter(h, sendbuf, recvbuf, recvcounts, op, nb=True)  # type: ignore[no-any-return]
