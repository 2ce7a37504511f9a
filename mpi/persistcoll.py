"""Persistent collectives (MPI 4.0 ``*_init``), mixed into the communicator classes.

A persistent collective is its non-blocking counterpart started anew by every ``Start``: MPI
requires all members to start a communicator's persistent collectives in the same order, which
is the order in which the non-blocking ones draw their sequence tags. The buffers are read again
at each start, so updates between starts are seen, as MPI allows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vpool.mpi import ops
from vpool.mpi.request import Prequest, Request


def _persistent(start: Callable[[], Request]) -> Prequest:
    return Prequest._persistent(lambda: start()._op)


class PersistentCollectives:
    """``Comm``'s ``*_init`` methods (over ``CommCollectives``' non-blocking ones)."""

    Ibarrier: Callable[..., Request]
    Ibcast: Callable[..., Request]
    Ireduce: Callable[..., Request]
    Iallreduce: Callable[..., Request]
    Igather: Callable[..., Request]
    Igatherv: Callable[..., Request]
    Iscatter: Callable[..., Request]
    Iscatterv: Callable[..., Request]
    Iallgather: Callable[..., Request]
    Iallgatherv: Callable[..., Request]
    Ialltoall: Callable[..., Request]
    Ialltoallv: Callable[..., Request]
    Ialltoallw: Callable[..., Request]
    Ireduce_scatter_block: Callable[..., Request]
    Ireduce_scatter: Callable[..., Request]

    def Barrier_init(self, info: Any = None) -> Prequest:
        return _persistent(lambda: self.Ibarrier())

    def Bcast_init(self, buf: Any, root: int = 0, info: Any = None) -> Prequest:
        return _persistent(lambda: self.Ibcast(buf, root))

    def Reduce_init(
        self, sendbuf: Any, recvbuf: Any, op: Any = ops.SUM, root: int = 0, info: Any = None
    ) -> Prequest:
        return _persistent(lambda: self.Ireduce(sendbuf, recvbuf, op, root))

    def Allreduce_init(
        self, sendbuf: Any, recvbuf: Any, op: Any = ops.SUM, info: Any = None
    ) -> Prequest:
        return _persistent(lambda: self.Iallreduce(sendbuf, recvbuf, op))

    def Gather_init(self, sendbuf: Any, recvbuf: Any, root: int = 0, info: Any = None) -> Prequest:
        return _persistent(lambda: self.Igather(sendbuf, recvbuf, root))

    def Gatherv_init(self, sendbuf: Any, recvbuf: Any, root: int = 0, info: Any = None) -> Prequest:
        return _persistent(lambda: self.Igatherv(sendbuf, recvbuf, root))

    def Scatter_init(self, sendbuf: Any, recvbuf: Any, root: int = 0, info: Any = None) -> Prequest:
        return _persistent(lambda: self.Iscatter(sendbuf, recvbuf, root))

    def Scatterv_init(
        self, sendbuf: Any, recvbuf: Any, root: int = 0, info: Any = None
    ) -> Prequest:
        return _persistent(lambda: self.Iscatterv(sendbuf, recvbuf, root))

    def Allgather_init(self, sendbuf: Any, recvbuf: Any, info: Any = None) -> Prequest:
        return _persistent(lambda: self.Iallgather(sendbuf, recvbuf))

    def Allgatherv_init(self, sendbuf: Any, recvbuf: Any, info: Any = None) -> Prequest:
        return _persistent(lambda: self.Iallgatherv(sendbuf, recvbuf))

    def Alltoall_init(self, sendbuf: Any, recvbuf: Any, info: Any = None) -> Prequest:
        return _persistent(lambda: self.Ialltoall(sendbuf, recvbuf))

    def Alltoallv_init(self, sendbuf: Any, recvbuf: Any, info: Any = None) -> Prequest:
        return _persistent(lambda: self.Ialltoallv(sendbuf, recvbuf))

    def Alltoallw_init(self, sendbuf: Any, recvbuf: Any, info: Any = None) -> Prequest:
        return _persistent(lambda: self.Ialltoallw(sendbuf, recvbuf))

    def Reduce_scatter_block_init(
        self, sendbuf: Any, recvbuf: Any, op: Any = ops.SUM, info: Any = None
    ) -> Prequest:
        return _persistent(lambda: self.Ireduce_scatter_block(sendbuf, recvbuf, op))

    def Reduce_scatter_init(
        self,
        sendbuf: Any,
        recvbuf: Any,
        recvcounts: Any = None,
        op: Any = ops.SUM,
        info: Any = None,
    ) -> Prequest:
        return _persistent(lambda: self.Ireduce_scatter(sendbuf, recvbuf, recvcounts, op))


class PersistentIntraCollectives:
    """``Intracomm``'s prefix reductions as persistent collectives."""

    Iscan: Callable[..., Request]
    Iexscan: Callable[..., Request]

    def Scan_init(
        self, sendbuf: Any, recvbuf: Any, op: Any = ops.SUM, info: Any = None
    ) -> Prequest:
        return _persistent(lambda: self.Iscan(sendbuf, recvbuf, op))

    def Exscan_init(
        self, sendbuf: Any, recvbuf: Any, op: Any = ops.SUM, info: Any = None
    ) -> Prequest:
        return _persistent(lambda: self.Iexscan(sendbuf, recvbuf, op))
