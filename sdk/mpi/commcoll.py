"""Collective methods of communicators, kept apart from ``comm`` (identity, management,
point-to-point) by concern: each forwards to the algorithms of ``coll`` (objects) and
``collbuf`` (buffers) with the communicator's core.

Non-blocking collectives run to completion at the call and return a complete request. That is
correct for every program that would not deadlock with blocking collectives in their place.
"""

from __future__ import annotations

from typing import Any

from vpool.sdk.mpi import coll, collbuf, ops
from vpool.sdk.mpi.request import DoneOp, Request


class CommCollectives:
    """Collectives of every communicator (mixed into ``Comm``)."""

    _core: Any

    # ---- collectives: objects --------------------------------------------------------------

    def barrier(self) -> None:
        coll.barrier(self._core())

    def bcast(self, obj: Any, root: int = 0) -> Any:
        return coll.bcast(self._core(), obj, root)

    def reduce(self, sendobj: Any, op: Any = ops.SUM, root: int = 0) -> Any:
        return coll.reduce(self._core(), sendobj, op, root)

    def allreduce(self, sendobj: Any, op: Any = ops.SUM) -> Any:
        return coll.allreduce(self._core(), sendobj, op)

    def gather(self, sendobj: Any, root: int = 0) -> Any:
        return coll.gather(self._core(), sendobj, root)

    def scatter(self, sendobj: Any, root: int = 0) -> Any:
        return coll.scatter(self._core(), sendobj, root)

    def allgather(self, sendobj: Any) -> list[Any]:
        return coll.allgather(self._core(), sendobj)

    def alltoall(self, sendobj: Any) -> list[Any]:
        return coll.alltoall(self._core(), sendobj)

    # ---- collectives: buffers --------------------------------------------------------------

    def Barrier(self) -> None:
        coll.barrier(self._core())

    def Bcast(self, buf: Any, root: int = 0) -> None:
        collbuf.Bcast(self._core(), buf, root)

    def Reduce(self, sendbuf: Any, recvbuf: Any, op: Any = ops.SUM, root: int = 0) -> None:
        collbuf.Reduce(self._core(), sendbuf, recvbuf, op, root)

    def Allreduce(self, sendbuf: Any, recvbuf: Any, op: Any = ops.SUM) -> None:
        collbuf.Allreduce(self._core(), sendbuf, recvbuf, op)

    def Gather(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> None:
        collbuf.Gather(self._core(), sendbuf, recvbuf, root)

    def Gatherv(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> None:
        collbuf.Gatherv(self._core(), sendbuf, recvbuf, root)

    def Scatter(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> None:
        collbuf.Scatter(self._core(), sendbuf, recvbuf, root)

    def Scatterv(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> None:
        collbuf.Scatterv(self._core(), sendbuf, recvbuf, root)

    def Allgather(self, sendbuf: Any, recvbuf: Any) -> None:
        collbuf.Allgather(self._core(), sendbuf, recvbuf)

    def Allgatherv(self, sendbuf: Any, recvbuf: Any) -> None:
        collbuf.Allgatherv(self._core(), sendbuf, recvbuf)

    def Alltoall(self, sendbuf: Any, recvbuf: Any) -> None:
        collbuf.Alltoall(self._core(), sendbuf, recvbuf)

    def Alltoallv(self, sendbuf: Any, recvbuf: Any) -> None:
        collbuf.Alltoallv(self._core(), sendbuf, recvbuf)

    def Reduce_scatter_block(self, sendbuf: Any, recvbuf: Any, op: Any = ops.SUM) -> None:
        collbuf.Reduce_scatter_block(self._core(), sendbuf, recvbuf, op)

    def Reduce_scatter(
        self, sendbuf: Any, recvbuf: Any, recvcounts: Any = None, op: Any = ops.SUM
    ) -> None:
        collbuf.Reduce_scatter(self._core(), sendbuf, recvbuf, recvcounts, op)

    # Non-blocking collectives run to completion at the call (see the module's known limits).

    def Ibarrier(self) -> Request:
        self.Barrier()
        return Request._of(DoneOp())

    def Ibcast(self, buf: Any, root: int = 0) -> Request:
        self.Bcast(buf, root)
        return Request._of(DoneOp())

    def Ireduce(self, sendbuf: Any, recvbuf: Any, op: Any = ops.SUM, root: int = 0) -> Request:
        self.Reduce(sendbuf, recvbuf, op, root)
        return Request._of(DoneOp())

    def Iallreduce(self, sendbuf: Any, recvbuf: Any, op: Any = ops.SUM) -> Request:
        self.Allreduce(sendbuf, recvbuf, op)
        return Request._of(DoneOp())

    def Igather(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> Request:
        self.Gather(sendbuf, recvbuf, root)
        return Request._of(DoneOp())

    def Iscatter(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> Request:
        self.Scatter(sendbuf, recvbuf, root)
        return Request._of(DoneOp())

    def Iallgather(self, sendbuf: Any, recvbuf: Any) -> Request:
        self.Allgather(sendbuf, recvbuf)
        return Request._of(DoneOp())

    def Ialltoall(self, sendbuf: Any, recvbuf: Any) -> Request:
        self.Alltoall(sendbuf, recvbuf)
        return Request._of(DoneOp())

    def ibarrier(self) -> Request:
        return self.Ibarrier()


class IntraCollectives:
    """Prefix reductions, only on intra-communicators (mixed into ``Intracomm``)."""

    _core: Any

    def scan(self, sendobj: Any, op: Any = ops.SUM) -> Any:
        return coll.scan(self._core(), sendobj, op, exclusive=False)

    def exscan(self, sendobj: Any, op: Any = ops.SUM) -> Any:
        return coll.scan(self._core(), sendobj, op, exclusive=True)

    def Scan(self, sendbuf: Any, recvbuf: Any, op: Any = ops.SUM) -> None:
        collbuf.Scan(self._core(), sendbuf, recvbuf, op, exclusive=False)

    def Exscan(self, sendbuf: Any, recvbuf: Any, op: Any = ops.SUM) -> None:
        collbuf.Scan(self._core(), sendbuf, recvbuf, op, exclusive=True)

    def Iscan(self, sendbuf: Any, recvbuf: Any, op: Any = ops.SUM) -> Request:
        self.Scan(sendbuf, recvbuf, op)
        return Request._of(DoneOp())

    def Iexscan(self, sendbuf: Any, recvbuf: Any, op: Any = ops.SUM) -> Request:
        self.Exscan(sendbuf, recvbuf, op)
        return Request._of(DoneOp())
